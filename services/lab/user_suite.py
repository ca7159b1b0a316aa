"""`octoserve bench-suite --workload FILE.yaml | --trace FILE.jsonl`: the policy comparison on a user's workload.

The full suite (`octoserve bench-suite`) is the seed workloads' matrix and rewrites BENCHMARKS.md; this runs the
chosen policies (`--policies`, default the four main ones) on the user's workload in the simulator, every policy on
the one placement of `--config` (the embedded default without it; the planner's and DistServe's own placement
searches belong to the full suite), under each `--cost-profiles` entry, and prints one table. Nothing is written
unless `--json FILE` is given. Every figure is over the steady-state window, as in `simulate`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from octoserve.services.lab.baselines import BASELINES, MAIN_POLICIES, configure
from octoserve.services.config import config_file
from octoserve.services.core.placement import PlacementError
from octoserve.services.usage import UsageError

COLUMNS = ("cost profile", "policy", "offered", "refused %", "goodput req/s", "attained of offered %",
           "TTFT P95 ms", "ITL P95 ms", "errors")


def add_user_workload_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("your own workload (instead of the seed matrix; prints a table, writes nothing)")
    one = group.add_mutually_exclusive_group()
    one.add_argument("--workload", type=config_file, metavar="FILE.yaml",
                     help="a workload profile (format: docs/WORKLOADS.md)")
    one.add_argument("--trace", metavar="FILE.jsonl", help="requests, one JSON object a line (format: docs/WORKLOADS.md)")
    group.add_argument("--config", type=config_file,
                       help="the placement every policy runs on (default: the embedded one)")
    group.add_argument("--only-served", action="store_true", help="drop requests for models the config lacks")
    group.add_argument("--json", dest="user_json", metavar="FILE", help="also write the table's figures here")


def wants_user_workload(args: argparse.Namespace) -> bool:
    return bool(getattr(args, "workload", None) or getattr(args, "trace", None))


def run_user_workload(args: argparse.Namespace, policies: tuple[str, ...], cost_profiles: tuple[str, ...],
                      duration_s: float | None, warmup_s: float | None, drain_s: float, seed: int) -> int:
    """The table of `policies` x `cost_profiles` on the user's workload (drain_s: kept for the full suite's flag)."""
    from octoserve.services.config import load_with_overrides
    from octoserve.services.sim.cli_simulate import simulate_with_progress
    from octoserve.services.workload import generate_trace
    from octoserve.services.workload_io import node_workload, with_workload_slos

    config = load_with_overrides(args.config, [])
    profile, trace = node_workload(args, config)
    config = with_workload_slos(config, profile)
    if trace is None:
        trace = generate_trace(profile, seed)
    policies = policies if policies != tuple(BASELINES) else MAIN_POLICIES
    print(f"bench-suite on {profile.name}: {len(trace)} requests, policies {', '.join(policies)}, placement "
          f"{args.config or 'embedded default'}", file=sys.stderr)
    rows = []
    for cost_profile in cost_profiles:
        for policy in policies:
            try:
                node = dataclasses.replace(configure(BASELINES[policy], config), cost_profile=cost_profile)
            except PlacementError as e:
                raise UsageError(f"policy {policy} cannot run on this placement: {e}") from None
            result = simulate_with_progress(node, trace, profile.duration_s, seed=seed, warmup_s=warmup_s,
                                            label=f"{cost_profile} {policy}")
            o = result.summary.overall
            rows.append({"cost profile": cost_profile, "policy": policy, "offered": o.num_offered,
                         "refused %": 100 * o.refused_fraction, "goodput req/s": o.goodput_rps,
                         "attained of offered %": 100 * o.attainment_offered, "TTFT P95 ms": o.ttft.p95_ms,
                         "ITL P95 ms": o.itl.p95_ms, "errors": o.num_errors})
    print(format_table(rows))
    if args.user_json:
        Path(args.user_json).write_text(json.dumps({"workload": profile.name, "rows": rows}, indent=2))
    return 0


def format_table(rows: list[dict]) -> str:
    def cell(v) -> str:
        return f"{v:.1f}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r[c]) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)
