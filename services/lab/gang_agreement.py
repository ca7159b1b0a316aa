"""The time-shared (gang) node, live against virtual: the agreement check of services/lab/agreement.py plus the gang
figures of both sides and the live control-loop latency.

    python -m octoserve.services.lab.gang_agreement [--config services/configs/node-gang.yaml]
        [--profile seed-000 | --workload W.yaml] [--rate 10] [--duration 6] [--time-scale 10]
        [--cost-profile default|pessimistic] [--json F]

Seed 003's node: `--config services/configs/node-seed003.yaml --workload services/configs/workload-seed003.yaml`.

Live, the scheduler runs each gang group's arbiter over the members' sim-engine workers, one grant per step
(services/scheduler/gang_live.py); the simulator runs the same arbiter in virtual time (services/sim/gang_sim.py).
Printed: goodput and TTFT / ITL P95 side by side (±15 % is the agreement bar), then per group the arbiter's
counters on both sides (steps, switches per second, the largest LM wait and SM stall against their bounds,
overruns), and the live control-loop latency (step end -> next grant running, in modelled ms) against the mean
modelled step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import urllib.request
from pathlib import Path

from octoserve.services.lab.agreement import TOLERANCE, Agreement, cap_outputs
from octoserve.services.config import config_file, config_source
from octoserve.services.metrics import summarize
from octoserve.services.workload import PROFILES, generate_trace, scaled

DEFAULT_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "node-gang.yaml")


def scrape_gang_stats(metrics_port: int) -> dict[str, dict[str, float]]:
    """The scheduler's `octoserve_gang_*` gauges: group (LM id) -> figure -> value."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read().decode()
    out: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        if not line.startswith("octoserve_gang_"):
            continue
        head, value = line.rsplit(" ", 1)
        name, _, labels = head.partition("{")
        group = labels.split('group="', 1)[1].split('"', 1)[0]
        out.setdefault(group, {})[name.removeprefix("octoserve_gang_")] = float(value)
    return out


def run(config, trace, time_scale: float, *, duration_s: float, slo=None) -> dict:
    """`config`: a path, or the mapping `config.config_source` makes of a path and a cost profile; `slo`: what both
    sides are judged by (None: the config's, per model and tier, as the simulator judges)."""
    from octoserve.services.config import load_config_source
    from octoserve.services.node.launcher import start_node
    from octoserve.services.loadgen import BenchOptions, run_bench
    from octoserve.services.sim.driver import run_simulation

    node_cfg = load_config_source(config)
    virtual = run_simulation(node_cfg, trace)
    slo = virtual.summary.slo if slo is None else slo
    last_finish_s = max((r.finish_s for r in virtual.records if r.finish_s is not None), default=duration_s)
    drain_s = (last_finish_s - duration_s) * time_scale * 2.0 + 60.0
    node = start_node(config, time_scale)
    try:
        records = asyncio.run(
            run_bench(node.router_address, trace, time_scale=time_scale, options=BenchOptions(drain_timeout_s=drain_s)))
        live_gang = scrape_gang_stats(node.scheduler.metrics_port)
    finally:
        node.stop()
    agreement = Agreement(summarize(records, slo, duration_s, warmup_s=virtual.window.start_s), virtual.summary)
    virtual_gang = {}
    for g in virtual.gangs:
        s = g.stats
        virtual_gang[g.lm] = dict(
            lm_steps=s.num_lm_steps, sm_steps=s.num_sm_steps, switches=s.num_switches,
            switches_per_s=g.switches_per_s, max_lm_wait_ms=1e3 * s.max_lm_wait_s,
            max_sm_stall_ms=1e3 * s.max_sm_stall_s, overruns=s.num_overruns, lm_held_s=s.lm_held_s,
            sm_held_s=s.sm_held_s)
    for lm, figures in live_gang.items():
        figures["switches_per_s"] = figures.get("switches", 0.0) / virtual.virtual_s if virtual.virtual_s else 0.0
    return dict(agreement=agreement, virtual_gang=virtual_gang, live_gang=live_gang, policy=node_cfg.gang.policy,
                records=records)


def gang_table(result: dict) -> str:
    policy = result["policy"]
    rows = [("LM steps", "lm_steps", "{:.0f}"), ("SM steps", "sm_steps", "{:.0f}"),
            ("lease switches / s", "switches_per_s", "{:.1f}"),
            (f"max LM wait ms (bound {policy.max_lm_wait_ms:g})", "max_lm_wait_ms", "{:.1f}"),
            (f"max SM stall ms (bound {policy.max_sm_stall_ms:g})", "max_sm_stall_ms", "{:.1f}"),
            ("overruns", "overruns", "{:.0f}")]
    lines = []
    for lm, virt in result["virtual_gang"].items():
        live = result["live_gang"].get(lm, {})
        lines.append(f"gang group {lm} ({policy.shape})     live      virtual")
        for label, key, fmt in rows:
            lv = fmt.format(live[key]) if key in live else "-"
            lines.append(f"  {label:<30} {lv:>9} {fmt.format(virt[key]):>9}")
        if live:
            lm_step_ms = 1e3 * live["lm_held_s"] / max(1.0, live["lm_steps"])
            lines.append(f"  control-loop latency (modelled ms): p50 {live['control_p50_ms']:.2f}, "
                         f"p95 {live['control_p95_ms']:.2f}, max {live['control_max_ms']:.2f}; "
                         f"LM lease time per LM step {lm_step_ms:.1f} ms")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=config_file, default=DEFAULT_CONFIG)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--profile", default="seed-000", choices=sorted(PROFILES))
    source.add_argument("--workload", help="a workload YAML (its models must be the config's)")
    parser.add_argument("--rate", type=float, default=10.0)
    parser.add_argument("--duration", type=float, default=6.0)
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-output", type=int, default=96, help="cap on true output lengths (wall time)")
    parser.add_argument("--cost-profile", choices=("default", "pessimistic"), default=None)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args(argv)
    if args.workload:
        from octoserve.services.usage import UsageError
        from octoserve.services.workload_io import load_workload

        try:
            base = load_workload(args.workload)
        except (OSError, ValueError, UsageError) as e:
            parser.error(f"--workload {args.workload}: {e}")
    else:
        base = PROFILES[args.profile]
    profile = scaled(base, rate_rps=args.rate, duration_s=args.duration)
    trace = cap_outputs(generate_trace(profile, args.seed), args.max_output)
    config = config_source(args.config, args.cost_profile)
    print(f"live (K={args.time_scale:g}) and virtual: {len(trace)} requests of {profile.name} at {args.rate:g} req/s "
          f"for {args.duration:g} s, cost profile {args.cost_profile or 'of the config'}", flush=True)
    # A workload file's SLOs are per model in the config (seed 003: the LM's ITL is not the 8B's): judge by those.
    result = run(config, trace, args.time_scale, duration_s=args.duration, slo=None if args.workload else profile.slo)
    agreement: Agreement = result["agreement"]
    print(agreement.table())
    ok = agreement.within()
    print(f"agreement within ±{TOLERANCE:.0%}: {'yes' if ok else 'NO'}")
    print(gang_table(result))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({
            "differences": agreement.relative_differences(), "within": ok,
            "live_gang": result["live_gang"], "virtual_gang": result["virtual_gang"]}, indent=2))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
