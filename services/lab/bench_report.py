"""The bench suite's report: BENCHMARKS.md sections, plots and results.json from `bench_suite.SuiteResults`.

`write_report(results, settings, markdown, plots)` rewrites two sections of `markdown` (SECTION_POLICY, the policy
comparison; SECTION_CALIBRATION, the cost model against published numbers) and leaves every other section as it is,
writes the PNGs and results.json under `plots`. `octoserve bench-suite` calls it after a run, and `--render PICKLE`
calls it on saved results without simulating again.

Invariants: pure rendering, no simulation: the same results and settings give byte-identical markdown and JSON;
every table of a quick run carries `bench_suite.QUICK_BANNER` between its heading and the table.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

from octoserve.services.lab.baselines import (
    BASELINES,
    BEST_DISAGGREGATED,
    MAIN_POLICIES,
    PLANNER,
    STATIC_SPLIT,
    configure,
    describe_instances,
)
from octoserve.services.lab.bench_suite import (
    PLANNER_CAPACITY,
    QUICK_BANNER,
    ProfileResults,
    Row,
    Settings,
    SuiteResults,
    batch_min_share,
)
from octoserve.services.report_sections import replace_section
from octoserve.services.sim.capacity import CapacitySearch

PEAK_GOODPUT_TARGET_RPS = 97.0
PER_MODEL_BASELINES = ("vllm-default", "sarathi", "distserve")  # what a user would pick instead
# octoserve's per-model SLO capacity over the best of them: 1.5x under the default constants; under the pessimistic
# ones, strictly above (the smallest step of the report's two decimals).
PER_MODEL_TARGET = {"default": 1.5, "pessimistic": 1.01}
SECTION_POLICY = "## Policy comparison (simulator)"
SECTION_CALIBRATION = "## Cost model calibration"


def _f(x: float, digits: int = 1, pct: bool = False) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{100 * x:.{digits}f}" if pct else f"{x:.{digits}f}"


TABLE_HEADER = (
    "| policy | workload | offered req/s | goodput req/s | / roofline | / SLO-aware est. | attained (admitted) % "
    "| attained (offered) % | TTFT P95 ms | ITL P95 ms | refused % | preemptions | KV util % | GPU busy % |\n"
    "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def table_row(r: Row) -> str:
    return (f"| {r.policy} | {r.workload} | {r.offered_rps:.1f} | {r.goodput_rps:.1f} "
            f"| {_f(r.goodput_over_roofline, 2)} "
            f"| {_f(r.goodput_over_slo_estimate, 2)} | {_f(r.attainment_admitted, 1, True)} "
            f"| {_f(r.attainment_offered, 1, True)} | {_f(r.ttft_p95_ms, 0)} | {_f(r.itl_p95_ms, 1)} "
            f"| {_f(r.refused_fraction, 1, True)} | {r.num_preemptions} | {_f(r.kv_utilisation, 1, True)} "
            f"| {_f(r.gpu_busy, 1, True)} |")


def _ratio(a: float, b: float) -> float:
    return a / b if b > 0 else (math.inf if a > 0 else math.nan)


def headline(pr: ProfileResults) -> dict:
    """The figures the targets are stated in, for one cost profile (NaN where a policy or workload did not run)."""
    cap = {p: s.capacity_rps for p, s in pr.capacity.items()}
    octo_rows = [r for r in pr.rows if r.policy == "octoserve"]
    peak = next((r for r in octo_rows if r.workload == "seed-000 peak 300"), None)
    s003 = next((r for r in octo_rows if r.workload.startswith("seed-003")), None)
    models = sorted({g.name for r in octo_rows for g in r.groups if g.name.startswith("llama")})
    worst = min(((g.attainment_admitted, g.name, r.workload) for r in octo_rows for g in r.groups
                 if g.name in models and not math.isnan(g.attainment_admitted)), default=(math.nan, "-", "-"))
    inter = s003.group("INTERACTIVE") if s003 else None
    batch = s003.group("BATCH") if s003 else None
    per_model = {p: s.capacity_rps for p, s in pr.capacity_per_model.items()}
    baselines = [(per_model[p], p) for p in PER_MODEL_BASELINES if p in per_model]
    best_value, best_name = max(baselines, default=(math.nan, "-"))
    octo = per_model.get("octoserve", math.nan)
    return {
        "capacity_per_model_rps": per_model,
        "best_baseline_per_model": (best_value, best_name),
        # equal capacities are 1.00x, both zero included (then nothing passes the lowest probe on either side)
        "octoserve_over_best_per_model": 1.0 if octo == best_value == 0 else _ratio(octo, best_value),
        "capacity_rps": cap,
        "capacity_spread": {p: s.spread() for p, s in pr.capacity.items()},
        "octoserve_over_vllm": _ratio(cap.get("octoserve", math.nan), cap.get("vllm-default", math.nan)),
        "peak_goodput_rps": peak.goodput_rps if peak else math.nan,
        "peak_admitted_by_model": {m: peak.group(m).attainment_admitted for m in models} if peak else {},
        "worst_model_admitted": worst,  # (attainment, model, workload) over every octoserve row
        "seed003_interactive_share": _ratio(inter.goodput_rps, s003.goodput_rps) if inter else math.nan,
        "seed003_interactive_admitted": inter.attainment_admitted if inter else math.nan,
        "seed003_batch_share": _ratio(batch.goodput_rps, s003.goodput_rps) if batch else math.nan,
    }


def targets(pr: ProfileResults) -> list[tuple[str, float, float, str]]:
    """(target, measured, threshold, format) of the headline targets; met when measured >= threshold."""
    h = headline(pr)
    worst, model, workload = h["worst_model_admitted"]
    share = batch_min_share(pr.placements[STATIC_SPLIT][1])
    best_value, best = h["best_baseline_per_model"]
    octo = h["capacity_per_model_rps"].get("octoserve", math.nan)
    return [
        (f"per-model SLO capacity, octoserve / the best of {', '.join(PER_MODEL_BASELINES)} "
         f"(here {best}: {octo:.1f} vs {best_value:.1f} req/s)",
         h["octoserve_over_best_per_model"], PER_MODEL_TARGET.get(pr.cost_profile, 1.5), "{:.2f}x"),
        (f"admitted requests of each model meeting both SLOs, worst model x load (here {model}, {workload})",
         worst, 0.95, "{:.3f}"),
        ("seed-003 peak: INTERACTIVE share of the node's goodput", h["seed003_interactive_share"], 0.80, "{:.3f}"),
        ("seed-003 peak: admitted INTERACTIVE meeting both SLOs", h["seed003_interactive_admitted"], 0.95, "{:.3f}"),
        ("seed-003 peak: BATCH share of goodput (policies.batch_min_share)", h["seed003_batch_share"], share, "{:.3f}"),
        ("goodput at 300 req/s (req/s)", h["peak_goodput_rps"], PEAK_GOODPUT_TARGET_RPS, "{:.1f}"),
        ("SLO capacity, octoserve / vllm-default", h["octoserve_over_vllm"], 2.0, "{:.2f}x"),
    ]


def _verdict(value: float, threshold: float) -> str:
    if math.isnan(value):
        return "not run"
    return "met" if value >= threshold else "**missed**"


def _banner(settings: Settings) -> list[str]:
    return [f"**{QUICK_BANNER}**", ""] if settings.quick else []


def _cap_text(search: CapacitySearch) -> str:
    lo, med, hi = search.spread()
    return f"{search.capacity_rps:.1f} (per seed {lo:.1f} / {med:.1f} / {hi:.1f})"


def headline_tables(results: SuiteResults, settings: Settings) -> list[str]:
    names = list(results.profiles)
    prs = [results.profiles[n] for n in names]
    lines = ["### Headline targets, per cost profile", "", *_banner(settings),
             "| target | threshold | " + " | ".join(f"{n} measured | {n} verdict" for n in names) + " |",
             "|---|---:|" + "---:|---|" * len(names)]
    per_profile = [targets(pr) for pr in prs]
    for i, (name, _, threshold, fmt) in enumerate(per_profile[0]):
        cells = []
        for t in per_profile:
            value = t[i][1]
            cells += ["-" if math.isnan(value) else (fmt.format(value) if not math.isinf(value) else "inf"),
                      _verdict(value, threshold)]
        first = name if len(names) == 1 else name.split(" (here")[0]
        lines.append(f"| {first} | >= {fmt.format(threshold)} | " + " | ".join(cells) + " |")
    if len(names) > 1:
        best = "; ".join(f"{n}: {targets(pr)[0][0].split('(here ')[1].rstrip(')')}" for n, pr in zip(names, prs))
        worst = "; ".join(f"{n}: {targets(pr)[1][0].split('(here ')[1].rstrip(')')}" for n, pr in zip(names, prs))
        lines += ["", f"Best baseline of the first target: {best}. Worst model x load of the second: {worst}."]
    heads = [headline(pr) for pr in prs]
    lines += ["", "### Headline figures, side by side", "", *_banner(settings),
              "| figure | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for p in prs[0].capacity_per_model:
        lines.append(f"| per-model SLO capacity req/s, {p} (per seed min / median / max) | "
                     + " | ".join(_cap_text(pr.capacity_per_model[p]) if p in pr.capacity_per_model else "-"
                                  for pr in prs) + " |")
    for p in prs[0].capacity:
        lines.append(f"| SLO capacity req/s, {p} (per seed min / median / max) | "
                     + " | ".join(_cap_text(pr.capacity[p]) if p in pr.capacity else "-" for pr in prs) + " |")
    lines.append("| SLO capacity, octoserve / vllm-default | "
                 + " | ".join(_f(h["octoserve_over_vllm"], 2) + "x" for h in heads) + " |")
    lines.append("| octoserve goodput at 300 req/s | " + " | ".join(_f(h["peak_goodput_rps"]) for h in heads) + " |")
    for m in sorted(heads[0]["peak_admitted_by_model"]):
        lines.append(f"| octoserve at 300 req/s: admitted {m} meeting both SLOs % | "
                     + " | ".join(_f(h["peak_admitted_by_model"].get(m, math.nan), 1, True) for h in heads) + " |")
    for key, text in (("seed003_interactive_share", "seed-003: INTERACTIVE share of goodput %"),
                      ("seed003_interactive_admitted", "seed-003: admitted INTERACTIVE meeting both SLOs %"),
                      ("seed003_batch_share", "seed-003: BATCH share of goodput %")):
        lines.append(f"| {text} | " + " | ".join(_f(h[key], 1, True) for h in heads) + " |")
    return lines


def placement_lines(pr: ProfileResults, settings: Settings) -> list[str]:
    label = {k: v[0] for k, v in pr.placements.items()}
    lines = [f"Placements: static split = {label.get(STATIC_SPLIT, '-')}; best disaggregated = "
             f"{label.get(BEST_DISAGGREGATED, '-')}."]
    if pr.choice:
        c = pr.choice
        lines += [f"octoserve's capacity probes and 0.25-1x roofline rows ran on the per-model SLO-capacity winner "
                  f"({c.by_capacity}); its overload rows (1.5x roofline, peak, bursty, seed-003) on the goodput "
                  f"winner ({c.by_goodput}). The planner's simulated candidates:", "", *_banner(settings),
                  "| candidate | per-model SLO capacity req/s (per seed min / median / max) | goodput at 300 req/s |",
                  "|---|---:|---:|"]
        for label, (cap, goodput) in c.evaluated.items():
            lo, med, hi = c.capacity_spread[label]
            cell = label.replace("|", "\\|")  # a placement label holds ' | ' between its models
            lines.append(f"| {cell} | {cap:.1f} ({lo:.1f} / {med:.1f} / {hi:.1f}) | {goodput:.1f} |")
    return lines


def capacity_lines(pr: ProfileResults, settings: Settings) -> list[str]:
    lines = [f"#### SLO capacity ({pr.cost_profile})", "", *_banner(settings),
             f"Bisection on the seed-000 rate, {settings.capacity_seeds} seeds per probe; a probe passes on a "
             "majority of seeds. Per model (the headline): a run passes when every model has >= 90 % of its offered "
             "requests good (DistServe, refused = miss) and its own TTFT P95 and ITL P95 inside its own SLOs; "
             "probes give the attainment of offered of the worst model. Pooled: the same test on all requests "
             "together, where the 8B's volume can hide the 70B. Probes: rate: seeds passing, attainment of "
             "offered % min / mean / max.", "",
             "| policy | criterion | SLO capacity req/s | per seed min / median / max | first failing rate | probes |",
             "|---|---|---:|---:|---:|---|"]
    searches = [(p, "per model", s) for p, s in pr.capacity_per_model.items()]
    searches += [(p, "pooled", s) for p, s in pr.capacity.items()]
    for p, criterion, s in searches:
        lo, med, hi = s.spread()
        probes = ", ".join(f"{q.rate_rps:g}: {sum(q.passed)}/{len(q.passed)}, "
                           + "/".join(f"{100 * a:.1f}" for a in q.attainment_spread) for q in s.probes) or "-"
        lines.append(f"| {p} | {criterion} | {s.capacity_rps:.1f} | {lo:.1f} / {med:.1f} / {hi:.1f} | "
                     f"{'-' if math.isinf(s.hi) else f'{s.hi:.1f}'} | {probes} |")
    return lines


def group_lines(pr: ProfileResults, settings: Settings) -> list[str]:
    """Per model (and per tier on seed-003) at each policy's capacity point and at the 300 req/s peak."""
    lines = [f"#### Per model and per tier ({pr.cost_profile})", "", *_banner(settings),
             "At the capacity point (the highest passing probe, seed "
             f"{settings.seed}), at the 300 req/s peak and on seed-003 (per tier).", "",
             "| policy | point | group | goodput req/s | attained (admitted) % | attained (offered) % | TTFT P95 ms "
             "| ITL P95 ms |", "|---|---|---|---:|---:|---:|---:|---:|"]
    points = []
    for p, s in pr.capacity.items():
        rows = pr.probe_rows.get((p, s.capacity_rps))
        if rows:
            points.append((p, f"capacity {s.capacity_rps:g}", rows[0]))
    points += [(r.policy, r.workload, r) for r in pr.rows if r.policy in MAIN_POLICIES
               and (r.workload == "seed-000 peak 300" or r.workload.startswith("seed-003"))]
    for policy, point, r in points:
        for g in r.groups:
            if point.startswith("seed-003") or g.name.startswith("llama"):
                lines.append(f"| {policy} | {point} | {g.name} | {g.goodput_rps:.1f} | "
                             f"{_f(g.attainment_admitted, 1, True)} | {_f(g.attainment_offered, 1, True)} | "
                             f"{_f(g.ttft_p95_ms, 0)} | {_f(g.itl_p95_ms, 1)} |")
    gang_rows = [(p, point, r) for p, point, r in points if not math.isnan(r.gang_max_lm_wait_ms)]
    if gang_rows:
        lines += ["", "Gang leases (whole run, the worst group): the two starvation bounds as measured and lease "
                  "switches per second.", "",
                  "| policy | point | max LM lease wait ms | max SM stall ms | lease switches/s |", "|---|---|---:|---:|---:|"]
        lines += [f"| {p} | {point} | {r.gang_max_lm_wait_ms:.1f} | {r.gang_max_sm_stall_ms:.1f} | "
                  f"{r.gang_switches_per_s:.1f} |" for p, point, r in gang_rows]
    return lines


def policy_section(results: SuiteResults, settings: Settings) -> str:
    first = next(iter(results.profiles.values()))
    lines = [
        *_banner(settings),
        "Generated by `make bench` (`octoserve bench-suite`); method and caveats: `docs/BENCHMARKS_METHOD.md`.",
        f"Simulated H100 node, seed {settings.seed} (capacity probes: seeds {settings.seed}-"
        f"{settings.seed + settings.capacity_seeds - 1}); seed-000 runs of {settings.duration_s:g} s of arrivals "
        f"with the first {settings.warmup_s:g} s excluded as warm-up (+{settings.drain_s:g} s drain), seed-003 "
        f"{settings.seed003_duration_s:g} s with {settings.seed003_warmup_s:g} s warm-up excluded; roofline "
        f"capacity of the seed-000 mix {first.roofline_rps:.1f} req/s (an upper bound by FLOPs). Cost profiles: "
        f"{', '.join(results.profiles)}. Suite wall time {results.wall_s / 60:.1f} min.",
        "",
        *headline_tables(results, settings),
        "",
        DISCUSSION,
    ]
    for pr in results.profiles.values():
        lines += ["", f"### Cost profile: {pr.cost_profile}", "", *placement_lines(pr, settings), "",
                  *capacity_lines(pr, settings), "", *group_lines(pr, settings), "",
                  f"#### Every run ({pr.cost_profile}, seed {settings.seed})", "", *_banner(settings), TABLE_HEADER]
        lines += [table_row(r) for r in pr.rows]
    lines += ["", "### Configurations", ""]
    for p in first.capacity:
        b = BASELINES[p]
        kind = PLANNER_CAPACITY if b.placement == PLANNER else b.placement
        if kind in first.placements:
            lines.append(f"- `{p}`: {b.description}. {describe_instances(configure(b, first.placements[kind][1]))}.")
    lines += ["", "### Plots (default cost profile)", "",
              "- goodput vs offered load: `docs/bench/goodput_vs_load.png`",
              "- TTFT / ITL CDFs at the 300 req/s peak: `docs/bench/cdf_peak_<policy>.png`",
              "- SLO attainment over time, bursty run: `docs/bench/attainment_bursty_<policy>.png`", ""]
    return "\n".join(lines)


DISCUSSION = """\
Reading the headline (the figures are in the tables above; this says only what the mechanisms are):
- **SLO capacity** is set by the 70B's share: it runs at TP=4 beside four 8B replicas, so its one instance bounds
  the 70B's throughput (~3 req/s of its requests), and a prompt of more than ~2,900 tokens (~2,400 pessimistic)
  misses the TTFT however idle the node is. Refused requests count as misses, so refusing 70B requests cannot raise
  the capacity; only a faster 70B can ("What would lift the SLO capacity").
- **Two SLO definitions** are checked at once: DistServe's per-request one (TTFT and mean TPOT per request, >= 90 %
  of offered) and the seed's fleet one (TTFT P95 and pooled per-token ITL P95). A policy with large mixed steps
  (vllm-default's 8,192-token budget) can pass the first at low load while its pooled ITL P95 breaks the second.
- **Overload** is where early refusal matters: policies that admit everything queue without bound and their
  goodput falls toward zero as the queue grows; octoserve refuses what it predicts would miss the TTFT and keeps
  the admitted requests inside both SLOs. The ablation without refusal shows the difference directly.
- **Cost profiles**: a conclusion that holds in both columns does not depend on the cost model's constants being
  right; one that flips under the pessimistic constants does.
- **Sampling**: capacity is reported with its per-seed spread; a difference smaller than that spread, or than one
  bisection step (the gap between the capacity and the first failing rate), is not a difference.
"""


def write_plots(results: SuiteResults, directory: Path) -> list[Path]:
    from octoserve.services.metrics import SloSpec
    from octoserve.services.plots import plot_attainment_over_time, plot_goodput_vs_load, plot_latency_cdfs

    pr = results.profiles.get("default") or next(iter(results.profiles.values()))
    directory.mkdir(parents=True, exist_ok=True)
    slo = SloSpec()
    points = [(r.policy, r.offered_rps, r.goodput_rps) for r in pr.rows
              if r.workload.startswith("seed-000") and "bursty" not in r.workload]
    out = [plot_goodput_vs_load(points, directory / "goodput_vs_load.png")]
    for (policy, workload), records in sorted(pr.records.items()):
        if policy not in MAIN_POLICIES:
            continue
        if "peak" in workload:
            out.append(plot_latency_cdfs(records, directory / f"cdf_peak_{policy}.png", slo))
        elif "bursty" in workload:
            out.append(plot_attainment_over_time(records, slo, directory / f"attainment_bursty_{policy}.png"))
    return out


def _search_json(s: CapacitySearch) -> dict:
    return {"capacity_rps": s.capacity_rps, "first_failing_rps": None if math.isinf(s.hi) else s.hi,
            "per_seed": s.per_seed_capacity(), "probes": [dataclasses.asdict(q) for q in s.probes]}


def results_json(results: SuiteResults, settings: Settings) -> dict:
    out = {"quick": settings.quick, "banner": QUICK_BANNER if settings.quick else None, "profiles": {}}
    for name, pr in results.profiles.items():
        out["profiles"][name] = {
            "placements": {k: v[0] for k, v in pr.placements.items()},
            "roofline_rps": pr.roofline_rps,
            "rows": [dataclasses.asdict(r) for r in pr.rows],
            "capacity": {p: _search_json(s) for p, s in pr.capacity.items()},
            "capacity_per_model": {p: _search_json(s) for p, s in pr.capacity_per_model.items()},
            "headline": headline(pr),
            "targets": [{"target": t, "measured": v, "threshold": th} for t, v, th, _ in targets(pr)],
        }
    return out


def write_report(results: SuiteResults, settings: Settings, markdown: Path, plots: Path) -> None:
    write_plots(results, plots)
    (plots / "results.json").write_text(json.dumps(results_json(results, settings), indent=1, default=str) + "\n")
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
    from octoserve.services.core.cost_model import COST_PROFILES, DEFAULT_CONSTANTS, CostModel
    from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS, num_kv_blocks

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
        "(docs/COST_MODEL.md, \"Profiles\"); \"Headline targets, per cost profile\" shows which conclusions survive it.",
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
        "`docs/COST_MODEL.md` (\"Sources\"). Against the decode floors (weights streamed at datasheet HBM bandwidth):",
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
        "Profiles measured on one H200 (8B TP=1, 70B TP=4 and TP=8 shards) are in `docs/bench/h200/`, with whole-step",
        "timings against both cost profiles in \"Cost model against a real GPU (H200)\" below; no H100 was measured.",
        "CPU timings on this shared 2-core machine are dominated by scheduler noise (10 ms slices) and are not reported",
        "as calibration.",
    ]
    return "\n".join(lines)
