"""Drain or migrate: what happens to a running decode on an instance that a reconfiguration retires.

The instance takes no new request. Each of its running decodes either finishes there (a drain) or moves by KV
hand-off to another instance of the same model (a migration, as Llumnix does), whichever ends the instance's part
sooner without hurting the request. One clock-free rule, shared by the queueing simulator
(services/sim/elastic_sim.py), the step-level simulator (services/sim/elastic_step.py) and the live node
(services/rpc/migration.py):

- `decide(remaining_s, transfer_s, pause_s, ...)`: migrate only when the hand-off is shorter than the decode left
  (`remaining_s`, what the drain would wait for this request), the target's decode step with this request added
  (`target_step_s`) stays within the ITL budget (`fits_itl`), and the stall it adds to the request's stream
  (`pause_s`: the transfer, plus any wait for a slot on the target) is shorter than the decode left too and within
  the larger of the request's TPOT slack and `max_pause_s`.
- `plan(running, targets, ...)`: the per-instance plan of the live node and the step-level simulator, with a
  hand-off's stall taken as the transfer plus one decode step. Longest remaining decode first (the drain waits
  for the longest one), each to the target with the most free KV among those that have a free slot, room for the
  request's context, and a decode step, by the cost model (`target_step_s`: its running decodes plus the ones
  already given to it plus this one, with all their KV), within `itl_budget_s`: moving many decodes onto one
  target must not push its step (every request there, not only the moved ones) past the ITL SLO. A target's
  headroom shrinks and its batch and KV grow with every request given to it. A request no target has room for
  stays (`target_full`); one that every target with room would slow past the budget stays too (`target_itl`).

Every decision carries its reason (`REASONS`), for the log line and the counter.

Invariants: pure (no clock, no I/O); times are modelled seconds on the caller's clock; a request is given to a target
only when that target had a free slot and the KV blocks for its context at the time of the plan, and (with
`target_step_s`) only when the target's decode step with every request given to it so far stays within the budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIGRATE = "migrate"
DRAIN_SHORTER = "drain_shorter"  # the decode left ends before the hand-off would (or at the same time)
PAUSE_TOO_LONG = "pause_too_long"  # the stall would exceed the request's TPOT slack and the pause bound
NO_TARGET = "no_target"  # no other instance of the model takes requests
TARGET_FULL = "target_full"  # no target has a free slot and the KV for this request's context
TARGET_ITL = "target_itl"  # every target with room would decode past the ITL budget with this request added
TARGET_REFUSED = "target_refused"  # live only: the target's reservation said no (its headroom changed)
ENGINE_CANNOT = "engine_cannot_migrate"  # live only: this engine cannot hand a running request over
REASONS = (MIGRATE, DRAIN_SHORTER, PAUSE_TOO_LONG, NO_TARGET, TARGET_FULL, TARGET_ITL, TARGET_REFUSED, ENGINE_CANNOT)

DEFAULT_MAX_PAUSE_S = 1.0  # modelled seconds a hand-off may stall a stream when the request has no TPOT slack


def decide(remaining_s: float, transfer_s: float, pause_s: float, *, max_pause_s: float = DEFAULT_MAX_PAUSE_S,
           tpot_slack_s: float = 0.0, target_step_s: float = 0.0, itl_budget_s: float = math.inf) -> str:
    """MIGRATE, or the reason to let the request finish where it is (DRAIN_SHORTER, TARGET_ITL, PAUSE_TOO_LONG).
    `target_step_s`: the target's decode step with this request added (0: not known, not checked)."""
    if remaining_s <= transfer_s or pause_s >= remaining_s:
        return DRAIN_SHORTER
    if not fits_itl(target_step_s, itl_budget_s):
        return TARGET_ITL
    if pause_s > max(tpot_slack_s, max_pause_s):
        return PAUSE_TOO_LONG
    return MIGRATE


def fits_itl(step_s: float, itl_budget_s: float) -> bool:
    """Whether a decode step of `step_s` (the target's, with the moved requests in its batch) keeps the ITL budget."""
    return step_s <= itl_budget_s


def kv_tokens_in_use(load) -> int:
    """The KV tokens an instance's requests hold, from its load snapshot (`EngineLoad`: blocks in use x block size):
    a target's KV before any request moves to it (`Target.kv_tokens`)."""
    return max(0, load.num_total_blocks - load.num_free_blocks) * load.block_size


def batch_step_s(cost, batch: int, kv_tokens: int) -> float:
    """The cost model's decode step of `batch` sequences holding `kv_tokens` of KV between them (each computes one
    token); 0 for an empty batch. `cost`: a CostModel (`decode_step_time_s(batch, context_len)`)."""
    if batch <= 0:
        return 0.0
    return cost.decode_step_time_s(batch, max(0.0, kv_tokens / batch - 1.0))


def expected_remaining_tokens(spec, num_output_tokens: int) -> int:
    """Output tokens still to come for a RequestSpec: the true length when the request carries one (the sim engine's
    `sim_output_len`, unless it ignores EOS), else what max_tokens allows."""
    total = spec.max_tokens
    if spec.sim_output_len is not None and not spec.sampling.ignore_eos:
        total = min(total, spec.sim_output_len)
    return max(0, total - num_output_tokens)


@dataclass(frozen=True, slots=True)
class RunningDecode:
    request_id: str
    context_tokens: int  # prompt + output so far: the KV the hand-off moves
    remaining_tokens: int  # output tokens still to decode (the expected count when the true one is unknown)


@dataclass(frozen=True, slots=True)
class Target:
    instance_id: str
    free_blocks: int
    block_size: int
    free_slots: int
    decode_batch: int = 0  # requests running there now (its decode batch before any move)
    kv_tokens: int = 0  # KV tokens its requests hold now (blocks in use x block size)


@dataclass(frozen=True, slots=True)
class Decision:
    request_id: str
    reason: str  # one of REASONS; MIGRATE when it moves
    target: str = ""  # the instance it moves to (MIGRATE only)
    remaining_s: float = 0.0
    transfer_s: float = 0.0

    @property
    def migrate(self) -> bool:
        return self.reason == MIGRATE


def plan(running: Sequence[RunningDecode], targets: Sequence[Target], *, step_s: float,
         transfer_s: Callable[[int], float], max_pause_s: float = DEFAULT_MAX_PAUSE_S,
         target_step_s: Callable[[str, int, int], float] | None = None,
         itl_budget_s: float = math.inf) -> list[Decision]:
    """One decision per running decode of a retiring instance (in `running`'s order of remaining decode, longest
    first). `step_s`: the instance's decode step (modelled seconds per token); `transfer_s(tokens)`: the hand-off
    time of that much context; `target_step_s(target id, batch, kv tokens)`: that target's decode step with that
    batch and KV, by the cost model (`batch_step_s`; None: the targets' load is not checked); `itl_budget_s`: the
    longest decode step a target may take with the moved requests added (the ITL SLO)."""
    # Per target: [free blocks, free slots, decode batch, KV tokens], as the requests given to it change them.
    free = {t.instance_id: [t.free_blocks, t.free_slots, t.decode_batch, t.kv_tokens] for t in targets}
    size = {t.instance_id: max(1, t.block_size) for t in targets}
    out: list[Decision] = []
    for r in sorted(running, key=lambda r: (-r.remaining_tokens, r.request_id)):
        remaining_s = r.remaining_tokens * step_s
        xfer = transfer_s(r.context_tokens)
        # The stall: the transfer, plus about one decode step (the request leaves at a step boundary and joins the
        # target's batch at the target's next one), as the live node measures it.
        reason = decide(remaining_s, xfer, xfer + step_s, max_pause_s=max_pause_s)
        if reason != MIGRATE:
            out.append(Decision(r.request_id, reason, remaining_s=remaining_s, transfer_s=xfer))
            continue
        if not free:
            out.append(Decision(r.request_id, NO_TARGET, remaining_s=remaining_s, transfer_s=xfer))
            continue
        # The KV for the context plus the token being decoded, in the target's blocks.
        need = {i: -(-(r.context_tokens + 1) // size[i]) for i in free}
        fits = [i for i, (blocks, slots, _, _) in free.items() if slots > 0 and blocks >= need[i]]
        if not fits:
            out.append(Decision(r.request_id, TARGET_FULL, remaining_s=remaining_s, transfer_s=xfer))
            continue
        if target_step_s is not None:  # the target's step with this request added, every request there included
            fits = [i for i in fits if decide(remaining_s, xfer, xfer + step_s, max_pause_s=max_pause_s,
                                              target_step_s=target_step_s(i, free[i][2] + 1,
                                                                          free[i][3] + r.context_tokens + 1),
                                              itl_budget_s=itl_budget_s) == MIGRATE]
            if not fits:
                out.append(Decision(r.request_id, TARGET_ITL, remaining_s=remaining_s, transfer_s=xfer))
                continue
        best = max(fits, key=lambda i: (free[i][0] - need[i], i))
        free[best][0] -= need[best]
        free[best][1] -= 1
        free[best][2] += 1
        free[best][3] += r.context_tokens + 1
        out.append(Decision(r.request_id, MIGRATE, best, remaining_s, xfer))
    return out
