"""`octoserve elastic-day`: its flags and its run: the day under each cost profile (services/sim/elastic_day.py),
its tables, plots and BENCHMARKS.md section, and the side-by-side arms of `--compare-ranker`
(services/sim/elastic_ranked.py) and `--compare-in-place` (services/sim/elastic_in_place.py), which build on the
day's own tables."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from octoserve.services.core.balancer import RANKERS, BalancerPolicy
from octoserve.services.core.elastic_capacity import OBJECTIVES
from octoserve.services.core.specs import GPU_PRESETS
from octoserve.services.sim import elastic_in_place, elastic_ranked
from octoserve.services.sim.elastic_day import SECTION, plot_run, print_run, run_profile, section, write_section
from octoserve.services.usage import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cost-profile", choices=("default", "pessimistic", "both"), default="both",
                        help="cost-model constants; both runs the day under each")
    parser.add_argument("--mix", choices=("load", "requests"), default="load",
                        help="the 8B share is of the node's load (default) or of requests at --rate")
    parser.add_argument("--load", type=float, default=0.9, help="with --mix load: offered load / node capacity")
    parser.add_argument("--rate", type=float, default=40.0, help="with --mix requests: total req/s")
    parser.add_argument("--hour-s", type=float, default=60.0, help="simulated seconds per hour of the day")
    parser.add_argument("--hours", type=float, default=24.0, help="hours of the day to simulate")
    parser.add_argument("--gpu", default="h100-sxm-80gb", choices=sorted(GPU_PRESETS),
                        help="the node's GPU preset (the project's node: h100-sxm-80gb)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    parser.add_argument("--objective", choices=OBJECTIVES, default="requests",
                        help="what the balancer and the oracle score placements by: request goodput (default) or "
                             "load-weighted goodput (each model's req/s over its alone capacity)")
    parser.add_argument("--ranker", choices=RANKERS, default="forward",
                        help="the balancer's candidate ranking: the capacity estimate alone (none) or each candidate "
                             "move played forward from the node's state in the simulator (forward)")
    parser.add_argument("--role-changes", choices=("auto", "drain", "in-place"), default="auto",
                        help="a role change between decode and colocated runs in place, the instance serving "
                             "throughout, or drains first like every other one; auto (default): in place with the "
                             "forward ranker (`role_in_place`)")
    parser.add_argument("--compare-ranker", choices=[r for r in RANKERS if r != "none"], default="",
                        help="also run every elastic day and P/D phase with this ranker, side by side")
    parser.add_argument("--compare-in-place", action="store_true",
                        help="also run every elastic day with decode <-> colocated role changes in place (with "
                             "--compare-ranker: with both rankers), side by side")
    parser.add_argument("--in-place-benchmarks", default="",
                        help="with --compare-in-place: write its section into this BENCHMARKS.md")
    parser.add_argument("--ranker-benchmarks", default="",
                        help="with --compare-ranker: write its section into this BENCHMARKS.md")
    # No plots unless asked: a user's run must not rewrite the committed docs/bench PNGs (the scripts/elastic_*.py
    # that regenerate the docs pass --plots / --ranker-plots docs/bench themselves).
    parser.add_argument("--ranker-plots", default="",
                        help="with --compare-ranker: folder for its PNG plot (default: none)")
    parser.add_argument("--plots", default="", help="folder for the PNG plots (default: none)")
    parser.add_argument("--benchmarks", default="", help="write the section into this BENCHMARKS.md")
    parser.add_argument("--also-gpu", action="append", default=[], choices=sorted(GPU_PRESETS),
                        help="also run the day on a node of this GPU preset (repeatable): a second placement space")
    parser.add_argument("--also-requests", action="store_true",
                        help="with --mix load: also run the day with the mix by requests (a second table row)")
    parser.add_argument("--command-line", default="octoserve elastic-day --benchmarks BENCHMARKS.md",
                        help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    if args.hour_s <= 0 or args.hours <= 0 or args.load <= 0 or args.rate <= 0:
        raise UsageError("--hour-s, --hours, --load and --rate must be > 0")
    if args.compare_in_place and args.role_changes != "drain":
        raise UsageError("--compare-in-place runs the in-place arms itself: give --role-changes drain")
    if args.compare_ranker and args.compare_ranker == args.ranker:
        raise UsageError(f"--compare-ranker {args.compare_ranker} is the --ranker already; give --ranker none")
    wall0 = time.perf_counter()
    profiles = ("default", "pessimistic") if args.cost_profile == "both" else (args.cost_profile,)
    common = dict(load=args.load, rate_rps=args.rate, hour_s=args.hour_s, hours=args.hours, seed=args.seed,
                  gpu=args.gpu, ranker=args.ranker,
                  policy=BalancerPolicy(objective=args.objective,
                                        role_in_place={"auto": None, "drain": False, "in-place": True}[args.role_changes]),
                  compare_ranker=args.compare_ranker, compare_in_place=args.compare_in_place)
    runs = [run_profile(p, mix=args.mix, **common) for p in profiles]
    request_runs = ([run_profile(p, mix="requests", **common) for p in profiles]
                    if args.also_requests and args.mix == "load" else [])
    gpu_runs = [run_profile(p, mix=args.mix, **{**common, "gpu": g})
                for g in dict.fromkeys(args.also_gpu) if g != args.gpu for p in profiles]
    plots: list[Path] = []
    for r in runs + request_runs + gpu_runs:
        print_run(r)
    for r in runs + gpu_runs:
        if args.plots:
            plots += plot_run(r, Path(args.plots), "" if r.gpu == args.gpu else f"-{r.gpu}")
    if args.benchmarks:
        write_section(args.benchmarks, SECTION,
                      section(runs, args.command_line, plots, time.perf_counter() - wall0, request_runs, gpu_runs))
    if args.compare_ranker:
        elastic_ranked.report(runs + request_runs + gpu_runs, args, time.perf_counter() - wall0)
    if args.compare_in_place:
        elastic_in_place.report(runs + request_runs + gpu_runs, args, time.perf_counter() - wall0)
    return 0
