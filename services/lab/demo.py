"""`octoserve demo` (what `make run` runs): the whole node live, driven by the seed-000 peak, then a report.

Starts the scheduler, the router and one worker process per instance on 127.0.0.1 (sim engines, the embedded
default placement, every modelled duration dilated by --time-scale so two cores can carry eight virtual GPUs),
replays a seed-000 trace at its 300 req/s peak through the load harness for about two minutes of wall time, prints
the SLO report of the live run next to the simulator's report of the very same trace, and stops every process.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from octoserve.services.lab.agreement import Agreement, cap_outputs
from octoserve.services.config import config_file
from octoserve.services.metrics import detect_window, format_summary, summarize
from octoserve.services.progress import Progress
from octoserve.services.workload import PROFILES, generate_trace, scaled


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from octoserve.services.flags import parse_duration_s
    from octoserve.services.config import add_cost_profile_argument

    parser.add_argument("--config", type=config_file, help="node config YAML (default: the embedded default placement)")
    parser.add_argument("--profile", default="seed-000", choices=sorted(PROFILES), help="built-in workload profile")
    parser.add_argument("--rate", type=float, help="req/s in modelled time (default: the profile's peak)")
    parser.add_argument("--duration", type=parse_duration_s, default=8.0,
                        help="arrival window in modelled time, e.g. 8s (default 8 s: the window after the warm-up "
                             "holds enough one-second samples to judge steady state)")
    parser.add_argument("--time-scale", type=float, default=15.0, help="wall seconds per modelled second")
    parser.add_argument("--max-output", type=int, default=128, help="cap on true output lengths (keeps it short)")
    parser.add_argument("--seed", type=int, default=0, help="trace seed")
    add_cost_profile_argument(parser)


def run(args: argparse.Namespace) -> int:
    from octoserve.services.flags import check_positive, check_workload_flags
    from octoserve.services.node.launcher import describe, start_node
    from octoserve.services.loadgen import BenchOptions, run_bench_series
    from octoserve.services.config import config_source, load_with_overrides
    from octoserve.services.sim.driver import run_simulation

    check_workload_flags(args)  # before the node starts
    check_positive("--time-scale", args.time_scale, "the time scale (wall seconds per modelled second)",
                   "--time-scale 15")
    profile = scaled(PROFILES[args.profile], rate_rps=args.rate, duration_s=args.duration)
    trace = cap_outputs(generate_trace(profile, args.seed), args.max_output)
    config = load_with_overrides(args.config, [], args.cost_profile)
    print(f"starting the node (time scale {args.time_scale:g}x) ...", file=sys.stderr)
    node = start_node(config_source(args.config, args.cost_profile), args.time_scale)
    try:
        print(describe(node), file=sys.stderr)
        print(f"replaying {len(trace)} {profile.name} requests at {profile.rate_rps:g} req/s (modelled) ...",
              file=sys.stderr)
        bar = Progress(total=len(trace), label="requests done")
        drain_s = args.max_output * 0.05 * args.time_scale + 60.0
        options = BenchOptions(drain_timeout_s=drain_s)
        try:
            bench = asyncio.run(run_bench_series(node.router_address, trace, time_scale=args.time_scale,
                                                 options=options, progress=bar))
        finally:
            bar.close()
    finally:
        codes = node.stop()
    virtual = run_simulation(config, trace).summary
    # The simulator's warm-up for both, and the live node's own occupancy to judge its steadiness.
    window = detect_window(bench.occupancy, profile.duration_s, warmup_s=virtual.window.start_s)
    live = summarize(bench.records, profile.slo, window)
    print("== live node (latencies in modelled time) ==")
    print(format_summary(live))
    print("\n== the same trace in the simulator ==")
    print(format_summary(virtual))
    print("\n== live vs virtual ==")
    print(Agreement(live, virtual).table())
    print(f"\nnode stopped; exit codes: {codes}")
    return 0 if all(code == 0 for code in codes.values()) else 1
