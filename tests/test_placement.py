"""Node config from a dict: defaults, derived helpers, and every placement problem with its exact message."""

from pathlib import Path

import pytest

from octoserve.services.core.placement import (
    InstanceConfig,
    PlacementError,
    PolicyConfig,
    SloConfig,
    instances_of,
    node_config_from_dict,
    num_kv_blocks_for,
)
from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS, num_kv_blocks
from octoserve.services.core.types import Priority, Role

LM, SM = "llama-3-70b", "llama-3-8b"


def default_dict(**top):
    d = {
        "models": [LM, SM],
        "instances": [{"id": "lm-0", "model": LM, "tp": 4, "gpu_ids": [0, 1, 2, 3]}]
        + [{"id": f"sm-{i}", "model": SM, "tp": 1, "gpu_ids": [4 + i]} for i in range(4)],
    }
    d.update(top)
    return d


def problems_of(d) -> list[str]:
    with pytest.raises(PlacementError) as info:
        node_config_from_dict(d)
    assert isinstance(info.value, ValueError)
    return list(info.value.problems)


def one_instance(**fields):
    return {"models": [LM], "instances": [{"id": "a", "model": LM, **fields}]}


def test_defaults_and_helpers():
    cfg = node_config_from_dict(default_dict())
    assert cfg.gpu == GPU_PRESETS["h100-sxm-80gb"] and cfg.num_gpus == 8
    assert cfg.models[LM] == MODEL_PRESETS[LM]
    lm = cfg.instance("lm-0")
    assert lm == InstanceConfig("lm-0", LM, Role.COLOCATED, 4, (0, 1, 2, 3), 256, 2048, 0.9, 16, True)
    assert [i.id for i in instances_of(cfg, SM)] == ["sm-0", "sm-1", "sm-2", "sm-3"]
    assert num_kv_blocks_for(cfg, lm) == num_kv_blocks(MODEL_PRESETS[LM], cfg.gpu, 4, 0.9, 2048, 16) == 30994
    assert cfg.num_kv_blocks_for(cfg.instance("sm-0")) == 28556
    assert cfg.slo == SloConfig() and cfg.policies == PolicyConfig()
    assert not cfg.is_disaggregated(LM)


def test_slo_tiers_and_request_override():
    slo = node_config_from_dict(default_dict(slo={"ttft_ms": 300, "tier_ttft_ms": {"interactive": 150}})).slo
    assert slo.ttft_ms == 300.0 and slo.itl_ms == 30.0
    assert [slo.ttft_ms_for(t) for t in Priority] == [150.0, 250.0, 10_000.0]


def test_model_overrides_and_prefill_token_default():
    d = default_dict(models={LM: {"preset": LM, "max_context_len": 4096}, SM: SM})
    d["instances"] = [
        {"id": "p", "model": LM, "role": "prefill", "tp": 2, "gpu_ids": [0, 1], "gpu_memory_utilization": 0.95},
        {"id": "d", "model": LM, "role": "decode", "tp": 4, "gpu_ids": [2, 3, 4, 5]},
        {"id": "s", "model": SM, "tp": 1, "gpu_ids": [6]},
    ]
    cfg = node_config_from_dict(d)
    assert cfg.max_context_len(LM) == 4096 and cfg.models[LM].name == LM
    assert cfg.instance("p").max_num_batched_tokens == 8192 and cfg.instance("d").max_num_batched_tokens == 2048
    assert cfg.is_disaggregated(LM) and [i.id for i in cfg.instances_of(LM, (Role.DECODE,))] == ["d"]


@pytest.mark.parametrize(
    "d, expected",
    [
        (
            one_instance(tp=1, gpu_ids=[0]),
            "instance a: llama-3-70b weights need 141.1 GB per GPU at TP=1 but h100-sxm-80gb x 0.9 leaves 77.3 GB; "
            "raise tp or gpu_memory_utilization",
        ),
        (
            one_instance(tp=2, gpu_ids=[0, 1], gpu_memory_utilization=0.83),
            "instance a: no room for KV cache: llama-3-70b weights take 70.6 of 71.3 GB per GPU at TP=2 and the "
            "activations of 2048 batched tokens take the rest; raise tp or lower max_num_batched_tokens",
        ),
        (
            one_instance(tp=3, gpu_ids=[0, 1, 2]),
            "instance a: tp=3 must divide num_attention_heads=64 of llama-3-70b; use a tp that splits the heads "
            "evenly (1, 2, 4 or 8)",
        ),
        (
            one_instance(tp=4, gpu_ids=[0, 1]),
            "instance a: tp=4 but 2 gpu_ids [0, 1]; give exactly 4 GPU ids or set tp=2",
        ),
        (
            one_instance(tp=4, gpu_ids=[6, 7, 8, 9]),
            "instance a: gpu ids [8, 9] are out of range; this node has GPUs 0..7",
        ),
        (
            one_instance(tp=2, gpu_ids=[3, 3]),
            "instance a: gpu_ids [3, 3] lists a GPU twice; list each GPU once",
        ),
        (
            one_instance(tp=4, gpu_ids=[0, 1, 2, 3], role="prefill"),
            "model llama-3-70b has prefill instances but no decode instance; add a role: decode instance",
        ),
        (
            one_instance(tp=4, gpu_ids=[0, 1, 2, 3], role="decode"),
            "model llama-3-70b has decode instances but no prefill instance; add a role: prefill instance",
        ),
        (
            one_instance(tp=4, gpu_ids=[0, 1, 2, 3], role="both"),
            "instance a: unknown role 'both'; choose one of: colocated, prefill, decode",
        ),
        (
            {"models": [LM, SM], "instances": [{"id": "a", "model": LM, "tp": 4, "gpu_ids": [0, 1, 2, 3]}]},
            "model llama-3-8b has no instance; add one or remove it from `models`",
        ),
        (
            {"models": ["gpt-4"], "instances": []},
            "models.gpt-4: unknown preset 'gpt-4'; choose one of: dense-180b, llama-3-70b, llama-3-8b",
        ),
        (
            {"gpu": "tpu-v5", **one_instance(tp=4, gpu_ids=[0, 1, 2, 3])},
            "gpu: unknown preset 'tpu-v5'; choose one of: a100-80gb, h100-sxm-80gb, h200-141gb",
        ),
        (
            one_instance(tp=4, gpu_ids=[0, 1, 2, 3], tpp=4),
            "unknown key 'tpp' in instance a; known keys: id, model, role, tp, gpu_ids, max_num_seqs, "
            "max_num_batched_tokens, gpu_memory_utilization, block_size, enable_prefix_caching",
        ),
        (
            {**one_instance(tp=4, gpu_ids=[0, 1, 2, 3]), "policies": {"queue": "lifo"}},
            "policies.queue: unknown policy 'lifo'; choose one of: edf, fcfs, priority",
        ),
        (
            {**one_instance(tp=4, gpu_ids=[0, 1, 2, 3]), "policies": {"scorer_weights": {"latency": 1}}},
            "policies.scorer_weights: unknown scorer 'latency'; choose from: kv_headroom, queue, ttft",
        ),
        (
            {**one_instance(tp=4, gpu_ids=[0, 1, 2, 3]), "policies": {"routing_filters": ["zone"]}},
            "policies.routing_filters: unknown filter 'zone'; choose from: healthy, kv_headroom, model",
        ),
        (
            {**one_instance(tp=4, gpu_ids=[0, 1, 2, 3]), "slo": {"tier_ttft_ms": {"gold": 100}}},
            "slo.tier_ttft_ms: unknown tier 'gold'; choose one of: interactive, standard, batch",
        ),
        (
            {**one_instance(tp=4, gpu_ids=[0, 1, 2, 3]), "slo": {"itl_ms": 0}},
            "slo.itl_ms is 0; set a positive number of milliseconds",
        ),
    ],
)
def test_each_problem_has_its_message(d, expected):
    assert problems_of(d) == [expected]


def test_instance_of_an_unlisted_model():
    d = {"models": [LM], "instances": [{"id": "a", "model": "llama-3-7b", "tp": 1, "gpu_ids": [0]}]}
    assert problems_of(d) == [
        "instance a: model 'llama-3-7b' is not under `models`; use one of: llama-3-70b",
        "model llama-3-70b has no instance; add one or remove it from `models`",
    ]


def test_gpu_shared_and_duplicate_ids_are_all_reported():
    d = default_dict()
    d["instances"][1]["gpu_ids"] = [3]
    d["instances"][2]["id"] = "sm-0"
    assert problems_of(d) == [
        "instance id 'sm-0' is used twice; give every instance its own id",
        "GPU 3 is given to both lm-0 and sm-0; give each GPU to one instance, or put them in one gang group "
        "(gang.groups: an LM and the SMs that share its GPUs)",
    ]


def test_error_message_lists_every_problem():
    d = {"models": [LM], "instances": [{"id": "a", "model": LM, "tp": 1, "gpu_ids": [9]}]}
    with pytest.raises(PlacementError) as info:
        node_config_from_dict(d)
    assert str(info.value) == (
        "invalid node config:\n"
        "  - instance a: gpu ids [9] are out of range; this node has GPUs 0..7\n"
        "  - instance a: llama-3-70b weights need 141.1 GB per GPU at TP=1 but h100-sxm-80gb x 0.9 leaves 77.3 GB; "
        "raise tp or gpu_memory_utilization"
    )


def test_embedded_default_and_disaggregated_example_load(tmp_path):
    from octoserve.services.config import load_node_config

    cfg = load_node_config(None)
    assert [(i.id, i.tp, i.gpu_ids) for i in cfg.instances] == [
        ("lm-0", 4, (0, 1, 2, 3)), ("sm-0", 1, (4,)), ("sm-1", 1, (5,)), ("sm-2", 1, (6,)), ("sm-3", 1, (7,))
    ]
    disagg = load_node_config("services/configs/node-disagg.yaml")
    assert disagg.is_disaggregated(LM) and not disagg.is_disaggregated(SM)
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(PlacementError) as info:
        load_node_config(bad)
    assert info.value.problems == (f"{bad} must hold a YAML mapping with gpu, models, instances, slo, policies",)


def test_picker_and_prefix_aware_routing_options():
    cfg = node_config_from_dict({**one_instance(tp=4, gpu_ids=[0, 1, 2, 3]),
                                 "policies": {"picker": "round_robin", "prefix_aware_routing": False}})
    assert (cfg.policies.picker, cfg.policies.prefix_aware_routing) == ("round_robin", False)
    assert (PolicyConfig().picker, PolicyConfig().prefix_aware_routing) == ("lowest_cost", True)
    assert problems_of({**one_instance(tp=4, gpu_ids=[0, 1, 2, 3]), "policies": {"picker": "random"}}) == [
        "policies.picker: unknown picker 'random'; choose one of: lowest_cost, round_robin"
    ]


def test_the_slo_budget_policies_parse_and_out_of_range_values_are_refused_with_what_to_set():
    one = one_instance(tp=4, gpu_ids=[0, 1, 2, 3])
    cfg = node_config_from_dict({**one, "policies": {"ttft_max_risk": 0.1, "tail_budget_fraction": 0.02}})
    assert (cfg.policies.ttft_max_risk, cfg.policies.tail_budget_fraction) == (0.1, 0.02)
    defaults = PolicyConfig()
    assert (defaults.ttft_quantile, defaults.ttft_max_risk, defaults.tail_budget_fraction,
            defaults.max_step_factor) == (0.97, 0.25, 0.04, 10.0)
    assert problems_of({**one, "policies": {"ttft_max_risk": 1.5}}) == [
        "policies.ttft_max_risk is 1.5; set a probability in [0, 1]: the largest chance of missing its TTFT SLO "
        "one admitted request may carry"
    ]
    assert problems_of({**one, "policies": {"tail_budget_fraction": 0.05}}) == [
        "policies.tail_budget_fraction is 0.05; set a fraction in [0, 0.05): the share of inter-token gaps a P95 "
        "ITL SLO lets run slow is 5 %, and the budget must stay inside it"
    ]


def test_cost_profile_key_parses_and_defaults_to_default():
    assert node_config_from_dict(default_dict()).cost_profile == "default"
    assert node_config_from_dict(default_dict(cost_profile="pessimistic")).cost_profile == "pessimistic"


@pytest.mark.parametrize("name", ["optimistic", ["pessimistic"], None])
def test_unknown_cost_profile_lists_the_choices(name):
    assert problems_of(default_dict(cost_profile=name)) == [
        f"cost_profile: unknown profile {name!r}; choose one of: default, pessimistic"
    ]


def test_every_cost_model_built_from_a_pessimistic_config_uses_the_pessimistic_constants():
    from octoserve.services.core.cost_model import DEFAULT_CONSTANTS, PESSIMISTIC_CONSTANTS
    from octoserve.services.core.instance import instance_parts
    from octoserve.services.core.planner import candidate_placements
    from octoserve.services.core.routing import build_cost_models
    from octoserve.services.sim.driver import NodeSimulator

    for name, constants in (("default", DEFAULT_CONSTANTS), ("pessimistic", PESSIMISTIC_CONSTANTS)):
        config = node_config_from_dict(default_dict(cost_profile=name))
        assert {i.id: config.cost_model(i).constants for i in config.instances} == {
            i.id: constants for i in config.instances}
        assert all(instance_parts(config, i).cost_model.constants is constants for i in config.instances)
        assert all(c.constants is constants for c in build_cost_models(config).values())  # the router service
        sim = NodeSimulator(config)  # the simulator's engines and its router
        assert all(inst.cost.constants is constants for inst in sim.instances.values())
        assert all(sim.router._cost_model(i).constants is constants for i in config.instances)
        placements = candidate_placements(config.gpu, config.models, config.num_gpus, cost_profile=name)
        assert placements and all(p.config.cost_profile == name for p in placements)


def test_cost_profile_flag_sets_the_config_key_for_every_subcommand():
    import argparse

    from octoserve.services.config import add_cost_profile_argument, config_source, load_with_overrides

    parser = argparse.ArgumentParser()
    add_cost_profile_argument(parser)
    assert parser.parse_args([]).cost_profile is None
    assert parser.parse_args(["--cost-profile", "pessimistic"]).cost_profile == "pessimistic"
    with pytest.raises(SystemExit):
        parser.parse_args(["--cost-profile", "optimistic"])
    assert load_with_overrides(None, []).cost_profile == "default"
    assert load_with_overrides(None, [], "pessimistic").cost_profile == "pessimistic"
    assert load_with_overrides(None, ["policies.queue=fcfs"], "pessimistic").policies.queue == "fcfs"
    assert config_source("node.yaml", None) == "node.yaml"  # `up` / `demo` pass the path through untouched
    assert config_source(None, "pessimistic")["cost_profile"] == "pessimistic"  # or a dict with the key set


def test_what_config_source_returns_loads_as_the_same_node_config():
    """A path, None and the mapping `--cost-profile` makes all load through config.py, the one reader of node YAML;
    the mapping's service sections (here the gang config's has none; tls, limits...) are left out of the placement."""
    from octoserve.services.config import config_source, load_config_source, load_node_config, node_config_from_raw

    gang = str(Path(__file__).resolve().parents[1] / "services" / "configs" / "node-gang.yaml")
    assert load_config_source(gang) == load_node_config(gang)
    assert load_config_source(None) == load_node_config(None)
    pessimistic = load_config_source(config_source(gang, "pessimistic"))
    assert pessimistic.cost_profile == "pessimistic"
    assert pessimistic.instances == load_node_config(gang).instances and pessimistic.gang == load_node_config(gang).gang
    raw = config_source(None, "pessimistic")
    assert node_config_from_raw({**raw, "limits": {"max_stop_strings": 8}}) == node_config_from_raw(raw)
