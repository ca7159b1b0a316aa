"""`octoserve simulate`: run a workload profile on a node config in the discrete-event simulator and report.

Prints the measurement window (warm-up detected or stated, steadiness), the summary table (the same metric
definitions as `octoserve bench` and `vllm bench serve`), per-instance busy fractions and KV use over that window,
preemptions, and the simulator's own speed; optionally writes JSON and PNG plots (those cover the whole run).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from octoserve.services.config import add_cost_profile_argument, config_file, load_with_overrides
from octoserve.services.flags import parse_duration_s  # the one duration parser: 90, 90s, 500ms, 2m
from octoserve.services.metrics import SloSpec, slo_spec_of, summary_to_dict
from octoserve.services.progress import Progress
from octoserve.services.sim.driver import SimResult, cycle_collector_paused, run_simulation
from octoserve.services.workload import generate_trace
from octoserve.services.workload_io import add_workload_arguments, node_workload, with_workload_slos


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=config_file, help="node config YAML (default: the embedded default placement)")
    add_workload_arguments(parser)
    parser.add_argument("--rate", type=float, help="arrival rate in req/s (default: the profile's)")
    parser.add_argument("--duration", type=parse_duration_s, help="arrival window, e.g. 60s (default: profile's)")
    parser.add_argument("--burstiness", type=float, help="gamma shape of inter-arrivals (<1 burstier)")
    parser.add_argument("--seed", type=int, default=0, help="trace and tie-break seed")
    parser.add_argument("--warmup", type=parse_duration_s, default=None,
                        help="warm-up to leave out of every metric, e.g. 10s (default: detected, MSER-5, >= 5 s)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="policies.KEY=VALUE",
        help="override a config value, e.g. --set policies.reservation=full (repeatable; VALUE is YAML)",
    )
    add_cost_profile_argument(parser)
    parser.add_argument("--json", dest="json_path", help="write the summary and per-request records here")
    parser.add_argument("--plots", help="directory for PNG plots")
    parser.add_argument("--fault", dest="faults", action="append", default=[], metavar="INSTANCE@T[+DOWN]",
                        help="lose an instance at T s, back after DOWN s (default 5), e.g. sm-0@30+5; repeatable: "
                             "reports the attainment dip, recovery time, and the requests moved, continued "
                             "and failed (services/sim/faults.py)")


def run(args: argparse.Namespace) -> int:
    with cycle_collector_paused():  # see there: ~5 % of the command's time, nothing to collect
        code, run_objects = _run(args)
        if getattr(args, "whole_process", False):
            # Still paused: the collector's first pass after the pause walks every object the run left (~0.2 s).
            # `run_objects` are still held: the process ends without freeing them one by one either.
            from octoserve.services.usage import exit_process

            exit_process(code)
    del run_objects
    return code


def _run(args: argparse.Namespace) -> tuple[int, tuple]:
    """The command; returns its exit code and the run's large objects (the trace, the result, the simulator)."""
    node = load_with_overrides(args.config, args.overrides, args.cost_profile)
    profile, trace = node_workload(args, node)
    node = with_workload_slos(node, profile)
    if trace is None:
        trace = generate_trace(profile, args.seed)
    print(f"simulating {len(trace)} requests of {profile.name} at {profile.rate_rps:g} req/s "
          f"for {profile.duration_s:g} s on {len(node.instances)} instances", file=sys.stderr)
    from octoserve.services.sim.faults import parse_fault

    try:
        faults = [parse_fault(f) for f in args.faults]
    except ValueError as e:
        raise SystemExit(f"--fault: {e}") from None
    simulator: list = []  # held until the process ends (`run`)
    result = simulate_with_progress(node, trace, profile.duration_s, seed=args.seed, warmup_s=args.warmup,
                                    faults=faults, keep=simulator)
    print(format_result(result))
    if faults:
        print("\n" + format_fault_reports(node, result, faults))
        if args.plots:
            from octoserve.services.sim.faults import plot_fault_attainment

            for model in sorted({node.instance(f.instance_id).model for f in faults}):
                plot_fault_attainment(result.records, slo_spec_of(node.slo), faults, model,
                                      Path(args.plots) / f"fault_attainment_{model}.png")
    if args.json_path:
        write_json(result, args.json_path)
    if args.plots:
        write_plots(result, args.plots, slo_spec_of(node.slo))
    return 0, (trace, result, simulator)


def simulate_with_progress(
    node, trace, duration_s: float, *, seed: int = 0, label: str = "virtual s", warmup_s: float | None = None,
    faults=(), keep: list | None = None,
) -> SimResult:
    bar = Progress(total=int(duration_s), label=label)
    done = [0]

    def advance(t: float) -> None:
        step = min(int(t), int(duration_s)) - done[0]
        if step > 0:
            bar.update(step)
            done[0] += step

    try:
        return run_simulation(node, trace, seed=seed, progress=advance, warmup_s=warmup_s, faults=faults, keep=keep)
    finally:
        bar.close()


def format_fault_reports(node, result: SimResult, faults) -> str:
    from octoserve.services.sim.faults import fault_report, format_reports

    slo = slo_spec_of(node.slo)
    reports = [fault_report(result.records, slo, f, node.instance(f.instance_id).model, counts=counts, faults=faults)
               for f, counts in zip(faults, result.fault_counts_by_fault)]
    return format_reports(reports)


def format_result(result: SimResult) -> str:
    from octoserve.services.metrics import format_summary

    lines = [format_summary(result.summary), "",
             "instance            model          role       steps   busy  preempt  kv_mean  kv_max"
             "   (busy, kv: measurement window)"]
    for s in result.instances:
        lines.append(
            f"{s.instance_id:<19} {s.model:<14} {s.role:<10} {s.num_steps:>6} {s.busy_fraction:>6.1%} "
            f"{s.num_preemptions:>8} {s.kv_mean:>8.1%} {s.kv_max:>7.1%}"
        )
    lines += format_gangs(result)
    lines.append(
        f"\nsimulator speed: {result.virtual_s:.1f} virtual s in {result.wall_s:.1f} wall s = {result.speed:.2f}x"
    )
    return "\n".join(lines)


def format_gangs(result: SimResult) -> list[str]:
    """One line per gang group: the two bounds as measured, lease switches, barrier cost, SM lease states."""
    lines = []
    for g in result.gangs:
        st = g.stats
        states = ", ".join(f"{k} {v}" for k, v in sorted(st.lease_states.items())) or "none"
        lines.append(
            f"\ngang {g.lm} ({g.shape}): max LM lease wait {st.max_lm_wait_s * 1e3:.1f} ms, max SM stall "
            f"{st.max_sm_stall_s * 1e3:.1f} ms, {g.switches_per_s:.1f} lease switches/s, LM held "
            f"{st.lm_held_s / max(g.virtual_s, 1e-9):.0%} of the run, barrier idle {st.barrier_idle_gpu_s:.2f} GPU-s, "
            f"fills {st.num_fill_steps}, forced leases {st.num_forced_lm} / releases {st.num_forced_sm}, "
            f"cap overruns {st.num_overruns}; SM states at lease start: {states}"
        )
    return lines


def write_json(result: SimResult, path: str) -> None:
    from dataclasses import asdict

    payload = {
        "summary": summary_to_dict(result.summary),  # its "window": warm-up, measurement window, steadiness
        "instances": [asdict(s) for s in result.instances],
        "virtual_s": result.virtual_s,
        "wall_s": result.wall_s,
        "records": [asdict(r) for r in result.records],
    }
    Path(path).write_text(json.dumps(payload, default=str))


def write_plots(result: SimResult, directory: str, slo: SloSpec) -> list[Path]:
    from octoserve.services.plots import plot_attainment_over_time, plot_latency_cdfs, plot_timeseries

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    kv = {k.removeprefix("kv:"): v for k, v in result.timeseries.items() if k.startswith("kv:")}
    busy = {k.removeprefix("busy:"): v for k, v in result.timeseries.items() if k.startswith("busy:")}
    occupancy = {"in flight": result.timeseries.get("occupancy", [])}
    return [
        plot_latency_cdfs(result.records, out / "latency_cdfs.png", slo),
        plot_attainment_over_time(result.records, slo, out / "attainment_over_time.png"),
        plot_timeseries(kv, out / "kv_utilisation.png", "KV cache utilisation"),
        plot_timeseries(busy, out / "gpu_busy.png", "GPU busy fraction"),
        plot_timeseries(occupancy, out / "occupancy.png", "requests in flight"),
    ]
