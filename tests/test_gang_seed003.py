"""Seed 003's own node (placement proves the fit, with exact figures), its SLOs, and the baselines the seed warns
about (LM-first, SM-greedy, coarse slices), each by its defining behaviour on a tiny deterministic schedule."""

from __future__ import annotations

import dataclasses

import pytest

from octoserve.services.config import default_config_text, parse_yaml_mapping
from octoserve.services.core.gang import GangArbiter, GangPolicy, MemberView
from octoserve.services.core.placement import PlacementError, node_config_from_dict
from octoserve.services.core.specs import GIB, MODEL_PRESETS, activation_reserve_bytes
from octoserve.services.lab.gang_bench import config_for, workload

UNBOUNDED = dict(max_lm_wait_ms=1e6, max_sm_stall_ms=2e6)


def _raw():
    return parse_yaml_mapping(default_config_text("node-seed003.yaml"), "node-seed003.yaml")


def test_the_large_model_needs_all_eight_gpus_by_memory():
    lm = MODEL_PRESETS["dense-180b"]
    assert lm.num_params == 179_516_485_632
    assert lm.weight_bytes_per_gpu(8) == 44_879_121_408  # 44.9 GB a GPU at TP=8
    assert lm.weight_bytes_per_gpu(4) == 89_758_242_816  # 89.8 GB at TP=4: over an 80 GiB (85.9 GB) GPU
    assert lm.kv_bytes_per_token_per_gpu(8) == 48 * 1024
    raw = _raw()
    raw["instances"] = [dict(raw["instances"][0], tp=4, gpu_ids=[0, 1, 2, 3], gpu_memory_utilization=0.9)]
    raw.pop("gang")
    with pytest.raises(PlacementError) as e:
        node_config_from_dict(raw)
    assert ("instance lm-0: dense-180b weights need 89.8 GB per GPU at TP=4 but h100-sxm-80gb x 0.9 leaves "
            "77.3 GB; raise tp or gpu_memory_utilization") in e.value.problems


def test_placement_proves_both_models_and_both_kv_pools_fit_each_gpu():
    node = node_config_from_dict(_raw())
    lm, sm = node.instance("lm-0"), node.instance("sm-0")
    assert (lm.tp, lm.gpu_memory_utilization, sm.tp, sm.gpu_memory_utilization) == (8, 0.6, 1, 0.3)
    assert node.gpu.memory_bytes == 80 * GIB
    # LM share 51.54 GB = 44.88 weights + 1.52 activations + 5.14 KV; SM share 25.77 GB = 16.06 + 1.36 + 8.35
    assert activation_reserve_bytes(node.models["dense-180b"], 8, 2048) == 1_516_240_896
    assert activation_reserve_bytes(node.models["llama-3-8b"], 1, 2048) == 1_361_051_648
    assert node.num_kv_blocks_for(lm) == 6541 and node.num_kv_blocks_for(sm) == 3980  # 104,656 / 63,680 tokens
    for i in range(8):
        members = [x for x in node.instances if i in x.gpu_ids]
        assert sorted(x.id for x in members) == ["lm-0", f"sm-{i}"]
        assert sum(x.gpu_memory_utilization for x in members) == pytest.approx(0.9)
    raw = _raw()
    raw["instances"][1] = dict(raw["instances"][1], gpu_memory_utilization=0.35)
    with pytest.raises(PlacementError) as e:
        node_config_from_dict(raw)
    assert any(p.startswith("GPU 0 is shared by a gang group: gpu_memory_utilization lm-0 0.6 (44.9 GB weights")
               and "= 0.95 of 85.9 GB exceeds 0.9" in p for p in e.value.problems)


def test_seed003_slos_per_model_and_tier():
    node = node_config_from_dict(_raw())
    assert node.slo.for_model("dense-180b").itl_ms == 100 and node.slo.for_model("llama-3-8b").itl_ms == 65
    assert {t.name: ms for t, ms in node.slo.tier_ttft_ms.items()} == {"INTERACTIVE": 200, "STANDARD": 250,
                                                                       "BATCH": 10000}
    profile = workload("seed003")
    assert profile.rate_rps == 625 and {t.model: t.itl_ms for t in profile.traffic} == {
        "llama-3-8b": 65, "dense-180b": 100}
    # The 70B case runs the same workload with its LM renamed, under the same SLOs.
    assert {t.model for t in workload("70b").traffic} == {"llama-3-8b", "llama-3-70b"}
    assert config_for("70b", "gang", "default").slo.for_model("llama-3-70b").itl_ms == 100


def test_baseline_configs_keep_the_node_and_lift_the_bounds():
    gang = config_for("seed003", "gang", "pessimistic")
    assert gang.gang.policy.shape == "deadline" and gang.cost_profile == "pessimistic"
    for policy, shape in (("lm-first", "lm_first"), ("sm-greedy", "sm_greedy"), ("slices", "slices")):
        c = config_for("seed003", policy, "default")
        assert c.instances == gang.instances
        assert c.gang.policy.shape == shape and c.gang.policy.max_lm_wait_ms == 1e6
        assert c.gang.policy.lm_shared_step_ms == 0 and c.gang.policy.sm_shared_step_ms == 0
    static = config_for("70b", "static-split", "default")
    assert static.gang is None
    assert sorted((i.model, i.tp) for i in static.instances)[0] == ("llama-3-70b", 4)


# ---- the baselines' defining behaviour -------------------------------------------------------------------------


def _views(lm_work, sm_work):  # floors: LM 20 ms, SM 10 ms
    return MemberView("lm", lm_work, 0.020), [MemberView(f"sm{i}", w, 0.010) for i, w in enumerate(sm_work)]


def _schedule(shape, work, until_s, **policy):
    """Run the arbiter with fixed steps (LM 20 ms, SM 10 ms) while `work(now)` says who has work; the starts."""
    arb = GangArbiter(GangPolicy(shape=shape, **UNBOUNDED, **policy), "lm", ["sm0", "sm1"])
    now, out = 0.0, []
    busy: dict[str, float] = {}
    while now < until_s - 1e-9:
        lm_work, sm_work = work(now)
        d = arb.decide(now, *_views(lm_work, sm_work))
        if d.run_lm:
            arb.started("lm", now, 0.020, d.lm_cap_s)
            busy["lm"] = now + 0.020
            out.append((round(now, 3), "LM"))
        for s, cap in d.sm_starts:
            arb.started(s, now, 0.010, cap)
            busy[s] = now + 0.010
            out.append((round(now, 3), s))
        now = round(min(busy.values()) if busy else now + 0.010, 9)  # whole ms: no float drift at slice edges
        for m in [m for m, t in busy.items() if t <= now + 1e-12]:
            arb.finished(m, now)
            del busy[m]
    return arb, out


def test_lm_first_reserves_the_node_while_the_lm_has_work():
    arb, out = _schedule("lm_first", lambda now: (now < 0.095, [True, True]), 0.16)
    # The LM holds every GPU from the first boundary until its work ends (0.1 s): the SMs starve meanwhile.
    assert [t for t, who in out if who == "LM"] == [0.0, 0.02, 0.04, 0.06, 0.08]
    assert [t for t, who in out if who == "sm0"] == [0.1, 0.11, 0.12, 0.13, 0.14, 0.15]
    assert arb.stats.max_sm_stall_s == pytest.approx(0.1)


def test_sm_greedy_runs_the_lm_only_when_every_sm_is_idle():
    arb, out = _schedule("sm_greedy", lambda now: (True, [now < 0.095, now < 0.045]), 0.16)
    # sm1 idles at 0.05 s, but sm0 still has work: the LM waits until every SM is idle (0.1 s).
    assert [t for t, who in out if who == "LM"] == [0.1, 0.12, 0.14]
    assert arb.stats.max_lm_wait_s == pytest.approx(0.1)
    _, out = _schedule("sm_greedy", lambda now: (True, [now >= 0.025, False]), 0.1)
    # SM work arriving during an LM step ends the lease at that step's end.
    assert out == [(0.0, "LM"), (0.02, "LM"), (0.04, "sm0"), (0.05, "sm0"), (0.06, "sm0"), (0.07, "sm0"),
                   (0.08, "sm0"), (0.09, "sm0")]


def test_slices_alternate_fixed_slices_whatever_the_deadlines():
    arb, out = _schedule("slices", lambda now: (True, [True, True]), 0.3, slice_ms=100.0)
    lm = [t for t, who in out if who == "LM"]
    sm = [t for t, who in out if who == "sm0"]
    assert sm == [0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.2, 0.21, 0.22, 0.23, 0.24, 0.25,
                  0.26, 0.27, 0.28, 0.29]
    assert lm == [0.1, 0.12, 0.14, 0.16, 0.18]
    assert arb.stats.max_lm_wait_s == pytest.approx(0.1) and arb.stats.max_sm_stall_s == pytest.approx(0.1)
    # Work-conserving: with no SM work the LM steps in the SMs' slice too.
    _, out = _schedule("slices", lambda now: (True, [False, False]), 0.06, slice_ms=100.0)
    assert out == [(0.0, "LM"), (0.02, "LM"), (0.04, "LM")]


def test_baseline_shapes_are_validated_and_unbounded_waits_are_reported_open():
    assert GangPolicy(shape="slices", slice_ms=0).problems() == ["gang.slice_ms is 0; set a positive number"]
    arb = GangArbiter(GangPolicy(shape="sm_greedy", **UNBOUNDED), "lm", ["sm0"])
    arb.decide(0.0, MemberView("lm", True, 0.02), [MemberView("sm0", True, 0.01)])
    arb.started("sm0", 0.0, 0.01, 1.0)
    assert arb.open_waits_s(0.5) == (0.5, 0.0)  # the LM has waited since 0 s and never ran
    assert dataclasses.replace(GangPolicy(), shape="lm_first").is_baseline


def test_deadline_shape_leases_by_each_sides_own_deadline():
    # The LM decodes with its next token due at 0.1 s (its latest start), the SMs have work without deadlines.
    arb = GangArbiter(GangPolicy(shape="deadline", max_lm_wait_ms=200, max_sm_stall_ms=300), "lm", ["sm0", "sm1"])
    now, starts = 0.0, []
    for _ in range(12):
        lm_deadline = 0.1 if now < 0.1 else 0.2
        lm = MemberView("lm", True, 0.020, lm_deadline)
        sms = [MemberView(f"sm{i}", True, 0.010) for i in range(2)]
        d = arb.decide(now, lm, sms)
        if d.run_lm:
            arb.started("lm", now, 0.020, d.lm_cap_s)
            starts.append((round(now, 3), "LM"))
            now = round(now + 0.020, 9)
            arb.finished("lm", now)
            continue
        for s, cap in d.sm_starts:
            arb.started(s, now, 0.010, cap)
        starts.append((round(now, 3), "SM" if d.sm_starts else "-"))
        now = round(now + 0.010, 9)
        for s, _ in d.sm_starts:
            arb.finished(s, now)
    # Not urgent: the SMs step; within the SM floor + urgent_ms (15 ms) of 0.1 s the LM takes one step, then gives
    # the GPUs back (its next deadline is 0.2 s): several SM steps per LM step.
    assert starts == [(0.0, "SM"), (0.01, "SM"), (0.02, "SM"), (0.03, "SM"), (0.04, "SM"), (0.05, "SM"),
                      (0.06, "SM"), (0.07, "SM"), (0.08, "SM"), (0.09, "LM"), (0.11, "SM"), (0.12, "SM")]


def test_a_gang_members_duty_is_its_step_share_of_its_own_itl():
    node = node_config_from_dict(_raw())
    # 0.6 of the LM's 100 ms and 0.4 of the 8B's 65 ms: duties 0.6 and 0.4 whatever the two ITLs.
    assert node.step_itl_ms(node.instance("lm-0")) == pytest.approx(60.0)
    assert node.step_itl_ms(node.instance("sm-0")) == pytest.approx(26.0)
    # The shared-step caps split 0.85 x the tightest ITL (65 ms): one LM step and one SM step fit an 8B token gap.
    assert node.gang.policy.lm_shared_step_ms == pytest.approx(0.6 * 0.85 * 65)
    assert node.gang.policy.sm_shared_step_ms == pytest.approx(0.4 * 0.85 * 65)


# ---- the comparison's figures ------------------------------------------------------------------------------------


def _row(rate, lm_pass, sm_pass, policy="gang"):
    from octoserve.services.lab.gang_bench import ModelRow, RunRow, TierRow

    def m(name, ok):
        return ModelRow(name, 100, 90, 1.0, 0.97, 0.9, 0.95 if ok else 0.5, 150.0, 40.0, ok)

    return RunRow("seed003", policy, "default", rate, 0, 2.0, (m("dense-180b", lm_pass), m("llama-3-8b", sm_pass)),
                  (TierRow("INTERACTIVE", 1.6, 0.97), TierRow("BATCH", 0.4, 1.0)), 60.0, 150.0, 0.4, 0)


def test_capacity_is_the_highest_grid_rate_with_every_lower_rate_passing():
    from octoserve.services.lab.gang_bench import capacity_rps

    rows = [_row(2.5, True, True), _row(5, True, True), _row(10, False, True), _row(20, True, True),
            _row(40, False, False)]
    assert capacity_rps(rows, "dense-180b") == 5  # 20 passes again, but 10 did not
    assert capacity_rps(rows, "llama-3-8b") == 20
    assert capacity_rps(rows, None) == 5
    assert capacity_rps([_row(2.5, False, True)], None) == 0


def test_the_table_states_each_policys_capacity_goodput_and_starvation():
    from octoserve.services.lab.gang_bench import Settings, capacity_ratio, render

    settings = Settings(grid_rps=(2.5, 5.0), cases=("seed003",), cost_profiles=("default",))
    rows = [_row(r, True, r < 5, p) for p in ("gang", "gang-slack", "lm-first", "sm-greedy", "slices")
            for r in (2.5, 5.0, 625.0)]
    text = render(rows, settings)
    assert "| gang | 2.5 | 5 | 2.5 | 1.0 | 1.0 | 97.0 | 97.0 | 95.0 | 50.0 | 80.0 | 97.0 | 100.0 | 60 ms | 150 ms | 40.0 | 0 |" in text
    assert "| lm-first | 2.5 | 5 | 2.5 |" in text and "| 60 ms | 150 ms | 40.0 | - |" in text
    assert ("Every-model capacity: gang 2.5 req/s, the best baseline (lm-first) 2.5: 1.00x. The gang's admitted "
            "requests good, worst run of its row: dense-180b 97.0 % (at 2.5 req/s), llama-3-8b 97.0 % (at 2.5 req/s)."
            in text)
    # Every baseline failing the lowest rate bounds the ratio from below.
    fails = [_row(r, p == "gang", p == "gang", p) for p in ("gang", "lm-first", "sm-greedy", "slices") for r in (2.5, 5.0)]
    assert capacity_ratio(fails, "seed003", (2.5, 5.0)).startswith(
        "Every-model capacity: gang 5 req/s; every baseline fails the grid's lowest rate (2.5 req/s), so the gang's "
        "is over 2x theirs.")


def test_a_system_prompt_counts_as_cached_once_an_earlier_request_carried_it():
    """Servable (any scheduler could serve it in time): a 7,000-token 8B prompt alone takes ~215 ms (SLO 200 ms); with
    its 1,024-token system prompt cached ~180 ms. The first request of a prefix group pays for the system prompt on
    every scheduler, so only a later one of the same group (and model) is servable."""
    from octoserve.services.core.types import Priority
    from octoserve.services.lab.gang_bench import servable_ids
    from octoserve.services.workload import TraceRequest

    def req(rid, t, group, model="llama-3-8b"):
        return TraceRequest(rid, t, model, tuple(range(7000)), 8, 8, Priority.INTERACTIVE, 200.0, prefix_group=group)

    cost = config_for("seed003", "gang", "default").cost_model(config_for("seed003", "gang", "default").instance("sm-0"))
    assert cost.prefill_time_s(7000, 0) > 0.2 >= cost.prefill_time_s(7000 - 1024, 1024)
    trace = [req("first", 0.0, 3), req("again", 1.0, 3), req("other", 2.0, 4), req("none", 3.0, -1),
             req("lm-first", 4.0, 4, "dense-180b")]
    assert servable_ids("seed003", trace, "default") == frozenset({"again"})


def test_a_grid_run_holds_its_arrivals_and_a_policy_stops_where_every_model_failed():
    from octoserve.services.lab.gang_bench import Settings, grid_job, run_grid

    settings = Settings(duration_s=60.0, warmup_s=10.0, grid_arrivals=1000, warmup_arrivals=250)
    assert (grid_job(settings, "seed003", "gang", "default", 0.5).duration_s,
            grid_job(settings, "seed003", "gang", "default", 0.5).warmup_s) == (2500.0, 500.0)
    assert (grid_job(settings, "seed003", "gang", "default", 80.0).duration_s,
            grid_job(settings, "seed003", "gang", "default", 80.0).warmup_s) == (60.0, 10.0)
    # Short real runs: the rows stop at the first rate where every model has failed at some rate so far (the
    # slices, which starve both sides, before the grid's end; SM-greedy's 8B passes the whole grid).
    short = Settings(duration_s=15.0, warmup_s=3.0, grid_arrivals=0, warmup_arrivals=0)
    rates = [0.5, 5.0, 20.0, 80.0]
    for policy, stops_early in (("slices", True), ("sm-greedy", False)):
        rows = run_grid([grid_job(short, "seed003", policy, "default", r) for r in rates])
        failed_before_last = {m.model for r in rows[:-1] for m in r.models if not m.passes}
        failed = failed_before_last | {m.model for m in rows[-1].models if not m.passes}
        assert len(failed_before_last) < 2
        assert (len(failed) == 2) is stops_early
        assert [r.rate_rps for r in rows] == rates[:len(rows)]
        assert (len(rows) < len(rates)) is stops_early
