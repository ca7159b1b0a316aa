"""Property tests of the gang arbiter over adversarial arrivals: neither starvation bound is ever exceeded, an LM
step never overlaps an SM step, and every step runs (no deadlock), for every lease shape."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from octoserve.services.core.gang import SHAPES, GangPolicy, check_bounds
from tests.gang_harness import run_gang

LM_FLOOR_S = 0.014  # step floors (decodes only); wanted steps run up to LONG_S (long prompts, unchunked)
SM_FLOOR_S = 0.008
LONG_S = 0.15
NUM_SMS = 4
EPS = 1e-9


def _policy(shape: str, wait_ms: float, extra_stall_ms: float, lm_w: float, sm_w: float) -> GangPolicy:
    # The tightest stall bound the arbiter can prove is max_lm_wait_ms + the LM's floor; draw from there up.
    stall_ms = wait_ms + LM_FLOOR_S * 1e3 + extra_stall_ms
    return GangPolicy(shape=shape, max_lm_wait_ms=wait_ms, max_sm_stall_ms=stall_ms, lm_weight=lm_w, sm_weight=sm_w,
                      lease_ms=15.0, period_ms=30.0)


policies = st.builds(
    _policy,
    st.sampled_from(SHAPES),
    st.floats(SM_FLOOR_S * 1e3, 60.0),
    st.floats(0.0, 60.0),
    st.sampled_from([0.25, 1.0, 4.0]),
    st.sampled_from([0.25, 1.0, 4.0]),
)


def _steps(max_len: int, longest_s: float = 0.03):
    return st.lists(st.floats(0.0005, longest_s), min_size=1, max_size=max_len)


def sm_flood_sparse_lm():
    sm = st.tuples(st.floats(0, 0.5), st.sampled_from([f"sm{i}" for i in range(NUM_SMS)]), _steps(40))
    lm = st.tuples(st.floats(0, 0.5), st.just("lm"), _steps(3, LONG_S))
    return st.tuples(st.lists(sm, min_size=8, max_size=30), st.lists(lm, min_size=1, max_size=2)).map(lambda t: t[0] + t[1])


def lm_burst():
    lm = st.tuples(st.floats(0, 0.05), st.just("lm"), _steps(60))
    sm = st.tuples(st.floats(0, 0.5), st.sampled_from([f"sm{i}" for i in range(NUM_SMS)]), _steps(5, LONG_S))
    return st.tuples(st.lists(lm, min_size=3, max_size=10), st.lists(sm, min_size=1, max_size=8)).map(lambda t: t[0] + t[1])


def alternating():
    return st.integers(2, 30).flatmap(lambda n: st.tuples(*[
        st.tuples(st.just(i * 0.02), st.just("lm" if i % 2 else f"sm{i % NUM_SMS}"),
                  _steps(6))
        for i in range(n)
    ]).map(list))


def long_prompts_both():
    # Long prompts: steps that want far more than any cap, on both sides, cut into chunks by the caps.
    member = st.sampled_from(["lm"] + [f"sm{i}" for i in range(NUM_SMS)])
    return st.lists(
        st.tuples(st.floats(0, 0.3), member, st.lists(st.floats(0.05, 0.5), min_size=1, max_size=4)),
        min_size=2, max_size=10,
    )


def _check(policy: GangPolicy, arrivals, deadline_offset_s=None) -> None:
    assert check_bounds(policy, SM_FLOOR_S, LM_FLOOR_S) == []
    res = run_gang(policy, LM_FLOOR_S, SM_FLOOR_S, NUM_SMS, arrivals, deadline_offset_s)
    assert res.steps_left == 0, "work left when no event remained: deadlock"
    assert res.overlaps == 0, "an LM step overlapped an SM step"
    assert res.max_lm_wait_s <= policy.max_lm_wait_ms / 1e3 + EPS, (res.max_lm_wait_s, policy)
    assert res.max_sm_stall_s <= policy.max_sm_stall_ms / 1e3 + EPS, (res.max_sm_stall_s, policy)
    # The arbiter's own counters agree with the harness's independent measurement.
    assert abs(res.arbiter.stats.max_lm_wait_s - res.max_lm_wait_s) < 1e-9
    assert abs(res.arbiter.stats.max_sm_stall_s - res.max_sm_stall_s) < 1e-9
    assert res.arbiter.stats.num_overruns == 0


@settings(max_examples=150, deadline=None)
@given(policies, sm_flood_sparse_lm(), st.sampled_from([None, 0.005, 0.05]))
def test_sm_flood_with_sparse_lm(policy, arrivals, deadline):
    _check(policy, arrivals, deadline)


@settings(max_examples=150, deadline=None)
@given(policies, lm_burst(), st.sampled_from([None, 0.005, 0.05]))
def test_lm_burst(policy, arrivals, deadline):
    _check(policy, arrivals, deadline)


@settings(max_examples=100, deadline=None)
@given(policies, alternating(), st.sampled_from([None, 0.005]))
def test_alternating(policy, arrivals, deadline):
    _check(policy, arrivals, deadline)


@settings(max_examples=100, deadline=None)
@given(policies, long_prompts_both(), st.sampled_from([None, 0.005, 0.05]))
def test_long_prompts_on_both(policy, arrivals, deadline):
    _check(policy, arrivals, deadline)
