"""The simulator's gang groups: the barrier is honest (an LM step starts only when every SM step on its GPUs has
ended, and no LM step overlaps an SM step), the bounds hold on a real workload, and placement validates groups."""

from __future__ import annotations

import pytest

from octoserve.services.config import load_node_config
from octoserve.services.core.placement import PlacementError, node_config_from_dict
from octoserve.services.core.types import Priority
from octoserve.services.sim.driver import NodeSimulator
from octoserve.services.workload import PROFILES, TraceRequest, generate_trace, scaled

MODELS = {"llama-3-70b": "llama-3-70b", "llama-3-8b": "llama-3-8b"}


def gang_dict(**gang):
    return {
        "gpu": "h100-sxm-80gb", "num_gpus": 8, "models": MODELS,
        "instances": [
            {"id": "lm-0", "model": "llama-3-70b", "tp": 8, "gpu_ids": list(range(8)), "gpu_memory_utilization": 0.45},
            *({"id": f"sm-{g}", "model": "llama-3-8b", "tp": 1, "gpu_ids": [g], "gpu_memory_utilization": 0.45}
              for g in range(8)),
        ],
        "gang": {"groups": [{"lm": "lm-0", "sms": [f"sm-{g}" for g in range(8)]}], "max_lm_wait_ms": 25,
                 "max_sm_stall_ms": 50, **gang},
        "policies": {"admission": False},
    }


def request(rid: str, model: str, arrival_s: float, prompt_len: int, output_len: int) -> TraceRequest:
    return TraceRequest(rid, arrival_s, model, tuple(range(1000, 1000 + prompt_len)), output_len, output_len + 8,
                        Priority.STANDARD, 250.0)


class _Logged(NodeSimulator):
    """Records every step's (instance, start, end)."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.steps: list[tuple[str, float, float]] = []

    def _start_capped_step(self, inst, step_cap_s):
        t = super()._start_capped_step(inst, step_cap_s)
        if t is not None:
            self.steps.append((inst.cfg.id, self.now, self.now + t))
        return t


@pytest.mark.parametrize("shape", ["interleave", "periodic", "slack"])
def test_lm_step_waits_for_the_slowest_sm_step_and_never_overlaps_one(shape):
    config = node_config_from_dict(gang_dict(shape=shape))
    # A long 8B prompt starts a capped SM step on GPU 0 at 0.5 s; the 70B request arrives just after it.
    trace = [request("sm", "llama-3-8b", 0.5, 3000, 20), request("lm", "llama-3-70b", 0.5001, 200, 20)]
    sim = _Logged(config)
    result = sim.run(trace)
    assert all(r.finish_s is not None for r in result.records)
    lm = [(s, e) for i, s, e in sim.steps if i == "lm-0"]
    sms = [(s, e) for i, s, e in sim.steps if i != "lm-0"]
    first_sm = min(sms)
    assert first_sm[0] == pytest.approx(0.5)
    # The barrier: the LM's first step starts when the SM step running at its arrival ends, not at its arrival.
    assert lm[0][0] == pytest.approx(first_sm[1], abs=1e-12) and lm[0][0] > 0.5001
    for ls, le in lm:
        assert not any(ss < le - 1e-12 and ls < se - 1e-12 for ss, se in sms), "LM step overlapped an SM step"
    report = result.gangs[0]
    assert report.stats.max_lm_wait_s >= first_sm[1] - 0.5001 - 1e-9  # the first wait, and any later one
    assert report.stats.max_lm_wait_s <= 0.025 + 1e-9 and report.stats.max_sm_stall_s <= 0.050 + 1e-9
    assert report.stats.num_overruns == 0 and report.stats.num_lm_steps == len(lm)


def test_seed_000_on_the_shipped_gang_config_keeps_both_bounds():
    config = load_node_config("services/configs/node-gang.yaml")
    trace = generate_trace(scaled(PROFILES["seed-000"], rate_rps=12, duration_s=8), 0)
    result = NodeSimulator(config).run(trace)
    (report,) = result.gangs
    policy = config.gang.policy
    assert report.stats.max_lm_wait_s <= policy.max_lm_wait_ms / 1e3 + 1e-9
    assert report.stats.max_sm_stall_s <= policy.max_sm_stall_ms / 1e3 + 1e-9
    assert report.stats.num_overruns == 0
    assert report.stats.num_lm_steps > 0 and report.stats.num_switches > 0
    assert sum(report.stats.lease_states.values()) == report.num_sm_pauses > 0
    assert all(r.refused or r.finish_s is not None for r in result.records)


def test_placement_refuses_sharing_outside_a_group_and_overfull_gpus_and_unprovable_bounds():
    d = gang_dict()
    d["instances"][1]["gpu_memory_utilization"] = 0.5  # sm-0: 0.45 + 0.5 > 0.9 on GPU 0
    d["gang"]["groups"][0]["sms"] = [f"sm-{g}" for g in range(1, 8)]  # sm-0 shares GPU 0 outside the group
    with pytest.raises(PlacementError) as e:
        node_config_from_dict(d)
    assert any("GPU 0 is given to both lm-0 and sm-0" in p for p in e.value.problems)
    d = gang_dict()
    d["instances"][2]["gpu_memory_utilization"] = 0.5
    with pytest.raises(PlacementError) as e:
        node_config_from_dict(d)
    assert e.value.problems == (
        "GPU 1 is shared by a gang group: gpu_memory_utilization lm-0 0.45 (17.6 GB weights, the rest activations "
        "and KV) + sm-1 0.5 (16.1 GB weights, the rest activations and KV) = 0.95 of 85.9 GB exceeds 0.9; lower "
        "the members' gpu_memory_utilization (their KV split)",
    )
    with pytest.raises(PlacementError) as e:
        node_config_from_dict(gang_dict(max_lm_wait_ms=5, max_sm_stall_ms=10))
    assert [p.split(": ", 1)[0] for p in e.value.problems] == ["gang group of lm-0"] * 2
    assert "raise it to at least" in e.value.problems[0]


def test_gang_keys_are_validated():
    with pytest.raises(PlacementError) as e:
        node_config_from_dict(gang_dict(shape="greedy", lease_ms=40, lm_step_share=1.5, slack_ms=3))
    problems = e.value.problems
    assert any(p.startswith("unknown key 'slack_ms' in gang") for p in problems)
    assert "gang.lm_step_share is 1.5; set a fraction in (0, 1), e.g. 0.6" in problems
    assert "gang.shape: unknown shape 'greedy'; choose one of: interleave, periodic, slack, deadline, lm_first, sm_greedy, slices" in problems
    assert "gang.lease_ms (40) must be below gang.period_ms (30)" in problems


def test_each_gang_member_keeps_its_own_kv_pool_from_its_share():
    config = node_config_from_dict(gang_dict())
    lm, sm = config.instance("lm-0"), config.instance("sm-0")
    assert config.num_kv_blocks_for(lm) > 0 and config.num_kv_blocks_for(sm) > 0
    # Their shares of the ITL (0.6 x 30 ms for the LM, the rest for the SMs) become the shared-step caps, of the
    # sized target 0.85 x 30 ms: 15.3 and 10.2 ms.
    assert config.step_itl_ms(lm) == pytest.approx(18.0) and config.step_itl_ms(sm) == pytest.approx(12.0)
    assert config.gang.policy.lm_shared_step_ms == pytest.approx(15.3)
    assert config.gang.policy.sm_shared_step_ms == pytest.approx(10.2)


def test_bench_rows_carry_the_gang_figures():
    import math

    from octoserve.services.lab import bench_suite as bs
    from octoserve.services.lab.baselines import BASELINES, configure

    gang = configure(BASELINES["octoserve-gang"], bs.load_node_config_text("node-gang.yaml"))
    static = configure(BASELINES["vllm-default"], load_node_config(None))
    w = bs.Workload("seed-000 tiny", "seed-000", 8.0, 4.0, 1.0)
    gang_row = bs.run_job(bs.Job("octoserve-gang", w, gang, 0, 5.0)).row
    static_row = bs.run_job(bs.Job("vllm-default", w, static, 0, 5.0)).row
    assert 0 < gang_row.gang_max_lm_wait_ms <= gang.gang.policy.max_lm_wait_ms + 1e-6
    assert 0 < gang_row.gang_max_sm_stall_ms <= gang.gang.policy.max_sm_stall_ms + 1e-6
    assert gang_row.gang_switches_per_s > 0
    assert math.isnan(static_row.gang_max_lm_wait_ms) and math.isnan(static_row.gang_switches_per_s)


def test_plan_lists_the_best_time_shared_candidate_with_its_rank(capsys):
    from octoserve.services.core import planner
    from octoserve.services.sim.cli_plan import _print_ranking
    from tests.test_planner import H100, MODELS as PLANNER_MODELS, SEED_000

    ranked = planner.rank_placements(planner.candidate_placements(H100, PLANNER_MODELS, 8), SEED_000)
    rank = next(i for i, (p, _) in enumerate(ranked) if p.config.gang is not None)
    assert rank >= 3
    _print_ranking(ranked, 3)
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 + 3 + 1
    assert lines[-1].endswith(f"{ranked[rank][0].label}  (rank {rank + 1} of {len(ranked)}: best time-shared)")
