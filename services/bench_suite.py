"""`octoserve bench-suite`: the policy-comparison matrix in the simulator, written into BENCHMARKS.md and PNGs.

Steps, all in the discrete-event simulator (`services.sim.driver.run_simulation`), deterministic for a seed:
1. Placements: the static split (the embedded default config), the planner's best fully disaggregated placement
   (DistServe's), and the planner's recommendation for octoserve: its top analytic candidates simulated at the
   seed-000 peak under octoserve's policies, the best simulated goodput taken.
2. The matrix: every policy of `services.baselines.BASELINES` on seed-000 at 0.25 / 0.5 / 1.0 / 1.5 x the roofline
   capacity and at the 300 req/s peak, a bursty variant (gamma, burstiness 0.25, at 1.0 x roofline) and seed-003
   (a reduced window: its long prompts make it the slowest to simulate).
3. SLO capacity (DistServe's comparison): per policy, the highest seed-000 rate at which >= 90 % of OFFERED
   requests meet both SLOs (refused = miss), bracketed by the matrix's seed-000 points and refined by bisection.
4. Report: tables, headline ratios against the targets, and plots under docs/bench/.

Every matrix run and capacity probe is an independent job (config + trace parameters), so they run in a process
pool and the results do not depend on the number of workers. Goodput is the DistServe definition of
services/metrics.py over the arrival window; requests still running `drain_s` after the last arrival count as
misses.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import multiprocessing
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.baselines import (
    BASELINES,
    BEST_DISAGGREGATED,
    MAIN_POLICIES,
    PLANNER,
    STATIC_SPLIT,
    configure,
    describe_instances,
)
from services.core import planner
from services.core.placement import NodeConfig
from services.core.types import Role

PEAK_RPS = 300.0
ROOFLINE_FRACTIONS = (0.25, 0.5, 1.0, 1.5)
CAPACITY_ATTAINMENT = 0.9  # of offered requests meeting both SLOs
BURSTINESS = 0.25
SECTION_POLICY = "## Policy comparison (simulator)"
SECTION_CALIBRATION = "## Cost model calibration"


@dataclass(frozen=True, slots=True)
class Settings:
    duration_s: float = 10.0  # arrival window of each seed-000 run
    drain_s: float = 15.0
    seed003_duration_s: float = 2.0
    seed003_rate_rps: float | None = None  # None: the profile's 625 req/s
    capacity_steps: int = 4  # bisection steps inside the bracket
    planner_top: int = 2  # analytic candidates simulated to pick octoserve's placement
    seed: int = 0
    workers: int = 2
    policies: tuple[str, ...] = tuple(BASELINES)


@dataclass(frozen=True, slots=True)
class Workload:
    label: str
    profile: str
    rate_rps: float
    duration_s: float
    burstiness: float | None = None  # None: Poisson
    keep_records: bool = False  # the plots need the per-request records of this run


@dataclass(frozen=True, slots=True)
class Job:
    policy: str
    workload: Workload
    config: NodeConfig
    seed: int
    drain_s: float


@dataclass(frozen=True, slots=True)
class Row:
    """One table row: a policy on a workload."""

    policy: str
    workload: str
    offered_rps: float
    goodput_rps: float
    roofline_rps: float  # the compute roofline bound at this offered load: min(offered, capacity)
    slo_bound_rps: float  # the planner's SLO-aware bound at this offered load (best placement)
    attainment_admitted: float
    attainment_offered: float
    ttft_p95_ms: float
    itl_p95_ms: float
    refused_fraction: float
    num_preemptions: int
    kv_utilisation: float  # mean over instances and samples in the measurement window (after the warm-up)
    gpu_busy: float  # GPU-weighted mean busy fraction in the measurement window
    num_errors: int  # admitted but unfinished when the run stopped

    @property
    def goodput_over_roofline(self) -> float:
        return self.goodput_rps / self.roofline_rps if self.roofline_rps > 0 else math.nan

    @property
    def goodput_over_slo_bound(self) -> float:
        return self.goodput_rps / self.slo_bound_rps if self.slo_bound_rps > 0 else math.nan


@dataclass(frozen=True, slots=True)
class JobResult:
    job_key: tuple[str, str]
    row: Row
    records: tuple = ()
    wall_s: float = 0.0


# --- traces and runs (process-pool workers) ---------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _trace(profile_name: str, rate_rps: float, duration_s: float, burstiness: float | None, seed: int):
    from services.workload import PROFILES, generate_trace, scaled

    profile = scaled(PROFILES[profile_name], rate_rps=rate_rps, duration_s=duration_s, burstiness=burstiness)
    return tuple(generate_trace(profile, seed))


def _gpu_weighted(instances, field: str, weights: dict[str, int]) -> float:
    """A per-instance figure of the measurement window (`InstanceStats`), averaged with GPU-count weights."""
    total = sum(weights.get(s.instance_id, 1) * getattr(s, field) for s in instances)
    weight = sum(weights.get(s.instance_id, 1) for s in instances)
    return total / weight if weight else math.nan


def run_job(job: Job) -> JobResult:
    """Simulate one (policy, workload) pair and reduce it to a table row (bounds are filled in by the parent)."""
    from services.sim.driver import run_simulation

    w = job.workload
    trace = _trace(w.profile, w.rate_rps, w.duration_s, w.burstiness, job.seed)
    res = run_simulation(job.config, trace, seed=job.seed, drain_s=job.drain_s)
    o = res.summary.overall
    gpus = {i.id: i.tp for i in job.config.instances}
    window_s = max(res.summary.duration_s, 1.0)
    row = Row(
        policy=job.policy, workload=w.label, offered_rps=o.num_offered / window_s, goodput_rps=o.goodput_rps,
        roofline_rps=math.nan, slo_bound_rps=math.nan, attainment_admitted=o.attainment_admitted,
        attainment_offered=o.attainment_offered, ttft_p95_ms=o.ttft.p95_ms, itl_p95_ms=o.itl.p95_ms,
        refused_fraction=o.refused_fraction, num_preemptions=o.num_preemptions,
        kv_utilisation=_gpu_weighted(res.instances, "kv_mean", gpus),
        gpu_busy=_gpu_weighted(res.instances, "busy_fraction", gpus), num_errors=o.num_errors,
    )
    return JobResult((job.policy, w.label), row, res.records if w.keep_records else (), res.wall_s)


def run_jobs(jobs: Sequence[Job], workers: int, on_done: Callable[[JobResult], None] | None = None) -> list[JobResult]:
    """Results in job order; `workers` <= 1 runs in this process (tests, debugging)."""
    if workers <= 1 or len(jobs) <= 1:
        out = []
        for job in jobs:
            out.append(run_job(job))
            if on_done:
                on_done(out[-1])
        return out
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(min(workers, len(jobs)), maxtasksperchild=8) as pool:
        out = []
        for result in pool.imap(run_job, jobs):
            out.append(result)
            if on_done:
                on_done(result)
    return out


# --- placements ------------------------------------------------------------------------------------------------


def seed000_mix(rate_rps: float) -> planner.WorkloadMix:
    from services.sim.cli_plan import mix_from_profile
    from services.workload import PROFILES

    return mix_from_profile(PROFILES["seed-000"], rate_rps)


def roofline_capacity_rps(node: NodeConfig) -> float:
    return planner.roofline_bound(node.models, node.gpu, node.num_gpus, seed000_mix(PEAK_RPS)).capacity_rps


def ranked_placements(node: NodeConfig, rate_rps: float = PEAK_RPS):
    candidates = planner.candidate_placements(node.gpu, node.models, node.num_gpus, slo=node.slo)
    return planner.rank_placements(candidates, seed000_mix(rate_rps))


def _fully_disaggregated(config: NodeConfig) -> bool:
    """Every model split into prefill and decode instances, each able to hold one max-context sequence: a
    placement where a model barely fits (70B at TP=2: ~32k tokens of KV) is one DistServe's search rejects, and
    without admission control a request larger than an instance's pool cannot be served at all."""
    if not all(config.is_disaggregated(m) for m in config.models):
        return False
    return all(config.num_kv_blocks_for(i) * i.block_size >= config.max_context_len(i.model) for i in config.instances)


def _fit_prefill_budgets(config: NodeConfig) -> NodeConfig:
    """Halve a prefill instance's chunk budget (8192 -> 4096 -> 2048) until a max-context prompt fits its KV:
    the activation reserve of a large chunk is what leaves a TP=2 70B prefill instance too little KV."""
    insts = []
    for inst in config.instances:
        while (inst.role is Role.PREFILL and inst.max_num_batched_tokens > 2048
               and config.num_kv_blocks_for(inst) * inst.block_size < config.max_context_len(inst.model)):
            inst = dataclasses.replace(inst, max_num_batched_tokens=inst.max_num_batched_tokens // 2)
        insts.append(inst)
    return dataclasses.replace(config, instances=tuple(insts))


def best_disaggregated(ranked) -> tuple:
    """The highest-ranked placement with every model disaggregated, prefill budgets fitted, that passes
    `_fully_disaggregated`; re-ranked by the SLO bound after the budget change."""
    mix = seed000_mix(PEAK_RPS)
    fitted = []
    for p, _ in ranked:
        if all(p.config.is_disaggregated(m) for m in p.config.models):
            cfg = _fit_prefill_budgets(p.config)
            if _fully_disaggregated(cfg):
                fitted.append((dataclasses.replace(p, config=cfg), planner.slo_bound(cfg, mix)))
    return max(fitted, key=lambda ps: (ps[1].goodput_rps, ps[0].label))


def resolve_placements(settings: Settings, log: Callable[[str], None]) -> dict[str, tuple[str, NodeConfig]]:
    """Placement kind -> (label, config). PLANNER simulates the top analytic candidates under octoserve."""
    from services.config import load_node_config

    static = load_node_config(None)
    ranked = ranked_placements(static)
    disagg = best_disaggregated(ranked)
    top = ranked[: settings.planner_top]
    log(f"placement search: simulating the planner's top {len(top)} at {PEAK_RPS:g} req/s for {settings.duration_s:g} s")
    peak = Workload("placement search", "seed-000", PEAK_RPS, settings.duration_s)
    jobs = [Job(p.label, peak, configure(BASELINES["octoserve"], p.config), settings.seed, settings.drain_s)
            for p, _ in top]
    results = run_jobs(jobs, settings.workers)
    best = max(zip(top, results), key=lambda pr: (pr[1].row.goodput_rps, pr[0][0].label))
    for (p, sb), r in zip(top, results):
        log(f"  {r.row.goodput_rps:6.1f} req/s (SLO bound {sb.goodput_rps:.1f})  {p.label}")
    return {
        STATIC_SPLIT: ("default config: " + _label_of(static), static),
        BEST_DISAGGREGATED: (disagg[0].label, disagg[0].config),
        PLANNER: (best[0][0].label, best[0][0].config),
    }


def _label_of(config: NodeConfig) -> str:
    parts = []
    for model in sorted(config.models, key=lambda m: -config.models[m].num_params):
        insts = config.instances_of(model)
        roles = {i.role for i in insts}
        tp = insts[0].tp
        if Role.PREFILL in roles:
            parts.append(f"{model} TP{tp} {len(config.instances_of(model, (Role.PREFILL,)))}P+"
                         f"{len(config.instances_of(model, (Role.DECODE,)))}D")
        else:
            parts.append(f"{model} TP{tp} x{len(insts)} colocated")
    return " | ".join(parts)


# --- the matrix and the capacity search --------------------------------------------------------------------------


def workloads(settings: Settings, roofline_rps: float) -> list[Workload]:
    out = [Workload(f"seed-000 {f:g}x roofline", "seed-000", round(f * roofline_rps, 1), settings.duration_s)
           for f in ROOFLINE_FRACTIONS]
    out.append(Workload("seed-000 peak 300", "seed-000", PEAK_RPS, settings.duration_s, keep_records=True))
    out.append(Workload(f"seed-000 bursty 1x roofline", "seed-000", round(roofline_rps, 1), settings.duration_s,
                        burstiness=BURSTINESS, keep_records=True))
    from services.workload import PROFILES

    rate = settings.seed003_rate_rps or PROFILES["seed-003"].rate_rps
    out.append(Workload(f"seed-003 {rate:g} req/s", "seed-003", rate, settings.seed003_duration_s))
    return out


def capacity_bracket(points: Iterable[tuple[float, float]], threshold: float = CAPACITY_ATTAINMENT) -> tuple[float, float]:
    """(lo, hi) from (rate, attainment of offered) points: lo the highest rate that passes with every lower point
    passing too, hi the lowest failing rate above it (inf when none fails). lo is 0 when the lowest point fails."""
    lo, hi = 0.0, math.inf
    for rate, attainment in sorted(points):
        if attainment >= threshold and hi == math.inf:
            lo = rate
        elif attainment < threshold:
            hi = min(hi, rate)
            break
    return lo, hi


def capacity_search(policies: Sequence[str], configs: dict[str, NodeConfig], points: dict[str, list[tuple[float, float]]],
                    settings: Settings, log: Callable[[str], None]) -> dict[str, tuple[float, float, list]]:
    """policy -> (capacity lo, hi, probes): bisection on the rate inside each policy's bracket, all policies' probes
    of one step run together in the pool."""
    brackets = {p: capacity_bracket(points[p]) for p in policies}
    probes: dict[str, list] = {p: [] for p in policies}
    for step in range(settings.capacity_steps):
        jobs = []
        for p in policies:
            lo, hi = brackets[p]
            if math.isinf(hi) or hi - lo < 1.0:
                continue
            mid = round((lo + hi) / 2.0, 1)
            w = Workload(f"capacity probe {mid:g}", "seed-000", mid, settings.duration_s)
            jobs.append(Job(p, w, configs[p], settings.seed, settings.drain_s))
        if not jobs:
            break
        log(f"capacity search step {step + 1}/{settings.capacity_steps}: {len(jobs)} probes")
        for job, result in zip(jobs, run_jobs(jobs, settings.workers)):
            rate, att = job.workload.rate_rps, result.row.attainment_offered
            probes[job.policy].append((rate, att, result.row.goodput_rps))
            lo, hi = brackets[job.policy]
            brackets[job.policy] = (rate, hi) if att >= CAPACITY_ATTAINMENT else (lo, rate)
    return {p: (*brackets[p], probes[p]) for p in policies}


# --- bounds --------------------------------------------------------------------------------------------------------


def slo_bound_rps(node: NodeConfig, profile_name: str, rate_rps: float, cache: dict) -> float:
    """The planner's SLO-aware upper bound of goodput at `rate_rps` (`planner.slo_upper_bound`), maximised over
    its candidate placements: what the best scheduler on the best placement could serve under the cost model."""
    from services.sim.cli_plan import length_samples, mix_from_profile
    from services.workload import PROFILES

    profile = PROFILES[profile_name]
    slo = dataclasses.replace(node.slo, ttft_ms=profile.slo.ttft_ms, itl_ms=profile.slo.itl_ms)
    mix = mix_from_profile(profile, rate_rps)
    key = ("placements", profile_name)
    if key not in cache:
        cache[key] = (planner.candidate_placements(node.gpu, node.models, node.num_gpus, slo=slo),
                      length_samples(profile))
    candidates, samples = cache[key]
    return max((planner.slo_upper_bound(p.config, mix, samples, cache).goodput_rps for p in candidates),
               default=math.nan)


def roofline_rps_at(node: NodeConfig, profile_name: str, rate_rps: float) -> float:
    from services.sim.cli_plan import mix_from_profile
    from services.workload import PROFILES

    mix = mix_from_profile(PROFILES[profile_name], rate_rps)
    cap = planner.roofline_bound(node.models, node.gpu, node.num_gpus, mix).capacity_rps
    return min(rate_rps, cap)


def with_bounds(row: Row, workload: Workload, node: NodeConfig, cache: dict) -> Row:
    return dataclasses.replace(
        row,
        roofline_rps=roofline_rps_at(node, workload.profile, row.offered_rps),
        slo_bound_rps=slo_bound_rps(node, workload.profile, row.offered_rps, cache),
    )


# --- report ------------------------------------------------------------------------------------------------------


def _f(x: float, digits: int = 1, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{100 * x:.{digits}f}" if pct else f"{x:.{digits}f}"


TABLE_HEADER = (
    "| policy | workload | offered req/s | goodput req/s | / roofline | / SLO bound | attained (admitted) % "
    "| attained (offered) % | TTFT P95 ms | ITL P95 ms | refused % | preemptions | KV util % | GPU busy % |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def table_row(r: Row) -> str:
    return (f"| {r.policy} | {r.workload} | {r.offered_rps:.1f} | {r.goodput_rps:.1f} | {_f(r.goodput_over_roofline, 2)} "
            f"| {_f(r.goodput_over_slo_bound, 2)} | {_f(r.attainment_admitted, 1, True)} "
            f"| {_f(r.attainment_offered, 1, True)} | {_f(r.ttft_p95_ms, 0)} | {_f(r.itl_p95_ms, 1)} "
            f"| {_f(r.refused_fraction, 1, True)} | {r.num_preemptions} | {_f(r.kv_utilisation, 1, True)} "
            f"| {_f(r.gpu_busy, 1, True)} |")


def replace_section(text: str, heading: str, body: str) -> str:
    """`text` with the section under `heading` (up to the next '## ' heading) replaced by `body`, or appended."""
    lines = text.splitlines()
    new = [heading, "", *body.strip("\n").splitlines(), ""]
    if heading not in lines:
        return "\n".join([*lines, "", *new]).strip("\n") + "\n"
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join([*lines[:start], *new, *lines[end:]]).rstrip("\n") + "\n"


# --- the command ---------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Settings()
    parser.add_argument("--duration", type=float, default=d.duration_s, help="arrival window of each seed-000 run (s)")
    parser.add_argument("--drain", type=float, default=d.drain_s, help="virtual seconds after the last arrival")
    parser.add_argument("--seed003-duration", type=float, default=d.seed003_duration_s)
    parser.add_argument("--seed003-rate", type=float, default=None)
    parser.add_argument("--capacity-steps", type=int, default=d.capacity_steps)
    parser.add_argument("--planner-top", type=int, default=d.planner_top)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--workers", type=int, default=d.workers, help="processes (default 2)")
    parser.add_argument("--policies", default=",".join(BASELINES), help="comma-separated subset of the policies")
    parser.add_argument("--output", default="BENCHMARKS.md", help="markdown file whose sections are (re)written")
    parser.add_argument("--plots", default="docs/bench", help="directory for the PNGs and results.json")
    parser.add_argument("--pickle", help="also save the raw results here (to re-render the report)")
    parser.add_argument("--render", help="re-render the report from a --pickle file instead of simulating")


def run(args: argparse.Namespace) -> int:
    from services.progress import Progress

    policies = tuple(p for p in args.policies.split(",") if p)
    unknown = [p for p in policies if p not in BASELINES]
    if unknown:
        print(f"unknown policies {unknown}; choose from: {', '.join(BASELINES)}", file=sys.stderr)
        return 2
    settings = Settings(args.duration, args.drain, args.seed003_duration, args.seed003_rate, args.capacity_steps,
                        args.planner_top, args.seed, args.workers, policies)
    log = functools.partial(print, file=sys.stderr, flush=True)
    if args.render:
        import pickle

        results, settings = pickle.loads(Path(args.render).read_bytes())
        results = rebound(results)
        write_report(results, settings, Path(args.output), Path(args.plots))
        return 0
    results = run_suite(settings, log, Progress)
    write_report(results, settings, Path(args.output), Path(args.plots))
    if args.pickle:
        import pickle

        Path(args.pickle).write_bytes(pickle.dumps((results, settings)))
    log(f"wrote {args.output} and plots under {args.plots}")
    return 0


@dataclass(frozen=True, slots=True)
class SuiteResults:
    placements: dict  # kind -> (label, config)
    policy_configs: dict  # policy -> NodeConfig
    roofline_rps: float
    workloads: tuple
    rows: tuple  # Row, in matrix order
    records: dict  # (policy, workload label) -> records (peak and bursty runs)
    capacity: dict  # policy -> (lo, hi, probes)
    wall_s: float


def rebound(results: "SuiteResults") -> "SuiteResults":
    """The same results with both bounds recomputed (after a change to the planner)."""
    cache: dict = {}
    by_label = {w.label: w for w in results.workloads}
    static = results.placements[STATIC_SPLIT][1]
    rows = tuple(with_bounds(r, by_label[r.workload], static, cache) for r in results.rows)
    return dataclasses.replace(results, rows=rows)


def run_suite(settings: Settings, log: Callable[[str], None], progress_cls) -> SuiteResults:
    import time

    start = time.perf_counter()
    placements = resolve_placements(settings, log)
    static = placements[STATIC_SPLIT][1]
    configs = {p: configure(BASELINES[p], placements[BASELINES[p].placement][1]) for p in settings.policies}
    for p in settings.policies:
        log(f"{p}: {placements[BASELINES[p].placement][0]} [{describe_instances(configs[p])}]")
    roofline = roofline_capacity_rps(static)
    loads = workloads(settings, roofline)
    # Ablations run where they answer a question: the seed-000 load points (capacity) and the peak.
    jobs = [Job(p, w, configs[p], settings.seed, settings.drain_s) for w in loads for p in settings.policies
            if p in MAIN_POLICIES or (w.profile == "seed-000" and w.burstiness is None)]
    bar = progress_cls(total=len(jobs), label="matrix runs")
    results = run_jobs(jobs, settings.workers, on_done=lambda _r: bar.update(1))
    bar.close()
    cache: dict = {}
    by_label = {w.label: w for w in loads}
    rows = tuple(with_bounds(r.row, by_label[r.row.workload], static, cache) for r in results)
    records = {r.job_key: r.records for r in results if r.records}
    points = {p: [] for p in settings.policies}
    for r in rows:
        if r.workload.startswith("seed-000") and "bursty" not in r.workload:
            points[r.policy].append((by_label[r.workload].rate_rps, r.attainment_offered))
    capacity = capacity_search(settings.policies, configs, points, settings, log)
    return SuiteResults(placements, configs, roofline, tuple(loads), rows, records, capacity,
                        time.perf_counter() - start)


# --- the written report --------------------------------------------------------------------------------------------


def capacity_of(results: SuiteResults, policy: str) -> float:
    """The SLO capacity: the highest probed rate that met the 90 % target (the bracket's lower end)."""
    return results.capacity[policy][0]


def headline(results: SuiteResults) -> dict:
    """The ratios the targets are stated in (NaN where a policy did not run)."""
    cap = {p: capacity_of(results, p) for p in results.capacity}
    others = [p for p in ("sarathi", "distserve") if p in cap]
    best_other = max(others, key=lambda p: cap[p]) if others else None
    peak = {r.policy: r for r in results.rows if r.workload == "seed-000 peak 300"}
    octo = cap.get("octoserve", math.nan)

    def ratio(a: float, b: float) -> float:
        return a / b if b > 0 else math.inf

    return {
        "capacity_rps": cap,
        "octoserve_over_vllm": ratio(octo, cap["vllm-default"]) if "vllm-default" in cap else math.nan,
        "best_other": best_other,
        "octoserve_over_best_other": ratio(octo, cap[best_other]) if best_other else math.nan,
        "peak_goodput_rps": peak["octoserve"].goodput_rps if "octoserve" in peak else math.nan,
        "peak_over_capacity": ratio(peak["octoserve"].goodput_rps, octo) if "octoserve" in peak else math.nan,
        "peak_admitted_attainment": peak["octoserve"].attainment_admitted if "octoserve" in peak else math.nan,
    }


def _target_line(name: str, value: float, target: float, fmt: str) -> str:
    ok = value >= target
    return f"| {name} | {fmt.format(value)} | >= {fmt.format(target)} | {'met' if ok else '**missed**'} |"


def policy_section(results: SuiteResults, settings: Settings) -> str:
    h = headline(results)
    lines = [
        "Generated by `make bench` (`octoserve bench-suite`); method and caveats: `docs/BENCHMARKS_METHOD.md`.",
        f"Simulated H100 node, seed {settings.seed}, seed-000 runs of {settings.duration_s:g} s of arrivals "
        f"(+{settings.drain_s:g} s drain), seed-003 {settings.seed003_duration_s:g} s; roofline capacity of the "
        f"seed-000 mix {results.roofline_rps:.1f} req/s. Suite wall time {results.wall_s / 60:.1f} min.",
        "",
        "### Headline",
        "",
        "| target | measured | target | verdict |",
        "|---|---:|---:|---|",
    ]
    if "octoserve" in h["capacity_rps"] and "vllm-default" in h["capacity_rps"]:
        lines.append(_target_line("SLO capacity, octoserve / vllm-default", h["octoserve_over_vllm"], 2.0, "{:.2f}x"))
    if h["best_other"]:
        name = f"SLO capacity, octoserve / best other baseline ({h['best_other']})"
        if math.isinf(h["octoserve_over_best_other"]):
            lines.append(f"| {name} | n/a: {h['best_other']} stays under 90 % at every probed rate | >= 1.30x | "
                         f"{'met' if h['capacity_rps'].get('octoserve', 0) > 0 else '**missed**'} |")
        else:
            lines.append(_target_line(name, h["octoserve_over_best_other"], 1.3, "{:.2f}x"))
    if not math.isnan(h["peak_over_capacity"]):
        lines.append(_target_line("goodput at 300 req/s / octoserve's SLO capacity", h["peak_over_capacity"], 0.9,
                                  "{:.2f}"))
        lines.append(_target_line("admitted requests meeting both SLOs at 300 req/s", h["peak_admitted_attainment"],
                                  0.95, "{:.3f}"))
    lines += ["", "SLO capacities: " + ", ".join(f"{p} {c:.1f} req/s" for p, c in h["capacity_rps"].items())
              + f". Peak (300 req/s) goodput of octoserve: {h['peak_goodput_rps']:.1f} req/s.", "", DISCUSSION]
    lines += ["", "### SLO capacity (>= 90 % of offered requests meet TTFT and ITL SLOs; refused = miss)", "",
              "| policy | placement | SLO capacity req/s | first failing rate | probes (rate: attained offered %) |",
              "|---|---|---:|---:|---|"]
    for p, (lo, hi, probes) in results.capacity.items():
        label = results.placements[BASELINES[p].placement][0]
        probe_text = ", ".join(f"{r:g}: {100 * a:.1f}" for r, a, _ in probes) or "-"
        lines.append(f"| {p} | {label} | {lo:.1f} | {'-' if math.isinf(hi) else f'{hi:.1f}'} | {probe_text} |")
    lines += ["", "### Every run", "", TABLE_HEADER]
    lines += [table_row(r) for r in results.rows]
    lines += ["", "### Configurations", ""]
    for p in results.policy_configs:
        b = BASELINES[p]
        lines.append(f"- `{p}`: {b.description}. {describe_instances(results.policy_configs[p])}.")
    lines += ["", "### Plots", "",
              "- goodput vs offered load: `docs/bench/goodput_vs_load.png`",
              "- TTFT / ITL CDFs at the 300 req/s peak: `docs/bench/cdf_peak_<policy>.png`",
              "- SLO attainment over time, bursty run: `docs/bench/attainment_bursty_<policy>.png`", ""]
    return "\n".join(lines)


DISCUSSION = """\
Reading the headline (the numbers above are this run's; the mechanisms below are why):
- **Every policy's SLO capacity is a small fraction of the roofline**, because the 70B (25 % of requests, prompts
  lognormal around 1,000 tokens with a long tail) runs at TP=4 beside four 8B replicas. Each 70B step pays ~14.5 ms
  of weight streaming, all-reduce latency and overhead before any token, so a step that keeps the 30 ms ITL carries
  a prefill chunk of only ~130 tokens. octoserve's slack-aware chunking (services/core/batcher.py `_slack_budget`)
  runs longer steps, up to 3x the ITL target, whenever every running decode's mean time per token has banked
  the slack, in at most 4.5 % of recent steps; that restores much of the 70B's prefill rate at low load while
  keeping pooled ITL P95 under 30 ms. Long 70B
  prompts still miss the 250 ms TTFT however idle the node is (EDF demotes them to the background deadline), and
  from ~3-4 req/s of 70B traffic octoserve refuses 70B requests to keep the ones it admits inside both SLOs.
  Refused requests count as misses in the capacity definition, so the 70B's share caps every policy's capacity.
- **vllm-default holds up at low load under DistServe's definition** (per-request mean TPOT, not per-token ITL):
  its 8,192-token steps prefill the 70B at full speed, and the occasional 100-200 ms mixed step is amortised over a
  request's ~400 tokens. Its pooled ITL P95 breaks the 30 ms SLO from ~1x roofline on (see the table), and at the
  peak it collapses (goodput ~0: every request queues). octoserve matches it at low load and is the only policy
  that does not collapse under overload, which is why the 2x capacity target is missed while the overload targets
  are met: at low load there is nothing to shed, and the 70B's TTFT arithmetic is the same for both.
- **Overload is where octoserve's policies pay off**: at 1.5x roofline and at the 300 req/s peak its goodput stays
  ~100 req/s with >= 95 % of admitted requests meeting both SLOs and ITL P95 under 30 ms, while every policy
  without early refusal (vllm-default, sarathi, distserve, octoserve-no-refusal) collapses to a few req/s.
- **sarathi** is limited by a fixed ITL-safe budget (96 tokens on the 70B) without refusal: prefill is so slow
  that queues grow from the lowest loads. **distserve** on this node has to put the 70B at TP=2 (a TP=4 prefill +
  TP=4 decode pair leaves no GPUs for the 8B), whose decode step is ~27 ms at batch 1: almost no ITL headroom,
  and a 4,096-token prefill instance with little KV.
- Ablations: no refusal is the one that matters (capacity and peak goodput collapse); cache-blind routing and full
  reservation change little on seed-000 (10 % prefix reuse; with ITL-sized batches KV is far from full).
- What would lift the SLO capacity further: the 70B at TP=8 under gang leases time-shared with the 8B, or a
  disaggregated 70B with prefill at TP=4, neither of which this placement space offers today.
- Probes are 10 s windows (~35 70B requests at 15 req/s): each capacity is +- one bisection step and a few
  percent of attainment; the bracket column shows the first failing rate.
"""


def write_plots(results: SuiteResults, directory: Path) -> list[Path]:
    from services.metrics import SloSpec
    from services.plots import plot_attainment_over_time, plot_goodput_vs_load, plot_latency_cdfs

    directory.mkdir(parents=True, exist_ok=True)
    slo = SloSpec()
    points = [(r.policy, r.offered_rps, r.goodput_rps) for r in results.rows
              if r.workload.startswith("seed-000") and "bursty" not in r.workload]
    out = [plot_goodput_vs_load(points, directory / "goodput_vs_load.png")]
    for (policy, workload), records in sorted(results.records.items()):
        if policy not in MAIN_POLICIES:
            continue
        if "peak" in workload:
            out.append(plot_latency_cdfs(records, directory / f"cdf_peak_{policy}.png", slo))
        elif "bursty" in workload:
            out.append(plot_attainment_over_time(records, slo, directory / f"attainment_bursty_{policy}.png"))
    return out


def results_json(results: SuiteResults) -> dict:
    return {
        "placements": {k: v[0] for k, v in results.placements.items()},
        "roofline_rps": results.roofline_rps,
        "rows": [dataclasses.asdict(r) for r in results.rows],
        "capacity": {p: {"lo": lo, "hi": None if math.isinf(hi) else hi, "probes": probes}
                     for p, (lo, hi, probes) in results.capacity.items()},
        "headline": {k: v for k, v in headline(results).items()},
    }


def write_report(results: SuiteResults, settings: Settings, markdown: Path, plots: Path) -> None:
    write_plots(results, plots)
    (plots / "results.json").write_text(json.dumps(results_json(results), indent=1, default=str) + "\n")
    text = markdown.read_text(encoding="utf-8") if markdown.exists() else "# octoserve benchmarks\n"
    text = replace_section(text, SECTION_POLICY, policy_section(results, settings))
    markdown.write_text(replace_section(text, SECTION_CALIBRATION, calibration_section()), encoding="utf-8")


# --- cost model calibration section --------------------------------------------------------------------------------

# Published end-to-end throughput the cost model is checked against: TensorRT-LLM v0.14 "perf-overview" table
# (trtllm-bench, infinite request rate, ISL/OSL 1000/1000, H100 SXM 80 GB, FP16 = BF16's tensor-core rate and bytes),
# LLaMA v3 70B, total output tokens/s by TP.
PUBLISHED_70B_1000_1000_TOK_S = {2: 777.0, 4: 3730.2, 8: 5963.1}


def steady_state_output_tok_s(cost, kv_tokens: int, isl: int, osl: int, max_batch: int = 2048) -> tuple[int, float]:
    """(batch, output tokens/s) of an engine kept full at infinite rate: B sequences (as many as the KV holds at
    isl + osl tokens) decode at mean context isl + osl / 2, and every request's prefill runs once per osl steps."""
    batch = max(1, min(max_batch, kv_tokens // (isl + osl)))
    cycle_s = osl * cost.decode_step_time_s(batch, isl + osl // 2) + batch * cost.prefill_time_s(isl)
    return batch, batch * osl / cycle_s


def calibration_section() -> str:
    from services.core.cost_model import COST_PROFILES, DEFAULT_CONSTANTS, CostModel
    from services.core.specs import GPU_PRESETS, MODEL_PRESETS, num_kv_blocks

    gpu, lm, sm = GPU_PRESETS["h100-sxm-80gb"], MODEL_PRESETS["llama-3-70b"], MODEL_PRESETS["llama-3-8b"]
    c = DEFAULT_CONSTANTS
    lines = [
        "Generated by `make bench`; sources of every constant in `docs/COST_MODEL.md` (table \"Constants\"), method in",
        "`docs/BENCHMARKS_METHOD.md`. Current constants: " + ", ".join(
            f"`{k}` {getattr(c, k):g}" for k in ("linear_eff", "attn_eff", "hbm_eff", "nvlink_eff", "allreduce_latency_s",
                                                 "layer_overhead_s", "step_overhead_s", "linear_overlap_loss")) + ".",
        "",
        "| constant | source | status |",
        "|---|---|---|",
        "| `linear_eff` 0.6 | cuBLAS BF16 GEMMs reach 60-75 % of H100 dense peak; whole prefill steps lower | literature range |",
        "| `attn_eff` 0.5 | FlashAttention-2 ~35 %, FlashAttention-3 up to ~75 % of H100 peak (Shah et al. 2024) | midpoint |",
        "| `hbm_eff` 0.85 | decode GEMV / paged-attention reach 80-90 % of datasheet HBM bandwidth (MBU studies) | estimate |",
        "| `nvlink_eff` 0.8 | NCCL / vLLM custom all-reduce bus bandwidth on one NVLink node | estimate |",
        "| `allreduce_latency_s` 20 us | Vidur H100 DGX NCCL profile: 18-21 us minimum for 10-18 KB over 8 ranks | measured (Vidur) |",
        "| `layer_overhead_s` 15 us | Vidur H100 per-op profile: 19-30 us a layer over the HBM roofline, unfused; halved for fusion + CUDA graphs | measured range, halved |",
        "| `step_overhead_s` 1.0 ms | host time not hidden behind the GPU; vLLM CI latency runs (H200, batch 8) were 1.4x the 0.5 ms model | estimate |",
        "| `linear_overlap_loss` 0.9 | fitted to two TensorRT-LLM A100 batch-1 TTFT points (128-token prompts) | fitted |",
        "",
        "### Against published end-to-end numbers (Llama-3 70B shape, H100, 16-bit)",
        "",
        "TensorRT-LLM v0.14 performance overview, `trtllm-bench` at an infinite request rate, ISL/OSL 1000/1000, FP16.",
        "Prediction: the engine kept full, B = sequences of 2,000 tokens the KV holds (gpu_memory_utilization 0.9,",
        "activation reserve for an 8,192-token step), a cycle of 1,000 decode steps at context 1,500 plus B prefills.",
        "",
        "| TP | KV tokens | batch B | predicted out tok/s | published out tok/s | predicted / published |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for tp, published in PUBLISHED_70B_1000_1000_TOK_S.items():
        cost = CostModel(lm, gpu, tp)
        kv = num_kv_blocks(lm, gpu, tp, 0.9, 8192, 16) * 16
        batch, tok_s = steady_state_output_tok_s(cost, kv, 1000, 1000)
        lines.append(f"| {tp} | {kv:,} | {batch} | {tok_s:,.0f} | {published:,.0f} | {tok_s / published:.2f} |")
    sm_cost, lm4, lm8 = CostModel(sm, gpu, 1), CostModel(lm, gpu, 4), CostModel(lm, gpu, 8)
    lines += [
        "",
        "### Predicted step times under both cost profiles (ms, H100; decode at context 1,400)",
        "",
        "`cost_profile: pessimistic` (or `--cost-profile pessimistic`) takes the slow end of every constant's range",
        "(docs/COST_MODEL.md, \"Profiles\"); \"Headline under both cost profiles\" shows which conclusions survive it.",
        "",
        "| profile | instance | decode b=1 | b=32 | b=256 | prefill 1,000 | prefill 2,700 |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, constants in COST_PROFILES.items():
        for label, spec, tp in (("8B TP=1", sm, 1), ("70B TP=4", lm, 4), ("70B TP=8", lm, 8)):
            cost = CostModel(spec, gpu, tp, constants)
            cells = [cost.decode_step_time_s(b, 1400) for b in (1, 32, 256)]
            cells += [cost.prefill_time_s(n) for n in (1000, 2700)]
            lines.append(f"| {name} | {label} | " + " | ".join(f"{s * 1e3:.1f}" for s in cells) + " |")
    lines += [
        "",
        "Reading it (throughput table, default constants): TP=4, the shape octoserve places the 70B at, is predicted",
        "~6 % under the published rate. TP=8 is over-predicted by ~18 %: at B ~ 660 the model's single `linear_eff` and all-reduce terms are optimistic for",
        "skinny TP=8 shards, and the published engine may cap its batch below what the KV holds. TP=2 is far under:",
        "with an 8,192-token activation reserve the model leaves a TP=2 70B only ~4.7k tokens of KV (two sequences),",
        "while TensorRT-LLM sizes KV from the memory free after its own, smaller, activation buffers: a memory-model",
        "difference, not a timing one.",
        "",
        "Small batches: vLLM's CI latency runs (H200, batch 8, 32 in / 128 out) fall between the profiles (default",
        "0.83x / 0.90x of the measured 8B / 70B TP=4 time, pessimistic 1.35x / 1.40x), and Vidur's H100 per-op",
        "profile of the 70B layers at 1 token between them too (default 0.86-0.99x, pessimistic 1.16-1.22x); see",
        "`docs/COST_MODEL.md` (\"Sources\"). Against the floors of DESIGN.md section 1 (weights at datasheet HBM):",
        f"predicted decode steps at context 1,400 are {sm_cost.decode_step_time_s(1, 1400) * 1e3:.2f} ms (8B, batch 1;",
        f"floor 4.8 ms), {lm4.decode_step_time_s(1, 1400) * 1e3:.2f} ms (70B TP=4; floor 10.5 ms) and",
        f"{lm8.decode_step_time_s(1, 1400) * 1e3:.2f} ms (70B TP=8; floor 5.3 ms). The A100 TensorRT-LLM latency points",
        "(Llama-2 7B/70B, 1.06-1.24x) are in `docs/COST_MODEL.md` (`scripts/cost_model_check.py`).",
        "",
        "### `octoserve calibrate`",
        "",
        "With torch on a CUDA device it times the per-GPU shards of a model's QKV, output, gate/up and down GEMMs at",
        "1-4,096 tokens and attention at prefill 512-4,096 and decode batch x context up to 64 x 4,096, prints predicted",
        "vs measured per operation, fits `linear_eff`, `hbm_eff` and `attn_eff`, and writes a profile JSON that",
        "`CostModel.from_profile` reads. On a CPU it does the same for the tiny test model's shapes against a measured",
        "CPU roofline and, with `--e2e`, times the vLLM engine on the tiny model end to end to fit `step_overhead_s`.",
        "No GPU was lent to this task, so no H100 profile is included; CPU timings on this shared 2-core machine are",
        "dominated by scheduler noise (10 ms slices) and are not reported as calibration.",
    ]
    return "\n".join(lines)
