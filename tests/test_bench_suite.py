"""Benchmark suite pieces: the SLO-aware upper bound (by hand and against the simulator), the capacity bracket and
bisection, the report sections, and one tiny end-to-end run through the same job path the suite uses."""

import dataclasses
import math

import pytest

from octoserve.services.lab import bench_report as br
from octoserve.services.lab import bench_suite as bs
from octoserve.services.lab.baselines import BASELINES, configure
from octoserve.services.core import planner
from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.core.types import Role
from octoserve.services.metrics import SloSpec
from octoserve.services.sim.capacity import CapacitySearch, Probe, bisect_capacity, passes, start_search


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
    from octoserve.services.sim.cli_plan import length_samples, mix_from_profile
    from octoserve.services.workload import PROFILES, scaled

    node = _one_sm_node()
    profile = dataclasses.replace(PROFILES["seed-000"], traffic=PROFILES["seed-000"].traffic[:1])
    for rate in (20.0, 60.0):
        mix = mix_from_profile(profile, rate)
        upper = planner.slo_upper_bound(node, mix, length_samples(profile)).goodput_rps
        assert upper >= planner.slo_bound(node, mix).goodput_rps
        job = bs.Job("octoserve", bs.Workload("t", "seed-000", rate, 4.0), configure(BASELINES["octoserve"], node), 0, 10.0)
        # the suite's trace has both models; this node serves one: simulate its share of the trace only
        from octoserve.services.sim.driver import run_simulation
        from octoserve.services.workload import generate_trace

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


def _fake_step(true_capacity_by_seed):
    """A run_step whose seed s passes at a rate iff rate <= true_capacity_by_seed[s]; attainment 1 or 0.5."""
    asked = []

    def run_step(asks):
        asked.append(list(asks))
        return {(key, rate): Probe(rate, tuple(rate <= c for c in true_capacity_by_seed),
                                   tuple(1.0 if rate <= c else 0.5 for c in true_capacity_by_seed))
                for key, rate in asks}

    return run_step, asked


def test_multi_seed_bisection_brackets_by_majority_and_reports_the_spread():
    # Seeds pass up to 20, 27 and 30 req/s: the majority passes up to 27.
    run_step, asked = _fake_step((20.0, 27.0, 30.0))
    out = bisect_capacity({"a": start_search([(10.0, True), (40.0, False)])}, run_step, steps=3)
    assert [[r for _, r in step] for step in asked] == [[25.0], [32.5], [28.8]]
    s = out["a"]
    assert (s.lo, s.hi, s.capacity_rps) == (25.0, 28.8, 25.0)
    assert [p.passed for p in s.probes] == [(False, True, True), (False, False, False), (False, False, True)]
    assert s.per_seed_capacity() == (10.0, 25.0, 28.8)  # seed 0 fails the first probe: the bracket's floor
    assert s.spread() == (10.0, 25.0, 28.8)
    assert s.probes[0].attainment_spread == (0.5, pytest.approx(2.5 / 3), 1.0)


def test_bisection_runs_every_search_in_one_step_and_stops_when_narrow():
    run_step, asked = _fake_step((5.0,))
    out = bisect_capacity({"a": start_search([], 8.0), "b": start_search([(1.0, True), (2.0, False)])}, run_step, 4)
    assert asked[0] == [("a", 4.0), ("b", 1.5)]  # both policies' probes of a step go out together
    assert [len(step) for step in asked] == [2, 1, 1, 1]  # b's bracket is under 1 req/s after one probe
    assert [r for step in asked[1:] for _, r in step] == [6.0, 5.0, 5.5]
    assert (out["a"].lo, out["a"].hi) == (5.0, 5.5) and (out["b"].lo, out["b"].hi) == (1.5, 2.0)
    assert start_search([(10.0, True), (20.0, True)]).next_rate() is None  # nothing failed: no bracket


class _Lat:
    def __init__(self, p95_ms):
        self.p95_ms = p95_ms


class _Group:
    def __init__(self, attainment_offered, ttft_p95_ms, itl_p95_ms):
        self.attainment_offered, self.ttft, self.itl = attainment_offered, _Lat(ttft_p95_ms), _Lat(itl_p95_ms)


@pytest.mark.parametrize("attainment, fleet_ok, expected", [
    (0.90, True, True),
    (0.899, True, False),  # DistServe's per-request goodput short of 90 % of offered
    (0.95, False, False),  # the seed's fleet SLO (P95s) must hold as well
])
def test_capacity_criterion_needs_both_slo_definitions(attainment, fleet_ok, expected):
    g = _Group(attainment, 100.0, 10.0)
    g.fleet_slo_met = fleet_ok
    assert passes(g, SloSpec(ttft_ms=250.0, itl_ms=30.0)) is expected


# --- the report --------------------------------------------------------------------------------------------------


def test_replace_section_keeps_other_sections():
    from octoserve.services.report_sections import replace_section

    text = "# Title\n\n## Policy comparison (simulator)\n\nold\n\n## Someone else's\n\ntheirs\n"
    out = replace_section(text, br.SECTION_POLICY, "new body")
    assert out == "# Title\n\n## Policy comparison (simulator)\n\nnew body\n\n## Someone else's\n\ntheirs\n"
    assert replace_section("# T\n", "## X", "b") == "# T\n\n## X\n\nb\n"


def _row(policy="octoserve", workload="w", goodput=10.0, **kw):
    base = dict(offered_rps=20.0, roofline_rps=20.0, slo_estimate_rps=16.0, attainment_admitted=0.96,
                attainment_offered=0.5, ttft_p95_ms=120.4, itl_p95_ms=24.26, refused_fraction=0.4,
                num_preemptions=3, kv_utilisation=0.123, gpu_busy=0.9, num_errors=0)
    return bs.Row(policy, workload, goodput_rps=goodput, **{**base, **kw})


def test_table_row_formats_every_column():
    assert br.table_row(_row()) == ("| octoserve | w | 20.0 | 10.0 | 0.50 | 0.62 | 96.0 | 50.0 | 120 | 24.3 | 40.0 | 3 "
                                    "| 12.3 | 90.0 |")
    assert br.table_row(_row(slo_estimate_rps=0.0)).split(" | ")[5] == "-"


def _profile(rows, capacity, name="default", per_model=None):
    placements = {bs.STATIC_SPLIT: ("static", _one_sm_node())}  # read for policies.batch_min_share
    return bs.ProfileResults(name, placements, None, 119.0, (), tuple(rows), {}, capacity, {}, per_model or {})


def _groups(**by_name):
    return tuple(bs.GroupRow(n, g, a, a, 100.0, 20.0) for n, (g, a) in by_name.items())


def test_headline_and_targets_read_the_run():
    rows = [_row("octoserve", "seed-000 peak 300", goodput=98.0,
                 groups=_groups(**{"llama-3-70b": (20.0, 0.97), "llama-3-8b": (78.0, 0.99)})),
            _row("octoserve", "seed-000 0.25x roofline", goodput=25.0,
                 groups=_groups(**{"llama-3-70b": (5.0, 0.93), "llama-3-8b": (20.0, 0.99)})),
            _row("octoserve", "seed-003 625 req/s", goodput=200.0,
                 groups=_groups(**{"llama-3-8b": (180.0, 0.96), "INTERACTIVE": (170.0, 0.96), "BATCH": (30.0, 0.9)}))]
    capacity = {"octoserve": CapacitySearch(25.0, 28.8), "vllm-default": CapacitySearch(10.0, 12.0)}
    per_model = {"octoserve": CapacitySearch(8.0, 12.0), "vllm-default": CapacitySearch(4.0, 6.0),
                 "sarathi": CapacitySearch(6.0, 8.0), "octoserve-gang": CapacitySearch(20.0, 24.0)}
    h = br.headline(_profile(rows, capacity, per_model=per_model))
    assert h["capacity_per_model_rps"]["octoserve"] == 8.0
    assert h["best_baseline_per_model"] == (6.0, "sarathi")  # the best of the baselines; octoserve arms are not
    assert h["octoserve_over_best_per_model"] == pytest.approx(8.0 / 6.0)
    assert h["octoserve_over_vllm"] == 2.5 and h["peak_goodput_rps"] == 98.0
    assert h["peak_admitted_by_model"] == {"llama-3-70b": 0.97, "llama-3-8b": 0.99}
    assert h["worst_model_admitted"] == (0.93, "llama-3-70b", "seed-000 0.25x roofline")
    assert h["seed003_interactive_share"] == 0.85 and h["seed003_batch_share"] == 0.15
    verdicts = [(round(v, 3), th, v >= th) for _, v, th, _ in br.targets(_profile(rows, capacity, per_model=per_model))]
    assert verdicts == [(1.333, 1.5, False), (0.93, 0.95, False), (0.85, 0.8, True), (0.96, 0.95, True),
                        (0.15, 0.1, True), (98.0, 97.0, True), (2.5, 2.0, True)]
    pessimistic = br.targets(_profile(rows, capacity, "pessimistic", per_model))[0]
    assert pessimistic[0].endswith("(here sarathi: 8.0 vs 6.0 req/s)") and pessimistic[2] == 1.01  # strictly above
    zero = {"octoserve": CapacitySearch(0.0, 1.0), "vllm-default": CapacitySearch(0.0, 1.0)}
    assert br.targets(_profile(rows, capacity, "pessimistic", zero))[0][1:3] == (1.0, 1.01)  # equal: not above
    assert math.isnan(br.targets(_profile(rows, capacity))[0][1])  # no per-model search: not run


def test_per_model_probe_passes_only_when_every_model_passes_and_reports_the_worst_model():
    rows = [_row(passes=True, passes_per_model=False, attainment_offered=0.93,
                 groups=_groups(**{"llama-3-70b": (2.0, 0.62), "llama-3-8b": (60.0, 0.97), "STANDARD": (62.0, 0.93)})),
            _row(passes=True, passes_per_model=True, attainment_offered=0.95,
                 groups=_groups(**{"llama-3-70b": (3.0, 0.91), "llama-3-8b": (60.0, 0.96), "STANDARD": (63.0, 0.95)}))]
    assert bs._probe(8.0, rows, per_model=False) == Probe(8.0, (True, True), (0.93, 0.95))
    assert bs._probe(8.0, rows, per_model=True) == Probe(8.0, (False, True), (0.62, 0.91))  # tiers are not models


def test_pooled_and_per_model_asks_for_one_rate_share_their_runs(monkeypatch):
    ran = []

    def fake_run_logged(jobs, settings, label, log, progress_cls=None):
        ran.extend((j.policy, j.workload.rate_rps, j.seed) for j in jobs)
        row = _row(passes=True, passes_per_model=False, groups=_groups(**{"llama-3-70b": (1.0, 0.5)}))
        return [bs.JobResult(("default", j.policy, j.workload.label, j.seed), row) for j in jobs]

    monkeypatch.setattr(bs, "run_logged", fake_run_logged)
    node = _one_sm_node()
    configs = {"octoserve": node, ("octoserve", bs.PER_MODEL): node}
    window = bs.Workload("capacity probe", "seed-000", 0.0, 2.0)
    step = bs.capacity_run_step(configs, bs.Settings(), "default", [0, 1], window, lambda _m: None)
    out = step([("octoserve", 4.0), (("octoserve", bs.PER_MODEL), 4.0), (("octoserve", bs.PER_MODEL), 2.0)])
    assert ran == [("octoserve", 4.0, 0), ("octoserve", 4.0, 1), ("octoserve", 2.0, 0), ("octoserve", 2.0, 1)]
    assert out[("octoserve", 4.0)].passed == (True, True)
    assert out[(("octoserve", bs.PER_MODEL), 4.0)] == Probe(4.0, (False, False), (0.5, 0.5))


def test_quick_mode_stamps_every_table_and_full_mode_none():
    rows = [_row("octoserve", "seed-000 peak 300")]
    choice = bs.PlacementChoice({"p": (0.0, 90.0)}, {"p": (0.0, 0.0, 0.0)}, "p", "p")
    results = bs.SuiteResults({c: dataclasses.replace(_profile(rows, {"octoserve": CapacitySearch(0.0, 5.0)}, c),
                                                      choice=choice) for c in bs.COST_PROFILES}, 60.0)
    quick = br.policy_section(results, bs.quick_settings(policies=("octoserve",)))
    lines = quick.splitlines()
    tables = [i for i, line in enumerate(lines) if line.startswith("|") and not lines[i - 1].startswith("|")]
    assert len(tables) == 10  # targets, figures; per cost profile: placements, capacity, per group, every run
    for i in tables:  # the banner sits between each table's heading and the table
        heading = max(j for j in range(i) if lines[j].startswith("#"))
        assert sum(bs.QUICK_BANNER in line for line in lines[heading:i]) == 1, lines[heading]
    assert lines[0] == f"**{bs.QUICK_BANNER}**"
    full = br.policy_section(results, bs.Settings(policies=("octoserve",)))
    assert bs.QUICK_BANNER not in full and "/ SLO-aware est." in full and "SLO bound" not in full


def test_gpu_weighted_averages_the_windowed_instance_figures_by_gpus():
    from octoserve.services.sim.driver import InstanceStats

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
    assert one[0].job_key == ("default", "octoserve", "tiny", 0)
    assert [g.name for g in row.groups] == ["llama-3-70b", "llama-3-8b", "STANDARD"]  # the 70B: no instance
    assert 0 <= row.attainment_offered <= 1 and 0 < row.gpu_busy <= 1
