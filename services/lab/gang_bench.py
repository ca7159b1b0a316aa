"""The gang comparison: octoserve's gang leases against the schedulers seed 003 warns about, on one node and workload.

Two cases, each on seed 003's workload with per-model SLOs (`configs/workload-seed003.yaml`: TTFT 200 ms
INTERACTIVE, 10 s BATCH; ITL 65 ms for the 8B, 100 ms for the large model):
- `seed003`: seed 003's own node (`configs/node-seed003.yaml`): dense-180b at TP=8, which needs all eight GPUs by
  memory, and eight 8B replicas resident beside it;
- `70b`: the 70B at TP=8 with eight 8B replicas (`configs/node-gang.yaml`); the 70B also fits at TP=4, so here
  the static split (70B TP=4 beside four 8B, `configs/node-default.yaml`) is a legitimate baseline too.
Policies: `gang` (the config as shipped), and the baselines as shapes of the same arbiter (`core/gang.py`), run
with the starvation bounds out of reach because starving one side is what defines them: `lm-first` (the whole
node reserved for the LM while it has work), `sm-greedy` (the LM steps only when no SM has work), `slices`
(fixed 1 s slices, as a pod-level gang scheduler); on the 70B case `static-split`.

Measured (`measure`), each run in steady state (arrivals after the warm-up up to the end of the window):
per model and per tier goodput and attainment, the longest LM wait and SM stall (waits still open at the end
included), and each model's SLO capacity on a rate grid: the highest grid rate at which the model, and every
lower grid rate, passes: >= 90 % of its *servable* offered requests good (a request is servable when prefilling
its uncached prompt on the case's idle LM or SM instance fits its TTFT SLO: no scheduler can serve the rest in
time; seed 003's long LM prompts make ~15 % of INTERACTIVE LM requests unservable) and its own P95s inside its
SLOs. Every run is deterministic for its seed.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import sys
from collections.abc import Iterable, Sequence
from typing import Any
from dataclasses import dataclass

from octoserve.services.core.gang import with_shared_steps
from octoserve.services.core.placement import (
    NodeConfig,
    PlacementError,
    check_placement,
    gang_itl_ms,
    gang_step_floor_s,
)

WORKLOAD = "workload-seed003.yaml"
LM_IN_WORKLOAD = "dense-180b"
CASES = {  # name -> (label, gang config, static-split config or None)
    "seed003": ("seed-003 node: dense-180b TP=8 + 8 x llama-3-8b", "node-seed003.yaml", None),
    "70b": ("70B case: llama-3-70b TP=8 + 8 x llama-3-8b", "node-gang.yaml", "node-default.yaml"),
}
BASELINE_SHAPES = {"lm-first": "lm_first", "sm-greedy": "sm_greedy", "slices": "slices"}
STATIC = "static-split"
# the shipped shape, and the others beside it (a variant whose shape is the shipped one is not run twice)
GANG_SHAPES = {"gang": None, "gang-slack": "slack", "gang-deadline": "deadline"}
POLICIES = (*GANG_SHAPES, *BASELINE_SHAPES, STATIC)
UNBOUNDED_MS = 1e6  # the baselines' bounds: out of reach of any run
SLICE_MS = 1000.0
CAPACITY_ATTAINMENT = 0.9  # of servable offered requests good
CONTEXT_TOKENS = 32768  # seed 003: contexts up to 32k tokens, on every config of the comparison


def policies_of(case: str) -> tuple[str, ...]:
    shipped = _load(CASES[case][1]).gang.policy.shape
    return tuple(p for p in POLICIES if (p != STATIC or CASES[case][2] is not None) and GANG_SHAPES.get(p) != shipped)


# --- the workload and the configs ----------------------------------------------------------------------------


def workload(case: str, rate_rps: float | None = None, duration_s: float | None = None, only: str | None = None):
    """The seed-003 workload of `case` (its LM renamed to the case's), at `rate_rps` for `duration_s`; `only`:
    "lm" or "sm", that model's traffic alone (a one-model peak)."""
    from octoserve.services.config import default_config_text, parse_yaml_mapping
    from octoserve.services.workload import scaled
    from octoserve.services.workload_io import workload_from_dict

    profile = workload_from_dict(parse_yaml_mapping(default_config_text(WORKLOAD), WORKLOAD), WORKLOAD)
    lm = _lm_model(_load(CASES[case][1]))
    traffic = tuple(dataclasses.replace(t, model=lm if t.model == LM_IN_WORKLOAD else t.model) for t in profile.traffic)
    if only is not None:
        traffic = tuple(t for t in traffic if (t.model == lm) == (only == "lm"))
    profile = dataclasses.replace(profile, traffic=traffic)
    return scaled(profile, rate_rps=rate_rps, duration_s=duration_s)


def _load(name: str) -> NodeConfig:
    from octoserve.services.config import default_config_text, node_config_from_text

    return node_config_from_text(default_config_text(name), source=name)


def _lm_model(node: NodeConfig) -> str:
    if node.gang is not None:
        return node.instance(node.gang.groups[0].lm).model
    return max(node.models, key=lambda m: node.models[m].num_params)


def config_for(case: str, policy: str, cost_profile: str) -> NodeConfig:
    """The node `policy` runs on in `case`: the workload's SLOs, 32k contexts, `cost_profile`; a gang's bounds
    raised where the workload's SLOs make its floors longer (the bounds stay provable), the baselines' unbounded."""
    _label, gang_name, static_name = CASES[case]
    node = _load(static_name if policy == STATIC else gang_name)
    from octoserve.services.workload_io import with_workload_slos

    models = {m: dataclasses.replace(s, max_context_len=CONTEXT_TOKENS) for m, s in node.models.items()}
    node = dataclasses.replace(node, models=models, cost_profile=cost_profile)
    node = with_workload_slos(node, workload(case))
    if node.gang is not None:
        node = dataclasses.replace(node, gang=_gang_for(node, policy))
    problems = check_placement(node)
    if problems:
        raise PlacementError(problems)
    return node


def _gang_for(node: NodeConfig, policy: str):
    gang = node.gang
    p = with_shared_steps(gang.policy, gang.lm_step_share, gang_itl_ms(node.slo, node.models))
    if policy in BASELINE_SHAPES:
        p = dataclasses.replace(p, shape=BASELINE_SHAPES[policy], max_lm_wait_ms=UNBOUNDED_MS,
                                max_sm_stall_ms=2 * UNBOUNDED_MS, lm_shared_step_ms=0.0, sm_shared_step_ms=0.0,
                                slice_ms=SLICE_MS)
    else:
        if GANG_SHAPES.get(policy):
            p = dataclasses.replace(p, shape=GANG_SHAPES[policy])
        group = gang.groups[0]
        lm_floor_ms = gang_step_floor_s(node, node.instance(group.lm)) * 1e3
        sm_floor_ms = max(gang_step_floor_s(node, node.instance(x)) for x in group.sms) * 1e3
        wait = max(p.max_lm_wait_ms, math.ceil(sm_floor_ms))
        p = dataclasses.replace(p, max_lm_wait_ms=wait, max_sm_stall_ms=max(p.max_sm_stall_ms,
                                                                            math.ceil(wait + lm_floor_ms)))
    return dataclasses.replace(gang, policy=p)


# --- servable requests -------------------------------------------------------------------------------------------


def servable_ids(case: str, trace, cost_profile: str) -> frozenset[str]:
    """Requests whose uncached prompt prefills within their TTFT SLO on the case's idle gang instance of their
    model (the LM at its full TP): what any scheduler could serve in time. The system-prompt prefix (~80 % of
    prompts share one of 16 per model) counts as cached once an earlier request of the trace carried it: the first
    request of each prefix pays for it on every scheduler, a later one pays only if its scheduler evicted it."""
    node = config_for(case, "gang", cost_profile)
    profile = workload(case)
    prefix = {t.model: t.prefix_len_tokens for t in profile.traffic}
    costs = {}
    for inst in node.instances:
        if inst.model not in costs or inst.tp > costs[inst.model][0]:
            costs[inst.model] = (inst.tp, node.cost_model(inst))
    out = []
    seen: set[tuple[str, int]] = set()
    for r in trace:
        warm = r.prefix_group >= 0 and (r.model, r.prefix_group) in seen
        seen.add((r.model, r.prefix_group))
        cached = min(prefix[r.model], len(r.prompt_token_ids) - 1) if warm else 0
        prefill_s = costs[r.model][1].prefill_time_s(len(r.prompt_token_ids) - cached, cached)
        if prefill_s * 1e3 <= r.ttft_slo_ms:
            out.append(r.request_id)
    return frozenset(out)


# --- one run -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ModelRow:
    model: str
    offered: int
    servable: int
    goodput_rps: float
    attainment_admitted: float  # good / admitted
    attainment_offered: float  # good / offered (refused = miss)
    attainment_servable: float  # good servable / servable offered
    ttft_p95_ms: float
    itl_p95_ms: float
    passes: bool  # the capacity criterion (module doc)


@dataclass(frozen=True, slots=True)
class TierRow:
    tier: str
    goodput_rps: float
    attainment_admitted: float


@dataclass(frozen=True, slots=True)
class RunRow:
    case: str
    policy: str
    cost_profile: str
    rate_rps: float
    seed: int
    goodput_rps: float
    models: tuple[ModelRow, ...]
    tiers: tuple[TierRow, ...]
    lm_wait_ms: float  # the longest LM wait (NaN: no gang)
    sm_stall_ms: float  # the longest SM stall
    lm_held: float  # share of the run the LM held the GPUs
    overruns: int

    def model(self, name: str) -> ModelRow:
        return next(m for m in self.models if m.model == name)


@dataclass(frozen=True, slots=True)
class Job:
    case: str
    policy: str
    cost_profile: str
    rate_rps: float
    duration_s: float
    warmup_s: float
    seed: int = 0
    # Long enough for the LM's longest admitted stream (~1,000 tokens at one LM step a cycle): a shorter drain
    # counts streams still running as misses.
    drain_s: float = 120.0
    only: str | None = None  # "lm" / "sm": one model's traffic alone


def run_job(job: Job) -> RunRow:
    from octoserve.services.metrics import meets_slo, passes_capacity
    from octoserve.services.sim.capacity import measured_run
    from octoserve.services.workload import generate_trace

    node = config_for(job.case, job.policy, job.cost_profile)
    trace = generate_trace(workload(job.case, job.rate_rps, job.duration_s, job.only), job.seed)
    servable = servable_ids(job.case, trace, job.cost_profile)
    res, summary = measured_run(node, trace, seed=job.seed, drain_s=job.drain_s, warmup_s=job.warmup_s)
    window = [r for r in res.records if summary.window.contains(r)] if summary.window else list(res.records)
    models = []
    for g in summary.per_model:
        mine = [r for r in window if r.model == g.name and r.request_id in servable]
        good = sum(meets_slo(r, summary.slo) for r in mine)
        att = good / len(mine) if mine else math.nan
        models.append(ModelRow(g.name, g.num_offered, len(mine), g.goodput_rps, g.attainment_admitted,
                               g.attainment_offered, att, g.ttft.p95_ms, g.itl.p95_ms,
                               bool(mine) and att >= CAPACITY_ATTAINMENT and g.fleet_slo_met))
    tiers = tuple(TierRow(g.name, g.goodput_rps, g.attainment_admitted) for g in summary.per_tier)
    gangs = res.gangs
    return RunRow(
        job.case, job.policy + (f" {job.only} only" if job.only else ""), job.cost_profile, job.rate_rps, job.seed, summary.overall.goodput_rps, tuple(models),
        tiers,
        lm_wait_ms=max((g.longest_lm_wait_s for g in gangs), default=math.nan) * 1e3,
        sm_stall_ms=max((g.longest_sm_stall_s for g in gangs), default=math.nan) * 1e3,
        lm_held=(gangs[0].stats.lm_held_s / gangs[0].virtual_s) if gangs and gangs[0].virtual_s else math.nan,
        overruns=sum(g.stats.num_overruns for g in gangs),
    )



# --- the comparison ------------------------------------------------------------------------------------------


SECTION = "## Gang leases on seed 003's node (simulator)"
QUICK_BANNER = "QUICK RUN: short windows; not for citing."
ONE_MODEL_PEAKS = (("lm", 100.0), ("sm", 1500.0))  # the seed's "~100 LM req/s or ~1,500 SM req/s"


@dataclass(frozen=True, slots=True)
class Settings:
    peak_rps: float = 625.0  # seed 003's peak (the workload's rate)
    grid_rps: tuple[float, ...] = (0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 40.0, 80.0)  # the capacity grid: ~2x steps
    duration_s: float = 60.0  # a grid run's window, at least
    warmup_s: float = 10.0  # and its warm-up, at least
    # A grid run's window holds at least this many arrivals of the mix after a warm-up of at least
    # `warmup_arrivals` (~100 and ~25 of the large model's at its 10 %): at the low rates a fixed 60 s would judge a
    # model on a handful of requests, and measure them while the prefix caches are still cold.
    grid_arrivals: int = 1000
    warmup_arrivals: int = 250
    peak_duration_s: float = 20.0
    peak_warmup_s: float = 5.0
    seed: int = 0
    workers: int = 2
    cases: tuple[str, ...] = tuple(CASES)
    cost_profiles: tuple[str, ...] = ("default", "pessimistic")
    quick: bool = False


def quick_settings(**given) -> Settings:
    base = dict(grid_rps=(5.0, 20.0), duration_s=10.0, warmup_s=3.0, grid_arrivals=0, warmup_arrivals=0,
                peak_duration_s=5.0, peak_warmup_s=2.0, quick=True)
    return Settings(**{**base, **given})


def grid_job(settings: Settings, case: str, policy: str, cost_profile: str, rate_rps: float) -> Job:
    """One capacity grid run: a window of at least `grid_arrivals` arrivals after `warmup_arrivals` (Settings)."""
    warmup_s = max(settings.warmup_s, settings.warmup_arrivals / rate_rps)
    duration_s = max(settings.duration_s, warmup_s + settings.grid_arrivals / rate_rps)
    return Job(case, policy, cost_profile, rate_rps, duration_s, warmup_s, settings.seed)


def jobs(settings: Settings) -> list[tuple[Job, ...]]:
    """The work, in units a worker runs in order: a policy's capacity grid (ascending, `run_grid`), and each peak
    run alone."""
    out: list[tuple[Job, ...]] = []
    for cost in settings.cost_profiles:
        for case in settings.cases:
            for policy in policies_of(case):
                out.append((Job(case, policy, cost, settings.peak_rps, settings.peak_duration_s,
                                settings.peak_warmup_s, settings.seed),))
                out.append(tuple(grid_job(settings, case, policy, cost, r) for r in sorted(settings.grid_rps)))
            if case == "seed003":
                out += [(Job(case, "gang", cost, rate, settings.peak_duration_s, settings.peak_warmup_s,
                             settings.seed, only=only),) for only, rate in ONE_MODEL_PEAKS]
    return out


def run_grid(grid: Sequence[Job]) -> list[RunRow]:
    """`grid`'s runs in order, up to the first rate at which every model has failed: a capacity counts only the
    rates below a model's first failure (`capacity_rps`), so the higher ones would change no figure."""
    rows: list[RunRow] = []
    failed: set[str] = set()
    for job in grid:
        row = run_job(job)
        rows.append(row)
        failed.update(m.model for m in row.models if not m.passes)
        if len(failed) == len(row.models):
            break
    return rows


def run_all(settings: Settings, log=None) -> list[RunRow]:
    todo = jobs(settings)
    rows = []
    results: Iterable[list[RunRow]]
    if settings.workers <= 1:
        results = map(run_grid, todo)
    else:
        pool = multiprocessing.get_context("fork").Pool(settings.workers)
        results = pool.imap_unordered(run_grid, todo)
    for done in results:
        rows += done
        if log:
            r = done[-1]
            rates = ", ".join(f"{x.rate_rps:g}" for x in done)
            log(f"{r.cost_profile} {r.case} {r.policy} {rates} req/s done")
    if settings.workers > 1:
        pool.close()
    return rows


def capacity_rps(rows: Sequence[RunRow], model: str | None) -> float:
    """The highest grid rate at which `model` (every model: None) passes, with every lower grid rate passing."""
    best = 0.0
    for row in sorted(rows, key=lambda r: r.rate_rps):
        ok = all(m.passes for m in row.models) if model is None else row.model(model).passes
        if not ok:
            break
        best = row.rate_rps
    return best


def _pct(x: float) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}"


def _ms(x: float) -> str:
    if math.isnan(x):
        return "-"
    return f"{x / 1e3:.1f} s" if x >= 1000 else f"{x:.0f} ms"


def _cap(x: float, grid: Sequence[float]) -> str:
    return f"< {min(grid):g}" if x == 0 else f"{x:g}"


def render(rows: Sequence[RunRow], settings: Settings) -> str:
    """The markdown of the comparison: per case and cost profile, one line per policy."""
    out = [QUICK_BANNER, ""] if settings.quick else []
    for case in settings.cases:
        for cost in settings.cost_profiles:
            mine = [r for r in rows if r.case == case and r.cost_profile == cost and " only" not in r.policy]
            if not mine:
                continue
            models = [m.model for m in mine[0].models]
            lm = next(m for m in models if m != "llama-3-8b")
            sm = "llama-3-8b"
            out.append(f"**{CASES[case][0]}, `{cost}` cost profile.** Capacity (req/s of the mix) on the grid "
                       f"{', '.join(f'{r:g}' for r in settings.grid_rps)}{_windows(settings)}; the rest at "
                       f"{settings.peak_rps:g} req/s (the seed's peak); waits: the longest over every run of the row.")
            out.append("")
            out.append(f"| policy | capacity: every model | {lm} | {sm} | peak goodput {lm} | {sm} | "
                       f"admitted good {lm} % | {sm} % | servable good {lm} % | {sm} % | INTERACTIVE share of goodput % "
                       f"| admitted good INTERACTIVE % | BATCH % | longest LM wait | longest SM stall | LM held % | "
                       "steps over cap |")
            out.append("|---|" + "---:|" * 16)
            for policy in policies_of(case):
                grid = [r for r in mine if r.policy == policy and r.rate_rps != settings.peak_rps]
                peak = next((r for r in mine if r.policy == policy and r.rate_rps == settings.peak_rps), None)
                if peak is None:
                    continue
                tiers = {t.tier: t for t in peak.tiers}
                inter, batch = tiers.get("INTERACTIVE"), tiers.get("BATCH")
                share = inter.goodput_rps / peak.goodput_rps if inter and peak.goodput_rps else math.nan
                runs = [peak, *grid]
                wait = max(r.lm_wait_ms for r in runs)
                stall = max(r.sm_stall_ms for r in runs)
                over = sum(r.overruns for r in runs) if policy in GANG_SHAPES else "-"
                g = settings.grid_rps
                out.append(
                    f"| {policy} | {_cap(capacity_rps(grid, None), g)} | {_cap(capacity_rps(grid, lm), g)} | "
                    f"{_cap(capacity_rps(grid, sm), g)} | {peak.model(lm).goodput_rps:.1f} | "
                    f"{peak.model(sm).goodput_rps:.1f} | "
                    f"{_pct(peak.model(lm).attainment_admitted)} | {_pct(peak.model(sm).attainment_admitted)} | "
                    f"{_pct(peak.model(lm).attainment_servable)} | {_pct(peak.model(sm).attainment_servable)} | "
                    f"{_pct(share)} | {_pct(inter.attainment_admitted if inter else math.nan)} | "
                    f"{_pct(batch.attainment_admitted if batch else math.nan)} | {_ms(wait)} | {_ms(stall)} | "
                    f"{_pct(peak.lm_held)} | {over} |")
            out.append("")
            out.append(capacity_ratio(mine, case, settings.grid_rps) + " " + gang_promise(mine))
            out.append("")
    one = [r for r in rows if " only" in r.policy]
    if one:
        out.append("**One-model peaks on seed 003's node** (gang config; the other model idle, so every shape runs "
                   "the same schedule): SLO-good req/s of the seed's offered peak, and what bounds it.")
        out.append("")
        out.append("| cost profile | load | offered req/s | goodput req/s | % of offered | servable % of offered | "
                   "admitted good % | TTFT P95 ms |")
        out.append("|---|---|---:|---:|---:|---:|---:|---:|")
        for r in sorted(one, key=lambda r: (r.cost_profile, r.policy)):
            m = r.models[0]
            out.append(f"| {r.cost_profile} | {m.model} only | {r.rate_rps:g} | {m.goodput_rps:.1f} | "
                       f"{_pct(m.attainment_offered)} | {_pct(m.servable / m.offered if m.offered else math.nan)} | "
                       f"{_pct(m.attainment_admitted)} | {m.ttft_p95_ms:.0f} |")
        out.append("")
        out.append(one_model_arithmetic(settings.cost_profiles))
    return "\n".join(out)


def _windows(settings: Settings) -> str:
    if not settings.grid_arrivals:
        return f" ({settings.duration_s:g} s after {settings.warmup_s:g} s)"
    return (f" (each run at least {settings.grid_arrivals:,} arrivals and {settings.duration_s:g} s after at least "
            f"{settings.warmup_arrivals:,} and {settings.warmup_s:g} s; a policy's rates stop where every model has "
            "failed)")


def capacity_ratio(rows: Sequence[RunRow], case: str, grid: Sequence[float]) -> str:
    """The shipped gang's every-model capacity against the best baseline's, in words: a baseline that fails the
    grid's lowest rate has a capacity below it, so the ratio is then a lower bound."""
    def cap(policy: str) -> float:
        return capacity_rps([r for r in rows if r.policy == policy and r.rate_rps in grid], None)

    baselines = [p for p in policies_of(case) if p in BASELINE_SHAPES or p == STATIC]
    best = max(baselines, key=cap)
    gang, other = cap("gang"), cap(best)
    lowest = min(grid)
    if other > 0:
        return (f"Every-model capacity: gang {_cap(gang, grid)} req/s, the best baseline ({best}) {other:g}: "
                + (f"{gang / other:.2f}x." if gang > 0 else f"under {lowest / other:g}x."))
    if gang > 0:
        return (f"Every-model capacity: gang {gang:g} req/s; every baseline fails the grid's lowest rate "
                f"({lowest:g} req/s), so the gang's is over {gang / lowest:g}x theirs.")
    return f"Every-model capacity: neither the gang nor any baseline passes the grid's lowest rate ({lowest:g} req/s)."


def gang_promise(rows: Sequence[RunRow]) -> str:
    """The shipped gang's admitted requests good, per model, at its worst run of the row (grid and peak)."""
    parts = []
    runs = [r for r in rows if r.policy == "gang"]
    for name in (m.model for m in runs[0].models) if runs else ():
        admitted = [(r.model(name).attainment_admitted, r.rate_rps) for r in runs
                    if not math.isnan(r.model(name).attainment_admitted)]
        if admitted:
            worst, rate = min(admitted)
            parts.append(f"{name} {_pct(worst)} % (at {rate:g} req/s)")
    return ("The gang's admitted requests good, worst run of its row: " + ", ".join(parts) + ".") if parts else ""


def one_model_arithmetic(cost_profiles: Sequence[str]) -> str:
    """What bounds each model alone on seed 003's node: the GPU time a request costs (its uncached prefill plus
    its share of decode steps at a full batch), by the cost model, over a sample of the workload's requests."""
    import statistics

    from octoserve.services.workload import generate_trace

    lines = []
    trace = generate_trace(workload("seed003", 200.0, 10.0), 0)
    prefix = {t.model: t.prefix_len_tokens for t in workload("seed003").traffic}
    for cost in cost_profiles:
        node = config_for("seed003", "gang", cost)
        for inst_id, count in (("lm-0", 1), ("sm-0", 8)):
            inst = node.instance(inst_id)
            c = node.cost_model(inst)
            batch = inst.max_num_seqs
            costs = []
            for r in (r for r in trace if r.model == inst.model):
                cached = min(prefix[r.model], len(r.prompt_token_ids) - 1) if r.prefix_group >= 0 else 0
                ctx = len(r.prompt_token_ids) + r.output_len / 2
                costs.append(c.prefill_time_s(len(r.prompt_token_ids) - cached, cached)
                             + r.output_len * c.decode_step_time_s(batch, ctx) / batch)
            mean, median = statistics.fmean(costs), statistics.median(costs)
            where = "the whole node" if count == 1 else "one GPU"
            lines.append(f"- `{cost}`, {inst.model} ({'TP=8' if count == 1 else 'eight TP=1 replicas'}): a request "
                         f"costs {1e3 * mean:.0f} ms of {where} on average (uncached prefill, system prompt cached, "
                         f"plus its decode steps' share at a batch of {batch}), {1e3 * median:.0f} ms at the median: "
                         f"{count / mean:.0f} req/s if every request is served, {count / median:.0f} req/s of the "
                         "cheaper half; the seed's peak is far beyond either, so the rest is refused at admission.")
    return "\n".join(lines)


def write_section(path, rows: Sequence[RunRow], settings: Settings, intro: str) -> None:
    """BENCHMARKS.md with its seed-003 gang section (re)written from `rows`."""
    from pathlib import Path

    from octoserve.services.report_sections import replace_section

    path = Path(path)
    text = path.read_text(encoding="utf-8") if path.exists() else "# octoserve benchmarks\n"
    path.write_text(replace_section(text, SECTION, intro + "\n\n" + render(rows, settings)), encoding="utf-8")


def run_section(path, cost_profiles: Sequence[str], workers: int, quick: bool, log=None) -> None:
    """`bench-suite`'s one call: the comparison under its default settings, written into its section of `path`."""
    given: dict[str, Any] = dict(cost_profiles=tuple(cost_profiles), workers=workers)
    settings = quick_settings(**given) if quick else Settings(**given)
    write_section(path, run_all(settings, log), settings, INTRO)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = Settings()
    parser.add_argument("--cases", default=",".join(d.cases), help="comma-separated: " + ", ".join(CASES))
    parser.add_argument("--cost-profiles", default=",".join(d.cost_profiles))
    parser.add_argument("--grid", default=",".join(f"{r:g}" for r in d.grid_rps), help="capacity grid, req/s")
    parser.add_argument("--peak", type=float, default=d.peak_rps)
    parser.add_argument("--duration", type=float, default=d.duration_s, help="grid runs' window, s")
    parser.add_argument("--warmup", type=float, default=d.warmup_s)
    parser.add_argument("--grid-arrivals", type=int, default=d.grid_arrivals,
                        help="a grid run's window holds at least this many arrivals")
    parser.add_argument("--warmup-arrivals", type=int, default=d.warmup_arrivals,
                        help="and its warm-up at least this many")
    parser.add_argument("--peak-duration", type=float, default=d.peak_duration_s)
    parser.add_argument("--peak-warmup", type=float, default=d.peak_warmup_s)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--workers", type=int, default=d.workers)
    parser.add_argument("--quick", action="store_true", help="short windows; the tables say so")
    parser.add_argument("--write", metavar="BENCHMARKS.md", help="(re)write the section in this file too")


def settings_from_args(args: argparse.Namespace) -> Settings:
    given: dict[str, Any] = dict(peak_rps=args.peak, seed=args.seed, workers=args.workers,
                 cases=tuple(c for c in args.cases.split(",") if c),
                 cost_profiles=tuple(c for c in args.cost_profiles.split(",") if c))
    if args.quick:
        return quick_settings(**given)
    return Settings(grid_rps=tuple(float(x) for x in args.grid.split(",") if x), duration_s=args.duration,
                    warmup_s=args.warmup, grid_arrivals=args.grid_arrivals, warmup_arrivals=args.warmup_arrivals,
                    peak_duration_s=args.peak_duration, peak_warmup_s=args.peak_warmup, **given)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m octoserve.services.lab.gang_bench", description=__doc__.split("\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    settings = settings_from_args(args)
    rows = run_all(settings, log=lambda s: print(s, file=sys.stderr, flush=True))
    print(render(rows, settings))
    if args.write:
        write_section(args.write, rows, settings, INTRO)
    return 0


INTRO = """Seed 003's node, `services/configs/node-seed003.yaml`: `dense-180b` (a ~180B dense Llama-style shape, 44.9 GB
of BF16 weights a GPU at TP=8 and 89.8 GB at TP=4, so it needs all eight GPUs) time-shared with eight 8B replicas
resident beside it, both KV pools resident (per GPU 0.6 + 0.3 of 85.9 GB: 6,541 LM and 3,980 SM KV blocks). The
workload is seed 003's mix (`services/configs/workload-seed003.yaml`: 90 % 8B, 10 % LM, prompts up to 32k tokens,
~80 % sharing one of 16 system prompts) at 625 req/s, one peak's worth of the seed's "~1,500 SM or ~100 LM
req/s", with the seed's SLOs: INTERACTIVE (70 %) TTFT 200 ms, BATCH (30 %) 10 s; ITL 65 ms for the 8B (one SM
step plus one LM step at the seed's longest, 15 + 50 ms) and 100 ms for the LM (its step plus as much for the
SMs). The second case is the 70B gang (`node-gang.yaml`, the 70B at TP=8 with eight 8B) on the same workload and
SLOs, where the static split (`node-default.yaml`: 70B TP=4 beside four 8B) is a legitimate baseline.

Policies, all on the same node, workload and seed: **gang** (the config as shipped: shape `deadline` on seed 003's
node, `interleave` on the 70B case), the other gang shapes beside it, and the seed's baselines as shapes of the same
arbiter, run with the starvation bounds out of reach (starving one side is what defines them): **lm-first** (the
whole node reserved for the LM while it has work), **sm-greedy** (the LM steps only when no SM has work),
**slices** (fixed 1 s slices, as a pod-level gang scheduler; work-conserving). Definitions: every run is measured
in steady state (arrivals after the warm-up to the end of the window; 120 s drain, so the LM's longest streams
finish). A grid run's window holds at least 1,000 arrivals of the mix (~100 of the LM's) and 60 s, after a warm-up
of at least 250 arrivals and 10 s (at 0.5 req/s: 2,000 s after 500 s), so that a low rate judges each model on
enough requests with its prefix caches warm; peak runs are 20 s after 5 s. *Servable*: a request whose uncached
prompt prefills within its TTFT SLO on an idle instance of its model at the case's largest TP, which no scheduler
can beat; its system prompt counts as cached once an earlier request of the trace carried it (the first request
of each system prompt pays for it on every scheduler). *Capacity* of a model: the highest grid rate (of the whole
mix) at which >= 90 % of its servable offered requests are good and its TTFT and ITL P95s hold, with every lower
grid rate passing too ("< 0.5": not even the lowest); a policy's grid runs stop at the rate where every model has
failed once, since no higher rate can change a capacity. *Admitted good*: good / admitted; *longest LM wait* and
*SM stall*: the longest over every run of the row, waits still open at the end included; *steps over cap*: gang
steps that ran past the arbiter's cap (the batcher's step model under-predicting the cost model), summed over the
row's runs.

Reproduce (both cost profiles, ~11 min on two cores): `.venv/bin/python -m octoserve.services.lab.gang_bench --write
BENCHMARKS.md` (`--cases seed003`, `--cost-profiles default`, `--grid 0.5,1,2` narrow it; `--quick` for a smoke
run); `make bench` runs it too, after the policy suite. One run by hand: `.venv/bin/octoserve simulate --config
services/configs/node-seed003.yaml --workload services/configs/workload-seed003.yaml --duration 20s --warmup 5s
--cost-profile pessimistic` (the gang; `--set` cannot change the shape, `gang_bench` does)."""


if __name__ == "__main__":
    raise SystemExit(main())
