"""Planner numbers by hand arithmetic: sizing, the roofline bound of seed 000, the verdict, SLO-aware capacities
with a toy cost model, and the candidate placements."""

import math

import pytest

from octoserve.services.core import planner
from octoserve.services.core.placement import SloConfig, check_placement
from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS
from octoserve.services.core.types import Role

H100 = GPU_PRESETS["h100-sxm-80gb"]
LM, SM = "llama-3-70b", "llama-3-8b"
MODELS = {LM: MODEL_PRESETS[LM], SM: MODEL_PRESETS[SM]}
SEED_000 = planner.WorkloadMix(300.0, (planner.ModelLoad(SM, 0.75, 1000, 400), planner.ModelLoad(LM, 0.25, 1000, 400)))


def test_roofline_bound_of_seed_000_matches_the_hand_figure():
    b = planner.roofline_bound(MODELS, H100, 8, SEED_000)
    # By hand: 70B 2 x 70.55e9 x 1400 = 197.55 TFLOP, 8B 2 x 8.03e9 x 1400 = 22.48 TFLOP per request;
    # mix 0.25 x 197.55 + 0.75 x 22.48 = 66.25 TFLOP; 8 x 989 TFLOP/s / 66.25 TFLOP = 119.4 req/s.
    assert b.capacity_rps == pytest.approx(119.0, rel=0.01)
    assert b.flops_per_request[LM] == 2 * 70_553_706_496 * 1400
    assert b.demand_flops_per_s / 1e15 == pytest.approx(19.9, rel=0.01)
    assert 75 * b.flops_per_request[LM] / 1e15 == pytest.approx(14.8, rel=0.01)
    assert 75 * b.prefill_flops_per_request[LM] / 1e15 == pytest.approx(10.6, rel=0.01)
    assert 225 * b.flops_per_request[SM] / 1e15 == pytest.approx(5.1, rel=0.01)
    assert b.peak_flops_per_s == 8 * 989e12
    assert b.load_factor == pytest.approx(2.51, abs=0.01)


def test_prefix_hits_remove_prompt_flops():
    cached = planner.WorkloadMix(300.0, tuple(
        planner.ModelLoad(m.model, m.share, 1000, 400, cached_fraction=0.5) for m in SEED_000.models))
    b = planner.roofline_bound(MODELS, H100, 8, cached)
    assert b.flops_per_request[LM] == 2 * 70_553_706_496 * (500 + 400)
    assert b.capacity_rps == pytest.approx(119.42 * 1400 / 900, rel=1e-3)


def test_verdict_sentences():
    assert planner.verdict(300, 119.4) == (
        "300 req/s exceeds the node by 2.5x by compute (bound 119 req/s): shed or queue at least 181 req/s"
    )
    assert planner.verdict(60, 120) == "60 req/s fits the compute bound of 120 req/s (50% of it)"
    assert planner.verdict(60, 0.0, "the SLOs") == "60 req/s cannot be served within the SLOs: the bound is 0 req/s"


def test_sizing_table():
    rows = {(r.model, r.tp): r for r in planner.sizing_table(MODELS, H100, SEED_000)}
    lm4, sm1 = rows[(LM, 4)], rows[(SM, 1)]
    assert lm4.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680  # 320 KiB
    assert lm4.kv_bytes_per_sequence == 327_680 * 1400  # 437.5 MiB
    assert sm1.kv_bytes_per_sequence == 131_072 * 1400  # 175 MiB
    assert lm4.weight_bytes_per_gpu == 70_553_706_496 * 2 // 4
    assert lm4.kv_tokens_per_instance == 30994 * 16 and lm4.kv_sequences_per_instance == pytest.approx(354.2, abs=0.1)
    assert (LM, 1) not in rows  # 141 GB of weights on one 80 GB GPU


def test_sizing_table_has_rows_only_for_the_models_the_mix_uses():
    only_8b = planner.WorkloadMix(20.0, (planner.ModelLoad(SM, 1.0, 500, 100),))
    rows = planner.sizing_table(MODELS, H100, only_8b)
    assert {r.model for r in rows} == {SM}
    assert [r.tp for r in rows] == [1, 2, 4, 8]


class ToyCost:
    """Step time = 10 ms + 0.1 ms per token; prefill at 10,000 tokens/s."""

    def step_time_s(self, chunks):
        return 0.010 + 0.0001 * sum(n for n, _ in chunks)

    def decode_step_time_s(self, batch_size, context_len):
        return 0.010 + 0.0001 * batch_size

    def prefill_time_s(self, num_tokens, num_context_tokens=0):
        return num_tokens / 10_000

    def prefill_tokens_per_s(self, chunk_tokens):
        return 10_000.0


LOAD = planner.ModelLoad(SM, 1.0, 1000, 400)


def test_decode_capacity_by_itl_and_by_kv():
    # ITL 30 ms: 10 + 0.1 B <= 30 -> B = 200; 200 / (0.030 s x 400 tokens) = 16.67 req/s.
    assert planner.decode_capacity_rps(ToyCost(), 10**9, LOAD, 0.030, 256) == pytest.approx(200 / (0.030 * 400))
    # KV for 50 sequences of 1400 tokens: B = 50, step 15 ms -> 8.33 req/s.
    assert planner.decode_capacity_rps(ToyCost(), 50 * 1400, LOAD, 0.030, 256) == pytest.approx(50 / (0.015 * 400))
    assert planner.decode_capacity_rps(ToyCost(), 10**9, LOAD, 0.030, 64) == pytest.approx(64 / (0.0164 * 400))


def test_prefill_capacity_and_ttft_cutoff():
    assert planner.prefill_capacity_rps(ToyCost(), 8192, LOAD, 0.250) == 10.0  # 10,000 tokens/s / 1000
    assert planner.prefill_capacity_rps(ToyCost(), 8192, LOAD, 0.050) == 0.0  # 100 ms prefill > 50 ms TTFT


def test_colocated_capacity_balances_prefill_and_decode_within_the_itl():
    # B decodes + chunk ceil(2.5 B); step 10 ms + 0.1 ms x 3.5 B <= 30 ms -> B = 57, chunk 143, step 30 ms;
    # min(57 / (0.030 x 400), 143 / (0.030 x 1000)) = 4.75 req/s; a prompt prefills in 7 steps = 210 ms.
    r = planner.colocated_capacity_rps(ToyCost(), 10**9, LOAD, SloConfig(), 256, 2048)
    assert r == pytest.approx(57 / (0.030 * 400))
    # A tighter TTFT forces bigger chunks, so smaller batches: less, but not nothing.
    tight = planner.colocated_capacity_rps(ToyCost(), 10**9, LOAD, SloConfig(ttft_ms=200.0), 256, 2048)
    assert 0 < tight < r
    # 100 ms: a 1000-token prompt alone costs 100 ms of chunk time plus 10 ms per step: never feasible.
    assert planner.colocated_capacity_rps(ToyCost(), 10**9, LOAD, SloConfig(ttft_ms=100.0), 256, 2048) == 0.0
    # KV for 20 sequences caps the batch at B = 20. Its balanced chunk, 50, takes 20 steps of 17 ms = 340 ms, over
    # the 250 ms TTFT; the smallest chunk that makes it is 84 (12 steps of 20.4 ms = 245 ms): 20 / (0.0204 x 400).
    capped = planner.colocated_capacity_rps(ToyCost(), 20 * 1400, LOAD, SloConfig(), 256, 2048)
    assert capped == pytest.approx(20 / (0.0204 * 400))


def test_a_colocated_candidate_takes_the_step_budget_that_holds_its_longest_servable_prompt_whole():
    # The 70B at TP=4 prefills at most 3,059 tokens within 250 ms when idle (default profile): a 4,096-token budget
    # holds them in one step, 2,048 would take two; at TP=2 (1,674) 2,048 does; the 8B at TP=1 (8,022) takes 8,192.
    budget = planner.servable_prompt_budget
    assert [budget(MODELS[LM], H100, tp, 250.0, "default") for tp in (1, 2, 4, 8)] == [2048, 2048, 4096, 8192]
    assert budget(MODELS[SM], H100, 1, 250.0, "default") == 8192
    assert budget(MODELS[LM], H100, 8, 250.0, "pessimistic") == 4096  # 3,882 tokens
    assert budget(MODELS[LM], H100, 4, 100.0, "default") == 2048
    by_label = {p.label: p.config for p in planner.candidate_placements(H100, MODELS, 8)}
    static = by_label["llama-3-70b TP4 x1 colocated | llama-3-8b TP1 x4 colocated"]
    assert [(i.model, i.max_num_batched_tokens) for i in static.instances] == [(LM, 4096)] + [(SM, 8192)] * 4
    split = by_label["llama-3-70b TP2 1P+2D | llama-3-8b TP1 1P+1D"]
    assert [(i.role, i.max_num_batched_tokens) for i in split.instances] == [
        (Role.PREFILL, 8192), (Role.DECODE, 2048), (Role.DECODE, 2048), (Role.PREFILL, 8192), (Role.DECODE, 2048)]


def test_candidate_placements_are_valid_and_cover_the_splits():
    cands = planner.candidate_placements(H100, MODELS, 8)
    labels = [p.label for p in cands]
    # 24 static splits at one TP per model, 4 with the 70B's prefill at its own TP (TP2 + TP4 in either role on six
    # GPUs, the 8B colocated or split on two), 2 gang shapes x 3 LM step shares, and 9 of the 70B alone on all eight
    # GPUs (TP2: 4, TP4: 2, TP8: 1, mixed TP: 2)
    assert len(labels) == len(set(labels)) == 24 + 4 + 6 + 9
    assert "llama-3-70b TP4 x1 colocated | llama-3-8b TP1 x4 colocated" in labels
    assert "llama-3-70b TP2 1P+2D | llama-3-8b TP1 1P+1D" in labels
    # TP=8 would leave the 8B no GPU of its own: it appears time-shared in a gang group, or with the 8B dropped.
    assert all("gang" in label or label.endswith("| llama-3-8b not placed") for label in labels if "TP8" in label)
    alone = [p for p in cands if p.label.endswith("| llama-3-8b not placed")]
    assert sorted(p.label for p in alone if "TP4" in p.label and "TP2" not in p.label) == [
        "llama-3-70b TP4 1P+1D | llama-3-8b not placed", "llama-3-70b TP4 x2 colocated | llama-3-8b not placed"]
    assert {tuple(p.config.models) for p in alone} == {("llama-3-70b",)}
    for p in cands:
        assert check_placement(p.config) == []
        if p.config.gang is None:
            assert sorted(g for i in p.config.instances for g in i.gpu_ids) == list(range(8))
        else:
            assert sorted({g for i in p.config.instances for g in i.gpu_ids}) == list(range(8))
    mixed = next(p for p in cands if p.label == "llama-3-70b 1P TP2 + 1D TP4 | llama-3-8b TP1 x2 colocated").config
    assert [(i.id, i.role, i.tp, i.gpu_ids) for i in mixed.instances] == [
        ("lm-p0", Role.PREFILL, 2, (0, 1)), ("lm-d0", Role.DECODE, 4, (2, 3, 4, 5)),
        ("sm-0", Role.COLOCATED, 1, (6,)), ("sm-1", Role.COLOCATED, 1, (7,)),
    ]
    disagg = next(p for p in cands if p.label == "llama-3-70b TP2 1P+2D | llama-3-8b TP1 1P+1D").config
    assert [(i.id, i.role, i.gpu_ids) for i in disagg.instances] == [
        ("lm-p0", Role.PREFILL, (0, 1)), ("lm-d0", Role.DECODE, (2, 3)), ("lm-d1", Role.DECODE, (4, 5)),
        ("sm-p0", Role.PREFILL, (6,)), ("sm-d0", Role.DECODE, (7,)),
    ]


def test_gang_candidates_share_gpus_only_inside_their_group_and_rank_below_at_the_seed_000_peak():
    gangs = planner.gang_placements(H100, MODELS, 8)
    assert [p.label for p in gangs][:1] == ["llama-3-70b TP8 colocated gang over llama-3-8b TP1 x8 (LM step share 0.55)"]
    full = gangs[0].config
    assert full.gang.groups[0].lm == "lm-0" and full.gang.groups[0].sms == tuple(f"sm-{g}" for g in range(8))
    hybrid = next(p for p in gangs if "1P + TP4 1D" in p.label).config
    assert hybrid.gang.groups[0].lm == "lm-d0" and hybrid.instance("lm-p0").gpu_ids == (0, 1, 2, 3)
    # The estimate gives each gang member its step share of the time: the 70B's TP=8 share serves fewer than the
    # dedicated TP=4 instance of the static split, so the static split still ranks first (the simulator decides).
    ranked = planner.rank_placements(planner.candidate_placements(H100, MODELS, 8), SEED_000)
    assert ranked[0][0].config.gang is None
    assert any(p.config.gang is not None for p, _ in ranked)


def test_one_model_alone_may_take_tp8():
    labels = [p.label for p in planner.candidate_placements(H100, {LM: MODEL_PRESETS[LM]}, 8)]
    assert "llama-3-70b TP8 x1 colocated" in labels and "llama-3-70b TP4 1P+1D" in labels


def test_ranking_puts_the_default_placement_first_for_seed_000():
    ranked = planner.rank_placements(planner.candidate_placements(H100, MODELS, 8), SEED_000)
    best, bound = ranked[0]
    assert best.label == "llama-3-70b TP4 x1 colocated | llama-3-8b TP1 x4 colocated"
    assert bound.limiting_model == LM and bound.serves_every_model
    assert bound.goodput_rps == pytest.approx(sum(bound.model_capacity_rps.values()))  # both models saturated
    assert bound.node_rps == pytest.approx(bound.model_capacity_rps[LM] / 0.25)
    # Placements that leave a model no SLO-meeting capacity rank last, whatever their goodput.
    assert not ranked[-1][1].serves_every_model
    goodputs = [b.goodput_rps for _, b in ranked if b.serves_every_model]
    assert goodputs == sorted(goodputs, reverse=True)


def test_mix_from_the_seed_000_profile_accounts_for_prefix_hits():
    from octoserve.services.sim.cli_plan import mix_from_profile
    from octoserve.services.workload import PROFILES

    mix = mix_from_profile(PROFILES["seed-000"])
    assert mix.rate_rps == 300.0
    assert mix.of(LM) == planner.ModelLoad(LM, 0.25, 1000.0, 400.0, 0.10 * 256 / 1000)
    # 2.56 % of prompt tokens cached: the bound rises from 119.4 to 121.6 req/s.
    assert planner.roofline_bound(MODELS, H100, 8, mix).capacity_rps == pytest.approx(121.6, abs=0.05)


def _plan(argv):
    import argparse

    from octoserve.services.sim import cli_plan

    parser = argparse.ArgumentParser()
    cli_plan.add_arguments(parser)
    return cli_plan.run(parser.parse_args(argv))


def test_plan_command_prints_the_bound_the_estimates_and_the_recommendation(capsys, tmp_path):
    import json

    out_json = tmp_path / "plan.json"
    assert _plan(["--top", "0", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "at most 121.6 req/s of this mix" in text
    assert "verdict: 300 req/s exceeds the node by 2.5x by compute (bound 122 req/s)" in text
    assert "Compute roofline, an upper bound by FLOPs" in text
    assert "  upper bound on goodput: 121.6 req/s = min(offered, compute roofline 121.6)" in text
    assert "  SLO-aware estimate (mean request, one operating point; not a bound): goodput ~ 56.9 req/s" in text
    assert "SLO-aware optimistic estimate (any scheduler" in text
    assert "goodput <=" not in text and "SLO-aware bound" not in text and "upper bound of" not in text
    assert "recommend llama-3-70b TP4 x1 colocated | llama-3-8b TP1 x4 colocated" in text
    doc = json.loads(out_json.read_text())
    assert doc["analytic_ranking"][0]["label"] == "llama-3-70b TP4 x1 colocated | llama-3-8b TP1 x4 colocated"
    assert doc["upper_bound_rps"] == pytest.approx(121.6, abs=0.05) and doc["simulated"] is None


def test_bound_check_lines():
    from octoserve.services.sim.cli_plan import bound_check

    assert bound_check(80.04, 121.6) == "simulated goodput 80.0 req/s <= upper bound 121.6 req/s: ok"
    assert bound_check(130.0, 121.6) == ("BOUND VIOLATED: simulated goodput 130.0 req/s > upper bound 121.6 req/s "
                                         "(a bug in the bound or the simulator)")


def test_the_printed_upper_bound_bounds_a_short_simulation_of_the_configured_placement(capsys, tmp_path):
    import json

    out_json = tmp_path / "plan.json"
    args = ["--top", "1", "--rate", "150", "--duration", "8", "--warmup", "3", "--capacity-steps", "0",
            "--json", str(out_json)]
    assert _plan(args) == 0
    text = capsys.readouterr().out
    doc = json.loads(out_json.read_text())
    check = doc["configured_check"]
    assert 0 < check["goodput_rps"] <= check["upper_bound_rps"] <= 121.6 + 0.05
    assert check["check"].endswith(": ok") and check["check"] in text
    assert "recommend for SLO capacity: " in text and "recommend for goodput at 150 req/s: " in text


def test_ranking_by_capacity_and_by_goodput_can_disagree():
    from octoserve.services.sim.capacity import Recommendation, rank_by_both

    evaluated = {"colocated": (12.0, 80.0), "disaggregated": (15.0, 60.0), "split-b": (15.0, 70.0),
                 "broken": (math.nan, 90.0)}
    by_cap, by_goodput, rec = rank_by_both(evaluated)
    assert by_cap == ["split-b", "disaggregated", "colocated", "broken"]  # tie at 15: more goodput first; NaN last
    assert by_goodput == ["broken", "colocated", "split-b", "disaggregated"]
    assert rec == Recommendation(by_capacity="split-b", by_goodput="broken")
    # every capacity 0 (nothing passes): the capacity ranking falls back to goodput, then to the label
    assert rank_by_both({"b": (0.0, 70.0), "a": (0.0, 70.0), "c": (0.0, 80.0)})[0] == ["c", "a", "b"]


def test_placements_are_ranked_by_the_per_model_criterion_so_the_8bs_volume_cannot_hide_the_70b():
    from types import SimpleNamespace as NS

    from octoserve.services.metrics import passes_capacity
    from octoserve.services.sim.capacity import passes_per_model

    good_70b, missing_70b = NS(attainment_offered=0.93, fleet_slo_met=True), NS(attainment_offered=0.66,
                                                                                 fleet_slo_met=True)
    good_8b, slow_8b = NS(attainment_offered=0.99, fleet_slo_met=True), NS(attainment_offered=0.97, fleet_slo_met=False)
    # Pooled, three 8B requests for each 70B one: 0.25 x 0.66 + 0.75 x 0.99 = 0.91 of offered good, a pass.
    pooled = NS(attainment_offered=0.25 * 0.66 + 0.75 * 0.99, fleet_slo_met=True)
    assert passes_capacity(pooled)
    assert passes_per_model(NS(overall=pooled, per_model=(missing_70b, good_8b))) == (False, 0.66)
    assert passes_per_model(NS(per_model=(good_70b, good_8b))) == (True, 0.93)
    assert passes_per_model(NS(per_model=(good_70b, slow_8b))) == (False, 0.93)  # its own ITL P95 missed


def test_plan_simulates_the_configured_placement_beside_the_top_n_when_it_is_not_among_them(capsys, tmp_path):
    import json

    from octoserve.services.config import load_node_config

    assert planner.placement_label(load_node_config(None)) == ("llama-3-70b TP4 x1 colocated | "
                                                               "llama-3-8b TP1 x4 colocated")
    out_json = tmp_path / "plan.json"
    args = ["--config", "services/configs/node-disagg.yaml", "--top", "1", "--rate", "150", "--duration", "8",
            "--warmup", "3", "--capacity-steps", "0", "--json", str(out_json)]
    assert _plan(args) == 0
    doc = json.loads(out_json.read_text())
    top_label = doc["analytic_ranking"][0]["label"]
    configured = "configured: llama-3-70b 1P TP2 + 1D TP4 | llama-3-8b TP1 x2 colocated"
    assert sorted(doc["simulated"]) == sorted([top_label, configured])
    assert all(v["goodput_rps"] > 0 for v in doc["simulated"].values())
    # The default config's layout is the analytic first: simulated once, as the candidate.
    args = ["--top", "1", "--rate", "150", "--duration", "8", "--warmup", "3", "--capacity-steps", "0",
            "--json", str(out_json)]
    assert _plan(args) == 0
    assert list(json.loads(out_json.read_text())["simulated"]) == [
        "llama-3-70b TP4 x1 colocated | llama-3-8b TP1 x4 colocated"]
