"""Tiers under saturation and the calibrated TTFT prediction, driven through the core objects directly.

- The batcher: a waiting INTERACTIVE request preempts running BATCH work at an iteration boundary (exact victims),
  never below BATCH's floor, never a victim the queue order puts ahead of it; a BATCH prompt mid-prefill yields its
  chunk budget to a waiting INTERACTIVE head. Property: whatever BATCH flood came first, an INTERACTIVE request is
  running within one step while BATCH holds more than its floor.
- The router: TtftCalibrator (exact quantile, window, prior, cap), TierPressure, BATCH held to its share while
  more urgent requests are being shed, and the calibrated correction moving the admission limit.
"""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
import dataclasses

from router_fixtures import LM, SM, colocated_config, policy, request
from router_fixtures import load as _load

from octoserve.services.core import admission as adm
from octoserve.services.core.batch_state import BatcherConfig, RequestStatus
from octoserve.services.core.batcher import Batcher
from octoserve.services.core.errors import Overloaded
from octoserve.services.core.kv_cache import KVCacheManager
from octoserve.services.core.routing import MAX_CORRECTION, Refuse, Route
from octoserve.services.core.types import Priority, RequestSpec, SamplingParams, ScheduledChunk, StepResult

B, I = Priority.BATCH, Priority.INTERACTIVE


def load(iid, model=SM, *, max_num_seqs=0, **kw):
    return dataclasses.replace(_load(iid, model, **kw), max_num_seqs=max_num_seqs)


def make_batcher(num_blocks=64, block_size=4, **overrides) -> Batcher:
    overrides.setdefault("reservation_policy", "watermark")
    overrides.setdefault("batch_min_share", 0.25)
    return Batcher(BatcherConfig(**overrides), KVCacheManager(num_blocks, block_size, extra_key="m"))


def spec(rid, prompt_len=8, max_tokens=50, arrival=0.0, priority=Priority.STANDARD, first=100) -> RequestSpec:
    return RequestSpec(rid, "m", tuple(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens),
                       arrival, priority)


def step(b: Batcher, now: float = 0.0):
    plan = b.schedule(now)
    return plan, b.update(plan, StepResult({c.request_id: 7 for c in plan.chunks if c.samples}), now)


# --- the batcher ----------------------------------------------------------------------------------------------


def test_interactive_preempts_the_latest_batch_request_for_a_slot_down_to_the_floor():
    b = make_batcher(max_num_seqs=4, max_num_batched_tokens=64)  # floor: 1 BATCH slot
    for i in range(4):
        b.add_request(spec(f"b{i}", arrival=0.1 * i, priority=B, first=100 + 10 * i), 0.0)
    step(b, 0.5)
    assert b.num_running == 4
    b.add_request(spec("i0", arrival=1.0, priority=I, first=500), 1.0)
    plan, _ = step(b, 1.0)
    assert plan.preempted_ids == ("b3",)  # the latest BATCH arrival gives way
    assert ScheduledChunk("i0", 8, 0, True) in plan.chunks
    for k in (1, 2):
        b.add_request(spec(f"i{k}", arrival=1.0 + k, priority=I, first=500 + 10 * k), 1.0 + k)
        plan, _ = step(b, 1.0 + k)
        assert plan.preempted_ids == (f"b{3 - k}",)
    b.add_request(spec("i3", arrival=4.0, priority=I, first=540), 4.0)
    plan, _ = step(b, 4.0)
    assert plan.preempted_ids == ()  # b0 is BATCH's floor: i3 waits for a slot
    assert b.request("i3").status is RequestStatus.WAITING
    assert b.request("b0").status is RequestStatus.RUNNING
    assert [b.request(f"b{i}").status for i in (1, 2, 3)] == [RequestStatus.WAITING] * 3


def test_a_batch_request_ahead_in_edf_order_is_never_preempted():
    # BATCH arrived at 0 (deadline 10 s), INTERACTIVE at 9.9 (deadline 10.1 s): the BATCH request goes first.
    b = make_batcher(max_num_seqs=1, max_num_batched_tokens=64, batch_min_share=0.01)
    b.add_request(spec("b0", arrival=0.0, priority=B), 0.0)
    step(b, 0.0)
    b.add_request(spec("i0", arrival=9.9, priority=I, first=500), 9.9)
    plan, _ = step(b, 9.9)
    assert plan.preempted_ids == () and b.request("i0").status is RequestStatus.WAITING


def test_tier_preemption_off_by_default_in_the_batcher_config():
    b = make_batcher(max_num_seqs=1, max_num_batched_tokens=64, batch_min_share=1.0)
    b.add_request(spec("b0", priority=B), 0.0)
    step(b)
    b.add_request(spec("i0", arrival=1.0, priority=I, first=500), 1.0)
    plan, _ = step(b, 1.0)
    assert plan.preempted_ids == () and b.request("i0").status is RequestStatus.WAITING
    assert BatcherConfig().batch_min_share == 1.0


def test_a_batch_prompt_mid_prefill_yields_its_chunk_to_a_waiting_interactive_head():
    b = make_batcher(max_num_seqs=8, max_num_batched_tokens=16)
    b.add_request(spec("b0", prompt_len=100, priority=B), 0.0)
    plan, _ = step(b)
    assert plan.chunks == (ScheduledChunk("b0", 16, 0, False),)
    b.add_request(spec("i0", prompt_len=10, arrival=0.1, priority=I, first=500), 0.1)
    plan, _ = step(b, 0.1)
    # The INTERACTIVE prompt is admitted first; BATCH continues with what is left of the budget.
    assert plan.chunks == (ScheduledChunk("i0", 10, 0, True), ScheduledChunk("b0", 6, 16, False))
    assert plan.preempted_ids == ()


@settings(max_examples=60, deadline=None)
@given(
    num_batch=st.integers(2, 12),
    prompt_lens=st.lists(st.integers(4, 40), min_size=12, max_size=12),
    steps_before=st.integers(0, 6),
    max_num_seqs=st.integers(2, 8),
)
def test_property_a_batch_flood_cannot_take_interactive_capacity(num_batch, prompt_lens, steps_before, max_num_seqs):
    b = make_batcher(num_blocks=512, max_num_seqs=max_num_seqs, max_num_batched_tokens=48)
    for i in range(num_batch):
        b.add_request(spec(f"b{i}", prompt_len=prompt_lens[i], arrival=0.01 * i, priority=B, first=1000 + 100 * i), 0.0)
    for k in range(steps_before):
        step(b, 0.01 * k)
    floor = math.ceil(0.25 * max_num_seqs)
    batch_running = sum(1 for i in range(num_batch) if (r := b.request(f"b{i}")) and r.status is RequestStatus.RUNNING)
    b.add_request(spec("i0", prompt_len=8, arrival=0.5, priority=I, first=50), 0.5)
    plan, _ = step(b, 0.5)
    if batch_running > floor or batch_running + 1 <= max_num_seqs:
        assert b.request("i0").num_computed_tokens > 0 or any(c.request_id == "i0" for c in plan.chunks)
    running_batch = sum(1 for i in range(num_batch) if (r := b.request(f"b{i}")) and r.status is RequestStatus.RUNNING)
    assert running_batch >= min(floor, batch_running)  # the floor is never preempted away


# --- the router -------------------------------------------------------------------------------------------------


def test_calibrator_prior_then_exact_nearest_rank_quantile_over_the_window():
    c = adm.TtftCalibrator(quantile=0.9, window=10, min_samples=5)
    for e in (0.04, 0.01, 0.03, 0.02):
        c.observe(SM, I, e)
    assert c.correction_s(SM, I, prior_s=0.5) == 0.5  # 4 < min_samples
    c.observe(SM, I, 0.05)
    assert c.correction_s(SM, I, prior_s=0.5) == 0.05  # rank ceil(0.9 * 5) = 5 of [.01 .02 .03 .04 .05]
    for e in (-0.01,) * 9:
        c.observe(SM, I, e)
    assert c.num_samples(SM, I) == 10  # 0.04, 0.01, 0.03, 0.02 fell out of the window
    assert c.correction_s(SM, I, prior_s=0.5) == -0.01  # rank 9 of nine -0.01s and 0.05
    c.observe(SM, I, 0.3)
    assert c.correction_s(SM, I, prior_s=0.5) == -0.01  # 0.05 left: rank 9 of nine -0.01s and 0.3
    c.observe(SM, I, 0.3)
    assert c.correction_s(SM, I, prior_s=0.5) == 0.3
    assert c.correction_s(SM, I, prior_s=0.5, cap_s=0.16) == 0.16
    assert c.correction_s(SM, B, prior_s=0.5, cap_s=0.16) == 0.16  # other keys: the prior, capped
    with pytest.raises(ValueError):
        adm.TtftCalibrator(quantile=0.9, window=4, min_samples=5)


def test_miss_probability_is_the_share_of_recent_errors_over_the_slack():
    c = adm.TtftCalibrator(quantile=0.9, window=10, min_samples=4)
    assert c.miss_probability(SM, I, slack_s=0.03, prior_s=0.02) == 0.0  # uncalibrated: the prior decides
    assert c.miss_probability(SM, I, slack_s=0.01, prior_s=0.02) == 1.0
    for e in (0.04, 0.01, 0.03, 0.02):
        c.observe(SM, I, e)
    assert c.miss_probability(SM, I, slack_s=0.025, prior_s=9.0) == 0.5  # 0.03 and 0.04 of four
    assert c.miss_probability(SM, I, slack_s=0.04, prior_s=9.0) == 0.0  # an error equal to the slack just makes it
    assert c.miss_probability(SM, I, slack_s=-1.0, prior_s=9.0) == 1.0
    assert c.miss_probability(SM, I, slack_s=0.015, prior_s=9.0, cap_s=0.015) == 0.0  # as safe as the capped margin


def test_risk_allowance_spends_the_quantile_s_tail_as_a_budget_over_the_window():
    c = adm.TtftCalibrator(quantile=0.9, window=4, min_samples=1, max_risk=0.25)
    assert c.risk_allowance(SM, I) == pytest.approx(0.1)  # nothing admitted yet: one admission's share
    c.note_admitted(SM, I, 0.0)
    assert c.risk_allowance(SM, I) == pytest.approx(0.2)  # mean of the two within 0.1
    c.note_admitted(SM, I, 0.0)
    c.note_admitted(SM, I, 0.0)
    assert c.risk_allowance(SM, I) == pytest.approx(0.25)  # 0.4 of budget, capped at max_risk
    c.note_admitted(SM, I, 0.25)  # window full: 0, 0, 0, 0.25
    assert c.risk_allowance(SM, I) == pytest.approx(0.15)  # the oldest 0 leaves: 0.4 - 0.25
    c.note_admitted(SM, I, 0.15)  # 0, 0, 0.25, 0.15
    assert c.risk_allowance(SM, I) == pytest.approx(0.1)  # spent: the quantile's own share remains
    assert c.risk_allowance(SM, I, spend=False) == pytest.approx(0.1)
    assert c.risk_allowance(SM, B) == pytest.approx(0.1)  # each model and tier keeps its own budget
    with pytest.raises(ValueError, match="max_risk"):
        adm.TtftCalibrator(quantile=0.9, window=4, min_samples=1, max_risk=1.5)


def test_tier_pressure_counts_overload_refusals_in_the_last_window_decisions():
    p = adm.TierPressure(window=10, threshold=0.2)
    assert not p.under_pressure(SM)
    for refused in (True, False, False, False, False, False, False, False, False, False):
        p.observe(SM, refused)
    assert not p.under_pressure(SM)  # 1 of 10
    p.observe(SM, True)
    assert not p.under_pressure(SM)  # the first True left the window: still 1 of 10
    p.observe(SM, True)
    assert p.under_pressure(SM)  # 2 of 10
    for _ in range(9):
        p.observe(SM, False)
    assert not p.under_pressure(SM)


def test_shortest_first_caps_a_refused_tiers_prompts_at_the_share_it_is_served():
    sf = adm.ShortestFirst(window=10, margin=0.25)
    for tokens in (100, 200, 300, 400):
        sf.observe(SM, I, tokens, admitted=False)
    assert sf.cap_tokens(SM, I) == -1  # under half a window: no cap
    sf.observe(SM, I, 500, admitted=True)
    assert sf.cap_tokens(SM, I) == 200  # 1 of 5 admitted, x 1.25: the length at quantile 0.25 of 100..500
    for tokens in (600, 700, 800, 900, 1000):
        sf.observe(SM, I, tokens, admitted=True)
    assert sf.cap_tokens(SM, I) == 800  # 6 of 10, x 1.25 = 0.75: index 7 of 100..1000
    sf.observe(SM, I, 50, admitted=True)  # the oldest (100, refused) leaves the window
    assert sf.num_decisions(SM, I) == 10 and sf.cap_tokens(SM, I) == 900  # 7 of 10: index 8 of 50, 200..1000
    sf.observe(SM, I, 50, admitted=True)
    assert sf.cap_tokens(SM, I) == -1  # 8 of 10, x 1.25 = 1: the tier is served what it gets
    # Each model and tier keeps its own window.
    assert (sf.cap_tokens(LM, I), sf.num_decisions(LM, I)) == (-1, 0)
    assert (sf.cap_tokens(SM, B), sf.num_decisions(SM, B)) == (-1, 0)
    # Nothing admitted: the cap holds at the margin's quantile (index 1 of 5), not at the shortest prompt.
    for tokens in (500, 400, 300, 200, 100):
        sf.observe(LM, I, tokens, admitted=False)
    assert sf.cap_tokens(LM, I) == 200
    with pytest.raises(ValueError, match="window"):
        adm.ShortestFirst(window=1)


def test_a_refused_tier_admits_its_shortest_prompts_first():
    """LinearCost: 10,000 prompt tokens/s, so a 2,500-token prompt alone fills the 250 ms SLO; 3,000 of queued
    prefill on every 8B instance refuses any prompt by TTFT."""
    p = policy(colocated_config())
    p.shortest_first = adm.ShortestFirst(window=4, margin=0.25)
    busy = {**_idle(), **{f"sm-{i}": load(f"sm-{i}", queued=3000) for i in range(3)}}
    assert isinstance(p.route(request("a", prompt=300), _idle(), 0.0), Route)
    assert isinstance(p.route(request("b", prompt=100), _idle(), 0.0), Route)
    assert p.shortest_first.cap_tokens(SM, Priority.STANDARD) == -1  # all it got, admitted
    for rid in ("c", "d"):
        r = p.route(request(rid, prompt=100), busy, 0.0)
        assert isinstance(r, Refuse) and r.reason == "ttft"
    # 2 of 4 admitted, x 1.25: index 2 of 100, 100, 100, 300
    assert p.shortest_first.cap_tokens(SM, Priority.STANDARD) == 100
    r = p.route(request("e", prompt=200), _idle(), 0.0)  # an idle node would serve it, but it is over the cap
    assert isinstance(r, Refuse) and isinstance(r.error, Overloaded) and r.reason == "long_prompt"
    assert ("llama-3-8b is refusing part of its STANDARD load and admits the shortest prompts first: this one's 200 "
            "uncached tokens are over the 100 it admits now") in r.error.reason
    assert isinstance(p.route(request("f", prompt=100), _idle(), 0.0), Route)
    # Not counted: prompts no idle instance serves in time, re-placements; another tier (BATCH) has its own window.
    r = p.route(request("g", prompt=3000), _idle(), 0.0)
    assert isinstance(r, Refuse) and r.reason == "slo_infeasible"
    assert isinstance(p.route(request("i", prompt=200), _idle(), 0.0, admitted=True), Route)
    assert isinstance(p.route(request("h", prompt=200, tier=B), _idle(), 0.0), Route)
    assert p.shortest_first.num_decisions(SM, Priority.STANDARD) == 4 and p.shortest_first.num_decisions(SM, B) == 1
    assert p.shortest_first.cap_tokens(SM, Priority.STANDARD) == 100
    # Off, the same prompt is admitted.
    off = policy(colocated_config(shortest_first=False))
    off.shortest_first = p.shortest_first
    assert isinstance(off.route(request("e", prompt=200), _idle(), 0.0), Route)


def _idle():
    return {"lm-0": load("lm-0", "llama-3-70b"), "sm-0": load("sm-0"), "sm-1": load("sm-1"), "sm-2": load("sm-2")}


def test_observed_ttfts_move_the_admission_limit():
    # ttft_slack 0.5: the prior refuses a predicted 150 ms (+125 ms margin > 250 ms); calibration learns the
    # prediction is 20 ms late at the 95th percentile and then admits it (150 + 20 <= 250).
    p = policy(colocated_config(ttft_slack=0.5, ttft_min_samples=4, ttft_window=8))
    loads = {**_idle(), **{f"sm-{i}": load(f"sm-{i}", queued=500) for i in range(3)}}  # 50 ms + 100 ms own
    assert isinstance(p.route(request("x"), loads, 0.0), Refuse)
    for k in range(4):
        rid = f"r{k}"
        route = p.route(request(rid, prompt=100), _idle(), 0.0)
        p.on_dispatched(rid, route, request(rid, prompt=100))
        p.on_first_token(rid, route.predicted_ttft_ms / 1000.0 + 0.005 * (k + 1))
    assert p.ttft_correction_s(SM, Priority.STANDARD, 250.0) == pytest.approx(0.020)
    assert isinstance(p.route(request("x"), loads, 0.0), Route)


def test_correction_is_capped_so_probes_still_get_in():
    p = policy(colocated_config(ttft_min_samples=1, ttft_window=1))
    route = p.route(request("a", prompt=10), _idle(), 0.0)
    p.on_dispatched("a", route, request("a", prompt=10))
    p.on_first_token("a", 5.0)  # 5 s late
    assert p.ttft_correction_s(SM, Priority.STANDARD, 250.0) == pytest.approx(MAX_CORRECTION * 0.25)
    assert isinstance(p.route(request("b", prompt=10), _idle(), 0.0), Route)  # 1 ms predicted: still admitted


def test_batch_is_held_to_its_share_while_more_urgent_requests_are_shed():
    p = policy(colocated_config(batch_min_share=0.1, tier_queue_bound={"interactive": 1}))
    max_seqs = 20  # load() snapshots: floor = 2 BATCH requests per instance
    loads = {k: load(k, max_num_seqs=max_seqs) if k != "lm-0" else v for k, v in _idle().items()}
    for k in range(6):  # two BATCH requests on each 8B instance
        rid = f"b{k}"
        route = p.route(request(rid, tier=B), loads, 0.0)
        p.on_dispatched(rid, route, request(rid, tier=B))
    assert isinstance(p.route(request("b6", tier=B), loads, 0.0), Route)  # no pressure yet
    route = p.route(request("i0", tier=I), loads, 0.0)
    p.on_dispatched("i0", route, request("i0", tier=I))
    for k in range(1, 8):  # INTERACTIVE being shed: its queue bound of 1 is reached
        assert isinstance(p.route(request(f"i{k}", tier=I), loads, 0.0), Refuse)
    r = p.route(request("b7", tier=B), loads, 0.0)
    assert isinstance(r, Refuse) and isinstance(r.error, Overloaded)
    assert "BATCH holds its minimum share of every instance" in r.error.reason and r.reason == "batch_share"


def test_preemptible_slots_leave_batch_its_floor():
    ledger = adm.InFlightLedger()
    for k, tier in enumerate((B, B, B, Priority.STANDARD)):
        ledger.on_dispatched(adm.Dispatched(f"r{k}", SM, tier, "sm-0", None, 10, 1, 0))
    snap = load("sm-0", max_num_seqs=20)
    assert adm.preemptible_slots(snap, ledger, I, 0.1) == 2  # 3 BATCH + 1 STANDARD below INTERACTIVE, floor 2
    assert adm.preemptible_slots(snap, ledger, Priority.STANDARD, 0.1) == 1
    assert adm.preemptible_slots(snap, ledger, B, 0.1) == 0
    assert adm.preemptible_slots(snap, ledger, I, 1.0) == 0  # tier preemption off
    assert math.isclose(adm.slot_wait_s(snap, ledger, 0), 0.0)


def test_only_less_urgent_work_whose_deadline_comes_later_is_preemptible():
    # The batcher never preempts a request the EDF order puts ahead of the newcomer, so neither does the router's
    # slot estimate: BATCH deadlines 9, 10, 11 and 12 s, a STANDARD one at 10.05 s; BATCH's floor is 2 of 20 slots.
    ledger = adm.InFlightLedger()
    for k, deadline in enumerate((9.0, 10.0, 11.0, 12.0)):
        ledger.on_dispatched(adm.Dispatched(f"b{k}", SM, B, "sm-0", None, 10, 1, 0, deadline_s=deadline))
    ledger.on_dispatched(adm.Dispatched("s0", SM, Priority.STANDARD, "sm-0", None, 10, 1, 0, deadline_s=10.05))
    snap = load("sm-0", max_num_seqs=20)
    assert adm.preemptible_slots(snap, ledger, I, 0.1) == 3  # every one below INTERACTIVE but the floor
    assert ledger.later_dispatched("sm-0", I, 10.1) == (2, 2)  # b2, b3
    assert adm.preemptible_slots(snap, ledger, I, 0.1, (2, 2)) == 2
    assert ledger.later_dispatched("sm-0", I, 10.0) == (3, 2)  # and s0
    assert adm.preemptible_slots(snap, ledger, I, 0.1, (3, 2)) == 3
    assert ledger.later_dispatched("sm-0", I, 11.5) == (1, 1)
    assert ledger.later_dispatched("sm-0", Priority.STANDARD, 10.1) == (2, 2)
    assert ledger.later_dispatched("sm-1", I, 0.0) == (0, 0)
    for rid in ("b3", "b1"):
        ledger.on_finished(rid)
    # b0 and b2 left, both BATCH's floor: none preemptible, however late b2's deadline
    assert ledger.later_dispatched("sm-0", I, 10.1) == (1, 1)
    assert adm.preemptible_slots(snap, ledger, I, 0.1, (1, 1)) == 0
    assert adm.edf_figures(snap, ledger, I, 10.1)[1:] == (3, 1, 1)  # b0, b2 and s0 below INTERACTIVE; b2 later


def test_a_full_instance_predicts_a_slot_wait_behind_batch_work_due_before_the_newcomer():
    p = policy(colocated_config(batch_min_share=0.1))
    # 2 running + the 2 BATCH requests sent since the snapshot fill each 4-slot 8B instance; BATCH keeps 1 slot
    full = {k: load(k, max_num_seqs=4, running=2) if k != "lm-0" else v for k, v in _idle().items()}
    for k in range(6):  # two BATCH requests on each 8B instance, dispatched at 0 s: deadlines 10 s
        route = p.route(request(f"b{k}", tier=B), _idle(), 0.0)
        p.on_dispatched(f"b{k}", route, request(f"b{k}", tier=B))
    soon = dataclasses.replace(request("i0", tier=I), arrival_s=1.0)  # deadline 1.2 s: the BATCH work goes after
    late = dataclasses.replace(request("i1", tier=I), arrival_s=9.9)  # deadline 10.1 s: the BATCH work goes first
    assert {c.instance.id: c.slot_wait_s for c in p.candidates(soon, full)} == {"sm-0": 0.0, "sm-1": 0.0, "sm-2": 0.0}
    assert all(c.slot_wait_s > 0.0 for c in p.candidates(late, full))


def test_sliding_share_counts_the_last_window_observations():
    s = adm.SlidingShare(window=4)
    assert s.share() == 0.0
    for flag in (True, True, False, False):
        s.observe(flag)
    assert s.share() == 0.5
    s.observe(False)  # the first True leaves
    assert s.share() == 0.25
