"""The elastic simulator and the mix-shift day: reconfigurations under load lose no request."""

import dataclasses
import math

import pytest

from octoserve.services.cli import main
from octoserve.services.core.balancer import BalancerPolicy
from octoserve.services.core.elastic_layouts import candidate_layouts
from octoserve.services.core.placement import InstanceConfig, NodeConfig
from octoserve.services.core.reconfig import Phase, ReconfigKind, Reconfiguration
from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS
from octoserve.services.core.types import Role
from octoserve.services.sim.elastic_sim import ElasticSim, model_alone_rps, run_day
from octoserve.services.workload_day import (
    HOUR_S,
    LARGE,
    SMALL,
    generate_day,
    mix_shift_day,
    mix_shift_schedule,
)

NODE = NodeConfig(GPU_PRESETS["h200-141gb"], 8, {LARGE: MODEL_PRESETS[LARGE], SMALL: MODEL_PRESETS[SMALL]}, ())
LM = InstanceConfig("lm-0", LARGE, Role.COLOCATED, 4, (0, 1, 2, 3))
SMS = tuple(InstanceConfig(f"sm-{k}", SMALL, Role.COLOCATED, 1, (4 + k,)) for k in range(4))
LAYOUTS = candidate_layouts(NODE)


def small_share(t_s, schedule):
    return dict(schedule(t_s).shares)[SMALL]


# --- the workload ---------------------------------------------------------------------------------------------------


def test_mix_shift_schedule_moves_90_10_to_10_90_and_back_with_a_step_and_a_pd_phase():
    at = mix_shift_schedule(40.0)
    assert HOUR_S == 15.0  # 240x compression by default
    assert small_share(0.0, at) == pytest.approx(0.9)
    assert small_share(12 * HOUR_S, at) == pytest.approx(0.1)
    assert small_share(24 * HOUR_S - 1e-9, at) == pytest.approx(0.9)
    assert small_share(17.9 * HOUR_S, at) == pytest.approx(0.5 + 0.4 * math.cos(2 * math.pi * 17.9 / 24))
    assert small_share(18.0 * HOUR_S, at) == 0.15  # the step, until hour 21
    assert at(18.5 * HOUR_S).label == "step"
    assert small_share(21.0 * HOUR_S, at) == pytest.approx(0.5 + 0.4 * math.cos(2 * math.pi * 21 / 24))
    assert at(3.2 * HOUR_S).label == "prefill-heavy" and at(3.2 * HOUR_S).prompt.mean == 2000.0
    assert at(3.7 * HOUR_S).label == "decode-heavy" and at(3.7 * HOUR_S).output.mean == 600.0
    assert at(9.0 * HOUR_S).label == "base"
    # By load: each model offers its share of what it alone would need the node for.
    by_load = mix_shift_schedule(0.0, load_rps=(100.0, 10.0))
    seg = by_load(0.0)
    assert seg.rate_rps == pytest.approx(0.9 * 100 + 0.1 * 10)
    assert small_share(0.0, by_load) == pytest.approx(90 / 91)


def test_day_trace_is_seeded_sorted_and_follows_the_mix():
    day = mix_shift_day(40.0, hours=24, hour_s=2.0)
    a, b = generate_day(day, 3), generate_day(day, 3)
    assert a == b
    assert a != generate_day(day, 4)
    assert [r.arrival_s for r in a] == sorted(r.arrival_s for r in a)
    assert len(a) == pytest.approx(40.0 * 48, rel=0.08)
    early = [r for r in a if r.arrival_s < 4.0]
    noon = [r for r in a if 22.0 <= r.arrival_s < 26.0]
    assert sum(r.model == SMALL for r in early) / len(early) > 0.8
    assert sum(r.model == SMALL for r in noon) / len(noon) < 0.2
    assert all(r.prompt_tokens >= 1 and r.output_tokens >= 1 for r in a)


# --- the simulator --------------------------------------------------------------------------------------------------


def _day(hours=24.0, hour_s=6.0, load=0.9, seed=0):
    alone = (model_alone_rps(NODE, SMALL, 1000, 250), model_alone_rps(NODE, LARGE, 1000, 250))
    day = mix_shift_day(hours=hours, hour_s=hour_s, load_rps=(load * alone[0], load * alone[1]))
    return day, generate_day(day, seed)


def test_elastic_day_reconfigures_under_load_and_loses_no_request():
    day, requests = _day()
    # The horizon is fixed at 60 s here (not the 6-s hours' dwell) so that the balancer moves several times: this
    # test is about the mechanics of moving under load.
    res = run_day(NODE, day, requests, (LM, *SMS), "elastic", layouts=LAYOUTS,
                  policy=BalancerPolicy(min_dwell_s=10.0, cost_horizon_s=60.0))
    assert res.lost == 0
    assert len(res.reconfigs) >= 3
    assert all(ev.phase is Phase.DONE for ev in res.reconfigs)
    assert sum(ev.migrated for ev in res.reconfigs) > 0  # some drains moved running decodes by KV hand-off
    assert {ev.reconfig.kind for ev in res.reconfigs} >= {ReconfigKind.MODEL}
    # Every request is accounted for: refused at arrival, or admitted and finished; none failed.
    assert len(res.records) == len(requests)
    assert all(r.refused or (r.completed and r.arrival_s <= r.first_token_s <= r.finish_s) for r in res.records)
    assert not any(r.error for r in res.records)
    # Each reconfiguration drains before it switches and switches for its stated time.
    for ev in res.reconfigs:
        assert ev.planned_s <= ev.drain_end_s <= ev.done_s
        if ev.reconfig.kind is ReconfigKind.MODEL:
            assert ev.done_s - ev.drain_end_s == pytest.approx(ev.reconfig.load_s)
    assert sum(res.counters.values()) == len(res.decisions)
    assert res.counters["planned:model"] + res.counters.get("planned:role", 0) == len(res.reconfigs)


def test_oracle_and_static_bracket_the_elastic_day():
    day, requests = _day()
    static = run_day(NODE, day, requests, (LM, *SMS), "static", layouts=LAYOUTS)
    oracle = run_day(NODE, day, requests, (LM, *SMS), "oracle", layouts=LAYOUTS)
    assert static.lost == oracle.lost == 0
    assert static.reconfigs == [] and len(static.placements) == 1
    assert len(oracle.placements) > 2  # re-planned during the day
    assert oracle.summary.overall.goodput_rps > static.summary.overall.goodput_rps


def test_drain_hands_running_decodes_off_and_switches_the_role():
    day, requests = _day(hours=2.0, hour_s=30.0)  # hours 0-2: 8B heavy, base lengths
    sim = ElasticSim(NODE, day, requests, (LM, *SMS), mode="static", layouts=LAYOUTS)
    upto = [r for r in requests if r.arrival_s < 20.0]
    for req in upto:
        sim.now_s = req.arrival_s
        sim._admit(req)
    sim.now_s = 20.0
    running = [tr for tr in sim.instances["sm-0"].running if tr.finish_s > 20.0]
    assert len(running) > 5
    last_before = max(tr.finish_s for tr in running)
    flip = Reconfiguration("t1", ReconfigKind.ROLE, ("sm-0",), (dataclasses.replace(SMS[0], role=Role.PREFILL),), "test")
    ev = sim._start(flip)
    assert not sim.instances["sm-0"].accepting
    assert ev.migrated > 0
    assert ev.drain_end_s < last_before  # the hand-off shortened the drain
    moved = [tr for tr in running if tr.migrations]
    assert len(moved) == ev.migrated
    assert all(tr.decoder != "sm-0" and tr.decoder_inst is not None for tr in moved)
    drain_end = ev.drain_end_s
    old = sim.instances["sm-0"]
    sim._tick(drain_end + sim.policy.role_switch_s)  # forgets the finished requests first, then advances
    assert ev.phase is Phase.DONE
    assert ev.drain_end_s == drain_end and old.removed_s == drain_end  # not pulled back to when it was planned
    assert sim.instances["sm-0"].cfg.role is Role.PREFILL
    assert sim.instances["sm-0"].accepting
    result = sim._result(0.0)
    assert result.lost == 0


def test_lost_counter_sees_a_request_whose_instance_went_away_under_it():
    day, requests = _day(hours=1.0, hour_s=20.0)
    sim = ElasticSim(NODE, day, requests, (LM, *SMS), mode="static", layouts=LAYOUTS)
    sim.run()
    assert sim._result(0.0).lost == 0
    victim = max(sim.trackers, key=lambda tr: tr.finish_s)
    victim.decoder_inst.removed_s = victim.finish_s - 1.0
    assert sim._result(0.0).lost >= 1


def test_elastic_day_command_writes_its_section_and_plots(tmp_path, capsys):
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    rc = main(["elastic-day", "--cost-profile", "default", "--hours", "3", "--hour-s", "4",
               "--plots", str(tmp_path / "plots"), "--benchmarks", str(bench)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "| best static | all |" in out and "| elastic | llama-3-8b |" in out
    text = bench.read_text()
    assert "## Other\n\nkept" in text
    assert "## Elastic pools (simulator)" in text
    assert "| default |" in text
    assert (tmp_path / "plots" / "elastic-day-default.png").stat().st_size > 0
    assert (tmp_path / "plots" / "elastic-pd-default.png").stat().st_size > 0


def test_elastic_day_command_refuses_bad_numbers(capsys):
    assert main(["elastic-day", "--hour-s", "0"]) == 2
    assert "--hour-s, --hours, --load and --rate must be > 0" in capsys.readouterr().err
    assert main(["elastic-day", "--compare-in-place"]) == 2
    assert "--compare-in-place runs the in-place arms itself: give --role-changes drain" in capsys.readouterr().err
    assert main(["elastic-day", "--compare-ranker", "forward"]) == 2
    assert "--compare-ranker forward is the --ranker already; give --ranker none" in capsys.readouterr().err


def test_elastic_day_compare_in_place_writes_four_arms_side_by_side(tmp_path, capsys):
    """8 H200s, pessimistic, a short day from the 70B colocated: the in-place arms make decode <-> colocated changes
    that the drained arms cannot, and every arm loses nothing; the section names each arm's figures."""
    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text("# Benchmarks\n\n## Other\n\nkept\n")
    rc = main(["elastic-day", "--cost-profile", "pessimistic", "--gpu", "h200-141gb", "--hours", "6", "--hour-s", "20",
               "--plots", "", "--ranker", "none", "--role-changes", "drain", "--compare-ranker", "forward",
               "--ranker-plots", "", "--compare-in-place",
               "--in-place-benchmarks", str(bench), "--command-line", "cmd"])
    assert rc == 0
    out = capsys.readouterr().out
    text = bench.read_text()
    assert "## Other\n\nkept" in text and "## Elastic pools: in-place role changes (simulator)" in text
    assert "Reproduce: `cmd` (" in text
    (line,) = [l for l in text.splitlines() if l.startswith("| 8 h200-141gb | pessimistic | load |")]
    assert line in out
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[-1] == "0, 0, 0, 0"  # nothing lost in any arm
    reconfigs = [tuple(int(x) for x in arm.replace(",", " ").replace("(", " ").replace(")", " ").split())
                 for arm in cells[-2].split(";")]
    assert [r[1] for r in reconfigs[0::2]] == [0, 0]  # the drained arms change nothing in place
    assert reconfigs[1] == (4, 2, 0)  # the estimate's in-place arm: two of its four changes in place, the 8B's


# --- steps, batch sizing, the serving rule, adaptation ---------------------------------------------------------------


def test_demand_window_scores_a_step_and_not_a_steady_rate():
    from octoserve.services.sim.elastic_sim import demand_of
    from octoserve.services.core.day_request import DayRequest

    def reqs(rates):  # rates[k] arrivals evenly spread over second k
        out = []
        for k, n in enumerate(rates):
            out += [DayRequest(f"r{k}-{j}", k + (j + 0.5) / n, SMALL, 100, 10, 250.0, "base") for j in range(n)]
        return out

    (steady,) = demand_of(reqs([10] * 10), [SMALL], 0.0, 10.0)
    assert steady.arrival_rps == 10.0 and steady.recent_rps == 10.0 and steady.step_z == 0.0
    (jump,) = demand_of(reqs([10] * 6 + [40] * 4), [SMALL], 0.0, 10.0)
    assert jump.recent_rps == 40.0  # the last two of five 2-s bins
    assert jump.step_z == pytest.approx((40.0 - 10.0) / math.sqrt(40.0 / 4.0 + 10.0 / 6.0))
    assert jump.step_z > BalancerPolicy().step_z


def test_an_instances_decode_batch_follows_the_mean_lengths():
    from octoserve.services.sim.elastic_sim import SimInstance

    inst = SimInstance(NODE, SMS[0], 0.0, (1000.0, 250.0), 0.027)
    base = (inst.full_slots, inst.tau_s)
    inst.rebalance(1.0, (2000.0, 60.0))  # prefill-heavy: longer contexts, fewer slots fit
    assert inst.full_slots < base[0]
    inst.rebalance(2.0, (1000.0, 250.0))  # and back: an instance started in one phase is not stuck with its batch
    assert (inst.full_slots, inst.tau_s) == base
    assert inst.cost.decode_step_time_s(inst.full_slots, 1125) <= 0.027


def test_oracle_never_picks_a_placement_that_cannot_serve_a_model():
    """On 80-GB GPUs the 70B's TP 2 instance cannot decode within the ITL SLO; by request goodput alone the oracle
    would put the 70B there in the 8B-heavy hours and refuse every 70B request."""
    from octoserve.services.core.elastic_capacity import CapacityModel, placement_goodput_rps, unserved
    from octoserve.services.core.elastic_load import ModelDemand
    from octoserve.services.sim.elastic_sim import best_layout

    h100 = NodeConfig(GPU_PRESETS["h100-sxm-80gb"], 8, {LARGE: MODEL_PRESETS[LARGE], SMALL: MODEL_PRESETS[SMALL]}, ())
    layouts = candidate_layouts(h100)
    capacity = CapacityModel(h100)
    demand = (ModelDemand(LARGE, 1.2), ModelDemand(SMALL, 120.0))
    d = {x.model: x for x in demand}
    by_goodput = max(layouts, key=lambda l: placement_goodput_rps(capacity, l, d, 0.0)[0])
    assert unserved(placement_goodput_rps(capacity, by_goodput, d, 0.0)[1]) == [LARGE]
    chosen = best_layout(capacity, layouts, demand)
    caps = placement_goodput_rps(capacity, chosen, d, 0.0)[1]
    assert unserved(caps) == [] and caps[LARGE] >= 1.2


def test_elastic_day_on_h200_adapts_to_the_step_and_beats_static():
    """On H200s (the 70B decodes at TP 2) the balancer moves GPUs between the models, reaches its targets without
    ever leaving a model unserved, adapts to the step within 30 simulated seconds, and beats the static placement
    it starts from."""
    from octoserve.services.sim.elastic_day import placement_adapt_s

    day, requests = _day(hour_s=20.0)
    policy = BalancerPolicy()
    static = run_day(NODE, day, requests, (LM, *SMS), "static", layouts=LAYOUTS)
    elastic = run_day(NODE, day, requests, (LM, *SMS), "elastic", layouts=LAYOUTS, policy=policy)
    assert static.lost == elastic.lost == 0
    assert len(elastic.reconfigs) > 0
    assert elastic.summary.overall.goodput_rps > 1.05 * static.summary.overall.goodput_rps
    adapt_s, best, gap = placement_adapt_s(NODE, day, requests, LAYOUTS, elastic, policy)
    assert 0.0 <= adapt_s <= 30.0 and best
    for _, layout in elastic.layouts:  # every placement it passed through serves both models
        roles = {m: {i.role for i in layout if i.model == m} for m in (LARGE, SMALL)}
        assert all(Role.COLOCATED in r or {Role.PREFILL, Role.DECODE} <= r for r in roles.values())


def test_the_oracle_takes_the_hour_that_serves_the_most_when_simulated():
    """The oracle's hour is picked by simulating its candidates over that hour. On 8 H200s under the pessimistic
    profile, hour 10 of a 6-s-hour day: the capacity estimate prefers a colocated 8B, the simulation a disaggregated
    one, and the oracle takes what serves more."""
    from octoserve.services.metrics import Window, summarize
    from octoserve.services.sim.elastic_day import day_node
    from octoserve.services.sim.elastic_sim import best_layout, demand_of, label_of

    node = day_node("pessimistic", "h200-141gb")
    layouts = candidate_layouts(node)
    alone = (model_alone_rps(node, SMALL, 1000, 250), model_alone_rps(node, LARGE, 1000, 250))
    day = mix_shift_day(hours=24, hour_s=6.0, load_rps=(0.9 * alone[0], 0.9 * alone[1]))
    requests = generate_day(day, 0)
    sim = ElasticSim(node, day, requests, [], mode="oracle", layouts=layouts)
    hour, h = 10, day.hour_s
    demand = demand_of(sim._window(hour * h, (hour + 1) * h), sim.models, hour * h, (hour + 1) * h)
    estimate_pick = best_layout(sim.capacity, layouts, demand, sim.weights)
    pick = sim._oracle_measured(hour, demand, estimate_pick)
    assert label_of(estimate_pick) == "llama-3-70b TP4Dx1 TP2Px1 | llama-3-8b TP1Cx2"
    assert label_of(pick) == "llama-3-70b TP4Dx1 TP2Px1 | llama-3-8b TP1Px1 TP1Dx1"

    def hour_goodput(layout):
        reqs = sim._window(hour * h - sim.window_s, (hour + 1) * h)
        res = run_day(node, day, reqs, layout, "static", layouts=layouts, oracle_trials=0)
        return summarize(res.records, day.slo, Window(hour * h, (hour + 1) * h)).overall.goodput_rps

    assert hour_goodput(pick) > hour_goodput(estimate_pick)


def test_best_static_is_shortlisted_by_the_hours_and_not_only_by_the_days_mean():
    """8 H100s, pessimistic profile, mix by requests (40 req/s, 5-s hours): at the day's mean demand the 8B (about
    19 req/s) fits in two GPUs, so the estimate ranks first the 70B on six GPUs (0.05 req/s more 70B). Hour by hour
    the 8B offers up to 36 req/s and needs four: the mean of the hours' estimates ranks the 70B on four GPUs first,
    and simulated over the day that placement serves more, so it is the best static one."""
    from octoserve.services.core.elastic_capacity import CapacityModel, placement_goodput_rps
    from octoserve.services.sim.elastic_day import best_static, day_node, hourly_estimate
    from octoserve.services.sim.elastic_sim import demand_of, label_of

    node = day_node("pessimistic", "h100-sxm-80gb")
    layouts = candidate_layouts(node)
    day = mix_shift_day(40.0, hours=24, hour_s=5.0)
    requests = generate_day(day, 0)
    six = next(l for l in layouts if label_of(l) == "llama-3-70b TP4Dx1 TP2Px1 | llama-3-8b TP1Cx2")
    four = next(l for l in layouts if label_of(l) == "llama-3-70b TP4Cx1 | llama-3-8b TP1Cx4")
    capacity, models = CapacityModel(node), sorted(node.models)
    mean = {d.model: d for d in demand_of(requests, models, 0.0, day.duration_s)}
    hours = [{d.model: d for d in demand_of(requests, models, h * 5.0, (h + 1) * 5.0)} for h in range(24)]
    assert placement_goodput_rps(capacity, six, mean, 0.0)[0] > placement_goodput_rps(capacity, four, mean, 0.0)[0]
    assert hourly_estimate(capacity, four, hours) > hourly_estimate(capacity, six, hours) + 2.0
    assert hourly_estimate(capacity, four, hours) == pytest.approx(
        sum(placement_goodput_rps(capacity, four, d, 0.0)[0] for d in hours) / 24)
    sources: list[str] = []
    best, tried = best_static(node, day, requests, layouts, "day", sources)
    labels = [label for label, _ in tried]
    # The mean-demand shortlist first, then the hours' shapes; the planner's pick, when not tried yet, is "mean".
    assert len(sources) == len(tried) and sources[:3] == ["mean"] * 3 and "hours" in sources
    assert sources[labels.index(label_of(four))] == "hours" and sources[labels.index(label_of(six))] == "mean"
    assert labels[0] == label_of(six)  # the mean's first pick is still tried
    assert label_of(four) in labels and label_of(best.initial) == label_of(four)
    assert dict(tried)[label_of(four)] > 1.1 * dict(tried)[label_of(six)]


def test_an_in_place_role_change_keeps_serving_and_keeps_what_it_holds():
    """Colocated -> decode in place: no drain, no migration, no reroute; the instance takes new requests in its old
    role until the switch, then hand-offs only, with the same running requests and queued prompts; nothing lost."""
    day, requests = _day(hours=2.0, hour_s=30.0)
    sim = ElasticSim(NODE, day, requests, (LM, *SMS), mode="static", layouts=LAYOUTS)
    for req in [r for r in requests if r.arrival_s < 20.0]:
        sim.now_s = req.arrival_s
        sim._admit(req)
    sim.now_s = 20.0
    inst = sim.instances["sm-0"]
    held = list(inst.running)
    queued_until = inst.prefill_free_s
    finishes = {tr.req.request_id: tr.finish_s for tr in held}
    to_decode = dataclasses.replace(SMS[0], role=Role.DECODE)
    ev = sim._start(Reconfiguration("t1", ReconfigKind.ROLE, ("sm-0",), (to_decode,), "test", in_place=True))
    assert ev.phase is Phase.SWITCHING and ev.migrated == 0 and ev.rerouted == 0
    assert ev.drain_end_s == 20.0 and ev.done_s == 20.0 + sim.policy.role_switch_s
    assert inst.accepting and inst.prefills  # still colocated until the switch is done
    sim._tick(20.0 + sim.policy.role_switch_s)
    assert ev.phase is Phase.DONE
    assert sim.instances["sm-0"] is inst  # the same instance: nothing removed, nothing started
    assert inst.cfg.role is Role.DECODE and inst.accepting and not inst.prefills and inst.removed_s == math.inf
    assert inst.share == 0.0 and len(inst.heap) == inst.full_slots  # every slot decodes now
    assert inst.prefill_free_s == queued_until  # the prompts it queued still run there
    assert [tr for tr in held if tr.decoder_inst is inst and tr.finish_s == finishes[tr.req.request_id]] == held
    assert sim._result(0.0).lost == 0


def test_in_place_role_changes_take_the_70b_in_and_out_of_a_disaggregated_split_with_nothing_lost():
    """8 H200s, pessimistic: from the 70B colocated on TP 4 the step period's best placement (a TP 4 decode beside
    a TP 2 prefill) is reachable only with in-place role changes; with them the balancer reaches it during the step
    and back, losing nothing, and a drained role change of the 70B's only decoder never happens."""
    node = NodeConfig(GPU_PRESETS["h200-141gb"], 8, {LARGE: MODEL_PRESETS[LARGE], SMALL: MODEL_PRESETS[SMALL]}, (),
                      cost_profile="pessimistic")
    alone = (model_alone_rps(node, SMALL, 1000, 250), model_alone_rps(node, LARGE, 1000, 250))
    day = mix_shift_day(hours=24.0, hour_s=10.0, load_rps=(0.9 * alone[0], 0.9 * alone[1]))
    requests = generate_day(day, 0)
    layouts = candidate_layouts(node)
    start = (LM, InstanceConfig("sm-p0", SMALL, Role.PREFILL, 1, (4,)), InstanceConfig("sm-p1", SMALL, Role.PREFILL, 1, (5,)),
             InstanceConfig("sm-d0", SMALL, Role.DECODE, 1, (6,)), InstanceConfig("sm-d1", SMALL, Role.DECODE, 1, (7,)))
    res = run_day(node, day, requests, start, "elastic", layouts=layouts,
                  policy=BalancerPolicy(role_in_place=True, cost_horizon_s=60.0))
    assert res.lost == 0 and not any(r.error for r in res.records)
    in_place = [ev for ev in res.reconfigs if ev.reconfig.in_place]
    assert in_place and all(ev.phase is Phase.DONE and ev.drain_end_s == ev.planned_s for ev in in_place)
    large = [ev.reconfig.start[0].role for ev in in_place if ev.reconfig.start[0].model == LARGE]
    assert set(large) == {Role.DECODE, Role.COLOCATED}  # into the split and back out
    # The 70B's role changes all ran in place; the drained ones are the 8B's, to or from prefill.
    drained = [ev.reconfig for ev in res.reconfigs if ev.reconfig.kind is ReconfigKind.ROLE and not ev.reconfig.in_place]
    assert all(r.start[0].model == SMALL and Role.PREFILL in (r.start[0].role, _role_before(res, r)) for r in drained)


def _role_before(res, r):
    """The role `r`'s instance had before `r`: from the last placement logged before it was planned."""
    ev = next(ev for ev in res.reconfigs if ev.reconfig is r)
    before = [layout for t, layout in res.layouts if t <= ev.planned_s][-1]
    return next(i.role for i in before if i.id == r.retire[0])
