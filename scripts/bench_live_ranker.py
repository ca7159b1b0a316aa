"""The elastic balancer's forward ranker on the live node: the estimate alone vs the forward ranker, side by side.

    python scripts/bench_live_ranker.py [--rate 60] [--hour-s 8] [--hours 4] [--time-scale 8] [--max-output 300]
                                        [--cost-profile pessimistic]

The P/D phase (prefill-heavy and decode-heavy 8B traffic alternating every half hour; one hour = `--hour-s`
modelled seconds) on the sim-engine node (separate processes, time dilated by `--time-scale`), started from the
embedded default placement (the 70B at TP 4, four colocated 8B), with the scheduler's elastic balancer on and role
changes only (the GPU split between the models fixed), outputs capped at `--max-output` tokens so that a dilated
request's stream fits the harness's drain (sized to the longest output at the ITL SLO), twice on the same trace: `ranker: none` (the capacity
estimate decides alone) and `ranker: forward` (each candidate move played forward from a twin of the node built from
the workers' load reports and the routers' demand reports, services/sim/live_ranker.py). Per run: goodput and
attainment per model, requests lost (errors or unfinished; must be 0), reconfigurations done, and the balancer's
decisions by reason from the scheduler's log. About 2 x (hours x hour-s x time-scale) seconds of wall time plus
start-ups; progress goes to stdout. Run it with `nice -n 10` on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from octoserve.services.lab.elastic_agreement import PERIOD_S, POLICY, WINDOW_S, node_config  # noqa: E402
from octoserve.services.workload_day import day_trace  # noqa: E402
from octoserve.services.node.launcher import start_node  # noqa: E402
from octoserve.services.loadgen import BenchOptions, run_bench  # noqa: E402
from octoserve.services.metrics import summarize  # noqa: E402
from octoserve.services.workload_day import SMALL, generate_day, pd_phase_day  # noqa: E402

# The forward ranker's clock on a compressed day: it ranks every 2 s (a quarter of an 8-s hour), judges a role
# change over 5 s and replays the last 10 s of arrivals.
FORWARD = {"forward_refresh_s": 2.0, "forward_short_s": 5.0, "forward_window_s": 10.0}


def decisions(scheduler_log: str) -> Counter:
    out: Counter = Counter()
    for line in scheduler_log.splitlines():
        if '"balancer decision"' in line:
            out[json.loads(line).get("reason", "?")] += 1
    return out


def run_once(ranker: str, args, requests) -> dict:
    config = node_config(None, args.cost_profile)
    config["elastic"].update({"ranker": ranker, "allow_model_changes": False, **(FORWARD if ranker != "none" else {})})
    profile_s = args.hours * args.hour_s
    print(f"[{ranker}] live: {profile_s * args.time_scale:.0f} s of arrivals at time scale {args.time_scale:g} ...",
          flush=True)
    t0 = time.perf_counter()
    node = start_node(config, args.time_scale, startup_timeout_s=180, grace_s=5)
    try:
        # The drain waits for the longest stream: its output at the ITL SLO, dilated, three times over.
        drain_s = max(60.0, 3.0 * args.max_output * 0.030 * args.time_scale)
        records = asyncio.run(run_bench(node.router_address, day_trace(requests), time_scale=args.time_scale,
                                        options=BenchOptions(drain_timeout_s=drain_s)))
        log = node.scheduler.log_file.read_text()
    finally:
        node.stop()
    print(f"[{ranker}] done in {time.perf_counter() - t0:.0f} s", flush=True)
    return {"records": records, "reconfigs": log.count('"msg": "reconfiguration done"'), "decisions": decisions(log)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=60.0, help="8B req/s (modelled)")
    parser.add_argument("--max-output", type=int, default=300, help="output tokens, at most")
    parser.add_argument("--hour-s", type=float, default=8.0)
    parser.add_argument("--hours", type=float, default=4.0)
    parser.add_argument("--time-scale", type=float, default=8.0)
    parser.add_argument("--cost-profile", default="pessimistic", choices=("default", "pessimistic"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    profile = pd_phase_day(rate_rps=args.rate, small_share=1.0, hours=args.hours, hour_s=args.hour_s)
    requests = [dataclasses.replace(r, output_tokens=min(r.output_tokens, args.max_output))
                for r in generate_day(profile, args.seed) if r.model == SMALL]
    print(f"{len(requests)} requests of {SMALL} over {profile.duration_s:g} modelled s; balancer policy "
          f"{POLICY}, period {PERIOD_S:g} s, window {WINDOW_S:g} s; forward ranker {FORWARD}", flush=True)
    runs = {r: run_once(r, args, requests) for r in ("none", "forward")}
    print(f"\n{args.cost_profile} cost profile, rate {args.rate:g} req/s, one hour = {args.hour_s:g} s, "
          f"{args.hours:g} hours, time scale {args.time_scale:g}\n")
    print("| ranker | goodput req/s | attainment | refused | lost | reconfigurations | decisions by reason |")
    print("|---|---|---|---|---|---|---|")
    good = {}
    for name, run in runs.items():
        s = summarize(run["records"], profile.slo, profile.duration_s).overall
        good[name] = s.goodput_rps
        lost = s.num_unfinished  # admitted and never finished (failed ones included)
        reasons = ", ".join(f"`{k}` {v}" for k, v in sorted(run["decisions"].items()))
        print(f"| {name} | {s.goodput_rps:.2f} | {s.attainment_offered:.3f} | {s.refused_fraction:.3f} | {lost} | "
              f"{run['reconfigs']} | {reasons} |")
    print(f"\nforward / none: {good['forward'] / good['none']:.2f}x" if good["none"] > 0 else "")
    for name, run in runs.items():
        errors = Counter(r.error[:160] for r in run["records"] if r.error and not r.refused)
        if errors:
            print(f"[{name}] not finished: {dict(errors)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
