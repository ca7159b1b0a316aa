"""Table tests of the gang arbiter's shapes and rules, and of the SM lease-state rule."""

from __future__ import annotations

import dataclasses

import pytest

from octoserve.services.core.gang import (
    GangArbiter,
    GangPolicy,
    Decision,
    Holder,
    MIN_PREFILL_S,
    MemberView,
    check_bounds,
    min_cap_s,
    policy_from_mapping,
)
from octoserve.services.core.lease_state import LeaseStateCosts, lease_state
from tests.gang_harness import run_gang


def _views(lm_work, sm_work, lm_deadline=None, sm_deadline=None):  # floors: LM 18 ms, SM 10 ms
    lm = MemberView("lm", lm_work, 0.018, lm_deadline)
    sms = [MemberView(f"sm{i}", w, 0.010, sm_deadline) for i, w in enumerate(sm_work)]
    return lm, sms


def test_lm_alone_runs_at_once_and_sms_alone_run_free():
    arb = GangArbiter(GangPolicy(), "lm", ["sm0", "sm1"])
    d = arb.decide(0.0, *_views(True, [False, False]))
    assert d.run_lm and d.start_sm_ids == ()
    arb.started("lm", 0.0, 0.015, 0.018)
    assert arb.decide(0.001, *_views(False, [True, True])).start_sm_ids == ()  # the LM step holds every GPU
    arb.finished("lm", 0.015)
    d = arb.decide(0.015, *_views(False, [True, True]))
    assert d.start_sm_ids == ("sm0", "sm1") and not d.run_lm
    assert arb.holder is Holder.SM


def test_interleave_alternates_one_lm_step_and_one_sm_round():
    arb = GangArbiter(GangPolicy(shape="interleave"), "lm", ["sm0", "sm1"])
    trace = []
    now = 0.0
    for _ in range(3):
        d = arb.decide(now, *_views(True, [True, True]))
        if d.run_lm:
            trace.append("LM")
            arb.started("lm", now, 0.015, 0.018)
            now += 0.015
            arb.finished("lm", now)
        else:
            trace.append("+".join(d.start_sm_ids))
            for s in d.start_sm_ids:
                arb.started(s, now, 0.008, 0.010)
            now += 0.008
            for s in d.start_sm_ids:
                arb.finished(s, now)
    assert trace == ["sm0+sm1", "LM", "sm0+sm1"]


def test_caps_bound_every_step_and_drain_fills_the_barrier():
    policy = GangPolicy(shape="interleave", max_lm_wait_ms=20.0, max_sm_stall_ms=50.0)
    arb = GangArbiter(policy, "lm", ["sm0", "sm1"])
    sms = [MemberView("sm0", True, 0.008), MemberView("sm1", True, 0.002)]
    d = arb.decide(0.0, MemberView("lm", False, 0.014), sms)
    assert d.sm_starts == (("sm0", 0.020), ("sm1", 0.020))  # no LM work: capped at the wait bound anyway
    arb.started("sm0", 0.0, 0.010, 0.020)
    arb.started("sm1", 0.0, 0.003, 0.020)
    arb.finished("sm1", 0.003)
    lm = MemberView("lm", True, 0.014)
    d = arb.decide(0.003, lm, sms)  # every SM has stepped once: interleave drains; sm1 fills until sm0 ends
    assert arb.draining and d.fills and d.sm_starts == (("sm1", pytest.approx(0.007)),)
    arb.started("sm1", 0.003, 0.006, 0.007)
    arb.finished("sm1", 0.009)
    d = arb.decide(0.009, lm, sms)
    assert d == Decision()  # 1 ms left before the barrier is below sm1's 2 ms floor: idle
    arb.finished("sm0", 0.010)
    d = arb.decide(0.010, lm, sms)
    # The LM step may run until the earliest SM stall deadline: sm1 waits since 9 ms, sm0 since 10 ms.
    assert d.run_lm and d.lm_cap_s == pytest.approx(0.009 + 0.050 - 0.010) and arb.holder is Holder.LM
    assert arb.stats.num_fill_steps == 1
    assert arb.stats.barrier_idle_gpu_s == pytest.approx(0.001)  # sm1 idle 9-10 ms


def test_lm_wait_bound_forces_the_lease_over_fair_share():
    # The SMs weigh 100x the LM: after its first step (fair share: it had used nothing) the LM's virtual time is
    # far ahead, so only the bound gives it its second step, as late as the bound allows.
    policy = GangPolicy(shape="slack", max_lm_wait_ms=25.0, max_sm_stall_ms=60.0, lm_weight=0.01, sm_weight=1.0,
                        urgent_ms=0.0)
    arrivals = [(0.0, f"sm{i}", [0.010] * 30) for i in range(2)] + [(0.001, "lm", [0.018, 0.018])]
    res = run_gang(policy, 0.018, 0.010, 2, arrivals)
    assert res.steps_left == 0 and 0.015 < res.max_lm_wait_s <= 0.025
    assert res.arbiter.stats.num_forced_lm == 1


def test_sm_stall_bound_ends_a_periodic_lease_early():
    policy = GangPolicy(shape="periodic", lease_ms=50.0, period_ms=60.0, max_sm_stall_ms=30.0, max_lm_wait_ms=15.0)
    arrivals = [(0.0, "lm", [0.009] * 20), (0.0005, "sm0", [0.010] * 5)]
    res = run_gang(policy, 0.009, 0.010, 1, arrivals)
    assert res.steps_left == 0 and 0.020 < res.max_sm_stall_s <= 0.030
    assert res.arbiter.stats.num_forced_sm >= 1


def test_a_capped_long_prefill_is_chunked_not_starving_the_other_side():
    # A 300 ms LM prompt against a busy SM: the LM runs it in capped chunks, the SM keeps stepping.
    policy = GangPolicy(shape="slack", max_lm_wait_ms=20.0, max_sm_stall_ms=40.0)
    arrivals = [(0.0, "lm", [0.300]), (0.0, "sm0", [0.008] * 40)]
    res = run_gang(policy, 0.005, 0.008, 1, arrivals)
    assert res.steps_left == 0 and res.max_sm_stall_s <= 0.040 + 1e-9 and res.max_lm_wait_s <= 0.020 + 1e-9
    assert res.arbiter.stats.num_lm_steps >= 300 // 40


def test_slack_gives_the_urgent_side_the_gpus():
    arb = GangArbiter(GangPolicy(shape="slack", urgent_ms=5.0), "lm", ["sm0"])
    lm = MemberView("lm", True, 0.018, deadline_s=0.012)  # due within the SM step (10 ms) + 5 ms
    sms = [MemberView("sm0", True, 0.010, deadline_s=1.0)]
    d = arb.decide(0.0, lm, sms)  # the SM slice must have its round first
    assert d.start_sm_ids == ("sm0",)
    arb.started("sm0", 0.0, 0.008, 0.010)
    arb.finished("sm0", 0.008)
    d = arb.decide(0.008, lm, sms)
    assert d.run_lm


@pytest.mark.parametrize("costs, choice", [
    (LeaseStateCosts(True, True, 0.01, 0.02, True), "drain"),
    (LeaseStateCosts(False, True, 0.01, 0.02, True), "keep"),
    (LeaseStateCosts(False, False, 0.01, 0.02, True), "swap"),
    (LeaseStateCosts(False, False, 0.03, 0.02, True), "recompute"),
    (LeaseStateCosts(False, False, 0.01, 0.02, False), "recompute"),
])
def test_lease_state_rule(costs, choice):
    assert lease_state(costs) == choice


def test_check_bounds_says_what_to_raise():
    problems = check_bounds(GangPolicy(max_lm_wait_ms=5.0, max_sm_stall_ms=20.0), 0.010, 0.018)
    assert len(problems) == 2
    assert "raise it to at least 10.0" in problems[0] and "raise it to at least 23.0" in problems[1]
    assert check_bounds(GangPolicy(max_lm_wait_ms=10.0, max_sm_stall_ms=28.0), 0.010, 0.018) == []


def test_policy_problems_and_mapping():
    assert GangPolicy(shape="round-robin").problems()[0].startswith("gang.shape: unknown shape 'round-robin'")
    assert "gang.lease_ms (30) must be below gang.period_ms (30)" in GangPolicy(lease_ms=30.0).problems()
    p = policy_from_mapping({"shape": "periodic", "max_lm_wait_ms": 50, "lm_weight": 2})
    assert (p.shape, p.max_lm_wait_ms, p.lm_weight) == ("periodic", 50.0, 2.0)


def test_shared_step_caps_apply_only_while_both_sides_have_work():
    policy = GangPolicy(shape="interleave", max_lm_wait_ms=25.0, max_sm_stall_ms=50.0, lm_shared_step_ms=15.0,
                        sm_shared_step_ms=10.0)
    arb = GangArbiter(policy, "lm", ["sm0"])
    d = arb.decide(0.0, MemberView("lm", False, 0.0), [MemberView("sm0", True, 0.004)])
    assert d.sm_starts == (("sm0", 0.025),)  # the LM idle: only the wait bound caps the SM
    arb.started("sm0", 0.0, 0.020, 0.025)
    arb.finished("sm0", 0.020)
    d = arb.decide(0.020, MemberView("lm", True, 0.012), [MemberView("sm0", True, 0.004)])
    assert d.run_lm and d.lm_cap_s == pytest.approx(0.015)  # both have work: the LM's shared cap
    arb.started("lm", 0.020, 0.015, 0.015)
    arb.finished("lm", 0.035)
    d = arb.decide(0.035, MemberView("lm", True, 0.012), [MemberView("sm0", True, 0.012)])
    assert d.sm_starts == (("sm0", pytest.approx(0.012)),)  # a floor above the shared cap is still allowed


def _after_an_sm_round(arb, lm, sm):
    """The SMs hold the GPUs at first: let the SM run its round (8 ms), then decide at 8 ms."""
    d = arb.decide(0.0, lm, [sm])
    assert d.start_sm_ids == ("sm0",)
    arb.started("sm0", 0.0, 0.008, d.sm_starts[0][1])
    arb.finished("sm0", 0.008)
    return arb.decide(0.008, lm, [sm])


def test_the_deadline_shape_caps_by_deadlines_not_by_the_fixed_shared_caps():
    policy = GangPolicy(shape="deadline", max_lm_wait_ms=60.0, max_sm_stall_ms=160.0, lm_shared_step_ms=15.0,
                        sm_shared_step_ms=10.0)
    arb = GangArbiter(policy, "lm", ["sm0"])
    # The LM urgent (its latest start passed), the SM's next latest start at 48 ms: the LM's step may run to it
    # (40 ms), past its 15 ms shared cap.
    d = _after_an_sm_round(arb, MemberView("lm", True, 0.018, deadline_s=0.0), MemberView("sm0", True, 0.010, 0.048))
    assert d.run_lm and d.lm_cap_s == pytest.approx(0.040)
    arb.started("lm", 0.008, 0.030, d.lm_cap_s)
    arb.finished("lm", 0.038)
    # The LM only decodes, its latest start 120 ms away: the SM steps to the LM-wait bound, not to a 10 ms cap.
    d = arb.decide(0.038, MemberView("lm", True, 0.018, deadline_s=0.160), [MemberView("sm0", True, 0.010, 0.100)])
    assert d.sm_starts == (("sm0", pytest.approx(0.060)),)


@pytest.mark.parametrize("due_s, cap_s", [(0.0, 0.018), (0.020, 0.020), (0.100, 0.018 + MIN_PREFILL_S)])
def test_a_due_prompt_keeps_room_in_a_step_cut_to_the_other_sides_latest_start(due_s, cap_s):
    """Both sides urgent step after step (a loaded node): the LM's step is cut to the SMs' latest start, which
    has passed, but a prompt of the LM's that is due keeps MIN_PREFILL_S of prefill beside its decodes (all of it
    when shorter), so it is not starved until some step runs uncapped."""
    policy = GangPolicy(shape="deadline", max_lm_wait_ms=60.0, max_sm_stall_ms=160.0)
    arb = GangArbiter(policy, "lm", ["sm0"])
    lm = MemberView("lm", True, 0.018, deadline_s=0.0, due_prefill_s=due_s)
    d = _after_an_sm_round(arb, lm, MemberView("sm0", True, 0.010, deadline_s=0.009))
    assert d.run_lm and d.lm_cap_s == pytest.approx(cap_s)
    assert min_cap_s(lm) == pytest.approx(cap_s)


@pytest.mark.parametrize("lends, due_s, cap_s", [
    ((True, True), 0.120, 0.160),  # every SM lends: the due prompt's step runs to the SM-stall bound
    ((True, False), 0.120, 0.050),  # sm1 keeps its tail: its latest start (58 ms) still cuts the step
    ((True, True), 0.030, 0.040),  # the prompt fits the step the deadlines leave: no tail is spent
    ((True, True), 0.0, 0.040),  # nothing due: the LM's decodes need no long step
])
def test_a_due_prompt_steps_past_the_deadlines_of_the_sms_that_lend_their_tail(lends, due_s, cap_s):
    """Deadline shape, seed 003's bounds: the LM urgent with a prompt due whose step (120 ms: a whole 1,000-token
    prompt of a large model) the SMs' latest start (48 and 58 ms: 40 ms after the SM round) would cut into chunks. SMs whose
    ITL tail affords one slow gap on each of their decodes lend it: the step runs to the bound (the SMs stall from their
    step's end, 8 ms: 160 ms from now); an SM that does not lend still caps it."""
    policy = GangPolicy(shape="deadline", max_lm_wait_ms=60.0, max_sm_stall_ms=160.0)
    arb = GangArbiter(policy, "lm", ["sm0", "sm1"])
    lm = MemberView("lm", True, 0.018, deadline_s=0.0, due_prefill_s=due_s)
    sms = [MemberView(f"sm{i}", True, 0.010, 0.048 + 0.010 * i, lends_tail=lent) for i, lent in enumerate(lends)]
    d = arb.decide(0.0, lm, sms)
    assert d.start_sm_ids == ("sm0", "sm1")
    for sm in ("sm0", "sm1"):
        arb.started(sm, 0.0, 0.008, 0.06)
        arb.finished(sm, 0.008)
    d = arb.decide(0.008, lm, sms)
    assert d.run_lm and d.lm_cap_s == pytest.approx(cap_s)


@pytest.mark.parametrize("lends, due_s, sm_deadline_s, goes_first, cap_s", [
    ((True, True), 0.120, 0.048, True, 0.160),  # every SM lends: the step may run to the stall bound, so it goes now
    ((True, False), 0.120, 0.048, False, None),  # sm1 keeps its tail: the step would be cut (40 ms), so it waits
    ((False, False), 0.030, 0.048, True, 0.040),  # short enough for the step the SMs' latest start leaves
    ((True, True), 0.0, 0.048, False, None),  # nothing due: the LM only decodes and waits for its own deadline
    ((True, True), 0.030, 0.020, False, None),  # an SM is urgent: the SMs step first
])
def test_a_due_prompt_whose_step_fits_goes_first(lends, due_s, sm_deadline_s, goes_first, cap_s):
    """Deadline shape: the LM is not urgent (its latest start 100 ms away) and has a prompt due. Waiting for its
    latest start would only spend the prompt's TTFT margin when its step fits the cap it gets now: the SMs' gaps
    are the same either way (lenders pay one slow gap on each decode, others are not passed). So it goes first."""
    policy = GangPolicy(shape="deadline", max_lm_wait_ms=60.0, max_sm_stall_ms=160.0)
    arb = GangArbiter(policy, "lm", ["sm0", "sm1"])
    lm = MemberView("lm", True, 0.018, deadline_s=0.100, due_prefill_s=due_s)
    sms = [MemberView(f"sm{i}", True, 0.010, sm_deadline_s + 0.010 * i, lends_tail=lent)
           for i, lent in enumerate(lends)]
    d = arb.decide(0.0, lm, sms)
    assert d.start_sm_ids == ("sm0", "sm1")  # every SM steps once after a lease before the LM may drain them
    for sm in ("sm0", "sm1"):
        arb.started(sm, 0.0, 0.008, 0.06)
        arb.finished(sm, 0.008)
    d = arb.decide(0.008, lm, sms)
    if goes_first:
        assert d.run_lm and d.lm_cap_s == pytest.approx(cap_s)
    else:
        assert not d.run_lm and d.start_sm_ids == ("sm0", "sm1")


def test_an_sm_prompt_spends_the_lms_tail_only_when_the_lm_lends_it():
    """The symmetric rule: an SM's due prompt (a 50 ms step) steps past the LM's latest start (30 ms away) up to the
    LM-wait bound (60 ms) only while the LM lends its tail."""
    policy = GangPolicy(shape="deadline", max_lm_wait_ms=60.0, max_sm_stall_ms=160.0)
    for lent, cap_s in ((False, 0.030), (True, 0.060)):
        arb = GangArbiter(policy, "lm", ["sm0"])
        lm = MemberView("lm", True, 0.018, deadline_s=0.030, lends_tail=lent)  # not urgent: the SM steps
        d = arb.decide(0.0, lm, [MemberView("sm0", True, 0.010, 1.0, due_prefill_s=0.050)])
        assert d.sm_starts == (("sm0", pytest.approx(cap_s)),)


def test_decisions_tell_each_member_whether_the_other_side_lends_its_tail():
    """Told like sharing: once when it changes, idle members included; the LM is lent only while every SM with work
    lends, the SMs while the LM lends or has no work; only the deadline shapes step past deadlines, so no other
    shape lends."""
    arb = GangArbiter(GangPolicy(shape="deadline", max_lm_wait_ms=60.0, max_sm_stall_ms=160.0), "lm", ["sm0", "sm1"])
    lm = MemberView("lm", True, 0.018, deadline_s=1.0, lends_tail=True)
    both = [MemberView("sm0", True, 0.010, 1.0, lends_tail=True), MemberView("sm1", True, 0.010, 1.0, lends_tail=True)]
    d = arb.decide(0.0, lm, both)
    assert d.lend_notices == (("lm", True), ("sm0", True), ("sm1", True))
    assert (arb.tail_lent("lm"), arb.tail_lent("sm1")) == (True, True)
    one_keeps = [both[0], dataclasses.replace(both[1], lends_tail=False)]
    d = arb.decide(0.0, lm, one_keeps)
    assert d.lend_notices == (("lm", False),) and arb.tail_lent("lm") is False
    d = arb.decide(0.0, lm, [both[0], dataclasses.replace(both[1], has_work=False, lends_tail=False)])
    assert d.lend_notices == (("lm", True),)  # an SM without work spends nothing
    arb.forget("sm0")
    assert arb.decide(0.0, lm, one_keeps).lend_notices == (("lm", False), ("sm0", True))
    interleave = GangArbiter(GangPolicy(shape="interleave"), "lm", ["sm0"])
    d = interleave.decide(0.0, lm, both[:1])
    assert d.lend_notices == (("lm", False), ("sm0", False))
    # A side with no work has no deadline to keep: the SMs are lent while the LM has none, the LM while no SM has.
    arb = GangArbiter(GangPolicy(shape="deadline", max_lm_wait_ms=60.0, max_sm_stall_ms=160.0), "lm", ["sm0"])
    d = arb.decide(0.0, MemberView("lm", False, 0.0), [dataclasses.replace(both[0], lends_tail=False)])
    assert d.lend_notices == (("lm", False), ("sm0", True))
    d = arb.decide(0.1, dataclasses.replace(lm, lends_tail=False), [MemberView("sm0", False, 0.0)])
    assert d.lend_notices == (("lm", True), ("sm0", False))
