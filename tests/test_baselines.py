"""Baselines: each named configuration sets exactly the policies and knobs of the system it stands for."""

import dataclasses

import pytest

from octoserve.services.lab.baselines import (
    BASELINES,
    MAIN_POLICIES,
    PLANNER,
    STATIC_SPLIT,
    configure,
    describe_instances,
    sarathi_budget,
)
from octoserve.services.config import load_node_config
from octoserve.services.core.cost_model import CostModel
from octoserve.services.core.placement import PlacementError, PolicyConfig
from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS
from octoserve.services.core.types import Role

H100 = GPU_PRESETS["h100-sxm-80gb"]
STATIC = load_node_config(None)
DISAGG = load_node_config("services/configs/node-disagg.yaml")


def test_the_named_set():
    assert list(BASELINES) == ["vllm-default", "sarathi", "distserve", "octoserve", "octoserve-gang",
                               "octoserve-no-refusal", "octoserve-no-prefix-routing", "octoserve-full-reservation"]
    assert MAIN_POLICIES == ("vllm-default", "sarathi", "distserve", "octoserve", "octoserve-gang")
    assert BASELINES["vllm-default"].placement == STATIC_SPLIT and BASELINES["octoserve"].placement == PLANNER


def test_vllm_default_is_vllm_v1_on_an_h100():
    cfg = configure(BASELINES["vllm-default"], STATIC)
    p = cfg.policies
    assert (p.queue, p.reservation, p.preemption, p.admission, p.slo_sizing, p.picker) == (
        "fcfs", "watermark", "recompute", False, False, "round_robin")
    assert {(i.max_num_batched_tokens, i.max_num_seqs) for i in cfg.instances} == {(8192, 1024)}
    assert cfg.instances == tuple(dataclasses.replace(i, max_num_batched_tokens=8192, max_num_seqs=1024)
                                  for i in STATIC.instances)  # same GPUs, same TP: a static split
    assert cfg.slo == STATIC.slo and cfg.models == STATIC.models


def test_octoserve_and_its_ablations_differ_in_one_policy_each():
    base = configure(BASELINES["octoserve"], STATIC).policies
    assert (base.queue, base.reservation, base.admission, base.slo_sizing, base.picker, base.ttft_slack,
            base.prefix_aware_routing) == ("edf", "predicted", True, True, "lowest_cost", 1.0, True)
    changed = {
        "octoserve-no-refusal": {"admission": False},
        "octoserve-no-prefix-routing": {"prefix_aware_routing": False},
        "octoserve-full-reservation": {"reservation": "full"},
    }
    for name, diff in changed.items():
        assert configure(BASELINES[name], STATIC).policies == dataclasses.replace(base, **diff)
    # octoserve keeps the placement's own budgets (its SLO sizing tightens them per instance)
    assert configure(BASELINES["octoserve"], STATIC).instances == STATIC.instances


def test_sarathi_budget_fits_the_itl_for_every_mix():
    for model, tp in (("llama-3-8b", 1), ("llama-3-70b", 4)):
        cost = CostModel(MODEL_PRESETS[model], H100, tp)
        budget = sarathi_budget(cost, 30.0)
        assert budget % 16 == 0 and budget >= 16
        for d in (0, budget // 4, budget // 2):
            assert cost.step_time_s([(budget - d, 0)] + [(1, 1200)] * d) <= 0.030 * 0.85
        over = budget + 16
        assert any(cost.step_time_s([(over - d, 0)] * (d < over) + [(1, 1200)] * d) > 0.030 * 0.85
                   for d in (0, over // 4, over // 2, 3 * over // 4, over))


def test_sarathi_sets_the_colocated_budgets_only():
    cfg = configure(BASELINES["sarathi"], DISAGG)
    for inst, orig in zip(cfg.instances, DISAGG.instances):
        if inst.role is Role.PREFILL:
            assert inst == orig
        elif inst.role is Role.COLOCATED:
            cost = CostModel(MODEL_PRESETS[inst.model], H100, inst.tp)
            # the headroom octoserve's sizing gives the instance: 0.95 for the 8B's wide batch, else 0.85
            headroom = 0.95 if inst.model == "llama-3-8b" else 0.85
            assert inst.max_num_batched_tokens == sarathi_budget(cost, 30.0, headroom=headroom)
    assert cfg.policies.admission is False and cfg.policies.queue == "fcfs"
    static = configure(BASELINES["sarathi"], STATIC)
    assert [(i.id, i.max_num_batched_tokens) for i in static.instances] == [
        ("lm-0", 64), ("sm-0", 256), ("sm-1", 256), ("sm-2", 256), ("sm-3", 256)]


def test_distserve_dispatches_by_shortest_queue_and_keeps_prefill_chunks():
    cfg = configure(BASELINES["distserve"], DISAGG)
    assert dict(cfg.policies.scorer_weights) == {"queue": 1.0}
    assert cfg.policies.admission is False and cfg.policies.slo_sizing is True
    assert cfg.instance("lm-prefill-0").max_num_batched_tokens == 4096


def test_configure_rejects_what_cannot_run():
    tiny = dataclasses.replace(BASELINES["vllm-default"], max_num_batched_tokens=10**7)
    with pytest.raises(PlacementError, match="no room for KV cache"):
        configure(tiny, STATIC)


def test_describe_instances():
    assert describe_instances(configure(BASELINES["vllm-default"], STATIC)) == (
        "llama-3-70b: 1 x colocated TP4 (budget 8192); llama-3-8b: 4 x colocated TP1 (budget 8192)")


def test_policy_defaults_are_untouched():
    assert PolicyConfig().admission is True and PolicyConfig().picker == "lowest_cost"
