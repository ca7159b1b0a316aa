"""The simulated model: turns a StepPlan into a StepResult without running any model.

It samples a deterministic pseudo-token for every chunk that samples, and EOS once a request has produced its
`sim_output_len` tokens (the workload's true output length; `max_tokens` may be far larger). The step's duration
comes from the cost model.

The pseudo-token depends only on the sequence so far, as a real model's greedy choice does: on its length and its
first token, never on where the prompt ended. So a request continued from its prompt plus the tokens it already
produced (a resumed or continued stream) samples exactly the tokens the uninterrupted request would have.

Used by the live sim engine and by the discrete-event simulator alike, so both produce the same tokens and the same
step times for the same plans.
"""

from __future__ import annotations

import sys
from array import array

from octoserve.services.core.batcher import Batcher
from octoserve.services.core.step_builders import CompactStep
from octoserve.services.core.cost_model import CostModel
from octoserve.services.core.types import StepPlan, StepResult

SIM_TOKEN_LO = 1000  # sampled ids live in [SIM_TOKEN_LO, SIM_TOKEN_LO + SIM_TOKEN_SPAN): never EOS or a special
SIM_TOKEN_SPAN = 29_000
SIM_TOKEN_STEP = 7919  # from one output position to the next


def sim_token_id(prompt_len: int, first_prompt_token: int, position: int) -> int:
    """Deterministic token for output position `position` of a request (same on every instance): a function of the
    sequence's length before it (prompt_len + position) and its first token only."""
    return SIM_TOKEN_LO + ((prompt_len + position) * SIM_TOKEN_STEP + first_prompt_token * 31) % SIM_TOKEN_SPAN


# Token n of the cycle n * SIM_TOKEN_STEP: SIM_TOKEN_LO + n * SIM_TOKEN_STEP % SIM_TOKEN_SPAN, twice over (built on
# first use). The step is prime to the span, so every offset is some whole number of steps: a run of formula
# tokens is a slice of this list (`sim_tokens`).
_CYCLE: list[int] = []
_STEP_INVERSE = pow(SIM_TOKEN_STEP, -1, SIM_TOKEN_SPAN)


def sim_tokens(start: int, end: int, offset: int) -> list[int]:
    """[SIM_TOKEN_LO + (n * SIM_TOKEN_STEP + offset) % SIM_TOKEN_SPAN for n in range(start, end)] (the tokens of
    `token_key`'s formula at lengths start..end-1), as one slice of the precomputed cycle: the same integers."""
    if end - start > SIM_TOKEN_SPAN:
        return [SIM_TOKEN_LO + x % SIM_TOKEN_SPAN
                for x in range(start * SIM_TOKEN_STEP + offset, end * SIM_TOKEN_STEP + offset, SIM_TOKEN_STEP)]
    if not _CYCLE:
        one = [SIM_TOKEN_LO + n * SIM_TOKEN_STEP % SIM_TOKEN_SPAN for n in range(SIM_TOKEN_SPAN)]
        _CYCLE.extend(one + one)
    # n * STEP + offset = (n + m) * STEP (mod SPAN) with m = offset / STEP (mod SPAN)
    first = (start + offset * _STEP_INVERSE) % SIM_TOKEN_SPAN
    return _CYCLE[first : first + max(0, end - start)]


_CYCLE_BYTES: list[bytes] = []  # [_CYCLE packed as `kv_cache._token_bytes` packs tokens], built on first use


def sim_token_bytes(start: int, end: int, offset: int) -> bytes:
    """`sim_tokens(start, end, offset)` packed as the prefix cache hashes tokens (uint32 little-endian,
    `kv_cache._token_bytes`): one slice of the packed cycle, for a run no longer than the span (a decode block)."""
    if end - start > SIM_TOKEN_SPAN:
        raise ValueError(f"sim_token_bytes: a run of {end - start} tokens is longer than the cycle")
    if not _CYCLE_BYTES:
        packed = array("I", sim_tokens(0, 2 * SIM_TOKEN_SPAN, 0))  # the whole cycle, twice over
        if sys.byteorder == "big":
            packed.byteswap()
        _CYCLE_BYTES.append(packed.tobytes())
    first = (start + offset * _STEP_INVERSE) % SIM_TOKEN_SPAN
    return _CYCLE_BYTES[0][4 * first : 4 * (first + max(0, end - start))]


def token_key(spec, num_prompt_tokens: int) -> tuple[int | float, int]:
    """(request length at which the sampled token is EOS, offset): for a request of `num_tokens` tokens below
    that length, `sim_token_id` of its next output position is
    SIM_TOKEN_LO + (num_tokens * SIM_TOKEN_STEP + offset) % SIM_TOKEN_SPAN.
    Position p = num_tokens - prompt is EOS when p + 1 >= sim_output_len."""
    prompt = spec.prompt_token_ids
    true_len = spec.sim_output_len
    eos_at = float("inf") if true_len is None else num_prompt_tokens + true_len - 1
    offset = ((len(prompt) - num_prompt_tokens) * SIM_TOKEN_STEP + (prompt[0] if prompt else 0) * 31) % SIM_TOKEN_SPAN
    return eos_at, offset


class SimExecutor:
    def __init__(self, cost_model: CostModel, block_size: int, eos_token_id: int = 2) -> None:
        self.cost_model = cost_model
        self.block_size = block_size
        self.eos_token_id = eos_token_id

    def execute(self, plan: StepPlan, batcher: Batcher) -> StepResult:
        sampled: dict[str, int] = {}
        for chunk in plan.chunks:
            if not chunk.samples:
                continue
            req = batcher.request(chunk.request_id)
            if req is None:
                continue
            position = req.num_output_tokens  # index of the token being sampled
            true_len = req.spec.sim_output_len
            if true_len is not None and position + 1 >= true_len:
                sampled[chunk.request_id] = self.eos_token_id
            else:
                prompt = req.spec.prompt_token_ids
                sampled[chunk.request_id] = sim_token_id(len(prompt), prompt[0] if prompt else 0, position)
        return StepResult(sampled, self.cost_model.plan_time_s(plan, self.block_size))

    def execute_compact(self, step: CompactStep) -> tuple[list[int | None], float]:
        """`execute` for a `Batcher.schedule_compact` step: (the token of each chunk, None where it samples none;
        the step time). The same tokens and the same time as `execute` on `step.to_plan()`."""
        sampled: list[int | None] = []
        append = sampled.append
        eos = self.eos_token_id
        num_samples = 0
        for req, samples in zip(step.reqs, step.samples):
            if not samples:
                append(None)
                continue
            num_samples += 1
            key = req.executor_key
            if key is None:
                key = req.executor_key = token_key(req.spec, req.num_prompt_tokens)
            eos_at, offset = key
            num_tokens = len(req.token_ids)
            # sim_token_id of output position num_tokens - prompt length, in the key's terms (once per token)
            append(eos if num_tokens >= eos_at
                   else SIM_TOKEN_LO + (num_tokens * SIM_TOKEN_STEP + offset) % SIM_TOKEN_SPAN)
        # A steady batcher's implicit decodes (services/sim/steady_batcher.py) sample their tokens there, from
        # `token_key`.
        step_s = self.cost_model.chunks_time_s(step.num_new, step.contexts, num_samples,
                                               step.swap_in_blocks + step.swap_out_blocks, self.block_size,
                                               step.num_steady, step.steady_tokens)
        return sampled, step_s
