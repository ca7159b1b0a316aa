"""The balancer's forward ranker: what the balancer asks and does with the answers (a table-driven ranker), and the
simulator's ranker that plays moves forward from a clone of the node's state."""

import dataclasses

import pytest

from octoserve.services.core.balancer import BalancerPolicy, ElasticBalancer, MoveCandidate
from octoserve.services.core.elastic_layouts import candidate_layouts, layout_key as _key
from octoserve.services.core.elastic_load import InstanceLoad, ModelDemand, NodeLoad
from octoserve.services.core.placement import InstanceConfig, NodeConfig
from octoserve.services.core.reconfig import ReconfigKind, apply, check_reconfiguration
from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS
from octoserve.services.core.types import Role
from octoserve.services.sim.elastic_sim import ElasticSim, label_of, run_day
from octoserve.services.sim.forward_ranker import ForwardSimRanker, fork, play_forward
from octoserve.services.workload import LengthDist
from octoserve.services.workload_day import LARGE, SMALL, DayProfile, Segment, generate_day, mix_shift_day

L, S = LARGE, SMALL
NODE = NodeConfig(GPU_PRESETS["h200-141gb"], 8, {L: MODEL_PRESETS[L], S: MODEL_PRESETS[S]}, ())
LAYOUTS = candidate_layouts(NODE)


def inst(iid, model, role, gpus):
    tokens = 8192 if role is Role.PREFILL else 2048
    return InstanceConfig(iid, model, role, len(gpus), tuple(gpus), max_num_batched_tokens=tokens)


LM = inst("lm-0", L, Role.COLOCATED, (0, 1, 2, 3))
SM_C = [inst(f"sm-{k}", S, Role.COLOCATED, (4 + k,)) for k in range(4)]


def load(placement, demand):
    return NodeLoad(10.0, tuple(placement), tuple(InstanceLoad(i.id) for i in placement), tuple(demand))


class TableRanker:
    """A ranker whose scores come from a table keyed by placement (`_key`) or its label (the balancer's side under
    test); it records every call."""

    name = "table"

    def __init__(self, scores):
        self.scores, self.calls, self.layouts, self.horizons = scores, [], [], []

    def forecast(self, now_s, moves, rates_rps, horizons_s):
        self.calls.append((now_s, [m.name for m in moves], [label_of(m.layout) for m in moves], dict(rates_rps)))
        self.layouts.append([m.layout for m in moves])
        self.horizons.append(list(horizons_s))
        out = []
        for m in moves:  # a table entry: one score for every horizon, or one per horizon
            v = self.scores.get(_key(m.layout), self.scores.get(label_of(m.layout), 0.0))
            out.append(list(v) if isinstance(v, tuple) else [v] * len(horizons_s))
        return out


DEMAND = (ModelDemand(L, 1.0), ModelDemand(S, 60.0))  # the 8B heavy: the estimate wants the 8B's GPUs busy
PLACED = (LM, *SM_C)


def _balancer(scores, **policy):
    ranker = TableRanker(scores)
    return ElasticBalancer(NODE, BalancerPolicy(**policy), LAYOUTS, ranker), ranker


# --- the balancer's side --------------------------------------------------------------------------------------------


def test_hold_wins_when_no_move_beats_it_by_the_margin():
    b, ranker = _balancer({})
    first = b.plan(10.0, load(PLACED, DEMAND), [])
    assert first == []
    (now, names, labels, rates), = ranker.calls
    assert names[0] == "hold" and labels[0] == label_of(PLACED)
    assert names[1] == "estimate" and len(names) == 4  # hold, the estimate's pick and its next two
    assert rates == {L: 1.0, S: 60.0}
    # Every candidate a few points above hold, none by the margin (max(0.5, 5 % of 40) = 2 req/s).
    b, ranker = _balancer({labels[0]: 40.0, **{lab: 41.9 for lab in labels[1:]}})
    assert b.plan(10.0, load(PLACED, DEMAND), []) == []
    assert b.counters == {"hold:forward": 1}
    detail = b.log[-1].detail
    assert ranker.horizons == [[60.0, 20.0]]  # the cost horizon (no mix change seen: 60 s) and the short one
    assert detail.startswith("no move beats hold by the margin (role changes over 20 s, model changes over 60 s): "
                             "60 / 20 s played forward at llama-3-70b 1.0, llama-3-8b 60.0 req/s: hold llama-3-70b "
                             "TP4Cx1 | llama-3-8b TP1Cx4 40.00 / 40.00 (estimate ")
    assert detail.count(" 41.90 / 41.90 (estimate ") == 3 and detail.endswith(" req/s")
    # The verdict stands for `forward_refresh_s` (no new ranking), then the candidates are played again.
    assert b.plan(12.0, load(PLACED, DEMAND), []) == []
    assert len(ranker.calls) == 1 and b.log[-1].detail.startswith("verdict of 10 s: 60 / 20 s played forward")
    b.plan(20.0, load(PLACED, DEMAND), [])
    assert len(ranker.calls) == 2


def test_role_changes_are_judged_over_the_short_horizon_model_changes_over_the_long_one():
    b, ranker = _balancer({}, forward_top_k=40)
    b.plan(10.0, load(PLACED, DEMAND), [])
    ctx = b._context(10.0, load(PLACED, DEMAND), [])
    moves = b._move_candidates(ctx)
    role = next(m for m in moves[1:] if all(r.kind is ReconfigKind.ROLE for r in m.changes))
    model = next(m for m in moves[1:] if any(r.kind is ReconfigKind.MODEL for r in m.changes))
    hold = _key(PLACED)
    # (60-s score, 20-s score): the role change wins only over 20 s, the model change only over 60 s.
    for winner, scores in ((role, {hold: (40.0, 40.0), _key(role.layout): (30.0, 45.0),
                                   _key(model.layout): (30.0, 60.0)}),
                           (model, {hold: (40.0, 40.0), _key(role.layout): (60.0, 30.0),
                                    _key(model.layout): (45.0, 30.0)})):
        b, ranker = _balancer(scores, forward_top_k=40)
        out = b.plan(10.0, load(PLACED, DEMAND), [])
        assert out and b.counters["ranked:table"] == 1 and b.counters[f"planned:{out[0].kind.value}"] == len(out)
        assert {r.kind for r in out} == {r.kind for r in winner.changes}
        assert b._forward_layout == winner.layout
        over = "20 s" if winner is role else "60 s"
        assert b.log[0].detail.startswith(f"{winner.name} beats hold by 5.00 req/s over {over} (margin 2.00)")
    # Neither wins over its own horizon: hold.
    b, ranker = _balancer({hold: (40.0, 40.0), _key(role.layout): (60.0, 30.0),
                           _key(model.layout): (30.0, 60.0)}, forward_top_k=40)
    assert b.plan(10.0, load(PLACED, DEMAND), []) == [] and b.counters == {"hold:forward": 1}


def test_a_step_plays_the_candidates_again_once_its_recent_rate_settles():
    """A step first seen at 12 s: moves with a model change wait (`hold:settle`) until `step_settle_s` (2 s) later;
    the candidates are then played at once, not at the 10-s refresh, on the recent rate, even where the step score
    has fallen back. Role changes are played while it settles. With no settling time all are played at the step."""
    b, ranker = _balancer({})
    b.plan(10.0, load(PLACED, DEMAND), [])
    stepped = (ModelDemand(L, 1.0), ModelDemand(S, 60.0, recent_rps=90.0, step_z=6.0))
    b.plan(12.0, load(PLACED, stepped), [])
    b.plan(13.0, load(PLACED, stepped), [])
    assert [c[0] for c in ranker.calls] == [10.0]  # the estimate's best three are all model changes
    assert [d.reason for d in b.log[1:]] == ["hold:settle", "hold:settle"]
    assert b.log[-1].detail == ("a step seen at 12 s in llama-3-8b: estimate, top 2, top 3 (a model change) wait "
                                "until 14 s, when its recent rate is measured")
    settled = (ModelDemand(L, 1.0), ModelDemand(S, 80.0, recent_rps=120.0, step_z=1.0))
    b.plan(14.0, load(PLACED, settled), [])
    assert [c[0] for c in ranker.calls] == [10.0, 14.0]
    assert ranker.calls[1][3][S] == 120.0  # after a step the forecast is the recent rate
    b, ranker = _balancer({}, step_settle_s=0.0)
    b.plan(10.0, load(PLACED, DEMAND), [])
    b.plan(12.0, load(PLACED, stepped), [])
    assert [c[0] for c in ranker.calls] == [10.0, 12.0] and ranker.calls[1][3][S] == 90.0
    # With role changes among the candidates (the estimate's best 40), those are played while the step settles.
    b, ranker = _balancer({}, forward_top_k=40)
    b.plan(10.0, load(PLACED, DEMAND), [])
    b.plan(12.0, load(PLACED, stepped), [])
    assert [c[0] for c in ranker.calls] == [10.0, 12.0]

    def gpus(layout):
        return sorted((i.model, i.tp, i.gpu_ids) for i in layout)
    assert any(gpus(l) != gpus(PLACED) for l in ranker.layouts[0])
    assert len(ranker.layouts[1]) > 1 and all(gpus(l) == gpus(PLACED) for l in ranker.layouts[1])
    assert [d.reason for d in b.log[-2:]] == ["hold:settle", "hold:forward"]  # every move scored 0, as hold


def test_a_move_wins_and_is_carried_out_without_asking_again():
    b, ranker = _balancer({})
    b.plan(10.0, load(PLACED, DEMAND), [])
    labels = ranker.calls[0][2]
    # The ranker prefers the estimate's second-best target: the balancer moves there, not to the estimate's pick.
    b, ranker = _balancer({labels[0]: 30.0, labels[1]: 35.0, labels[2]: 50.0, labels[3]: 20.0}, max_in_flight=1)
    out = b.plan(10.0, load(PLACED, DEMAND), [])
    assert b.counters["ranked:table"] == 1 and b.log[0].detail.startswith("top 2 beats hold by 20.00 req/s over")
    target = ranker.layouts[0][2]
    assert len(out) == 1  # one change at a time (`max_in_flight` 1)
    placement = apply({i.id: i for i in PLACED}, out[0])
    # The next period continues the same move without a new ranking, once the first change is done.
    out2 = b.plan(40.0, load(placement.values(), DEMAND), [])
    assert len(ranker.calls) == 1
    for r in out2:
        placement = apply(placement, r)
    while _key(list(placement.values())) != _key(target):
        more = b.plan(70.0, load(placement.values(), DEMAND), [])
        assert more, b.log[-1].detail
        for r in more:
            placement = apply(placement, r)
    # Arrived: the next ranking offers the way back (where the move started) among the candidates.
    b.plan(100.0, load(placement.values(), DEMAND), [])
    names, labs = ranker.calls[-1][1], ranker.calls[-1][2]
    assert "way back" in names and labs[names.index("way back")] == label_of(PLACED)


def test_each_candidates_changes_reach_its_target_keeping_every_model_served():
    b, ranker = _balancer({})
    b.plan(10.0, load(PLACED, DEMAND), [])
    ctx = b._context(10.0, load(PLACED, DEMAND), [])
    for move in b._move_candidates(ctx)[1:]:
        placement = {i.id: i for i in PLACED}
        for r in move.changes:
            assert check_reconfiguration(placement, r) == []
            placement = apply(placement, r)
        assert _key(list(placement.values())) == _key(move.layout)
        assert all(r.kind is ReconfigKind.ROLE or r.load_s > 0 for r in move.changes)


# --- the simulator's ranker -----------------------------------------------------------------------------------------


def _profile(small_rps, large_rps, prompt=1000.0, output=250.0, duration_s=200.0):
    total = small_rps + large_rps
    seg = Segment(total, ((S, small_rps / total), (L, large_rps / total)), LengthDist.lognormal(prompt, 0.3),
                  LengthDist.lognormal(output, 0.3), "base")
    return DayProfile("test", duration_s, lambda t: seg, hour_s=60.0)


def _warm(profile, placement, until_s, seed=0):
    """A static simulator that has served the profile's arrivals up to `until_s` (a node under load)."""
    requests = generate_day(profile, seed)
    sim = ElasticSim(NODE, profile, requests, placement, mode="static", layouts=LAYOUTS)
    t = 0.0
    for req in requests:
        if req.arrival_s >= until_s:
            break
        while t <= req.arrival_s:
            sim._tick(t)
            t += sim.period_s
        sim.now_s = req.arrival_s
        sim._admit(req)
    sim._tick(until_s)
    return sim, requests


def _moves(sim, target):
    """hold and a move to `target`, the changes built as the balancer builds them."""
    b = ElasticBalancer(NODE, BalancerPolicy(), LAYOUTS)
    ctx = b._context(sim.now_s, sim._node_load(), [])
    return [MoveCandidate("hold", tuple(ctx.current.values()), (), 0.0),
            MoveCandidate("move", tuple(target), b.changes_to(ctx, target), 0.0)]


def _find(label):
    return next(l for l in LAYOUTS if label_of(l) == label)


def test_hold_wins_in_the_simulator_when_the_move_takes_the_busy_models_gpus():
    sim, _ = _warm(_profile(60.0, 0.3), PLACED, 70.0)  # the 8B busy on its 4 GPUs
    target = _find("llama-3-70b TP4Cx1 TP2Cx1 | llama-3-8b TP1Cx2")
    moves = _moves(sim, target)
    assert [r.kind for r in moves[1].changes] == [ReconfigKind.MODEL]
    (hold, hold20), (move, move20) = ForwardSimRanker(sim, seed=1, window_s=60.0).forecast(
        70.0, moves, {S: 60.0, L: 0.3}, [60.0, 20.0])
    assert hold > 50.0 and move < 0.8 * hold and move20 < 0.8 * hold20


def test_a_move_wins_in_the_simulator_when_it_gives_the_busy_model_gpus():
    start = _find("llama-3-70b TP4Cx1 TP2Cx1 | llama-3-8b TP1Cx2")
    sim, _ = _warm(_profile(60.0, 0.3), start, 70.0)  # the 8B overloaded on 2 GPUs, the 70B idle on 6
    moves = _moves(sim, _find("llama-3-70b TP4Cx1 | llama-3-8b TP1Cx4"))
    ranker = ForwardSimRanker(sim, seed=1, window_s=60.0)
    (hold,), (move,) = ranker.forecast(70.0, moves, {S: 60.0, L: 0.3}, [60.0])
    assert move > 1.3 * hold
    # The move paid for its drain and load: the same target placed at no cost would have served more.
    free = ForwardSimRanker(_warm(_profile(60.0, 0.3), _find("llama-3-70b TP4Cx1 | llama-3-8b TP1Cx4"), 70.0)[0],
                            seed=1, window_s=60.0)
    ((placed,),) = free.forecast(70.0, [MoveCandidate("hold", (), (), 0.0)], {S: 60.0, L: 0.3}, [60.0])
    assert move < placed


def _state(sim):
    return (
        {iid: (inst.accepting, inst.prefill_free_s, sorted(inst.heap), inst.removed_s,
               [(r.req.request_id, r.first_s, r.finish_s, r.decoder, r.migrations) for r in inst.running],
               [(r.req.request_id, r.busy_until_s) for r in inst.queued]) for iid, inst in sim.instances.items()},
        [(ev.reconfig.reconfig_id, ev.phase, ev.drain_end_s, ev.done_s) for ev in sim.reconfigs],
        len(sim.trackers), len(sim.refused), sim.migrated, sim.now_s,
    )


def test_playing_forward_leaves_the_live_simulator_untouched():
    sim, _ = _warm(_profile(60.0, 0.3), PLACED, 70.0)
    moves = _moves(sim, _find("llama-3-70b TP4Cx1 | llama-3-8b TP1Px2 TP1Dx2"))
    assert {r.kind for r in moves[1].changes} == {ReconfigKind.ROLE}
    before = _state(sim)
    assert any(inst.running for inst in sim.instances.values())
    ForwardSimRanker(sim, seed=1, window_s=60.0).forecast(70.0, moves, {S: 60.0, L: 0.3}, [60.0])
    assert _state(sim) == before
    twin = fork(sim, [])
    assert all(twin.instances[i] is not sim.instances[i] for i in sim.instances)
    assert not {id(r) for i in twin.instances.values() for r in i.running} & {
        id(r) for i in sim.instances.values() for r in i.running}


def test_a_day_with_a_forecast_in_the_middle_ends_as_one_without():
    profile = _profile(50.0, 0.5, duration_s=120.0)
    requests = generate_day(profile, 3)
    a = run_day(NODE, profile, requests, PLACED, "static", layouts=LAYOUTS)
    sim = ElasticSim(NODE, profile, requests, PLACED, mode="static", layouts=LAYOUTS)
    ranker = ForwardSimRanker(sim, seed=1, window_s=10.0)
    asked = []
    t = 0.0
    for req in requests:  # `ElasticSim.run`'s loop, with a forecast after the tick at 60 s
        while t <= req.arrival_s:
            sim._tick(t)
            if t == 60.0:
                target = _find("llama-3-70b TP4Cx1 | llama-3-8b TP1Px1 TP1Dx3")
                asked.append(ranker.forecast(t, _moves(sim, target), {S: 50.0, L: 0.5}, [30.0]))
            t = round(t + sim.period_s, 9)
        sim.now_s = req.arrival_s
        sim._advance_reconfigs(req.arrival_s)
        sim._admit(req)
    sim.now_s = max([profile.duration_s] + [tr.finish_s for tr in sim.trackers])
    sim._advance_reconfigs(sim.now_s + 3600.0)
    b = sim._result(0.0)
    assert asked and asked[0][0][0] > 0
    assert [(r.request_id, r.first_token_s, r.finish_s, r.refused) for r in a.records] == \
           [(r.request_id, r.first_token_s, r.finish_s, r.refused) for r in b.records]


def test_a_forecast_is_deterministic_for_a_seed_and_every_move_sees_the_same_arrivals():
    sim, _ = _warm(_profile(60.0, 0.3), PLACED, 70.0)
    moves = _moves(sim, _find("llama-3-70b TP4Cx1 | llama-3-8b TP1Px2 TP1Dx2"))
    rates = {S: 60.0, L: 0.3}
    r1, r2, r3 = (ForwardSimRanker(sim, seed=k, window_s=60.0) for k in (1, 1, 2))
    assert r1.arrivals(70.0, rates, 60.0) == r2.arrivals(70.0, rates, 60.0)
    assert r1.arrivals(70.0, rates, 60.0) != r3.arrivals(70.0, rates, 60.0)
    assert r1.forecast(70.0, moves, rates, [60.0, 20.0]) == r2.forecast(70.0, moves, rates, [60.0, 20.0])
    # Common arrivals: a move with no change scores exactly what hold does.
    same = [moves[0], dataclasses.replace(moves[0], name="hold again")]
    a, b = r1.forecast(70.0, same, rates, [60.0, 20.0])
    assert a == b and a[0] > 0 and a[1] > 0
    arrivals = r1.arrivals(70.0, rates, 60.0)
    assert all(70.0 <= r.arrival_s < 130.0 for r in arrivals)
    assert sum(r.model == S for r in arrivals) == pytest.approx(60.0 * 60.0, rel=0.1)
    recent = {(r.prompt_tokens, r.output_tokens) for r in sim._window(10.0, 70.0) if r.model == S}
    assert {(r.prompt_tokens, r.output_tokens) for r in arrivals if r.model == S} <= recent
    assert play_forward(sim, (), [], [], 70.0, [60.0]) == [0.0]
    # Over a shorter horizon, only the arrivals within it count, per second of it.
    arrivals = r1.arrivals(70.0, rates, 60.0)
    past = sim._window(60.0, 70.0)
    (g60, g20), (g20_alone,) = (play_forward(sim, (), arrivals, past, 70.0, h) for h in ([60.0, 20.0], [20.0]))
    assert g20 == g20_alone and g60 != g20


def test_no_evidence_before_a_load_window_then_what_has_been_seen_replays():
    sim, _ = _warm(_profile(60.0, 0.3), PLACED, 6.0)
    moves = _moves(sim, _find("llama-3-70b TP4Cx1 | llama-3-8b TP1Px2 TP1Dx2"))
    ranker = ForwardSimRanker(sim, seed=1, window_s=60.0)
    assert ranker.forecast(6.0, moves, {S: 60.0, L: 0.3}, [60.0, 20.0]) == [[0.0, 0.0], [0.0, 0.0]]
    assert ranker.calls == 0
    sim, _ = _warm(_profile(60.0, 0.3), PLACED, 12.0)  # 12 s seen of the 60-s window: those 12 s replay
    ranker = ForwardSimRanker(sim, seed=1, window_s=60.0)
    arrivals = ranker.arrivals(12.0, {S: 60.0}, 30.0)
    seen = {(r.prompt_tokens, r.output_tokens) for r in sim._window(0.0, 12.0) if r.model == S}
    assert arrivals and {(r.prompt_tokens, r.output_tokens) for r in arrivals} <= seen
    assert ranker.forecast(12.0, moves, {S: 60.0, L: 0.3}, [60.0])[0][0] > 0 and ranker.calls == 1


def test_an_elastic_day_with_the_forward_ranker_loses_nothing_and_explains_itself():
    """A 12-s-hour mix-shift day on 8 H200s: every ranking is a decision with its figures, every move it makes is
    one the ranking chose, and no request is lost."""
    from octoserve.services.sim.elastic_sim import model_alone_rps

    alone = (model_alone_rps(NODE, S, 1000, 250), model_alone_rps(NODE, L, 1000, 250))
    day = mix_shift_day(hours=24, hour_s=12.0, load_rps=(0.9 * alone[0], 0.9 * alone[1]))
    requests = generate_day(day, 0)
    res = run_day(NODE, day, requests, PLACED, "elastic", layouts=LAYOUTS, ranker="forward", seed=0)
    again = run_day(NODE, day, requests, PLACED, "elastic", layouts=LAYOUTS, ranker="forward", seed=0)
    assert res.lost == 0 and len(res.records) == len(requests)
    assert res.forward_rankings > 0 and res.forward_moves > res.forward_rankings
    ranked = [d for d in res.decisions if d[1] == "ranked:forward"]
    assert ranked and res.counters["ranked:forward"] == len(ranked)
    assert all(" beats hold by " in d[2] and "played forward at" in d[2] for d in ranked)
    assert sum(res.counters.values()) == len(res.decisions)
    assert res.counters.get("planned:model", 0) + res.counters.get("planned:role", 0) == len(res.reconfigs) > 0
    # Nothing else decides a move: no estimate-only guard appears.
    assert not {"hold:cost", "hold:no_gain"} & set(res.counters) - {"hold:no_gain"}
    assert [ev.planned_s for ev in res.reconfigs] == [ev.planned_s for ev in again.reconfigs]
    assert res.summary.overall.goodput_rps == again.summary.overall.goodput_rps
    with pytest.raises(ValueError, match="ranker must be one of"):
        ElasticSim(NODE, day, requests, PLACED, mode="elastic", ranker="replay")


def test_elastic_day_compares_the_ranker_off_and_on_in_its_own_section(tmp_path, capsys):
    from octoserve.services.cli import main

    bench = tmp_path / "BENCHMARKS.md"
    bench.write_text("# Benchmarks\n\n## Elastic pools (simulator)\n\nkept as it is\n")
    rc = main(["elastic-day", "--cost-profile", "pessimistic", "--hours", "2", "--hour-s", "15", "--plots", "",
               "--ranker", "none", "--role-changes", "drain", "--compare-ranker", "forward", "--ranker-benchmarks", str(bench), "--ranker-plots", str(tmp_path)])
    assert rc == 0
    text = bench.read_text()
    assert "## Elastic pools (simulator)\n\nkept as it is\n" in text
    section = text.split("## Elastic pools: forward-simulated ranking (simulator)\n", 1)[1]
    assert "| 8 h100-sxm-80gb | pessimistic | load |" in section and "Goals:" in section
    assert "![elastic-forward-ranker](" in section and (tmp_path / "elastic-forward-ranker.png").stat().st_size > 0
    assert "Elastic pools: forward-simulated ranking (simulator)" in capsys.readouterr().out
