"""The policy-comparison matrix in the simulator, written into BENCHMARKS.md and PNGs (the `octoserve bench-suite`
command that runs it: services/lab/bench_command.py).

Steps, all in the discrete-event simulator (`octoserve.services.sim.driver.run_simulation`), deterministic for a seed, repeated
for every cost profile (`--cost-profiles`, default both `default` and `pessimistic`) so a reader sees which
conclusions survive pessimistic constants:
1. Placements: the static split (the embedded default config), the planner's best fully disaggregated placement
   (DistServe's), and the planner's two recommendations for octoserve: its top analytic candidates and the default
   config simulated under octoserve's policies and ranked by per-model SLO capacity (bisection) and by steady-state
   goodput at the 300 req/s peak.
   octoserve (and its ablations) use the capacity winner for the capacity probes and the 0.25-1x roofline rows,
   and the goodput winner for the overload rows (1.5x roofline, peak, bursty, seed-003).
2. The matrix: every policy of `octoserve.services.lab.baselines.BASELINES` on seed-000 at 0.25 / 0.5 / 1.0 / 1.5 x the roofline
   capacity and at the 300 req/s peak, a bursty variant (gamma, burstiness 0.25, at 1.0 x roofline) and seed-003
   (a shorter window: its long prompts make it the slowest to simulate; its warm-up is excluded too).
3. SLO capacity (`octoserve.services.sim.capacity`): per policy, bisection on the seed-000 rate with `capacity_seeds` seeds
   per probe; a run passes when >= 90 % of OFFERED requests are good (DistServe, refused = miss) and the fleet SLO
   (TTFT P95 < SLO, ITL P95 < 30 ms) holds; a probe passes on a majority of seeds; the spread is the capacity per
   seed.
4. Report (`octoserve.services.lab.bench_report`): tables, headline targets per cost profile, and plots (default cost
   profile) under docs/bench/.

Every run is measured in steady state: metrics cover arrivals after `warmup_s` up to the end of the arrival window;
requests still running `drain_s` after the last arrival count as misses. `--quick` shortens everything and stamps
every table it writes with QUICK_BANNER. Every run is an independent job, so they run in a process pool and the
results do not depend on the number of workers.

Why one module past 600 lines: the suite's matrix, placements and capacity probes.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import multiprocessing
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from octoserve.services.lab.baselines import (
    BASELINES,
    BEST_DISAGGREGATED,
    GANG,
    MAIN_POLICIES,
    PLANNER,
    STATIC_SPLIT,
    configure,
)
from octoserve.services.core import planner
from octoserve.services.core.placement import NodeConfig
from octoserve.services.core.types import Role
from octoserve.services.sim.capacity import (
    CAPACITY_ATTAINMENT,
    DRAIN_S,
    Probe,
    bisect_capacity,
    measured_run,
    passes,
    rank_by_both,
    start_search,
)

PEAK_RPS = 300.0
ROOFLINE_FRACTIONS = (0.25, 0.5, 1.0, 1.5)
OVERLOAD_FRACTION = 1.5  # rows at or above this use the planner's goodput winner
BURSTINESS = 0.25
COST_PROFILES = ("default", "pessimistic")
QUICK_BANNER = "QUICK MODE (not steady state; do not cite)"
PLANNER_CAPACITY = "planner-capacity"  # the planner's candidate with the highest simulated SLO capacity
PLANNER_GOODPUT = "planner-goodput"  # ... with the highest simulated goodput at the peak


@dataclass(frozen=True, slots=True)
class Settings:
    # seed-000: at the peak the running batch is flat from ~10 s on and the admitted rate drops from its empty-queue
    # burst to within a few percent of its later value by ~10 s (docs/BENCHMARKS_METHOD.md, "Workloads and
    # windows", has the measurement and the slow drift after it); 20 s of warm-up leaves a 40 s window.
    duration_s: float = 60.0  # arrival window of each seed-000 run
    warmup_s: float = 20.0  # arrivals before this are excluded from the metrics
    drain_s: float = DRAIN_S  # every admitted request finishes within it (capacity.DRAIN_S)
    # seed-003 takes 1-2 s of wall per simulated second at 625 req/s; MSER-5 on its occupancy puts the warm-up at
    # ~10 s (its long BATCH prompts fill the batch slowly): 30 s with the first 10 s excluded.
    seed003_duration_s: float = 30.0
    seed003_warmup_s: float = 10.0
    seed003_rate_rps: float | None = None  # None: the profile's 625 req/s
    capacity_steps: int = 4  # bisection steps inside the bracket
    capacity_seeds: int = 3  # seeds per capacity probe (the seed changes the trace)
    planner_top: int = 2  # analytic candidates simulated to pick octoserve's placements
    planner_capacity_steps: int = 5  # bisection from [0, roofline / 0.9) for each candidate
    planner_capacity_seeds: int = 2
    seed: int = 0
    workers: int = 2
    policies: tuple[str, ...] = tuple(BASELINES)
    cost_profiles: tuple[str, ...] = COST_PROFILES
    quick: bool = False


def quick_settings(**overrides) -> Settings:
    """Development mode: short windows, one seed, fewer probes. Its tables carry QUICK_BANNER."""
    base = dict(duration_s=10.0, warmup_s=2.0, drain_s=15.0, seed003_duration_s=3.0, seed003_warmup_s=1.0,
                capacity_steps=2, capacity_seeds=1, planner_top=1, planner_capacity_steps=2,
                planner_capacity_seeds=1, quick=True)
    return Settings(**{**base, **overrides})


@dataclass(frozen=True, slots=True)
class Workload:
    label: str
    profile: str
    rate_rps: float
    duration_s: float
    warmup_s: float = 0.0  # arrivals before this are not measured
    burstiness: float | None = None  # None: Poisson
    keep_records: bool = False  # the plots need the per-request records of this run
    overload: bool = False  # octoserve runs it on the planner's goodput winner


@dataclass(frozen=True, slots=True)
class Job:
    policy: str
    workload: Workload
    config: NodeConfig
    seed: int
    drain_s: float
    cost_profile: str = "default"


@dataclass(frozen=True, slots=True)
class GroupRow:
    """One model's or tier's figures in a run's measurement window."""

    name: str
    goodput_rps: float
    attainment_admitted: float
    attainment_offered: float
    ttft_p95_ms: float
    itl_p95_ms: float


@dataclass(frozen=True, slots=True)
class Row:
    """One table row: a policy on a workload (one seed, one cost profile)."""

    policy: str
    workload: str
    offered_rps: float
    goodput_rps: float
    roofline_rps: float  # the compute roofline bound at this offered load: min(offered, capacity)
    slo_estimate_rps: float  # the planner's SLO-aware estimate at this offered load (best placement): NOT a bound
    attainment_admitted: float
    attainment_offered: float
    ttft_p95_ms: float
    itl_p95_ms: float
    refused_fraction: float
    num_preemptions: int
    kv_utilisation: float  # mean over instances and samples in the measurement window (after the warm-up)
    gpu_busy: float  # GPU-weighted mean busy fraction in the measurement window
    num_errors: int  # admitted but unfinished when the run stopped
    cost_profile: str = "default"
    seed: int = 0
    passes: bool = False  # the capacity criterion (octoserve.services.sim.capacity.passes) on the pooled requests
    passes_per_model: bool = False  # the same criterion held by every model's own requests, against its own SLOs
    groups: tuple[GroupRow, ...] = ()  # per model, then per tier
    # Gang leases (NaN without a gang group; the worst group over the whole run): the two bounds as measured and
    # lease switches per second.
    gang_max_lm_wait_ms: float = math.nan
    gang_max_sm_stall_ms: float = math.nan
    gang_switches_per_s: float = math.nan

    @property
    def goodput_over_roofline(self) -> float:
        return self.goodput_rps / self.roofline_rps if self.roofline_rps > 0 else math.nan

    @property
    def goodput_over_slo_estimate(self) -> float:
        return self.goodput_rps / self.slo_estimate_rps if self.slo_estimate_rps > 0 else math.nan

    def group(self, name: str) -> GroupRow | None:
        return next((g for g in self.groups if g.name == name), None)


@dataclass(frozen=True, slots=True)
class JobResult:
    job_key: tuple[str, str, str, int]  # (cost profile, policy, workload label, seed)
    row: Row
    records: tuple = ()
    wall_s: float = 0.0


# --- traces and runs (process-pool workers) ---------------------------------------------------------------------


@functools.lru_cache(maxsize=4)
def _trace(profile_name: str, rate_rps: float, duration_s: float, burstiness: float | None, seed: int):
    from octoserve.services.workload import PROFILES, generate_trace, scaled

    profile = scaled(PROFILES[profile_name], rate_rps=rate_rps, duration_s=duration_s, burstiness=burstiness)
    return tuple(generate_trace(profile, seed))


def _gpu_weighted(instances, field: str, weights: dict[str, int]) -> float:
    """A per-instance figure of the measurement window (`InstanceStats`), averaged with GPU-count weights."""
    total = sum(weights.get(s.instance_id, 1) * getattr(s, field) for s in instances)
    weight = sum(weights.get(s.instance_id, 1) for s in instances)
    return total / weight if weight else math.nan


def _group_row(g) -> GroupRow:
    return GroupRow(g.name, g.goodput_rps, g.attainment_admitted, g.attainment_offered, g.ttft.p95_ms, g.itl.p95_ms)


def _gang_fields(res) -> dict:
    if not res.gangs:
        return {}
    return dict(gang_max_lm_wait_ms=max(g.stats.max_lm_wait_s for g in res.gangs) * 1e3,
                gang_max_sm_stall_ms=max(g.stats.max_sm_stall_s for g in res.gangs) * 1e3,
                gang_switches_per_s=sum(g.switches_per_s for g in res.gangs))


def run_job(job: Job) -> JobResult:
    """Simulate one (policy, workload, seed) and reduce its measurement window to a row (bounds filled in later)."""
    start = time.perf_counter()
    w = job.workload
    trace = _trace(w.profile, w.rate_rps, w.duration_s, w.burstiness, job.seed)
    res, summary = measured_run(job.config, trace, seed=job.seed, drain_s=job.drain_s, warmup_s=w.warmup_s)
    o = summary.overall
    gpus = {i.id: i.tp for i in job.config.instances}
    row = Row(
        policy=job.policy, workload=w.label, offered_rps=o.num_offered / max(summary.duration_s, 1e-9),
        goodput_rps=o.goodput_rps, roofline_rps=math.nan, slo_estimate_rps=math.nan,
        attainment_admitted=o.attainment_admitted, attainment_offered=o.attainment_offered,
        ttft_p95_ms=o.ttft.p95_ms, itl_p95_ms=o.itl.p95_ms, refused_fraction=o.refused_fraction,
        num_preemptions=o.num_preemptions,
        kv_utilisation=_gpu_weighted(res.instances, "kv_mean", gpus),
        gpu_busy=_gpu_weighted(res.instances, "busy_fraction", gpus), num_errors=o.num_errors,
        cost_profile=job.cost_profile, seed=job.seed, passes=passes(o, summary.slo),
        passes_per_model=all(passes(g) for g in summary.per_model),
        groups=tuple(_group_row(g) for g in (*summary.per_model, *summary.per_tier)),
        **_gang_fields(res),
    )
    records = tuple(r for r in res.records if r.arrival_s >= w.warmup_s) if w.keep_records else ()
    return JobResult((job.cost_profile, job.policy, w.label, job.seed), row, records, time.perf_counter() - start)


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


class JobLog:
    """Progress of a batch of jobs: the TTY bar, plus a plain line every ~10 % (make bench is often piped)."""

    def __init__(self, total: int, label: str, log: Callable[[str], None], progress_cls=None) -> None:
        self.total, self.label, self.log, self.done = total, label, log, 0
        self.bar = progress_cls(total=total, label=label) if progress_cls else None
        self.start = time.perf_counter()
        self.cpu_s = 0.0

    def __call__(self, result: JobResult) -> None:
        self.done += 1
        self.cpu_s += result.wall_s
        if self.bar:
            self.bar.update(1)
        if self.done == self.total or self.done % max(1, self.total // 10) == 0:
            elapsed = time.perf_counter() - self.start
            self.log(f"  {self.label}: {self.done}/{self.total} jobs, {elapsed:.0f} s "
                     f"(~{elapsed / self.done * (self.total - self.done):.0f} s left)")

    def close(self) -> None:
        if self.bar:
            self.bar.close()


def run_logged(jobs: Sequence[Job], settings: Settings, label: str, log: Callable[[str], None],
               progress_cls=None) -> list[JobResult]:
    progress = JobLog(len(jobs), label, log, progress_cls)
    try:
        return run_jobs(jobs, settings.workers, on_done=progress)
    finally:
        progress.close()


# --- cost profiles -------------------------------------------------------------------------------------------------


def with_cost_profile(config: NodeConfig, cost_profile: str) -> NodeConfig:
    """`config` with every cost model under `cost_profile`."""
    return dataclasses.replace(config, cost_profile=cost_profile)


def batch_min_share(config: NodeConfig) -> float:
    """BATCH's configured minimum share of the decode slots while more urgent tiers are shed."""
    return config.policies.batch_min_share


# --- placements ------------------------------------------------------------------------------------------------


def seed000_mix(rate_rps: float) -> planner.WorkloadMix:
    from octoserve.services.sim.cli_plan import mix_from_profile
    from octoserve.services.workload import PROFILES

    return mix_from_profile(PROFILES["seed-000"], rate_rps)


def roofline_capacity_rps(node: NodeConfig) -> float:
    return planner.roofline_bound(node.models, node.gpu, node.num_gpus, seed000_mix(PEAK_RPS)).capacity_rps


def ranked_placements(node: NodeConfig, rate_rps: float = PEAK_RPS):
    candidates = planner.candidate_placements(node.gpu, node.models, node.num_gpus, slo=node.slo,
                                              cost_profile=node.cost_profile)
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
    `_fully_disaggregated`; re-ranked by the SLO-aware estimate after the budget change."""
    mix = seed000_mix(PEAK_RPS)
    fitted = []
    for p, _ in ranked:
        if all(p.config.is_disaggregated(m) for m in p.config.models):
            cfg = _fit_prefill_budgets(p.config)
            if _fully_disaggregated(cfg):
                fitted.append((dataclasses.replace(p, config=cfg), planner.slo_bound(cfg, mix)))
    return max(fitted, key=lambda ps: (ps[1].goodput_rps, ps[0].label))


@dataclass(frozen=True, slots=True)
class PlacementChoice:
    """The planner's simulated candidates for octoserve under one cost profile and the two winners."""

    evaluated: dict  # label -> (SLO capacity req/s, goodput req/s at the peak)
    capacity_spread: dict  # label -> (min, median, max) capacity per seed
    by_capacity: str
    by_goodput: str


# The last element of a per-model capacity search's key: (policy, PER_MODEL), or (policy, label, PER_MODEL)
PER_MODEL = "per-model"


def _probe(rate: float, rows: Sequence[Row], per_model: bool) -> Probe:
    if not per_model:
        return Probe(rate, tuple(r.passes for r in rows), tuple(r.attainment_offered for r in rows))
    worst = tuple(min((g.attainment_offered for g in r.groups if g.name.startswith("llama")),
                      default=r.attainment_offered) for r in rows)
    return Probe(rate, tuple(r.passes_per_model for r in rows), worst)


def capacity_run_step(configs: dict, settings: Settings, cost_profile: str, seeds: Sequence[int], window: Workload,
                      log: Callable[[str], None], rows_out: dict | None = None):
    """A `bisect_capacity` run_step: every asked (key, rate) under every seed, in the pool; keys index `configs`
    (a key is a policy or a tuple whose first element names the policy). A tuple key ending in PER_MODEL is judged
    by the per-model criterion (`Row.passes_per_model`, attainment of offered of its worst model); asks for the same
    config and rate share their runs."""

    def run_step(asks):
        runs: dict = {}  # (id of the config, rate) -> index of its first job
        jobs = []
        for key, rate in asks:
            policy = key if isinstance(key, str) else key[0]
            if (id(configs[key]), rate) in runs:
                continue
            runs[(id(configs[key]), rate)] = len(jobs)
            w = dataclasses.replace(window, label=f"capacity probe {rate:g}", rate_rps=rate)
            jobs += [Job(policy, w, configs[key], s, settings.drain_s, cost_profile) for s in seeds]
        results = run_logged(jobs, settings, f"{cost_profile}: capacity probes", log)
        out = {}
        for key, rate in asks:
            first = runs[(id(configs[key]), rate)]
            rows = [r.row for r in results[first:first + len(seeds)]]
            out[(key, rate)] = _probe(rate, rows, isinstance(key, tuple) and key[-1] == PER_MODEL)
            if rows_out is not None:
                rows_out[(key, rate)] = tuple(rows)
        return out

    return run_step


def choose_planner_placements(settings: Settings, cost_profile: str, ranked, roofline_rps: float,
                              log: Callable[[str], None],
                              configured: tuple[str, NodeConfig] | None = None) -> tuple[PlacementChoice, dict]:
    """Simulate the top analytic candidates under octoserve, and the `configured` placement (label, config) beside
    them: goodput at the peak and per-model SLO capacity by bisection (the suite's headline criterion, as `plan`
    ranks them). The configured placement is always a candidate because the analytic estimate can rank it below
    placements that serve less: under the pessimistic constants it put two placements with a TP=2 70B prefill
    instance first, and the default placement's goodput at the peak is nearly twice theirs."""
    top = [(p.label, p.config) for p, _ in ranked[: settings.planner_top]]
    if configured is not None:
        top.append(configured)
    configs = {("octoserve", label, PER_MODEL): with_cost_profile(configure(BASELINES["octoserve"], config),
                                                                   cost_profile)
               for label, config in top}
    log(f"{cost_profile}: placement search over the planner's top {settings.planner_top}"
        f"{' and the configured placement' if configured is not None else ''}: goodput at {PEAK_RPS:g} req/s and "
        f"per-model SLO capacity ({settings.planner_capacity_seeds} seeds x {settings.planner_capacity_steps} steps)")
    peak = Workload("placement search peak", "seed-000", PEAK_RPS, settings.duration_s, settings.warmup_s)
    peak_rows = run_logged([Job("octoserve", peak, cfg, settings.seed, settings.drain_s, cost_profile)
                            for cfg in configs.values()], settings, f"{cost_profile}: placement goodput", log)
    window = Workload("capacity probe", "seed-000", 0.0, settings.duration_s, settings.warmup_s)
    seeds = [settings.seed + k for k in range(settings.planner_capacity_seeds)]
    searches = bisect_capacity({key: start_search([], roofline_rps / CAPACITY_ATTAINMENT) for key in configs},
                               capacity_run_step(configs, settings, cost_profile, seeds, window, log),
                               settings.planner_capacity_steps, log)
    evaluated = {key[1]: (searches[key].capacity_rps, r.row.goodput_rps) for key, r in zip(configs, peak_rows)}
    _, _, rec = rank_by_both(evaluated)
    for label, (cap, goodput) in evaluated.items():
        log(f"  per-model SLO capacity {cap:6.1f} req/s, goodput at the peak {goodput:6.1f} req/s  {label}")
    choice = PlacementChoice(evaluated, {k[1]: s.spread() for k, s in searches.items()}, rec.by_capacity,
                             rec.by_goodput)
    by_label = dict(top)
    return choice, {PLANNER_CAPACITY: (rec.by_capacity, by_label[rec.by_capacity]),
                    PLANNER_GOODPUT: (rec.by_goodput, by_label[rec.by_goodput])}


def placement_kind(policy: str, workload: Workload) -> str:
    """Which placement a policy runs a workload on: octoserve's planner placement depends on the load."""
    kind = BASELINES[policy].placement
    if kind != PLANNER:
        return kind
    return PLANNER_GOODPUT if workload.overload else PLANNER_CAPACITY


# --- the matrix ------------------------------------------------------------------------------------------------


def workloads(settings: Settings, roofline_rps: float) -> list[Workload]:
    d, wu = settings.duration_s, settings.warmup_s
    out = [Workload(f"seed-000 {f:g}x roofline", "seed-000", round(f * roofline_rps, 1), d, wu,
                    overload=f >= OVERLOAD_FRACTION) for f in ROOFLINE_FRACTIONS]
    out.append(Workload("seed-000 peak 300", "seed-000", PEAK_RPS, d, wu, keep_records=True, overload=True))
    out.append(Workload("seed-000 bursty 1x roofline", "seed-000", round(roofline_rps, 1), d, wu,
                        burstiness=BURSTINESS, keep_records=True, overload=True))
    from octoserve.services.workload import PROFILES

    rate = settings.seed003_rate_rps or PROFILES["seed-003"].rate_rps
    out.append(Workload(f"seed-003 {rate:g} req/s", "seed-003", rate, settings.seed003_duration_s,
                        settings.seed003_warmup_s, overload=True))
    return out


def capacity_bracket(points, threshold: float = CAPACITY_ATTAINMENT) -> tuple[float, float]:
    """(lo, hi) from (rate, attainment of offered) points (see `octoserve.services.sim.capacity.start_search`)."""
    s = start_search([(r, a >= threshold) for r, a in points])
    return s.lo, s.hi


# --- bounds and estimates ------------------------------------------------------------------------------------------


def slo_estimate_rps(node: NodeConfig, profile_name: str, rate_rps: float, cache: dict) -> float:
    """The planner's SLO-aware estimate of goodput at `rate_rps` (`planner.slo_upper_bound`, maximised over its
    candidate placements). Built to bound any scheduler under the cost model, but not proven for a finite
    measured window (requests served in the drain count), so it is reported as an estimate, not a bound."""
    from octoserve.services.sim.cli_plan import length_samples, mix_from_profile
    from octoserve.services.workload import PROFILES

    profile = PROFILES[profile_name]
    slo = dataclasses.replace(node.slo, ttft_ms=profile.slo.ttft_ms, itl_ms=profile.slo.itl_ms)
    mix = mix_from_profile(profile, rate_rps)
    key = ("placements", profile_name)
    if key not in cache:
        cache[key] = (planner.candidate_placements(node.gpu, node.models, node.num_gpus, slo=slo,
                                                   cost_profile=node.cost_profile),
                      length_samples(profile))
    candidates, samples = cache[key]
    return max((planner.slo_upper_bound(p.config, mix, samples, cache).goodput_rps for p in candidates),
               default=math.nan)


def roofline_rps_at(node: NodeConfig, profile_name: str, rate_rps: float) -> float:
    from octoserve.services.sim.cli_plan import mix_from_profile
    from octoserve.services.workload import PROFILES

    mix = mix_from_profile(PROFILES[profile_name], rate_rps)
    cap = planner.roofline_bound(node.models, node.gpu, node.num_gpus, mix).capacity_rps
    return min(rate_rps, cap)


def with_bounds(row: Row, workload: Workload, node: NodeConfig, cache: dict) -> Row:
    return dataclasses.replace(
        row,
        roofline_rps=roofline_rps_at(node, workload.profile, row.offered_rps),
        slo_estimate_rps=slo_estimate_rps(node, workload.profile, row.offered_rps, cache),
    )


# --- the suite ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProfileResults:
    """Everything measured under one cost profile."""

    cost_profile: str
    placements: dict  # kind -> (label, config)
    choice: PlacementChoice | None  # the planner's simulated candidates (None: octoserve not run)
    roofline_rps: float
    workloads: tuple
    rows: tuple  # Row, in matrix order (seed `settings.seed`)
    records: dict  # (policy, workload label) -> records (peak and bursty runs)
    capacity: dict  # policy -> CapacitySearch (pooled: the node's requests together)
    probe_rows: dict  # (search key, rate) -> Rows, one per seed
    capacity_per_model: dict = dataclasses.field(default_factory=dict)  # policy -> CapacitySearch (every model)


@dataclass(frozen=True, slots=True)
class SuiteResults:
    profiles: dict  # cost profile -> ProfileResults
    wall_s: float


def run_profile(settings: Settings, cost_profile: str, log: Callable[[str], None], progress_cls=None) -> ProfileResults:
    from octoserve.services.config import load_node_config

    static = with_cost_profile(load_node_config(None), cost_profile)
    roofline = roofline_capacity_rps(static)
    ranked = ranked_placements(static)
    disagg = best_disaggregated(ranked)
    gang = with_cost_profile(load_node_config_text("node-gang.yaml"), cost_profile)
    placements = {STATIC_SPLIT: ("default config: " + planner.placement_label(static), static),
                  BEST_DISAGGREGATED: (disagg[0].label, disagg[0].config),
                  GANG: ("gang config: " + planner.placement_label(gang), gang)}
    choice = None
    if any(BASELINES[p].placement == PLANNER for p in settings.policies):
        choice, planner_placements = choose_planner_placements(settings, cost_profile, ranked, roofline, log,
                                                               placements[STATIC_SPLIT])
        placements.update(planner_placements)
    loads = workloads(settings, roofline)

    def config_for(policy: str, w: Workload) -> NodeConfig:
        return with_cost_profile(configure(BASELINES[policy], placements[placement_kind(policy, w)][1]), cost_profile)

    # Ablations run where they answer a question: the seed-000 Poisson load points (capacity) and the peak.
    jobs = [Job(p, w, config_for(p, w), settings.seed, settings.drain_s, cost_profile)
            for w in loads for p in settings.policies
            if p in MAIN_POLICIES or (w.profile == "seed-000" and w.burstiness is None)]
    results = run_logged(jobs, settings, f"{cost_profile}: matrix runs", log, progress_cls)
    cache: dict = {}
    by_label = {w.label: w for w in loads}
    rows = tuple(with_bounds(r.row, by_label[r.row.workload], static, cache) for r in results)
    records = {r.job_key[1:3]: r.records for r in results if r.records}
    # Brackets from the seed-000 Poisson rows run on the capacity placement; the probes decide.
    # Two searches a policy: pooled (key: the policy) and per model (key: (policy, PER_MODEL)); one step's probes
    # of both run together, and a rate both ask for runs once.
    points: dict = {k: [] for p in settings.policies for k in (p, (p, PER_MODEL))}
    for r in rows:
        w = by_label[r.workload]
        if w.profile == "seed-000" and w.burstiness is None and placement_kind(r.policy, w) != PLANNER_GOODPUT:
            points[r.policy].append((w.rate_rps, r.passes))
            points[(r.policy, PER_MODEL)].append((w.rate_rps, r.passes_per_model))
    capacity_load = Workload("capacity probe", "seed-000", 0.0, settings.duration_s, settings.warmup_s)
    configs = {p: config_for(p, capacity_load) for p in settings.policies}
    configs.update({(p, PER_MODEL): configs[p] for p in settings.policies})
    seeds = [settings.seed + k for k in range(settings.capacity_seeds)]
    probe_rows: dict = {}
    searches = bisect_capacity(
        {k: start_search(v, roofline / CAPACITY_ATTAINMENT) for k, v in points.items()},
        capacity_run_step(configs, settings, cost_profile, seeds, capacity_load, log, probe_rows),
        settings.capacity_steps, log)
    capacity = {p: searches[p] for p in settings.policies}
    per_model = {p: searches[(p, PER_MODEL)] for p in settings.policies}
    return ProfileResults(cost_profile, placements, choice, roofline, tuple(loads), rows, records, capacity,
                          probe_rows, per_model)


def load_node_config_text(name: str) -> NodeConfig:
    """An embedded config under services/configs/ by file name."""
    from octoserve.services.config import default_config_text, node_config_from_text

    return node_config_from_text(default_config_text(name), source=name)


def run_suite(settings: Settings, log: Callable[[str], None], progress_cls=None) -> SuiteResults:
    start = time.perf_counter()
    profiles = {c: run_profile(settings, c, log, progress_cls) for c in settings.cost_profiles}
    return SuiteResults(profiles, time.perf_counter() - start)


def rebound(results: SuiteResults) -> SuiteResults:
    """The same results with the roofline and the SLO-aware estimate recomputed (after a planner change)."""
    profiles = {}
    for name, pr in results.profiles.items():
        cache: dict = {}
        by_label = {w.label: w for w in pr.workloads}
        static = pr.placements[STATIC_SPLIT][1]
        rows = tuple(with_bounds(r, by_label[r.workload], static, cache) for r in pr.rows)
        profiles[name] = dataclasses.replace(pr, rows=rows)
    return dataclasses.replace(results, profiles=profiles)


# --- the command ---------------------------------------------------------------------------------------------------
