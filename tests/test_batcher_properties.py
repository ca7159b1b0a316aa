"""No sequence of operations makes the batcher use KV it does not hold (OOM impossible by construction).

Hypothesis drives random add / step / abort sequences through every reservation policy and preemption mode; after
every step the KV pool's books must balance and every scheduled token must fit in its request's held blocks. A
burst of 10x the pool's capacity goes through each policy with the same checks.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octoserve.services.core.batch_state import BatcherConfig, RequestStatus
from octoserve.services.core.batcher import Batcher
from octoserve.services.core.kv_cache import KVCacheManager
from octoserve.services.core.types import FinishReason, Priority, RequestSpec, SamplingParams, StepResult

POLICIES = ("full", "predicted", "watermark")
MODES = ("recompute", "swap")


def _check_plan_fits(b: Batcher, plan) -> None:
    assert plan.num_batched_tokens <= b.config.max_num_batched_tokens
    assert b.num_running <= b.config.max_num_seqs
    for chunk in plan.chunks:
        req = b.request(chunk.request_id)
        assert req is not None and req.status is RequestStatus.RUNNING
        held_tokens = len(b.kv.block_ids(chunk.request_id)) * b.block_size
        assert chunk.num_context_tokens + chunk.num_new_tokens <= held_tokens, "a step would write KV it lacks"


def _check_books(b: Batcher) -> None:
    held = set()
    for rid in list(b._requests):
        held.update(b.kv.block_ids(rid))
    # A block is either held by at least one request or on the free list (cached-evictable or empty).
    assert len(held) + b.kv.num_free_blocks == b.kv.num_total_blocks


def _spec(i: int, prompt_len: int, max_tokens: int, tier: int) -> RequestSpec:
    return RequestSpec(
        request_id=f"r{i}",
        model="m",
        prompt_token_ids=tuple((i * 131 + k) % 5000 + 10 for k in range(prompt_len)),
        sampling=SamplingParams(max_tokens=max_tokens),
        arrival_s=float(i),
        priority=Priority(tier),
    )


def _run_step(b: Batcher, now: float, eos_every: int) -> list:
    plan = b.schedule(now)
    _check_plan_fits(b, plan)
    sampled = {}
    for c in plan.chunks:
        if c.samples:
            req = b.request(c.request_id)
            sampled[c.request_id] = 2 if eos_every and (req.num_output_tokens + 1) % eos_every == 0 else 7
    out = b.update(plan, StepResult(sampled), now)
    _check_books(b)
    return list(out.outputs)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 30), st.integers(0, 2)),
        st.tuples(st.just("step"), st.integers(0, 0), st.integers(0, 0), st.integers(0, 0)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.integers(0, 0), st.integers(0, 0)),
    ),
    max_size=60,
)


@settings(max_examples=60, deadline=None)
@given(
    ops=ops,
    policy=st.sampled_from(POLICIES),
    mode=st.sampled_from(MODES),
    num_blocks=st.integers(4, 24),
    budget=st.integers(4, 64),
)
def test_random_operations_never_overallocate(ops, policy, mode, num_blocks, budget):
    b = Batcher(
        BatcherConfig(
            max_num_seqs=8,
            max_num_batched_tokens=budget,
            max_model_len=128,
            reservation_policy=policy,
            preemption_mode=mode,
            num_swap_blocks=8,
            predictor_prior_tokens=4,
        ),
        KVCacheManager(num_blocks, 4, extra_key="m"),
    )
    added = 0
    for op, a, c, tier in ops:
        if op == "add":
            # Requests that could never fit the pool are the router's to refuse; keep them out here.
            if -(-(a + c) // 4) <= num_blocks:
                b.add_request(_spec(added, a, c, tier), float(added))
                added += 1
        elif op == "step":
            _run_step(b, float(added), eos_every=5)
        else:
            b.abort(f"r{a}")
            _check_books(b)
    for _ in range(2000):  # drain: everything admitted must finish
        if not b.has_work:
            break
        _run_step(b, float(added), eos_every=5)
    assert not b.has_work
    assert b.kv.num_free_blocks == num_blocks


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("policy", POLICIES)
def test_burst_of_ten_times_capacity(policy, mode):
    """10x more KV demand than the pool holds arrives at once: every request finishes, no step over-allocates."""
    num_blocks, block_size = 64, 4
    b = Batcher(
        BatcherConfig(max_num_seqs=32, max_num_batched_tokens=64, reservation_policy=policy,
                      preemption_mode=mode, num_swap_blocks=32, predictor_prior_tokens=8),
        KVCacheManager(num_blocks, block_size, extra_key="m"),
    )
    # Each request needs 16 + 16 tokens = 8 blocks at its end; 80 of them need 640 blocks = 10x the pool.
    for i in range(80):
        b.add_request(_spec(i, 16, 16, i % 3), 0.0)
    finished = {}
    for step in range(5000):
        if not b.has_work:
            break
        for out in _run_step(b, float(step), eos_every=0):
            if out.finish_reason is not None:
                finished[out.request_id] = out.finish_reason
    assert len(finished) == 80 and set(finished.values()) == {FinishReason.LENGTH}
    assert b.kv.num_free_blocks == num_blocks
    if policy == "full":
        assert b.num_preemptions_total == 0  # full reservation never preempts
