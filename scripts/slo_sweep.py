"""Goodput per model against offered load, octoserve beside the engines a user would pick instead, in one run.

Every policy serves the same seed-000 traces: vLLM's defaults (`vllm-default`), Sarathi-Serve's ITL-sized budget
(`sarathi`) and octoserve on the embedded default placement (the 70B at TP=4 beside four 8B replicas), DistServe
(`distserve`) on the planner's best placement with every model split into prefill and decode instances, each at
every rate of `--rates`, under both cost profiles, over `--seeds` seeds. Each run is `--duration` seconds of
arrivals with the first `--warmup` excluded (+120 s drain, so every admitted request finishes). Each model is
judged against its own SLOs: a request is good when its TTFT and TPOT are within them, a refused request is a
miss. A model's row also says whether its
TTFT P95 and ITL P95 (pooled over its gaps) are inside its SLOs.

Per-model SLO capacity on the grid: the highest swept rate at which, on the median seed, every model has >= 90 %
of its offered requests good and its own P95s inside its SLOs (pooled capacity, for comparison: the same with the
node's requests pooled). Writes the BENCHMARKS.md section "## SLO budget: goodput per model against load
(simulator)" and docs/bench/slo_sweep_<profile>.png (good requests per second of each model against the offered
rate). Progress on stderr.

Usage: python scripts/slo_sweep.py [--rates 0.5,1,2,4,8,12,16,24,300] [--seeds 0,1,2] [--duration 120] [--warmup 20]
       [--workers 2] [--benchmarks BENCHMARKS.md] [--plots docs/bench]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

POLICIES = ("vllm-default", "sarathi", "distserve", "octoserve")
PROFILES = ("default", "pessimistic")
HEADING = "## SLO budget: goodput per model against load (simulator)"
THRESHOLD = 0.9


@dataclasses.dataclass(frozen=True)
class Cell:
    """One model's figures in one run."""

    good: float  # good / offered
    goodput_rps: float
    refused: float
    ttft_p95_ms: float
    itl_p95_ms: float
    slo_met: bool  # its TTFT P95 and pooled ITL P95 inside its own SLOs


def run_one(job: tuple[str, str, float, int, float, float]) -> tuple[tuple, dict[str, Cell], bool]:
    profile, policy, rate, seed, duration_s, warmup_s = job
    from octoserve.services.lab import baselines
    from octoserve.services.config import load_node_config
    from octoserve.services.metrics import passes_capacity
    from octoserve.services.sim.capacity import DRAIN_S
    from octoserve.services.sim.driver import run_simulation
    from octoserve.services.workload import PROFILES as WORKLOADS
    from octoserve.services.workload import generate_trace, scaled

    node = dataclasses.replace(load_node_config(), cost_profile=profile)
    if baselines.BASELINES[policy].placement == baselines.BEST_DISAGGREGATED:
        node = disaggregated_placement(profile)
    config = baselines.configure(dataclasses.replace(baselines.BASELINES[policy], placement="static"), node)
    trace = generate_trace(scaled(WORKLOADS["seed-000"], rate_rps=rate, duration_s=duration_s), seed)
    summary = run_simulation(config, trace, seed=seed, warmup_s=warmup_s, drain_s=DRAIN_S).summary
    cells = {g.name: Cell(g.attainment_offered, g.goodput_rps, g.refused_fraction, g.ttft.p95_ms, g.itl.p95_ms,
                          g.fleet_slo_met) for g in summary.per_model}
    return job, cells, passes_capacity(summary.overall, THRESHOLD)


@functools.lru_cache(maxsize=None)
def disaggregated_placement(profile: str):
    """The planner's best placement with every model split into prefill and decode instances (what the suite gives
    DistServe), under `profile`."""
    from octoserve.services.lab.bench_suite import best_disaggregated, ranked_placements, with_cost_profile
    from octoserve.services.config import load_node_config

    return best_disaggregated(ranked_placements(with_cost_profile(load_node_config(), profile)))[0].config


def median_cell(cells: list[Cell]) -> tuple[Cell, float, float]:
    """The seed whose good share is the median, and the spread (min, max) of the good share."""
    ordered = sorted(cells, key=lambda c: c.good)
    return ordered[len(ordered) // 2], ordered[0].good, ordered[-1].good


def per_model_pass(cells: dict[str, Cell]) -> bool:
    return all(c.good >= THRESHOLD and c.slo_met for c in cells.values())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rates", default="0.5,1,2,4,8,12,16,24,300",
                        help="offered rates, req/s (default 0.5,1,2,4,8,12,16,24,300: 300 is the seed-000 peak)")
    parser.add_argument("--seeds", default="0,1,2", help="trace seeds (default 0,1,2)")
    parser.add_argument("--duration", type=float, default=120.0, help="arrival window of each run, s (default 120)")
    parser.add_argument("--warmup", type=float, default=20.0, help="arrivals excluded as warm-up, s (default 20)")
    parser.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    parser.add_argument("--profiles", default=",".join(PROFILES), help="cost profiles (default default,pessimistic)")
    parser.add_argument("--benchmarks", default="", help="markdown file whose section is rewritten (default: none)")
    parser.add_argument("--plots", default="", help="directory for the PNG plots (default: none)")
    args = parser.parse_args(argv)
    rates = [float(r) for r in args.rates.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    profiles = args.profiles.split(",")
    jobs = [(p, pol, r, s, args.duration, args.warmup) for p in profiles for r in rates for pol in POLICIES
            for s in seeds]
    results: dict[tuple, tuple[dict[str, Cell], bool]] = {}
    started = time.monotonic()
    with ProcessPoolExecutor(max_workers=args.workers) as pool:
        for i, (job, cells, pooled) in enumerate(pool.map(run_one, jobs), 1):
            results[job[:4]] = (cells, pooled)
            print(f"[{i}/{len(jobs)}] {job[0]} {job[1]} {job[2]:g} req/s seed {job[3]} "
                  f"({time.monotonic() - started:.0f} s)", file=sys.stderr, flush=True)
    body = render(results, profiles, rates, seeds, args, time.monotonic() - started)
    print(body)
    if args.benchmarks:
        from octoserve.services.report_sections import replace_section

        path = Path(args.benchmarks)
        path.write_text(replace_section(path.read_text(encoding="utf-8"), HEADING, body), encoding="utf-8")
    if args.plots:
        for profile in profiles:
            plot(results, profile, rates, seeds, Path(args.plots) / f"slo_sweep_{profile}.png")
    return 0


def render(results, profiles, rates, seeds, args, wall_s: float) -> str:
    models = sorted({m for cells, _ in results.values() for m in cells})
    command = (f"python scripts/slo_sweep.py --rates {args.rates} --seeds {args.seeds} --duration {args.duration:g} "
               f"--warmup {args.warmup:g} --benchmarks BENCHMARKS.md --plots docs/bench")
    out = [f"`{command}` ({wall_s / 60:.0f} min). The seed-000 mix on the embedded default placement (DistServe on the "
           f"planner's best prefill/decode split), every policy on "
           f"the same traces, seeds {args.seeds}; {args.duration:g} s of arrivals, the first {args.warmup:g} s "
           "excluded. Each cell: the median seed's share of the model's offered requests that were good under its "
           "own SLOs (refused = miss), with the seeds' min-max, then its TTFT P95 / ITL P95 in ms; `*` marks a P95 "
           "outside the model's SLO. Plots: `docs/bench/slo_sweep_<profile>.png`.", ""]
    for profile in profiles:
        out += [f"### {profile} cost profile", "",
                "| rate req/s | policy | " + " | ".join(f"{m}: good (min-max), TTFT/ITL P95" for m in models)
                + " | refused " + " / ".join(m.split("-")[-1] for m in models) + " |",
                "|---:|---|" + "---|" * len(models) + "---|"]
        behind: list[str] = []
        for rate in rates:
            behind += behind_at(results, profile, rate, seeds, models)
            for policy in POLICIES:
                row = [f"{rate:g}", policy]
                refused = []
                for m in models:
                    cell, lo, hi = median_cell([results[profile, policy, rate, s][0][m] for s in seeds])
                    mark = "" if cell.slo_met else " *"
                    row.append(f"{100 * cell.good:.1f} % ({100 * lo:.0f}-{100 * hi:.0f}), "
                               f"{cell.ttft_p95_ms:.0f} / {cell.itl_p95_ms:.1f}{mark}")
                    refused.append(f"{100 * cell.refused:.0f} %")
                out.append("| " + " | ".join(row) + " | " + " / ".join(refused) + " |")
        out += ["", capacity_line(results, profile, rates, seeds), ""]
        out.append("octoserve below a baseline on every seed (same traces): " + ("; ".join(behind) if behind else "none")
                   + ".")
        out.append("")
    return "\n".join(out)


def behind_at(results, profile, rate, seeds, models) -> list[str]:
    """Where octoserve's good share of a model is below a baseline's on every seed (paired: the same trace), with
    the median gap in points."""
    out = []
    for m in models:
        for policy in POLICIES[:-1]:
            gaps = [results[profile, "octoserve", rate, s][0][m].good - results[profile, policy, rate, s][0][m].good
                    for s in seeds]
            if max(gaps) < 0:
                out.append(f"{m} at {rate:g} req/s vs {policy} ({100 * statistics.median(gaps):+.1f} points)")
    return out


def capacity_line(results, profile, rates, seeds) -> str:
    parts = []
    for policy in POLICIES:
        per_model = pooled = 0.0
        for rate in rates:
            runs = [results[profile, policy, rate, s] for s in seeds]
            ordered = sorted(runs, key=lambda r: min(c.good for c in r[0].values()))
            cells, _ = ordered[len(ordered) // 2]
            if per_model_pass(cells):
                per_model = rate
            if statistics.median(1.0 if p else 0.0 for _, p in runs) >= 1.0:
                pooled = rate
        parts.append(f"{policy} {per_model:g} (pooled {pooled:g})")
    return ("Per-model SLO capacity on this grid (highest swept rate, req/s, where every model passes on the median "
            "seed; 0: none): " + ", ".join(parts) + ".")


def plot(results, profile, rates, seeds, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({m for (p, *_), (cells, _) in results.items() if p == profile for m in cells})
    fig, axes = plt.subplots(1, len(models), figsize=(5.5 * len(models), 4.2), squeeze=False)
    for ax, m in zip(axes[0], models):
        for policy in POLICIES:
            ys = [median_cell([results[profile, policy, r, s][0][m] for s in seeds])[0].goodput_rps for r in rates]
            ax.plot(rates, ys, marker="o", label=policy)
        ax.set_title(f"{m} ({profile} cost profile)")
        ax.set_xscale("log")
        ax.set_xlabel("offered rate, whole node (req/s, log scale)")
        ax.set_ylabel(f"{m} requests good under its SLOs (req/s)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
