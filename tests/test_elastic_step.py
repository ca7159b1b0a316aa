"""The elastic balancer on the step-level simulator: reconfigurations under load drain, switch, and lose nothing."""

import dataclasses

import pytest

from octoserve.services.core.balancer import BalancerPolicy
from octoserve.services.core.placement import InstanceConfig, NodeConfig
from octoserve.services.core.reconfig import Phase, ReconfigKind, Reconfiguration
from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS
from octoserve.services.core.types import Priority, Role
from octoserve.services.sim.elastic_step import ElasticStepSim, run_elastic_step
from octoserve.services.workload import TraceRequest
from octoserve.services.workload_day import LARGE, SMALL

LM = InstanceConfig("lm-0", LARGE, Role.COLOCATED, 4, (0, 1, 2, 3))
SMS = tuple(InstanceConfig(f"sm-{k}", SMALL, Role.COLOCATED, 1, (4 + k,)) for k in range(4))
NODE = NodeConfig(GPU_PRESETS["h200-141gb"], 8, {LARGE: MODEL_PRESETS[LARGE], SMALL: MODEL_PRESETS[SMALL]},
                  (LM, *SMS))
LM_NEW = InstanceConfig("lm-1", LARGE, Role.COLOCATED, 2, (6, 7))


def _trace(duration_s=12.0, small_rps=40.0, large_rps=5.0, output=40):
    out = []
    for model, rps, prompt in ((SMALL, small_rps, 300), (LARGE, large_rps, 1500)):
        for k in range(int(duration_s * rps)):
            out.append(TraceRequest(f"{model}-{k}", k / rps, model,
                                    tuple(1000 + (k * 7919 + i * 31) % 30000 for i in range(prompt)),
                                    output, output, Priority.STANDARD, 2000.0))
    return sorted(out, key=lambda r: r.arrival_s)


def test_role_and_model_changes_under_load_lose_no_request_and_the_models_keep_serving():
    to_decode = Reconfiguration("r1", ReconfigKind.ROLE, ("sm-0",), (dataclasses.replace(SMS[0], role=Role.DECODE),),
                                "test: colocated -> decode")
    back = Reconfiguration("r2", ReconfigKind.ROLE, ("sm-0",), (SMS[0],), "test: decode -> colocated")
    join = Reconfiguration("m1", ReconfigKind.MODEL, ("sm-2", "sm-3"), (LM_NEW,), "test: two 8B GPUs join a 70B",
                           load_s=1.5)
    trace = _trace()
    # Drain only: the routes checked below are where each request was placed (a migration would move them).
    sim = ElasticStepSim(NODE, balance=False, plan_at=[(2.0, to_decode), (3.0, join), (6.0, back)], migrate=False)
    res = sim.run(trace)
    records = res.sim.records
    # Exact counts: every request of the trace finished; none refused, failed or lost.
    assert len(records) == len(trace) == 12 * 40 + 12 * 5
    assert sum(1 for r in records if r.finish_s is not None and not r.error and not r.refused) == len(trace)
    assert res.lost == 0 and [ev.lost for ev in res.reconfigs] == [0, 0, 0]
    assert all(r.num_output_tokens == 40 for r in records)
    # Each drained first, then switched for its stated time.
    assert [ev.phase for ev in res.reconfigs] == [Phase.DONE] * 3
    r1, m1, r2 = res.reconfigs
    assert (r1.planned_s, m1.planned_s, r2.planned_s) == (2.0, 3.0, 6.0)
    for ev in res.reconfigs:
        assert ev.planned_s <= ev.drain_end_s < ev.done_s
    assert r1.held > 0 and m1.held > 0 and r2.held == 0  # sm-0 as a decode instance got no request to hold
    assert r1.drain_end_s > r1.planned_s and m1.drain_end_s > m1.planned_s  # the switches waited for the drains
    assert m1.done_s - m1.drain_end_s == pytest.approx(1.5)
    assert r1.done_s - r1.drain_end_s == pytest.approx(sim.policy.role_switch_s)
    # No new request reached a retired instance once its drain began; the started ones served afterwards.
    routes = {t.trace.request_id: (t.trace.arrival_s, t.route.instance_id)
              for t in sim.sim._trackers.values()}
    for ev in (r1, m1):
        for iid in ev.reconfig.retire:
            assert all(arr <= ev.planned_s or arr >= (r2.done_s if iid == "sm-0" else float("inf"))
                       for arr, inst in routes.values() if inst == iid)
    assert any(inst == "lm-1" and arr >= m1.done_s for arr, inst in routes.values())
    assert any(inst == "sm-0" and arr >= r2.done_s for arr, inst in routes.values())
    # Both models kept serving throughout: requests of each arrived during every drain and switch and finished.
    for model in (SMALL, LARGE):
        during = [r for r in records if r.model == model and r1.planned_s <= r.arrival_s <= r2.done_s]
        assert during and all(r.finish_s is not None for r in during)
    assert set(res.placements[-1][1]) == {"lm-0", "lm-1", "sm-0", "sm-1"}


def test_a_plan_that_retires_an_unknown_instance_is_refused():
    sim = ElasticStepSim(NODE, balance=False)
    bad = Reconfiguration("x", ReconfigKind.ROLE, ("sm-9",), (SMS[0],), "test")
    with pytest.raises(ValueError, match="sm-9"):
        sim.start(bad)


def test_the_balancer_moves_gpus_to_the_70b_when_its_demand_dominates():
    # 70B-heavy traffic on a placement with one 70B instance: the balancer moves 8B GPUs to the 70B.
    policy = BalancerPolicy(forecast_window_s=30.0, min_dwell_s=5.0, confirm_periods=1, min_gain_fraction=0.03,
                            engine_init_s=0.5)
    res = run_elastic_step(NODE, _trace(duration_s=30.0, small_rps=2.0, large_rps=15.0), policy=policy,
                           window_s=6.0)
    assert res.lost == 0
    assert res.done and all(ev.phase is Phase.DONE for ev in res.reconfigs)
    assert any(ev.reconfig.kind is ReconfigKind.MODEL for ev in res.done)
    final = {s.instance_id: s.model for s in res.sim.instances}
    assert set(final) == set(res.placements[-1][1])
    assert sorted(final.values()).count(LARGE) == 2 and SMALL in final.values()  # the 8B kept instances
    assert res.counters.get("planned:model", 0) + res.counters.get("planned:role", 0) == len(res.reconfigs)


def test_a_prefill_instance_without_a_decode_partner_leaves_the_model_served_by_its_colocated_ones():
    # Mid-reconfiguration a model can hold a prefill instance and no decode one yet: the router sends its
    # requests to the colocated instances (before, its admission check raised on the empty decoder list).
    to_prefill = Reconfiguration("r1", ReconfigKind.ROLE, ("sm-0",),
                                 (dataclasses.replace(SMS[0], role=Role.PREFILL),), "test: colocated -> prefill")
    trace = _trace(duration_s=6.0)
    sim = ElasticStepSim(NODE, balance=False, plan_at=[(2.0, to_prefill)])
    res = sim.run(trace)
    (ev,) = res.reconfigs
    assert ev.phase is Phase.DONE and res.lost == 0
    assert sum(1 for r in res.sim.records if r.finish_s is not None and not r.refused) == len(trace) == 6 * 45
    late = [t for t in sim.sim._trackers.values() if t.trace.model == SMALL and t.trace.arrival_s >= ev.done_s]
    assert late and all(t.route.instance_id in ("sm-1", "sm-2", "sm-3") and t.route.decode_instance_id is None
                        for t in late)


def test_the_shortened_day_runs_at_both_levels_and_loses_nothing():
    from octoserve.services.sim.elastic_step import day_rows

    hourly: list[str] = []
    rows = day_rows("default", hour_s=1.0, load=0.9, gpu="h200-141gb", hourly=hourly)  # on 80-GB GPUs the 70B has
    # no smaller serving placement than TP 4, and on this short day the balancer finds no move worth making there
    assert [name for name, *_ in rows] == ["best static, queueing", "elastic, queueing", "best static, step level",
                                           "elastic, step level"]
    assert [lost for *_, lost in rows] == [0, 0, 0, 0]
    assert rows[0][2] == rows[2][2] == 0 and rows[3][2] > 0  # the step-level balancer reconfigured
    offered = {s.overall.num_offered for _, s, _, _ in rows}
    assert len(offered) == 1  # the same requests everywhere
    # Hour by hour (1 s each): the two step-level runs' good requests per hour add up to their goodput over the day,
    # and every reconfiguration done is listed after the table.
    hours = [line.split(" | ") for line in hourly[2:] if line.startswith("| ")]
    assert [int(h[0][2:]) for h in hours] == list(range(24))
    for col, row in ((1, rows[2]), (2, rows[3])):
        assert sum(float(h[col]) for h in hours) / 24 == pytest.approx(row[1].overall.goodput_rps, abs=0.01)
    assert len([line for line in hourly if line.startswith("- ")]) >= rows[3][2]


def test_a_model_change_migrates_running_decodes_and_ends_its_drain_sooner(monkeypatch):
    """The same model change on the same trace, drain only and with migration (services/core/migration.py): the
    running decodes of the retired 8B instances move to the other 8B ones, every request still produces its 160
    tokens, none is lost, and the drain (virtual time) ends sooner (decodes of 160 tokens outlast a poll or two)."""
    join = Reconfiguration("m1", ReconfigKind.MODEL, ("sm-2", "sm-3"), (LM_NEW,), "test: two 8B GPUs join a 70B",
                           load_s=1.5)
    trace = _trace(duration_s=8.0, small_rps=40.0, large_rps=2.0, output=160)
    runs = {m: ElasticStepSim(NODE, balance=False, plan_at=[(3.0, join)], migrate=m).run(trace) for m in (False, True)}
    for res in runs.values():
        records = res.sim.records
        assert res.lost == 0 and len(records) == len(trace)
        assert all(r.finish_s is not None and not r.error and r.num_output_tokens == 160 for r in records)
    drained, migrated = runs[False].reconfigs[0], runs[True].reconfigs[0]
    assert drained.migrated == 0 and migrated.migrated > 0
    assert migrated.migrated + sum(migrated.kept.values()) <= migrated.held
    assert migrated.drain_end_s < drained.drain_end_s
    # The simulator's plain path (every decode explicit) gives the same records as its fast one, migrations included.
    monkeypatch.setenv("OCTOSERVE_SIM_FAST", "0")
    plain = ElasticStepSim(NODE, balance=False, plan_at=[(3.0, join)], migrate=True).run(trace)
    assert plain.reconfigs[0].migrated == migrated.migrated
    assert sorted((r.request_id, r.token_times_s, r.finish_s) for r in plain.sim.records) == \
        sorted((r.request_id, r.token_times_s, r.finish_s) for r in runs[True].sim.records)


def test_in_place_role_changes_keep_serving_and_hold_on_to_their_requests():
    """The 8B's decode instance turns colocated in place and back under load: no drain (drain end = plan time), the
    switch time only, nothing removed or lost, decodes running on it when the change began finish there, it takes
    work in its old role until each switch is done, and in between it takes whole requests, before and after only
    hand-offs."""
    sm = [InstanceConfig("sm-p", SMALL, Role.PREFILL, 1, (4,), max_num_batched_tokens=8192),
          InstanceConfig("sm-d", SMALL, Role.DECODE, 1, (5,)),
          InstanceConfig("sm-6", SMALL, Role.COLOCATED, 1, (6,)), InstanceConfig("sm-7", SMALL, Role.COLOCATED, 1, (7,))]
    node = dataclasses.replace(NODE, instances=(LM, *sm))
    to_colocated = Reconfiguration("r1", ReconfigKind.ROLE, ("sm-d",), (dataclasses.replace(sm[1], role=Role.COLOCATED),),
                                   "test: decode -> colocated in place", in_place=True)
    back = Reconfiguration("r2", ReconfigKind.ROLE, ("sm-d",), (sm[1],), "test: colocated -> decode in place",
                           in_place=True)
    trace = _trace(small_rps=60.0)
    sim = ElasticStepSim(node, balance=False, plan_at=[(2.0, to_colocated), (6.0, back)])
    res = sim.run(trace)
    records = res.sim.records
    # Every request was admitted and finished in full, as on the same trace with no change.
    unchanged = ElasticStepSim(node, balance=False).run(trace).sim.records
    refused = sorted(r.request_id for r in records if r.refused)
    assert refused == sorted(r.request_id for r in unchanged if r.refused) == []
    assert len(records) == len(trace)
    assert sum(1 for r in records if r.finish_s is not None and not r.error and not r.refused) == len(trace)
    assert res.lost == 0 and all(r.num_output_tokens == 40 for r in records if not r.refused)
    r1, r2 = res.reconfigs
    assert [(ev.phase, ev.planned_s, ev.drain_end_s, ev.done_s, ev.held, ev.migrated) for ev in res.reconfigs] == [
        (Phase.DONE, 2.0, 2.0, 2.0 + sim.policy.role_switch_s, 0, 0),
        (Phase.DONE, 6.0, 6.0, 6.0 + sim.policy.role_switch_s, 0, 0)]
    assert all("sm-d" in ids for _, ids in res.placements)  # never off the node
    assert sim.sim.instances["sm-d"].cfg.role is Role.DECODE
    routes = [(t.trace.arrival_s, t.route, t.finish_s) for t in sim.sim._trackers.values() if t.route is not None]
    # A decode running on it when the change began finished there, and it took new hand-offs until the switch was
    # done (a draining instance takes none).
    assert any(r.decode_instance_id == "sm-d" and arr < r1.planned_s < fin for arr, r, fin in routes)
    assert any(r.decode_instance_id == "sm-d" and r1.planned_s <= arr < r1.done_s for arr, r, _ in routes)
    # Whole requests only while colocated (routed once the switch was done, before the change back)...
    whole = [arr for arr, r, _ in routes if r.instance_id == "sm-d"]
    assert whole and all(r1.done_s <= arr < r2.done_s for arr in whole)
    # ... and hand-offs again after it.
    assert any(r.decode_instance_id == "sm-d" and arr >= r2.done_s for arr, r, _ in routes)


def test_with_the_forward_ranker_the_live_schedulers_balancer_runs_at_step_level():
    """`ranker="forward"`: the step-level simulator hands the live scheduler's own balancer the view it would build
    (load snapshots, demand, the reported arrivals to replay); it plays its candidates forward on a twin of the node
    once a load window has been seen, in-place role changes on by default, and nothing is lost."""
    from octoserve.services.core.live_balancer import LiveElasticBalancer
    from octoserve.services.sim.live_ranker import LiveForwardRanker

    sim = ElasticStepSim(NODE, window_s=4.0, period_s=1.0, ranker="forward")
    assert isinstance(sim.live, LiveElasticBalancer) and isinstance(sim.live.ranker, LiveForwardRanker)
    assert sim.balancer is sim.live.inner and sim.balancer.in_place
    assert sim.demand.history_s == BalancerPolicy().forward_window_s
    res = sim.run(_trace(duration_s=12.0))
    assert res.lost == 0
    # One decision per period from the first full window on (t = 4 ... 11 s); one ranking played on the twin (then
    # its hold verdict stands for `forward_refresh_s`, 10 s), which found no move worth making on this steady load.
    assert [d.now_s for d in sim.balancer.log] == [4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0]
    assert dict(res.counters) == {"hold:forward": 8} and sim.live.ranker.calls == 1 and res.reconfigs == []
    view = sim.live_view(sim.sim.now)
    assert {i.id for i in view.placement} == set(sim.sim.instances) and all(view.accepting.values())
    assert view.arrivals and all(a.arrival_s <= sim.sim.now for a in view.arrivals)
    # Without a ranker the estimate decides alone, role changes drained, as before.
    plain = ElasticStepSim(NODE, window_s=4.0)
    assert plain.live is None and not plain.balancer.in_place and plain.demand.history_s == 4.0
