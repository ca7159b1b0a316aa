"""The mix-shift day in the elastic simulator, three configurations side by side (the `octoserve elastic-day`
command: services/sim/cli_elastic_day.py).

For each cost profile it runs, on one seeded trace:
- best static: the candidate placements ranked by the balancer's capacity estimate, once at the day's mean demand
  and once by the mean of each hour's estimate (`hourly_estimate`), the top few of each (and the planner's own pick,
  `planner.rank_placements`, when it serves every model) simulated for the whole day, the best kept;
- oracle: re-planned at every compressed hour for that hour's true demand, switched at zero cost; the placement for an
  hour is the one that serves the most in a simulation of that hour, among the capacity estimate's best few and the
  best static one (`ElasticSim` mode "oracle");
- elastic: the balancer every 2 s from a 10-s window, reconfigurations carried out (drain, migrate, load).
Then the P/D phase alone with disaggregated placements only: the best fixed P:D ratio vs the balancer limited to
role changes. It prints a table per profile, writes PNG plots and, with `--benchmarks`, the BENCHMARKS.md section
"## Elastic pools (simulator)".

The day's mix is by load by default (`--mix load`): the 8B's share s(t) of the node's load moves 90 % -> 10 % -> 90 %
(each model offers its share x `--load` x the req/s it would serve with the whole node to itself); `--mix requests`
takes s(t) as the share of requests at `--rate` req/s instead (see the BENCHMARKS section for why both).

Why one module past 600 lines: the elastic day's runs and its report, one BENCHMARKS section.
"""

from __future__ import annotations

import dataclasses
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from octoserve.services.core.balancer import BalancerPolicy
from octoserve.services.core.elastic_capacity import (
    CapacityModel,
    objective_weights,
    placement_goodput_rps,
    unserved,
    weight_load_s,
)
from octoserve.services.core.elastic_layouts import candidate_layouts
from octoserve.services.core.elastic_load import ModelDemand
from octoserve.services.core.placement import InstanceConfig, NodeConfig
from octoserve.services.core.planner import ModelLoad, WorkloadMix, candidate_placements, rank_placements
from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS
from octoserve.services.core.types import Role
from octoserve.services.metrics import GroupStats, attainment_over_time
from octoserve.services.sim.elastic_sim import (
    DayResult,
    demand_of,
    label_of,
    model_alone_rps,
    run_day,
)
from octoserve.services.workload_day import (
    BASE_OUTPUT,
    BASE_PROMPT,
    LARGE,
    SMALL,
    DayProfile,
    generate_day,
    mix_shift_day,
    pd_phase_day,
)

SECTION = "## Elastic pools (simulator)"
STATIC_TRIALS = 3  # top candidates by estimate simulated for the best static placement


@dataclass
class ProfileRun:
    cost_profile: str
    day: DayProfile
    alone_rps: tuple[float, float]
    static: DayResult
    static_tried: list[tuple[str, float]]  # (label, simulated goodput)
    oracle: DayResult
    elastic: DayResult
    pd_fixed: DayResult
    pd_elastic: DayResult
    gpu: str  # the GPU preset of the node
    adapt_s: float  # step change -> last reconfiguration started within 60 s of it DONE (NaN: none)
    first_adapt_s: float  # step change -> first reconfiguration after it DONE (NaN: none)
    placement_adapt_s: float = math.nan  # step change -> the placement within 5 % of the best for the step's demand
    step_best: str = ""  # the best placement for the step's demand (label)
    step_gap: float = 0.0  # 1 - (the placement at the step's score / the best's), for the step's demand
    pd_tried: list[tuple[str, float]] = dataclasses.field(default_factory=list)  # the P/D phase's static trials
    # The best simulated goodput among the static placements picked for the day's average mix (the mean-demand
    # shortlist and the planner's pick): the static placement one would pick for the day's average mix, beside the
    # best static placement found by the hours too (`static`).
    static_by_mean: float = math.nan
    # With `compare_ranker`: the elastic day and the P/D phase again with that balancer ranker, and its adaptation.
    ranked: DayResult | None = None
    pd_ranked: DayResult | None = None
    ranked_adapt_s: float = math.nan
    # With `compare_in_place`: the elastic day again with decode <-> colocated role changes in place
    # (`BalancerPolicy.role_in_place`), ranker off and (with `compare_ranker`) on, and their adaptation.
    in_place: DayResult | None = None
    in_place_ranked: DayResult | None = None
    in_place_adapt_s: tuple[float, float] = (math.nan, math.nan)
    # How the elastic runs balanced: the ranker, and whether decode <-> colocated role changes ran in place.
    ranker: str = "none"
    in_place: bool = False


def day_node(cost_profile: str, gpu: str) -> NodeConfig:
    models = {name: dataclasses.replace(MODEL_PRESETS[name], name=name) for name in (LARGE, SMALL)}
    return NodeConfig(GPU_PRESETS[gpu], 8, models, (), cost_profile=cost_profile)


def _load_s(run: "ProfileRun", tp: int) -> float:
    return weight_load_s(MODEL_PRESETS[LARGE], GPU_PRESETS[run.gpu], tp)


def _say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def write_section(path_text: str, heading: str, body: str) -> None:
    """Replace (or append) the section `heading` of the markdown file at `path_text` (created when missing)."""
    from octoserve.services.report_sections import replace_section  # noqa: PLC0415

    path = Path(path_text)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    path.write_text(replace_section(text, heading, body))
    _say(f"wrote {heading!r} into {path}")


def print_table(heading: str, header: str, lines: Sequence[str]) -> None:
    """A comparison's table and verdicts on stdout, under its section's title."""
    print(f"\n{heading[3:]}")
    print(header)
    for line in lines:
        print(line)


def hourly_estimate(capacity: CapacityModel, layout: Sequence[InstanceConfig],
                    hours: Sequence[dict[str, ModelDemand]]) -> float:
    """A static placement's capacity-estimate goodput over a day: the mean over its hours of each hour's estimate
    (sum over models of min(that hour's demand, capacity)). Not the estimate at the day's mean demand: min() of a
    mean is not the mean of min(), and a placement short of capacity at one model's peak hours looks as good as one
    that is not when only the mean is compared."""
    return sum(placement_goodput_rps(capacity, layout, d, 0.0)[0] for d in hours) / max(1, len(hours))


def best_static(node: NodeConfig, day: DayProfile, requests, layouts, label: str,
                sources: list[str] | None = None) -> tuple[DayResult, list]:
    """The best static placement for the day: the top `STATIC_TRIALS` candidates by the capacity estimate at the
    day's mean demand, then the best shapes by the mean of the hours' estimates (`hourly_estimate`) not among them
    (up to `STATIC_TRIALS` more), and the planner's pick (unless `label` is "pd"), each simulated for the whole day;
    (best, [(label, goodput)]). `sources`, when given, gets each trial's source in the same order: "mean" (picked
    for the day's average mix: the mean-demand shortlist and the planner), or "hours"."""
    models = sorted(node.models)
    demand = {d.model: d for d in demand_of(requests, models, 0.0, day.duration_s)}
    capacity = CapacityModel(node)
    scored = [(placement_goodput_rps(capacity, l, demand, 0.0), l) for l in layouts]
    # Every configuration must serve every model (`unserved`): a placement whose only 70B instance cannot decode
    # within the ITL is not a placement for this day.
    ranked = [l for (g, caps), l in sorted(scored, key=lambda x: -x[0][0]) if not unserved(caps)]
    n_hours = max(1, math.ceil(day.duration_s / day.hour_s - 1e-9))
    hours = [{d.model: d for d in demand_of(requests, models, h * day.hour_s, min((h + 1) * day.hour_s,
                                                                                   day.duration_s))}
             for h in range(n_hours)]
    by_hour = sorted(ranked, key=lambda l: -hourly_estimate(capacity, l, hours))  # stable: ties keep the mean's order
    trials: list[Sequence[InstanceConfig]] = list(ranked[:STATIC_TRIALS])
    kinds = ["mean"] * len(trials)
    shapes = {label_of(t) for t in trials}
    for layout in by_hour:  # the hours' best shapes not tried yet (a mirror image serves the same)
        if len(trials) >= 2 * STATIC_TRIALS:
            break
        if label_of(layout) not in shapes:
            trials.append(layout)
            kinds.append("hours")
            shapes.add(label_of(layout))
    # The planner's own pick for the day's average mix, when it is a plain (not time-shared) placement serving both.
    total = sum(d.arrival_rps for d in demand.values())
    mix = WorkloadMix(total, tuple(ModelLoad(m, d.arrival_rps / total, d.mean_prompt_tokens, d.mean_output_tokens)
                                   for m, d in demand.items()))
    planner = [p for p, b in rank_placements(
        [p for p in candidate_placements(node.gpu, node.models, node.num_gpus, cost_profile=node.cost_profile)
         if p.config.gang is None], mix) if b.serves_every_model]
    if planner and label != "pd" and _layout_key(planner[0].config.instances) not in {_layout_key(t) for t in trials}:
        trials.append(planner[0].config.instances)
        kinds.append("mean")
    if sources is not None:
        sources.extend(kinds)
    best, tried = None, []
    for layout in trials:
        res = run_day(node, day, requests, layout, "static", layouts=layouts)
        tried.append((label_of(layout), res.summary.overall.goodput_rps))
        if best is None or res.summary.overall.goodput_rps > best.summary.overall.goodput_rps:
            best = res
    return best, tried


def _layout_key(layout: Sequence[InstanceConfig]) -> tuple:
    return tuple(sorted((i.model, i.role.value, i.tp, i.gpu_ids) for i in layout))


def _adapt_s(res: DayResult, step_s: float | None, within_s: float = 60.0, first: bool = False) -> float:
    """From the step to the end of the last (or, with `first`, the first) reconfiguration the balancer started
    within `within_s` after it; NaN when none."""
    if step_s is None:
        return math.nan
    after = [ev.done_s for ev in res.reconfigs if step_s <= ev.planned_s <= step_s + within_s]
    if not after:
        return math.nan
    return (min(after) if first else max(after)) - step_s


def run_profile(cost_profile: str, *, gpu: str = "h100-sxm-80gb", mix: str = "load", load: float = 0.9,
                rate_rps: float = 40.0, hour_s: float = 60.0, hours: float = 24.0, seed: int = 0,
                policy: BalancerPolicy = BalancerPolicy(), ranker: str = "none",
                compare_ranker: str = "", compare_in_place: bool = False) -> ProfileRun:
    """One row of the day's table. `ranker`: the balancer's candidate ranking in the elastic runs ("none": the
    capacity estimate alone; "forward": played forward, services/sim/forward_ranker.py); `compare_ranker`: also run
    the elastic day and the P/D phase with this one, beside (`ProfileRun.ranked`); `compare_in_place`: also run the
    elastic day with in-place role changes, with each ranker (`ProfileRun.in_place`). The P/D phase is not run
    again: its 8B is all prefill or decode and its 70B one instance, so it has no decode <-> colocated change."""
    node = day_node(cost_profile, gpu)
    mean_prompt, mean_output = BASE_PROMPT.mean, BASE_OUTPUT.mean
    alone = (model_alone_rps(node, SMALL, mean_prompt, mean_output), model_alone_rps(node, LARGE, mean_prompt, mean_output))
    if mix == "load":
        day = mix_shift_day(hours=hours, hour_s=hour_s, load_rps=(load * alone[0], load * alone[1]))
    else:
        day = mix_shift_day(rate_rps, hours=hours, hour_s=hour_s)
    requests = generate_day(day, seed)
    layouts = candidate_layouts(node)
    t0 = time.perf_counter()
    _say(f"[{cost_profile}] {day.name}: {len(requests)} requests over {day.duration_s:g} s, {len(layouts)} candidate "
         f"placements; best static ...")
    sources: list[str] = []
    static, tried = best_static(node, day, requests, layouts, "day", sources)
    _say(f"[{cost_profile}]   static {static.summary.overall.goodput_rps:.1f} req/s ({time.perf_counter() - t0:.0f} s); oracle ...")
    # The oracle picks each hour by simulated goodput among the estimate's best and the best static placement.
    oracle = run_day(node, day, requests, [], "oracle", layouts=layouts, policy=policy, oracle_extra=[static.initial])
    _say(f"[{cost_profile}]   oracle {oracle.summary.overall.goodput_rps:.1f} req/s ({time.perf_counter() - t0:.0f} s); elastic ...")
    elastic = run_day(node, day, requests, static.initial, "elastic", layouts=layouts, policy=policy, ranker=ranker,
                      seed=seed)
    _say(f"[{cost_profile}]   elastic {elastic.summary.overall.goodput_rps:.1f} req/s ({time.perf_counter() - t0:.0f} s); P/D phase ...")
    # The P/D phase alone, the 8B disaggregated (the 70B as any placement that serves it: on an 80-GB GPU its only
    # decoding instance is TP 4, so a disaggregated 70B leaves the 8B two GPUs and no ratio to balance), the GPU
    # split between the models fixed.
    pd_day = pd_phase_day(hours=min(8.0, hours), hour_s=hour_s, rate_rps=1.0)
    pd_day = dataclasses.replace(pd_day, schedule=_pd_schedule(day, hour_s))
    pd_requests = generate_day(pd_day, seed + 1)
    disagg = [l for l in layouts if all(i.role is not Role.COLOCATED for i in l if i.model == SMALL)]
    pd_fixed, pd_tried = best_static(node, pd_day, pd_requests, disagg, "pd")
    fixed_layout = pd_fixed.initial
    split = [l for l in disagg if _gpu_split(l) == _gpu_split(fixed_layout)]
    pd_policy = dataclasses.replace(policy, allow_model_changes=False)
    pd_elastic = run_day(node, pd_day, pd_requests, fixed_layout, "elastic", layouts=split, policy=pd_policy,
                         ranker=ranker, seed=seed)
    _say(f"[{cost_profile}]   P/D fixed {pd_fixed.summary.overall.goodput_rps:.1f}, balanced "
         f"{pd_elastic.summary.overall.goodput_rps:.1f} req/s ({time.perf_counter() - t0:.0f} s)")
    run = ProfileRun(cost_profile, day, alone, static, tried, oracle, elastic, pd_fixed, pd_elastic, gpu,
                     _adapt_s(elastic, day.step_s), _adapt_s(elastic, day.step_s, first=True), pd_tried=pd_tried,
                     static_by_mean=max(g for (_, g), k in zip(tried, sources) if k == "mean"), ranker=ranker,
                     in_place=policy.role_in_place if policy.role_in_place is not None else ranker != "none")
    if day.step_s is not None:
        run.placement_adapt_s, run.step_best, run.step_gap = placement_adapt_s(node, day, requests, layouts, elastic,
                                                                              policy)
    if compare_ranker:
        run.ranked = run_day(node, day, requests, static.initial, "elastic", layouts=layouts, policy=policy,
                             ranker=compare_ranker, seed=seed)
        run.pd_ranked = run_day(node, pd_day, pd_requests, fixed_layout, "elastic", layouts=split, policy=pd_policy,
                                ranker=compare_ranker, seed=seed)
        if day.step_s is not None:
            run.ranked_adapt_s = placement_adapt_s(node, day, requests, layouts, run.ranked, policy)[0]
        _say(f"[{cost_profile}]   ranker {compare_ranker}: elastic {run.ranked.summary.overall.goodput_rps:.1f}, "
             f"P/D balanced {run.pd_ranked.summary.overall.goodput_rps:.1f} req/s ({time.perf_counter() - t0:.0f} s)")
    if compare_in_place:
        here = dataclasses.replace(policy, role_in_place=True)
        run.in_place = run_day(node, day, requests, static.initial, "elastic", layouts=layouts, policy=here,
                               ranker=ranker, seed=seed)
        if compare_ranker:
            run.in_place_ranked = run_day(node, day, requests, static.initial, "elastic", layouts=layouts,
                                          policy=here, ranker=compare_ranker, seed=seed)
        if day.step_s is not None:
            run.in_place_adapt_s = (
                placement_adapt_s(node, day, requests, layouts, run.in_place, here)[0],
                placement_adapt_s(node, day, requests, layouts, run.in_place_ranked, here)[0]
                if run.in_place_ranked is not None else math.nan)
        _say(f"[{cost_profile}]   in place: elastic {run.in_place.summary.overall.goodput_rps:.1f}"
             + (f", ranker {compare_ranker} {run.in_place_ranked.summary.overall.goodput_rps:.1f}"
                if run.in_place_ranked is not None else "") + f" req/s ({time.perf_counter() - t0:.0f} s)")
    return run


def placement_adapt_s(node: NodeConfig, day: DayProfile, requests, layouts, res: DayResult,
                      policy: BalancerPolicy, within: float = 0.05) -> tuple[float, str, float]:
    """Time to adapt to the step, measured on the placement: from the step until the node's placement (a change
    counts once DONE) scores within `within` of the best serving candidate for the step period's true demand (the
    capacity estimate and objective the balancer and the oracle use); 0 when the placement at the step already does,
    NaN when it never does before the step ends. Also the best placement's label and the gap at the step."""
    step_end = day.step_s + 3 * day.hour_s
    demand = {d.model: d for d in demand_of(requests, sorted(node.models), day.step_s, step_end)}
    capacity = CapacityModel(node)
    weights = objective_weights(node, policy.objective)
    scored = [(placement_goodput_rps(capacity, l, demand, 0.0, weights), l) for l in layouts]
    best_score, best = max(((g, l) for (g, caps), l in scored if not unserved(caps)), key=lambda x: x[0])
    at_step = [l for t, l in res.layouts if t <= day.step_s][-1]
    gap = 1.0 - placement_goodput_rps(capacity, at_step, demand, 0.0, weights)[0] / best_score
    for t, layout in [(day.step_s, at_step)] + [(t, l) for t, l in res.layouts if day.step_s < t < step_end]:
        if placement_goodput_rps(capacity, layout, demand, 0.0, weights)[0] >= (1.0 - within) * best_score:
            return t - day.step_s, label_of(best), gap
    return math.nan, label_of(best), gap


def _gpu_split(layout: Sequence[InstanceConfig]) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple(sorted((i.model, i.gpu_ids) for i in layout))


def _pd_schedule(day: DayProfile, hour_s: float):
    """The P/D phase at the day's 50/50 point: the mix-shift schedule's rates at hour 6, lengths alternating."""
    base = day.schedule(6 * hour_s)
    pd = pd_phase_day(rate_rps=base.rate_rps, small_share=dict(base.shares)[SMALL], hour_s=hour_s)
    return pd.schedule


# --- reporting ------------------------------------------------------------------------------------------------------


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else math.nan


def _row(name: str, g: GroupStats) -> str:
    return (f"| {name} | {g.name} | {g.num_offered} | {g.goodput_rps:.2f} | {g.attainment_offered:.3f} | "
            f"{g.refused_fraction:.3f} |")


def table(run: ProfileRun) -> str:
    lines = ["| configuration | group | offered | goodput req/s | attainment | refused |", "|---|---|---|---|---|---|"]
    for name, res in (("best static", run.static), ("hourly oracle", run.oracle), ("elastic", run.elastic)):
        s = res.summary
        lines.append(_row(name, s.overall))
        lines += [_row(name, g) for g in (*s.per_model, *s.per_tier)]
    return "\n".join(lines)


def load_goodput(res: DayResult, alone: Sequence[float]) -> float:
    """Load-weighted goodput: each model's goodput over the req/s it would serve with the node to itself, summed
    (the share of the node's capacity served within the SLOs); beside the request goodput, never instead of it."""
    per = {g.name: g.goodput_rps for g in res.summary.per_model}
    return per.get(SMALL, 0.0) / alone[0] + per.get(LARGE, 0.0) / alone[1]


def model_attainment(res: DayResult, model: str) -> float:
    return next((g.attainment_offered for g in res.summary.per_model if g.name == model), math.nan)


def headline(run: ProfileRun) -> dict:
    st, orc, el = (r.summary.overall.goodput_rps for r in (run.static, run.oracle, run.elastic))
    pd_f, pd_e = run.pd_fixed.summary.overall.goodput_rps, run.pd_elastic.summary.overall.goodput_rps
    ls, lo, le = (load_goodput(r, run.alone_rps) for r in (run.static, run.oracle, run.elastic))
    return {
        "static": st, "oracle": orc, "elastic": el, "vs_static": _ratio(el, st), "vs_oracle": _ratio(el, orc),
        "load_static": ls, "load_oracle": lo, "load_elastic": le,
        "load_vs_static": _ratio(le, ls), "load_vs_oracle": _ratio(le, lo),
        "att_large": tuple(model_attainment(r, LARGE) for r in (run.static, run.oracle, run.elastic)),
        "att_small": tuple(model_attainment(r, SMALL) for r in (run.static, run.oracle, run.elastic)),
        "lost": {r.mode: r.lost for r in (run.static, run.oracle, run.elastic)} | {"pd": run.pd_elastic.lost},
        "adapt_s": run.adapt_s, "first_adapt_s": run.first_adapt_s, "placement_adapt_s": run.placement_adapt_s,
        "step_gap": run.step_gap, "step_best": run.step_best,
        "pd_fixed": pd_f, "pd_balanced": pd_e, "pd_factor": _ratio(pd_e, pd_f),
        "reconfigs": len(run.elastic.reconfigs), "migrated": run.elastic.migrated,
        "pd_reconfigs": len(run.pd_elastic.reconfigs),
    }


def print_run(run: ProfileRun) -> None:
    h = headline(run)
    print(f"\n[{run.cost_profile}] {run.day.name}, window {run.static.summary.window.start_s:g}-"
          f"{run.static.summary.window.end_s:g} s")
    print(table(run))
    print(summary_lines(run, h))
    print("decisions by reason:", dict(sorted(run.elastic.counters.items())))


def summary_lines(run: ProfileRun, h: dict | None = None) -> str:
    """The lines under a run's table: each goodput named as in the table, each ratio naming what it divides."""
    h = h or headline(run)
    mean = run.static_by_mean
    return "\n".join([
        f"goodput: best static {h['static']:.2f} req/s, static for the average mix {mean:.2f} req/s, hourly oracle "
        f"{h['oracle']:.2f} req/s, elastic {h['elastic']:.2f} req/s",
        "  (best static: the best of the static placements simulated for the day; static for the average mix: the "
        "best of those picked for the day's mean demand alone)",
        f"elastic / best static {h['vs_static']:.2f}x, elastic / static for the average mix "
        f"{_ratio(h['elastic'], mean):.2f}x, elastic / hourly oracle {h['vs_oracle']:.2f}x",
        f"load-weighted goodput: elastic / best static {h['load_vs_static']:.2f}x, elastic / hourly oracle "
        f"{h['load_vs_oracle']:.2f}x",
        f"lost {h['lost']}, adapted {_adapt_text(h)}, {h['reconfigs']} reconfigurations, {h['migrated']} migrated",
        f"P/D phase, disaggregated: fixed ratio {h['pd_fixed']:.2f} req/s, balanced {h['pd_balanced']:.2f} req/s "
        f"(balanced / fixed {h['pd_factor']:.2f}x, {h['pd_reconfigs']} role changes)",
    ])


def plot_run(run: ProfileRun, out_dir: Path, suffix: str = "") -> list[Path]:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    out_dir.mkdir(parents=True, exist_ok=True)
    bin_s = run.day.hour_s / 4
    fig, axes = plt.subplots(4, 1, figsize=(11, 12), sharex=True)
    for res, color in ((run.static, "tab:gray"), (run.oracle, "tab:green"), (run.elastic, "tab:blue")):
        bins = attainment_over_time(res.records, run.day.slo, bin_s)
        xs = [b.start_s / run.day.hour_s for b in bins]
        axes[0].plot(xs, [b.num_good / bin_s for b in bins], color=color, label=f"{res.mode} (lost {res.lost})")
        axes[1].plot(xs, [b.attainment_offered for b in bins], color=color, label=res.mode)
    offered = attainment_over_time(run.static.records, run.day.slo, bin_s)
    axes[0].plot([b.start_s / run.day.hour_s for b in offered], [b.num_offered / bin_s for b in offered], "k:",
                 label="offered")
    small = [(t / run.day.hour_s, dict(run.day.schedule(t).shares)[SMALL])
             for t in range(0, int(run.day.duration_s), max(1, int(bin_s)))]
    axes[2].plot([x for x, _ in small], [y for _, y in small], color="tab:orange", label="8B share of requests")
    for ev in run.elastic.reconfigs:
        x = ev.planned_s / run.day.hour_s
        axes[3].plot([x, ev.done_s / run.day.hour_s], [len(ev.reconfig.retire)] * 2,
                     color="tab:red" if ev.reconfig.kind.value == "model" else "tab:purple", lw=4)
    axes[3].plot([], [], color="tab:red", lw=4, label="model change (planned -> done)")
    axes[3].plot([], [], color="tab:purple", lw=4, label="role change")
    if run.day.step_s is not None:
        for ax in axes:
            ax.axvline(run.day.step_s / run.day.hour_s, color="k", lw=0.8, ls="--")
    axes[0].set_ylabel("goodput req/s")
    axes[1].set_ylabel("attainment (of offered)")
    axes[2].set_ylabel("8B share")
    axes[3].set_ylabel("instances retired")
    axes[3].set_xlabel(f"hour of the day (1 h = {run.day.hour_s:g} simulated s)")
    for ax in axes:
        ax.legend(loc="upper right", fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"Mix-shift day, {run.cost_profile} cost profile, 8 {run.gpu} GPUs")
    fig.tight_layout()
    path = out_dir / f"elastic-day-{run.cost_profile}{suffix}.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    # The P/D phase: goodput over time, fixed vs balanced ratio.
    fig, ax = plt.subplots(figsize=(11, 3.5))
    for res, color, name in ((run.pd_fixed, "tab:gray", "fixed P:D"), (run.pd_elastic, "tab:blue", "balanced P:D")):
        bins = attainment_over_time(res.records, run.day.slo, bin_s)
        ax.plot([b.start_s / run.day.hour_s for b in bins], [b.num_good / bin_s for b in bins], color=color, label=name)
    for ev in run.pd_elastic.reconfigs:
        ax.axvline(ev.planned_s / run.day.hour_s, color="tab:purple", lw=0.6, alpha=0.5)
    ax.set_xlabel("hour (prefill-heavy and decode-heavy traffic alternate every half hour; purple: role changes)")
    ax.set_ylabel("goodput req/s")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    pd_path = out_dir / f"elastic-pd-{run.cost_profile}{suffix}.png"
    fig.savefig(pd_path, dpi=90)
    plt.close(fig)
    return [path, pd_path]


def _adapt_text(h: dict) -> str:
    if math.isnan(h["placement_adapt_s"]):
        return "not within the step"
    if not math.isnan(h["first_adapt_s"]):
        return f"{h['placement_adapt_s']:.1f} s (first change done {h['first_adapt_s']:.1f} s after the step)"
    return f"{h['placement_adapt_s']:.1f} s (no change needed: {h['step_gap']:.1%} below the best)"


def _headline_row(run: ProfileRun, mix: str) -> str:
    h = headline(run)
    att = "; ".join(f"{a:.3f}" for a in h["att_large"])
    return (f"| 8 {run.gpu} | {run.cost_profile} | {mix} | {h['static']:.2f} | {h['oracle']:.2f} | "
            f"{h['elastic']:.2f} | "
            f"{h['vs_static']:.2f}x | {h['vs_oracle']:.2f}x | {run.static_by_mean:.2f} "
            f"({_ratio(h['elastic'], run.static_by_mean):.2f}x) | {h['load_static']:.3f}; {h['load_oracle']:.3f}; "
            f"{h['load_elastic']:.3f} ({h['load_vs_static']:.2f}x, {h['load_vs_oracle']:.2f}x) | {att} | "
            f"{h['lost']['static']}, {h['lost']['oracle']}, {h['lost']['elastic']}, {h['lost']['pd']} | "
            f"{_adapt_text(h)} | {h['reconfigs']} ({h['migrated']} requests migrated) | {h['pd_fixed']:.2f} -> "
            f"{h['pd_balanced']:.2f} ({h['pd_factor']:.2f}x, {h['pd_reconfigs']} role changes) |")


def _targets(run: ProfileRun) -> str:
    """One bullet: each target met or missed, with the arithmetic behind a miss."""
    h = headline(run)
    mix = "by load" if run.day.name.endswith("load") else "by requests"
    oracle_gain = _ratio(h["oracle"], h["static"])
    adapted = h["placement_adapt_s"]
    parts = [
        f"elastic >= 1.3x best static (request goodput): {'met' if h['vs_static'] >= 1.3 else 'missed'} "
        f"({h['vs_static']:.2f}x; load-weighted {h['load_vs_static']:.2f}x; against the static placement for the "
        f"average mix {_ratio(h['elastic'], run.static_by_mean):.2f}x)",
        f"elastic >= 0.9x oracle (request goodput): {'met' if h['vs_oracle'] >= 0.9 else 'missed'} "
        f"({h['vs_oracle']:.2f}x; load-weighted {h['load_vs_oracle']:.2f}x)",
        f"0 lost: {'met' if all(v == 0 for v in h['lost'].values()) else 'MISSED'}",
        f"adapted within 30 s of the step: {'met' if adapted <= 30 else 'missed'}, {_adapt_text(h)}",
        f"balanced P:D beats the fixed ratio: {'met' if h['pd_factor'] > 1 else 'missed'} ({h['pd_factor']:.2f}x)",
        f"elastic never well below static: {'met' if h['vs_static'] >= 0.97 else 'MISSED'} ({h['vs_static']:.2f}x)",
    ]
    why = ""
    if h["vs_static"] < 1.3 and oracle_gain < 1.3:
        why = (f" Why 1.3x is out of reach here: the hourly oracle, which switches for free and knows each hour's "
               f"demand, serves {oracle_gain:.2f}x the best static placement, so the elastic scheduler would need "
               f"{1.3 / oracle_gain:.2f}x the oracle's goodput to reach 1.3x static"
               + (" (see \"Why the placements differ so little\" below)." if run.gpu == "h100-sxm-80gb" else "."))
    elif h["vs_static"] < 1.3:
        why = (f" A better placement exists: the hourly oracle serves {oracle_gain:.2f}x the best static placement; "
               f"the balancer reaches {h['vs_oracle']:.2f}x of it (its guards, the decisions by reason below, and the "
               f"drains and loads of its {h['reconfigs']} changes cost what the oracle gets for free, and a move that "
               f"needs a model to stop serving for a moment is never made).")
    for name, tried, worse in (("day", run.static_tried, h["vs_static"] < 0.97), ("P/D phase", run.pd_tried,
                                                                                  h["pd_factor"] < 1.0)):
        best = max(tried, key=lambda x: x[1], default=None)
        if worse and best and tried[0][0] != best[0]:
            why += (f" Where the balancer loses ({name}): its capacity estimate ranks {tried[0][0]} first for the "
                    f"{name}'s mix, while the simulator serves {best[1] / tried[0][1]:.2f}x as much on {best[0]}; the "
                    f"balancer moves toward what the estimate prefers (the estimate counts capacity and ignores "
                    f"queueing, which decides TTFT under load).")
    return f"- {run.gpu}, {run.cost_profile}, mix {mix}: " + "; ".join(parts) + "." + why


def _balancer_text(run: ProfileRun) -> str:
    """How the elastic runs balanced, in a sentence or two."""
    how = ("The balancer shortlists moves by its capacity estimate and ranks them by playing each forward from the "
           "node's state (`ranker: forward`, the default; the section \"Elastic pools: forward-simulated ranking\" "
           "compares it with the estimate alone)" if run.ranker == "forward"
           else "The balancer plans by its capacity estimate alone (`ranker: none`)")
    roles = (", and a role change between decode and colocated runs in place, the instance serving throughout "
             "(`role_in_place`, the default with the forward ranker; the section \"Elastic pools: in-place role "
             "changes\" compares it with draining)." if run.in_place else ", and every role change drains first.")
    return how + roles


def why_little(run: ProfileRun) -> str:
    """The 70B's placements on this node, from the capacity estimate: why no placement beats another by much."""
    node = day_node(run.cost_profile, run.gpu)
    capacity = CapacityModel(node)
    load = ModelLoad(LARGE, 1.0, BASE_PROMPT.mean, BASE_OUTPUT.mean)
    itl_ms = run.day.itl_slo_ms * capacity.fraction

    def one(role: Role, tp: int) -> InstanceConfig:
        tokens = 8192 if role is Role.PREFILL else 2048
        return InstanceConfig("x", LARGE, role, tp, tuple(range(tp)), max_num_batched_tokens=tokens)

    def cap(*insts: InstanceConfig) -> float:
        return capacity.model_capacity_rps(list(insts), load)

    def step_ms(tp: int, batch: int) -> float:
        ctx = int(BASE_PROMPT.mean + BASE_OUTPUT.mean / 2)
        return node.cost_model(one(Role.DECODE, tp)).decode_step_time_s(batch, ctx) * 1000

    p2 = dataclasses.replace(one(Role.PREFILL, 2), gpu_ids=(4, 5))
    tp2_decodes = capacity.instance_rps(one(Role.DECODE, 2), load)[1] > 0
    return (f"On 8 {run.gpu} GPUs under the {run.cost_profile} cost profile, at 1000-token prompts and 250-token "
            f"outputs: a 70B TP 2 instance's decode step at batch 1 takes {step_ms(2, 1):.1f} ms against the "
            f"{itl_ms:.0f} ms the balancer sizes decode batches to ({capacity.fraction:.0%} of the ITL SLO), so "
            + ("it can decode" if tp2_decodes else "it cannot decode within the SLO and serves the 70B only as a "
               "prefill instance")
            + f"; at TP 4 the step is {step_ms(4, 1):.1f} ms at batch 1 and {step_ms(4, 64):.1f} ms at 64 (weight "
            f"streaming), so one TP 4 instance serves {cap(one(Role.COLOCATED, 4)):.2f} req/s colocated, a TP 4 "
            f"decode instance with a TP 2 prefill one (6 GPUs) {cap(one(Role.DECODE, 4), p2):.2f} req/s, and the 70B "
            f"alone on all 8 GPUs {run.alone_rps[1]:.1f} req/s (TP 8 needs every GPU, which the 8B may not give up: "
            f"each model keeps an instance). So every placement that serves the 70B gives it 4 or 6 GPUs, the 8B "
            f"gets 4 or 2, and the 6-GPU 70B gains "
            f"{cap(one(Role.DECODE, 4), p2) - cap(one(Role.COLOCATED, 4)):.2f} req/s of 70B for 2 GPUs of 8B: the "
            f"oracle's and the balancer's whole room is the 8B's role split and that swap. (An earlier version of "
            f"this section reported 1.17-1.27x static: those placements gave the 70B a TP 2 colocated instance in "
            f"the 8B-heavy hours, one that cannot decode within the SLO, so the 70B was refused outright while the "
            f"8B used six GPUs.) Moving from a 6-GPU 70B back to 4 GPUs needs the TP 4 decode instance to become "
            f"colocated while the TP 2 prefill one goes: "
            + ("in place, the decoder turns colocated first and serves throughout, then the prefill instance's GPUs "
               "go to the 8B." if run.in_place else
               "drained, for that moment the 70B would have no instance that serves it, so the balancer never makes "
               "such a move (no downtime) and stays where it started there."))


def tp2_text(run: ProfileRun) -> str:
    """The 70B at TP 2 on this run's GPU: its decode step at batch 1 against the ITL target, and what it serves."""
    node = day_node(run.cost_profile, run.gpu)
    capacity = CapacityModel(node)
    load = ModelLoad(LARGE, 1.0, BASE_PROMPT.mean, BASE_OUTPUT.mean)
    inst = InstanceConfig("x", LARGE, Role.COLOCATED, 2, (0, 1), max_num_batched_tokens=2048)
    step = node.cost_model(inst).decode_step_time_s(1, int(BASE_PROMPT.mean + BASE_OUTPUT.mean / 2)) * 1000
    return (f"a 70B TP 2 instance's decode step at batch 1 takes {step:.1f} ms against the "
            f"{run.day.itl_slo_ms * capacity.fraction:.0f} ms target, and colocated it serves "
            f"{capacity.model_capacity_rps([inst], load):.2f} req/s ({run.cost_profile} cost profile).")


def section(runs: Sequence[ProfileRun], command: str, plots: Sequence[Path], wall_s: float,
            request_runs: Sequence[ProfileRun] = (), gpu_runs: Sequence[ProfileRun] = ()) -> str:
    r0 = runs[0]
    day = r0.day
    out = [
        f"Reproduce: `{command}` ({wall_s:.0f} s of wall time; progress on stderr). Simulator: the elastic "
        f"queueing model (services/sim/elastic_sim.py), coarser than the step-level simulator so that a day runs in "
        f"seconds; a node of 8 {r0.gpu} GPUs serving Llama-3-70B and Llama-3-8B, TTFT SLO {day.ttft_slo_ms:g} ms, "
        f"ITL SLO {day.itl_slo_ms:g} ms. Weights load from pinned host memory over PCIe at the measured 55 GB/s, two "
        f"GPUs sharing a switch uplink (the 70B at TP 4: {_load_s(r0, 4):.2f} s), plus an assumed 2 s engine start; "
        f"a role change is an assumed 0.5 s.",
        "",
        f"The day is compressed {3600 / day.hour_s:g}x: one hour is {day.hour_s:g} simulated seconds, the day "
        f"{day.duration_s:g} s. Each run is measured over [{r0.static.summary.window.start_s:g}, "
        f"{r0.static.summary.window.end_s:g}] s (the first hour is the stated warm-up; the day is not steady by design, "
        f"so no steadiness is claimed). The 8B share s(t) moves 90 % -> 10 % -> 90 % over the day (cosine), with a step "
        f"to 15 % from hour 18 to hour 21 and a P/D phase from hour 3 to hour 9 (prefill-heavy and decode-heavy "
        f"traffic alternating every half hour).",
        "",
        "Mix by load (the headline): the 8B offers s(t) x 0.9 x what it alone can serve on the node, the 70B "
        "(1 - s(t)) x 0.9 x its own: the node is always about 90 % loaded, the load moving between the models. "
        "Mix by requests: s(t) is the share of requests at a constant 40 req/s.",
        "",
        f"Every configuration must serve every model: a placement whose only instance of a model cannot meet the "
        f"ITL SLO at any batch (`unserved`) is not a candidate for the static pick, the oracle or the balancer. "
        f"Placements are scored by request goodput (the balancer's default objective; `--objective load` scores each "
        f"model's goodput over its alone capacity instead). Request goodput is the headline; the load-weighted "
        f"goodput (each model's goodput over what it alone would serve on the node, summed: the share of the node's "
        f"capacity served within the SLOs) and the 70B's attainment are reported beside it so that a model starved "
        f"for the other's request count shows.",
        "",
        "The best static placement is the one that serves the most, simulated over the whole day, among the "
        "capacity estimate's best three at the day's mean demand, its best three shapes by the mean of the hours' "
        "estimates (the estimate at the mean demand hides a model's peak hours: min(mean demand, capacity) is not the "
        "mean of min(demand, capacity)) and, for the day, the planner's pick. The elastic runs start from it. "
        "\"Static for the average mix\" is the best of those picked for the day's average mix alone (the mean-demand "
        "three and the planner's pick), what one would deploy knowing only the day's average: the best static "
        "placement is at least as good, since it also tries the hours' best shapes in hindsight. The elastic runs "
        "start from the best static placement, not from this one.",
        "",
        "The hourly oracle picks each hour's placement by measurement: the capacity estimate's best three for that "
        "hour's true demand, the best static placement and the placement in place are each simulated over that hour, "
        "and the one that serves the most is switched to (for free). " + _balancer_text(r0) + " "
        "With `measured_corrections` (off in these runs: with it on, the H200 rows lost to static, see the section "
        "on measured corrections below) it corrects the estimate by what it measures: each period, a model whose placement shape (its instances' TP degrees and "
        "roles) has held a whole load window while refusing requests (saturated) is observed, its served rate over "
        "its estimated capacity blended into a factor for that shape; the factors re-rank the role and TP splits of "
        "the same number of a model's GPUs that were observed (`measured:observed` counts the observations). The cost "
        "check's horizon is the observed demand dwell (how long the load-weighted mix has held within 30 %, mean over "
        "the past segments, at most the 60-s forecast window), not a fixed 60 s.",
        "",
        "| GPUs | cost profile | mix | best static req/s | hourly oracle req/s | elastic req/s | elastic / static | "
        "elastic / oracle | static for the average mix req/s (elastic / it) | "
        "load-weighted goodput: static; oracle; elastic (elastic / static, / oracle) | "
        "70B attainment: static; oracle; elastic | lost (static, oracle, elastic, P/D) | adapted after the step | "
        "reconfigurations | P/D phase, 8B disaggregated: fixed -> balanced ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        *[_headline_row(run, "load") for run in runs],
        *[_headline_row(run, "requests") for run in request_runs],
        *[_headline_row(run, "load") for run in gpu_runs],
        "",
        "\"Adapted\" is measured on the placement: from the step change until the node's placement (a change counts "
        "once done) scores within 5 % of the best serving placement for the step period's true demand (hours 18-21), "
        "by the capacity estimate and objective the balancer and the oracle use; 0 s when the placement at the step "
        "already does (then no change was needed), with the first change's done time when one followed. The P/D "
        "comparison keeps each model's GPUs fixed (the best static placement for the phase among those whose 8B "
        "instances are all prefill or decode) and lets the balancer change roles only.",
    ]
    out += ["", "Targets, stated against these runs (request goodput unless said):"]
    for run in list(runs) + list(request_runs) + list(gpu_runs):
        out.append(_targets(run))
    out += ["", "### Why the placements differ so little", "", why_little(runs[0])]
    for run in gpu_runs[:1]:
        out += ["", f"On 8 {run.gpu} GPUs the space is wider: " + tp2_text(run) + " There the hourly oracle and the "
                "balancer can give the 8B six GPUs in its heavy hours while the 70B keeps serving on two, and the "
                "balancer reaches that placement by starting the 70B's TP 2 instance before retiring its TP 4 one."]
    for run in list(runs) + list(gpu_runs):
        h = headline(run)
        out += ["", f"### {run.cost_profile} cost profile, mix by load, 8 {run.gpu} GPUs", "",
                f"Each model alone on the node: 8B {run.alone_rps[0]:.1f} req/s, 70B {run.alone_rps[1]:.1f} req/s "
                f"(balancer capacity estimate at the base lengths). Static placements simulated: "
                + "; ".join(f"{label} {g:.2f} req/s" for label, g in run.static_tried) + ". Best placement for the "
                f"step period's demand: {h['step_best']}.", "",
                table(run), "",
                "Balancer decisions by reason: " + ", ".join(f"`{k}` {v}" for k, v in sorted(run.elastic.counters.items()))
                + "."]
    out += ["", *[f"![{p.stem}]({p.as_posix()})" for p in plots]]
    return "\n".join(out)


# --- the command --------------------------------------------------------------------------------------------------
