"""Benchmark suite pieces: the SLO-aware upper bound (by hand and against the simulator), the capacity bracket and
bisection, the report sections, and one tiny end-to-end run through the same job path the suite uses."""

import dataclasses
import math

import pytest

from services import bench_suite as bs
from services.baselines import BASELINES, configure
from services.core import planner
from services.core.placement import node_config_from_dict
from services.core.types import Role


class ToyCost:
    """Step time = 10 ms + 0.1 ms per token; prefill at 10,000 tokens/s (the planner tests' toy)."""

    def step_time_s(self, chunks):
        return 0.010 + 0.0001 * sum(n for n, _ in chunks)

    def prefill_time_s(self, num_tokens, num_context_tokens=0):
        return num_tokens / 10_000

    def prefill_tokens_per_s(self, chunk_tokens):
        return 10_000.0


# --- the upper bound -----------------------------------------------------------------------------------------------


def test_operating_points_of_a_colocated_toy_lie_on_one_line():
    # 10 ms + 0.1 ms (B + C) <= 30 ms -> B + C = 200 tokens per 30 ms step: P + D = 6,666.7 tokens/s.
    hull = planner.operating_points(ToyCost(), Role.COLOCATED, 0.030, 1024, 8192)
    assert hull[0] == pytest.approx((0.0, 200 / 0.030)) and hull[-1] == pytest.approx((200 / 0.030, 0.0))
    assert all(p + d == pytest.approx(200 / 0.030) for p, d in hull)
    assert planner.operating_points(ToyCost(), Role.PREFILL, 0.030, 1, 8192) == [(10_000.0, 0.0)]
    decode = planner.operating_points(ToyCost(), Role.DECODE, 0.030, 1024, 8192)
    assert decode == [pytest.approx((0.0, 200 / 0.030))]


def test_servable_rate_keeps_the_cheapest_requests_first():
    sums = planner._prefix_sums([1000, 100])  # [0, 100, 1100]
    # 10 req/s offered, each sampled request stands for 5 req/s: all fit at 5,500 tokens/s.
    assert planner._servable_rps(sums, 10.0, 5500.0) == 10.0
    assert planner._servable_rps(sums, 10.0, 500.0) == pytest.approx(5.0)  # the short ones only
    assert planner._servable_rps(sums, 10.0, 3000.0) == pytest.approx(5.0 + 5.0 * (600 - 100) / 1000)


def test_best_point_on_the_boundary_is_the_exact_crossing():
    # Two request kinds, 10 req/s each: (100 prompt, 10 output) and (1000, 100), on P + D <= 6,666.7 tokens/s.
    # Serving all short ones costs 1,100; a fraction f of the long ones 11,000 f: f = 0.50606, 15.06 req/s.
    sp, sd = planner._prefix_sums([100, 1000]), planner._prefix_sums([10, 100])
    support = [(0.0, 200 / 0.030), (200 / 0.030, 0.0)]
    best = planner._best_on_boundary(support, lambda p, d: (planner._servable_rps(sp, 20.0, p),
                                                            planner._servable_rps(sd, 20.0, d)))
    assert best == pytest.approx(10 + 10 * (200 / 0.030 - 1100) / 11000, rel=1e-6)


def _one_sm_node(**policies):
    return node_config_from_dict({
        "models": ["llama-3-8b"],
        "instances": [{"id": "sm-0", "model": "llama-3-8b", "tp": 1, "gpu_ids": [0]}],
        "num_gpus": 1,
        "policies": policies,
    })


def test_upper_bound_is_above_the_old_mean_estimate_and_the_simulated_goodput():
    from services.sim.cli_plan import length_samples, mix_from_profile
    from services.workload import PROFILES, scaled

    node = _one_sm_node()
    profile = dataclasses.replace(PROFILES["seed-000"], traffic=PROFILES["seed-000"].traffic[:1])
    for rate in (20.0, 60.0):
        mix = mix_from_profile(profile, rate)
        upper = planner.slo_upper_bound(node, mix, length_samples(profile)).goodput_rps
        assert upper >= planner.slo_bound(node, mix).goodput_rps
        job = bs.Job("octoserve", bs.Workload("t", "seed-000", rate, 4.0), configure(BASELINES["octoserve"], node), 0, 10.0)
        # the suite's trace has both models; this node serves one: simulate its share of the trace only
        from services.sim.driver import run_simulation
        from services.workload import generate_trace

        trace = generate_trace(scaled(profile, rate_rps=rate, duration_s=6.0), 0)
        goodput = run_simulation(job.config, trace, seed=0, drain_s=10.0).summary.overall.goodput_rps
        assert goodput <= upper


# --- capacity search ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("points, expected", [
    ([(10, 0.99), (20, 0.95), (40, 0.5), (80, 0.1)], (20, 40)),
    ([(10, 0.5), (20, 0.95)], (0.0, 10)),  # the lowest point fails: search below it
    ([(10, 0.95), (20, 0.92)], (20, math.inf)),
    ([(40, 0.2), (10, 0.91), (20, 0.89)], (10, 20)),  # order does not matter
])
def test_capacity_bracket(points, expected):
    assert bs.capacity_bracket(points) == expected


def test_capacity_search_bisects_inside_the_bracket(monkeypatch):
    seen = []

    def fake_run_jobs(jobs, workers, on_done=None):
        out = []
        for job in jobs:
            seen.append((job.policy, job.workload.rate_rps))
            att = 1.0 if job.workload.rate_rps <= 27.0 else 0.0  # the true capacity is 27 req/s
            row = bs.Row(job.policy, job.workload.label, job.workload.rate_rps, 0.0, 0, 0, 1.0, att,
                         0, 0, 0, 0, 0, 0, 0)
            out.append(bs.JobResult((job.policy, job.workload.label), row))
        return out

    monkeypatch.setattr(bs, "run_jobs", fake_run_jobs)
    settings = bs.Settings(capacity_steps=3)
    out = bs.capacity_search(["a"], {"a": None}, {"a": [(10.0, 1.0), (40.0, 0.0)]}, settings, lambda _m: None)
    assert [r for _, r in seen] == [25.0, 32.5, 28.8]
    assert out["a"][:2] == (25.0, 28.8)


# --- the report --------------------------------------------------------------------------------------------------


def test_replace_section_keeps_other_sections():
    text = "# Title\n\n## Policy comparison (simulator)\n\nold\n\n## Someone else's\n\ntheirs\n"
    out = bs.replace_section(text, bs.SECTION_POLICY, "new body")
    assert out == "# Title\n\n## Policy comparison (simulator)\n\nnew body\n\n## Someone else's\n\ntheirs\n"
    assert bs.replace_section("# T\n", "## X", "b") == "# T\n\n## X\n\nb\n"


def _row(policy="octoserve", workload="w", goodput=10.0, **kw):
    base = dict(offered_rps=20.0, roofline_rps=20.0, slo_bound_rps=16.0, attainment_admitted=0.96,
                attainment_offered=0.5, ttft_p95_ms=120.4, itl_p95_ms=24.26, refused_fraction=0.4,
                num_preemptions=3, kv_utilisation=0.123, gpu_busy=0.9, num_errors=0)
    return bs.Row(policy, workload, goodput_rps=goodput, **{**base, **kw})


def test_table_row_formats_every_column():
    assert bs.table_row(_row()) == ("| octoserve | w | 20.0 | 10.0 | 0.50 | 0.62 | 96.0 | 50.0 | 120 | 24.3 | 40.0 | 3 "
                                    "| 12.3 | 90.0 |")
    assert bs.table_row(_row(slo_bound_rps=0.0)).split(" | ")[5] == "-"


def test_headline_ratios():
    rows = (_row("octoserve", "seed-000 peak 300", goodput=40.0, attainment_admitted=0.97),)
    results = bs.SuiteResults({}, {}, 119.0, (), rows, {}, {"octoserve": (50.0, 55.0, []),
                              "vllm-default": (20.0, 25.0, []), "sarathi": (30.0, 35.0, []),
                              "distserve": (10.0, 12.0, [])}, 0.0)
    h = bs.headline(results)
    assert h["octoserve_over_vllm"] == 2.5 and h["best_other"] == "sarathi"
    assert h["octoserve_over_best_other"] == pytest.approx(50 / 30)
    assert h["peak_over_capacity"] == 0.8 and h["peak_admitted_attainment"] == 0.97


def test_gpu_weighted_averages_the_windowed_instance_figures_by_gpus():
    from services.sim.driver import InstanceStats

    stats = [InstanceStats("a", "m", "colocated", 10, 0.75, 0, kv_mean=0.5),
             InstanceStats("b", "m", "colocated", 10, 0.2, 0)]
    assert bs._gpu_weighted(stats, "busy_fraction", {"a": 4, "b": 1}) == pytest.approx((4 * 0.75 + 0.2) / 5)
    assert bs._gpu_weighted(stats, "kv_mean", {"a": 4, "b": 1}) == pytest.approx(4 * 0.5 / 5)


# --- one tiny run through the job path -------------------------------------------------------------------------


def test_run_job_and_run_jobs_are_deterministic_and_worker_count_free():
    node = _one_sm_node()
    w = bs.Workload("tiny", "seed-000", 10.0, 2.0)
    jobs = [bs.Job(p, w, configure(BASELINES[p], node), 0, 5.0) for p in ("octoserve", "octoserve-no-refusal")]
    one = bs.run_jobs(jobs, workers=1)
    two = bs.run_jobs(jobs, workers=2)
    assert [repr(r.row) for r in one] == [repr(r.row) for r in two]  # repr: NaN bounds compare equal
    row = one[0].row
    assert row.policy == "octoserve" and row.workload == "tiny" and math.isnan(row.roofline_rps)
    assert 0 <= row.attainment_offered <= 1 and 0 < row.gpu_busy <= 1
