"""The mix-shift day, shortened, live and simulated: the sim-engine node (separate processes, dilated by K) with the
elastic balancer on in its scheduler, against the elastic simulator (services/sim/elastic_sim.py) in "elastic" mode
on the same trace with the same balancer policy.

    python -m octoserve.services.elastic_agreement [--rate 8] [--hour-s 1.0] [--time-scale 8] [--max-output 64]

The day (services/workload_day.py, "mix-shift-day") is compressed further: one hour of the day is `--hour-s`
simulated seconds (the named day uses 15 s), and true output lengths are capped at `--max-output` on both sides, so
the live run takes minutes. Reported side by side: goodput, SLO attainment, refused share, requests lost (sent
without a final status, or failed other than by an admission refusal), and reconfigurations carried out. Agreement:
goodput and attainment within ±15 % of the step-level elastic simulator (services/sim/elastic_step.py: the
step-level simulator with the same balancer, fed the same load figures as the live scheduler builds, carrying out
its reconfigurations in simulated time). Two diagnostic columns: the queueing-level elastic simulator
(services/sim/elastic_sim.py, per-instance prefill server and decode slots, exact queues as the balancer's input),
and the step-level simulator with the start placement and no balancer.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time

from octoserve.services.core.balancer import BalancerPolicy
from octoserve.services.core.types import Priority
from octoserve.services.metrics import summarize
from octoserve.services.workload import TraceRequest
from octoserve.services.workload_day import DayRequest, generate_day, mix_shift_day

TOLERANCE = 0.15
# The balancer's policy on both sides, sized for a shortened day (a move must pay for itself over 30 s).
POLICY = {"forecast_window_s": 30.0, "min_dwell_s": 5.0, "confirm_periods": 1, "min_gain_fraction": 0.03,
          "engine_init_s": 0.5}
PERIOD_S, WINDOW_S = 1.0, 6.0


def day_trace(requests: list[DayRequest]) -> list[TraceRequest]:
    """The day's requests as the load harness sends them: distinct token prompts (no shared prefix)."""
    return [TraceRequest(r.request_id, r.arrival_s, r.model,
                         tuple(1000 + (n * 7919 + i * 31) % 30000 for i in range(r.prompt_tokens)),
                         r.output_tokens, r.output_tokens, Priority.STANDARD, r.ttft_slo_ms)
            for n, r in enumerate(requests)]


def node_config(base_path: str | None) -> dict:
    import yaml

    from octoserve.services.config import default_config_text

    text = default_config_text() if base_path is None else open(base_path, encoding="utf-8").read()
    config = yaml.safe_load(text)
    config["elastic"] = {"balancer": "elastic", "period_s": PERIOD_S, "window_s": WINDOW_S, **POLICY}
    return config


def run(args) -> int:
    from octoserve.services.config import node_config_from_text
    from octoserve.services.launcher import start_node
    from octoserve.services.loadgen import BenchOptions, run_bench
    from octoserve.services.sim.driver import run_simulation
    from octoserve.services.sim.elastic_sim import run_day
    from octoserve.services.sim.elastic_step import ElasticStepSim

    import yaml

    profile = mix_shift_day(rate_rps=args.rate, hours=24.0, hour_s=args.hour_s)
    requests = [dataclasses.replace(r, output_tokens=min(r.output_tokens, args.max_output))
                for r in generate_day(profile, args.seed)]
    config = node_config(args.config)
    node_cfg = node_config_from_text(yaml.safe_dump(config))
    t0 = time.perf_counter()
    sim = run_day(node_cfg, profile, requests, node_cfg.instances, "elastic", policy=BalancerPolicy(**POLICY),
                  period_s=PERIOD_S, window_s=WINDOW_S)
    print(f"simulated {len(requests)} requests over {profile.duration_s:g} s in {time.perf_counter() - t0:.1f} s; "
          f"{len(sim.reconfigs)} reconfigurations", flush=True)
    print(f"live: {profile.duration_s * args.time_scale:.0f} s of arrivals at time scale {args.time_scale:g} ...",
          flush=True)
    node = start_node(config, args.time_scale, startup_timeout_s=180, grace_s=5)
    try:
        records = asyncio.run(run_bench(node.router_address, day_trace(requests), time_scale=args.time_scale,
                                        options=BenchOptions(drain_timeout_s=120.0)))
        scheduler_log = node.scheduler.log_file.read_text()
    finally:
        node.stop()
    live_reconfigs = scheduler_log.count('"msg": "reconfiguration done"')
    t0 = time.perf_counter()
    estep = ElasticStepSim(node_cfg, policy=BalancerPolicy(**POLICY), period_s=PERIOD_S,
                           window_s=WINDOW_S).run(day_trace(requests))
    print(f"step-level elastic simulator: {time.perf_counter() - t0:.1f} s; {len(estep.done)} reconfigurations",
          flush=True)
    live = summarize(records, profile.slo, profile.duration_s)
    stepel = summarize(estep.sim.records, profile.slo, profile.duration_s)
    virt = summarize(sim.records, profile.slo, profile.duration_s)
    # The step-level simulator on the same trace and the start placement (a diagnostic: where the gap comes from).
    step = summarize(run_simulation(node_cfg, day_trace(requests)).records, profile.slo, profile.duration_s)
    lost = live.overall.num_errors + live.overall.num_unfinished
    o = (live.overall, stepel.overall, virt.overall, step.overall)
    rows = [("goodput req/s", *(g.goodput_rps for g in o), True),
            ("SLO attainment %", *(100 * g.attainment_offered for g in o), True),
            ("refused %", *(100 * g.refused_fraction for g in o), False),
            ("reconfigurations", live_reconfigs, len(estep.done), len(sim.reconfigs), 0, False),
            ("errors or unfinished", lost, estep.lost + stepel.overall.num_unfinished, sim.lost,
             step.overall.num_errors + step.overall.num_unfinished, False)]
    for m in sorted({r.model for r in requests}):
        per = [next(g for g in s.per_model if g.name == m) for s in (live, stepel, virt, step)]
        rows.append((f"goodput {m} req/s", *(g.goodput_rps for g in per), False))
    print("\n| metric | live (dilated) | step-level elastic sim | live vs step-level elastic | "
          "queueing elastic sim (diagnostic) | live vs queueing | step-level static (diagnostic) | live vs static |"
          "\n|---|---|---|---|---|---|---|---|")
    ok = True
    for name, lv, ev, vv, sv, checked in rows:
        ediff, diff, sdiff = _rel(lv, ev), _rel(lv, vv), _rel(lv, sv)
        ok &= (abs(ediff) <= TOLERANCE) if checked else True
        print(f"| {name} | {lv:.2f} | {ev:.2f} | {ediff:+.1%} | {vv:.2f} | {diff:+.1%} | {sv:.2f} | {sdiff:+.1%} |")
    print("\nstep-level elastic reconfigurations: " + ("; ".join(
        f"{ev.reconfig.kind.value} {'+'.join(ev.reconfig.retire)} -> {'+'.join(c.id for c in ev.reconfig.start)} "
        f"planned {ev.planned_s:.1f} s, drained {ev.drain_end_s:.1f} s, done {ev.done_s:.1f} s"
        for ev in estep.reconfigs) or "none") + f"; balancer decisions {dict(sorted(estep.counters.items()))}")
    errors = sorted({r.error[:120] for r in records if r.error and not r.refused})
    if errors:
        print("\nlive errors (not refusals): " + "; ".join(errors[:3]))
    print(f"\nagreement with the step-level elastic simulator (goodput, attainment) within ±{TOLERANCE:.0%}: "
          f"{'yes' if ok else 'NO'}; lost live: {lost}")
    return 0 if ok and lost == 0 else 1


def _rel(live: float, ref: float) -> float:
    return (live - ref) / ref if ref else (0.0 if live == ref else float("inf"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=None, help="node config YAML (default: the embedded default)")
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--hour-s", type=float, default=1.0)
    parser.add_argument("--time-scale", type=float, default=8.0)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
