"""Per-model SLOs: the node config's `slo.models` and a workload's per-model `ttft_ms` / `itl_ms`, resolved once and
read by every per-model decision (sizing, the ITL tail, admission) and by the reports."""

from __future__ import annotations

import dataclasses

import pytest

from octoserve.services.config import load_node_config, node_config_from_text
from octoserve.services.core.instance import instance_parts
from octoserve.services.core.placement import PlacementError, SloConfig
from octoserve.services.core.types import Priority
from octoserve.services.metrics import (RequestRecord, SloSpec, group_stats, meets_slo, slo_spec_of, summarize,
                                       summary_to_dict)
from octoserve.services.workload import PROFILES, generate_trace, scaled
from octoserve.services.workload_io import with_workload_slos

LM, SM = "llama-3-70b", "llama-3-8b"

NODE = """
models: {llama-3-70b: llama-3-70b, llama-3-8b: llama-3-8b}
instances:
  - {id: lm-0, model: llama-3-70b, role: colocated, tp: 4, gpu_ids: [0, 1, 2, 3]}
  - {id: sm-0, model: llama-3-8b, role: colocated, tp: 1, gpu_ids: [4]}
slo:
  ttft_ms: 250
  itl_ms: 30
  tier_ttft_ms: {interactive: 200}
  models:
%s
"""


def node(models_yaml: str):
    return node_config_from_text(NODE % models_yaml)


def test_a_model_slo_overrides_the_node_values_it_names_and_keeps_the_rest():
    slo = node("    llama-3-70b: {ttft_ms: 500, itl_ms: 50}\n    llama-3-8b: {tier_ttft_ms: {interactive: 120}}").slo
    lm, sm = slo.for_model(LM), slo.for_model(SM)
    assert (lm.ttft_ms, lm.itl_ms) == (500.0, 50.0)
    # its ttft_ms is its STANDARD tier's SLO; the node's other tiers stay
    assert lm.tier_ttft_ms == {Priority.INTERACTIVE: 200.0, Priority.STANDARD: 500.0, Priority.BATCH: 10_000.0}
    assert (sm.ttft_ms, sm.itl_ms) == (250.0, 30.0)
    assert sm.tier_ttft_ms == {Priority.INTERACTIVE: 120.0, Priority.STANDARD: 250.0, Priority.BATCH: 10_000.0}
    assert slo.for_model("other") is slo


def test_model_slo_errors_name_the_key_and_what_to_change():
    with pytest.raises(PlacementError) as e:
        node("    gpt-4: {itl_ms: 50}\n    llama-3-70b: {itl_ms: -1, latency: 3}\n    llama-3-8b: 30")
    problems = "\n".join(e.value.problems)
    assert "slo.models.gpt-4: 'gpt-4' is not a served model; choose one of: llama-3-70b, llama-3-8b" in problems
    assert "slo.models.llama-3-70b.itl_ms is -1; set a positive number of milliseconds" in problems
    assert "latency" in problems and "slo.models.llama-3-70b" in problems
    assert "slo.models.llama-3-8b is 30; give a mapping with ttft_ms, itl_ms and/or tier_ttft_ms" in problems


def test_each_instance_is_sized_and_its_tail_judged_against_its_own_model_itl():
    plain = load_node_config()
    loose = node("    llama-3-70b: {itl_ms: 50}")
    lm_plain = instance_parts(plain, plain.instance("lm-0")).batcher_config
    lm_loose = instance_parts(loose, loose.instance("lm-0")).batcher_config
    sm_loose = instance_parts(loose, loose.instance("sm-0")).batcher_config
    assert (lm_plain.itl_slo_s, lm_loose.itl_slo_s, sm_loose.itl_slo_s) == (0.030, 0.050, 0.030)
    assert lm_loose.max_num_seqs > lm_plain.max_num_seqs  # a 50 ms step holds a larger decode batch


def record(model: str, tpot_ms: float, ttft_ms: float = 100.0, ttft_slo_ms: float | None = None) -> RequestRecord:
    times = tuple(ttft_ms / 1000.0 + i * tpot_ms / 1000.0 for i in range(11))
    return RequestRecord("r", model, Priority.STANDARD, 0.0, ttft_slo_ms, 100, 0, len(times), times[0], times,
                         times[-1])


def test_reports_judge_each_request_against_its_own_model_slo():
    spec = slo_spec_of(node("    llama-3-70b: {ttft_ms: 500, itl_ms: 50}").slo)
    assert spec == SloSpec(250.0, 30.0, ((LM, 500.0),), ((LM, 50.0),))
    assert meets_slo(record(LM, 40.0), spec) and not meets_slo(record(SM, 40.0), spec)
    assert meets_slo(record(LM, 20.0, ttft_ms=400.0), spec) and not meets_slo(record(SM, 20.0, ttft_ms=400.0), spec)
    # the group row: each model's pooled ITL P95 against its own SLO
    stats = group_stats("all", [record(LM, 40.0), record(SM, 20.0)], spec, 10.0)
    assert stats.num_good == 2 and stats.fleet_itl_ok
    stats = group_stats("all", [record(LM, 40.0), record(SM, 40.0)], spec, 10.0)
    assert stats.num_good == 1 and not stats.fleet_itl_ok
    # --json states them
    assert summary_to_dict(summarize([record(LM, 40.0)], spec, 10.0))["slo"] == {
        "ttft_ms": 250.0, "itl_ms": 30.0, "models": {LM: {"ttft_ms": 500.0, "itl_ms": 50.0}}}
    # one SLO for both (no per-model entry): the pooled P95 against it, as before
    stats = group_stats("all", [record(LM, 40.0), record(SM, 20.0)], SloSpec(250.0, 30.0), 10.0)
    assert stats.num_good == 1 and not stats.fleet_itl_ok


def test_a_workload_sets_a_model_slo_for_its_trace_and_its_node():
    base = PROFILES["seed-000"]
    traffic = tuple(dataclasses.replace(t, ttft_ms=400.0, itl_ms=45.0) if t.model == LM else t for t in base.traffic)
    profile = scaled(dataclasses.replace(base, traffic=traffic), rate_rps=20.0, duration_s=5.0)
    trace = generate_trace(profile, 0)
    assert {r.ttft_slo_ms for r in trace if r.model == LM} == {400.0}
    assert {r.ttft_slo_ms for r in trace if r.model == SM} == {250.0}
    config = with_workload_slos(load_node_config(), profile)
    assert (config.slo.for_model(LM).ttft_ms, config.slo.for_model(LM).itl_ms) == (400.0, 45.0)
    assert config.slo.for_model(LM).tier_ttft_ms[Priority.STANDARD] == 400.0
    assert config.slo.for_model(SM) is config.slo and isinstance(config.slo, SloConfig)
    with pytest.raises(ValueError, match="itl_ms is 0; set a positive number of milliseconds"):
        dataclasses.replace(traffic[0], itl_ms=0)
