"""SteadyBatcher (decodes advanced implicitly, services/sim/steady_batcher.py) against the plain Batcher, in lockstep.

Both run the same requests step by step, each with its own SimExecutor: the plain batcher through `schedule` /
`execute` / `update` (the message API of the live engine), the steady one through the compact calls. Every step must
take the same time and end the same requests with the same outputs, KV events and free-block order, with the same
load snapshot between steps; a request's tokens and token times, written out, must be the plain path's. The
workload forces the irregular cases: a small KV pool (decodes that need a block the pool lacks, preemption by
recompute and by swap, tier preemption), shared prompts (prefix hits), `ignore_eos` requests that run to their
length limit, aborts (between steps and while a step runs) and write-outs while a step runs.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from octoserve.services.config import default_config_text, node_config_from_text
from octoserve.services.core.batcher import Batcher
from octoserve.services.core.instance import instance_parts
from octoserve.services.core.kv_cache import KVCacheManager
from octoserve.services.core.sim_executor import SimExecutor
from octoserve.services.sim.steady_batcher import SteadyBatcher
from octoserve.services.core.types import Priority, RequestSpec, SamplingParams

BLOCK = 16


def _pair(preemption_mode: str, num_blocks: int, reservation: str):
    node = node_config_from_text(default_config_text())
    inst = next(i for i in node.instances if i.model == "llama-3-8b")
    parts = instance_parts(node, inst)
    # Watermark reservation: decodes take their blocks as they grow, so a decode finds the pool empty.
    cfg = dataclasses.replace(parts.batcher_config, preemption_mode=preemption_mode, num_swap_blocks=40,
                              max_num_seqs=24, reservation_policy=reservation)
    plain = Batcher(cfg, KVCacheManager(num_blocks, BLOCK, extra_key="m"))
    steady = SteadyBatcher(cfg, KVCacheManager(num_blocks, BLOCK, extra_key="m"))
    return plain, steady, SimExecutor(parts.cost_model, BLOCK), SimExecutor(parts.cost_model, BLOCK)


def _specs(rng: random.Random, n: int) -> list[RequestSpec]:
    shared = [tuple(rng.randrange(3000, 9000) for _ in range(rng.randint(20, 70))) for _ in range(3)]
    specs = []
    for i in range(n):
        prompt = rng.choice(shared) + tuple(rng.randrange(3000, 9000) for _ in range(rng.randint(1, 40)))
        ignore_eos = rng.random() < 0.15
        max_tokens = rng.randint(5, 120)
        specs.append(RequestSpec(
            f"r{i:03d}", "m", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos),
            arrival_s=i * 0.004, priority=rng.choice([Priority.STANDARD] * 3 + [Priority.BATCH, Priority.INTERACTIVE]),
            sim_output_len=rng.randint(1, 150),
        ))
    return specs


def _state(b: Batcher, request_id: str):
    r = b.request(request_id)
    return None if r is None else (r.status, list(r.token_ids), r.num_computed_tokens, r.capacity_tokens,
                                   r.num_preemptions, r.first_token_s, r.last_token_s)


@pytest.mark.parametrize("preemption_mode,num_blocks,reservation", [
    ("recompute", 45, "watermark"), ("swap", 45, "watermark"), ("recompute", 70, "predicted"),
    ("recompute", 400, "predicted"),
])
def test_steady_batcher_steps_exactly_as_the_plain_batcher(preemption_mode, num_blocks, reservation):
    plain, steady, plain_exec, steady_exec = _pair(preemption_mode, num_blocks, reservation)
    rng = random.Random(num_blocks * 7 + len(preemption_mode))
    specs = _specs(rng, 90)
    times_plain: dict[str, list[float]] = {}
    times_steady: dict[str, list[float]] = {}
    num_steady_tokens = num_preempted = num_aborted = 0
    seen: set[str] = set()  # requests with a token so far
    now = 0.0
    for _ in range(3000):
        while specs and specs[0].arrival_s <= now:
            spec = specs.pop(0)
            plain.add_request(spec, now)
            steady.add_request(spec, now)
        if rng.random() < 0.01 and plain.num_running:  # an abort between steps
            victim = rng.choice(sorted(r.request_id for r in plain._running))
            assert plain.abort(victim) and steady.abort(victim)
            num_aborted += 1
        plan = plain.schedule(now)
        step = steady.schedule_compact(now)
        num_steady_tokens += step.num_steady
        num_preempted += len(plan.preempted_ids)
        assert step.preempted_ids == plan.preempted_ids
        assert step.num_chunks == len(plan.chunks) and step.num_batched_tokens == plan.num_batched_tokens
        if plan.is_empty and not plain.has_pending_outputs:
            assert step.is_empty
            if not specs:
                break
            now = specs[0].arrival_s
            continue
        result = plain_exec.execute(plan, plain)
        sampled, step_s = steady_exec.execute_compact(step)
        assert step_s == result.step_time_s
        if rng.random() < 0.02:
            steady.sync_all()  # written out while the step runs: still gets this step's token
        if rng.random() < 0.01 and plain.num_running:  # an abort while the step runs: it loses this step's token
            victim = rng.choice(sorted(r.request_id for r in plain._running))
            assert plain.abort(victim) and steady.abort(victim)
            num_aborted += 1
        now += step_s
        out = plain.update(plan, result, now)
        fast = steady.update_compact(step, sampled, now)
        for request_id, times in steady.drain_token_times():
            times_steady.setdefault(request_id, []).extend(times)
        for req in fast.plain:
            times_steady.setdefault(req.request_id, []).append(now)
        for o in fast.outputs:
            times_steady.setdefault(o.request_id, []).extend([now] * len(o.new_token_ids))
        for o in out.outputs:
            times_plain.setdefault(o.request_id, []).extend([now] * len(o.new_token_ids))
        # Only first and last tokens (and hand-offs) keep their message; the rest are plain or implicit.
        assert [o for o in out.outputs if o.finish_reason is not None or o.num_output_tokens == 1
                or o.request_id not in seen] == list(fast.outputs)
        seen.update(o.request_id for o in out.outputs)
        assert fast.handoffs == out.handoffs and fast.kv_events == out.kv_events
        assert plain.kv.free_block_ids() == steady.kv.free_block_ids()
        assert plain.load("i", "m", 1.0, 0.01) == steady.load("i", "m", 1.0, 0.01)
        assert plain.num_preemptions_total == steady.num_preemptions_total
        if rng.random() < 0.05:  # written out, every request equals the plain batcher's
            steady.sync_all()
            for request_id, times in steady.drain_token_times():
                times_steady.setdefault(request_id, []).extend(times)
            for r in plain._running:
                assert _state(plain, r.request_id) == _state(steady, r.request_id)
    assert not plain.has_work and not steady.has_work and not specs
    for request_id, times in steady.drain_token_times():  # an abort after the last step
        times_steady.setdefault(request_id, []).extend(times)
    assert times_steady == times_plain
    assert num_steady_tokens > 1000 and num_aborted > 0
    if num_blocks < 100:
        assert num_preempted > 0


def test_sim_tokens_are_the_formula_tokens():
    # The steady batcher writes tokens out as slices of a precomputed cycle: the same integers as the formula,
    # for runs shorter and longer than the cycle, from any offset.
    from octoserve.services.core.sim_executor import SIM_TOKEN_LO, SIM_TOKEN_SPAN, SIM_TOKEN_STEP, sim_tokens

    rng = random.Random(7)
    for _ in range(3000):
        start, offset = rng.randrange(0, 300_000), rng.randrange(0, SIM_TOKEN_SPAN)
        span = SIM_TOKEN_SPAN
        length = rng.choice([0, 1, 16, 17, 1000, span, span + 5, rng.randrange(0, 2 * span)])
        expected = [SIM_TOKEN_LO + (n * SIM_TOKEN_STEP + offset) % SIM_TOKEN_SPAN for n in range(start, start + length)]
        assert sim_tokens(start, start + length, offset) == expected


def test_sim_token_bytes_are_the_formula_tokens_packed_as_the_prefix_cache_hashes_them():
    # Steady decodes hash a block of output tokens from these bytes, without building the tokens.
    from octoserve.services.core.kv_cache import _token_bytes
    from octoserve.services.core.sim_executor import SIM_TOKEN_SPAN, sim_token_bytes, sim_tokens

    rng = random.Random(11)
    for _ in range(2000):
        start, offset = rng.randrange(0, 300_000), rng.randrange(0, SIM_TOKEN_SPAN)
        length = rng.choice([0, 1, 15, 16, 17, 1000, SIM_TOKEN_SPAN])
        assert sim_token_bytes(start, start + length, offset) == _token_bytes(sim_tokens(start, start + length, offset))
    with pytest.raises(ValueError, match="longer than the cycle"):
        sim_token_bytes(0, SIM_TOKEN_SPAN + 1, 0)


def test_a_block_cached_from_its_bytes_is_cached_as_from_its_tokens():
    # Same hashes, same registrations, same KV events, for a first block, a chained one and a block whose hash
    # another block holds already (the copy stays anonymous).
    from octoserve.services.core.kv_cache import _token_bytes

    managers = [KVCacheManager(8, 4, extra_key="m") for _ in range(2)]
    blocks = [[1001, 1002, 1003, 1004], [2001, 2002, 2003, 2004]]
    for kv in managers:
        for rid in ("a", "b"):
            assert kv.allocate(rid, [], 8) is not None
    for rid in ("a", "b"):
        for num_full, block in enumerate(blocks, start=1):
            assert managers[0].cache_next_block(rid, num_full, block)
            assert managers[1].cache_next_block_bytes(rid, num_full, _token_bytes(block))
    assert not managers[1].cache_next_block_bytes("a", 1, _token_bytes(blocks[0]))  # not the next block: no change
    tokens, from_bytes = managers
    events = tokens.drain_events()
    assert from_bytes.drain_events() == events and len(events) == 2  # b's blocks hash as a's: anonymous copies
    assert [from_bytes.block_hash(b) for b in range(8)] == [tokens.block_hash(b) for b in range(8)]
    assert from_bytes.num_cached_blocks == tokens.num_cached_blocks == 2
