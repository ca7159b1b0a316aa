"""`octoserve bench-suite`: its flags and its run, which simulates the matrix (services/lab/bench_suite.py), writes the
report (services/lab/bench_report.py) and then the seed-003 gang section (services/lab/gang_bench.py). Apart from the suite
so that the report can read the suite's results without the suite importing its report."""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

from octoserve.services.lab.baselines import BASELINES
from octoserve.services.lab.bench_suite import (
    COST_PROFILES,
    QUICK_BANNER,
    Settings,
    quick_settings,
    rebound,
    run_suite,
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from octoserve.services.flags import parse_duration_s

    d = Settings()
    parser.add_argument("--quick", action="store_true",
                        help=f"short windows, 1 seed, fewer probes; every table says {QUICK_BANNER!r}")
    parser.add_argument("--duration", type=parse_duration_s,
                        help=f"arrival window of each seed-000 run (default {d.duration_s:g} s)")
    parser.add_argument("--warmup", type=parse_duration_s,
                        help=f"arrivals excluded as warm-up (default {d.warmup_s:g} s)")
    parser.add_argument("--drain", type=parse_duration_s,
                        help=f"virtual time after the last arrival (default {d.drain_s:g} s)")
    parser.add_argument("--seed003-duration", type=parse_duration_s,
                        help=f"arrival window of each seed-003 run (default {d.seed003_duration_s:g} s)")
    parser.add_argument("--seed003-warmup", type=parse_duration_s,
                        help=f"seed-003 arrivals excluded as warm-up (default {d.seed003_warmup_s:g} s)")
    parser.add_argument("--seed003-rate", type=float, default=None, help="seed-003 req/s (default: the profile's peak)")
    parser.add_argument("--capacity-steps", type=int,
                        help=f"bisection steps of each capacity probe (default {d.capacity_steps})")
    parser.add_argument("--capacity-seeds", type=int, help=f"seeds per capacity probe (default {d.capacity_seeds})")
    parser.add_argument("--planner-top", type=int,
                        help=f"analytic candidates simulated to pick octoserve's placement (default {d.planner_top})")
    parser.add_argument("--seed", type=int, default=d.seed, help="seed of the single-seed runs")
    parser.add_argument("--workers", type=int, default=d.workers, help="processes (default 2)")
    parser.add_argument("--policies", default=",".join(BASELINES), help="comma-separated subset of the policies")
    parser.add_argument("--cost-profiles", default=",".join(COST_PROFILES), help="comma-separated cost profiles")
    parser.add_argument("--output", default="BENCHMARKS.md", help="markdown file whose sections are (re)written")
    parser.add_argument("--plots", default="docs/bench", help="directory for the PNGs and results.json")
    parser.add_argument("--pickle", help="also save the raw results here (to re-render the report)")
    parser.add_argument("--no-gang-section", action="store_true",
                        help="skip the section on gang leases on seed 003's node (about half the suite's time)")
    parser.add_argument("--render", help="re-render the report from a --pickle file instead of simulating")
    from octoserve.services.lab.user_suite import add_user_workload_arguments

    add_user_workload_arguments(parser)  # --workload / --trace: the comparison on the user's workload instead


def settings_from_args(args: argparse.Namespace) -> Settings:
    given = {"duration_s": args.duration, "warmup_s": args.warmup, "drain_s": args.drain,
             "seed003_duration_s": args.seed003_duration, "seed003_warmup_s": args.seed003_warmup,
             "seed003_rate_rps": args.seed003_rate, "capacity_steps": args.capacity_steps,
             "capacity_seeds": args.capacity_seeds, "planner_top": args.planner_top}
    given = {k: v for k, v in given.items() if v is not None}
    given.update(seed=args.seed, workers=args.workers, policies=tuple(p for p in args.policies.split(",") if p),
                 cost_profiles=tuple(c for c in args.cost_profiles.split(",") if c))
    return quick_settings(**given) if args.quick else Settings(**given)


def run(args: argparse.Namespace) -> int:
    from octoserve.services.progress import Progress

    settings = settings_from_args(args)
    unknown = [p for p in settings.policies if p not in BASELINES]
    if unknown:
        print(f"unknown policies {unknown}; choose from: {', '.join(BASELINES)}", file=sys.stderr)
        return 2
    bad = [c for c in settings.cost_profiles if c not in COST_PROFILES]
    if bad or not settings.cost_profiles:
        print(f"unknown cost profiles {bad}; choose from: {', '.join(COST_PROFILES)}", file=sys.stderr)
        return 2
    log = functools.partial(print, file=sys.stderr, flush=True)
    from octoserve.services.lab.user_suite import run_user_workload, wants_user_workload

    if wants_user_workload(args):
        return run_user_workload(args, settings.policies, settings.cost_profiles, args.duration, args.warmup,
                                 settings.drain_s, settings.seed)
    from octoserve.services.lab.bench_report import write_report

    if args.render:
        import pickle

        results, settings = pickle.loads(Path(args.render).read_bytes())
        write_report(rebound(results), settings, Path(args.output), Path(args.plots))
        return 0
    if settings.quick:
        log(QUICK_BANNER)
    results = run_suite(settings, log, Progress)
    write_report(results, settings, Path(args.output), Path(args.plots))
    if not args.no_gang_section:
        from octoserve.services.lab.gang_bench import run_section

        run_section(Path(args.output), settings.cost_profiles, settings.workers, settings.quick, log)  # its own
    if args.pickle:
        import pickle

        Path(args.pickle).write_bytes(pickle.dumps((results, settings)))
    log(f"wrote {args.output} and plots under {args.plots} in {results.wall_s / 60:.1f} min")
    return 0
