"""The balancer's drain estimate with migration on: by the migration rule vs by the remaining decode, on the
step-level elastic simulator (services/sim/elastic_step.py), where every reconfiguration's drain is also measured.

    python scripts/bench_drain_estimate.py [--hour-s 15] [--gpu h100-sxm-80gb] [--cost-profile default]

The shortened mix-shift day (offered load 0.9 x each model's capacity alone), from the best static placement, with
the elastic balancer and KV migration on, twice: the drain of a retired instance estimated as the live scheduler now
does (`live_balancer.drain_estimates`: the hand-off of the decodes the rule would move, the decode left of those it
would keep) and as before (mean output x step, `drain_by_rule=False`). Per run: goodput, reconfigurations, the
balancer's decisions by reason, and per reconfiguration the estimated drain against the measured one (DRAINING until
the retired instances are idle). Also the refusals the router reported into the balancer's demand window against
the refusals in the records. Run it with `nice -n 10` on a shared machine (about 1-2 minutes per run).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from octoserve.services.core.elastic_layouts import candidate_layouts
from octoserve.services.core.specs import GPU_PRESETS  # noqa: E402
from octoserve.services.workload_day import day_trace  # noqa: E402
from octoserve.services.metrics import summarize  # noqa: E402
from octoserve.services.sim.elastic_day import best_static, day_node  # noqa: E402
from octoserve.services.sim.elastic_sim import model_alone_rps  # noqa: E402
from octoserve.services.sim.elastic_step import ElasticStepSim  # noqa: E402
from octoserve.services.workload_day import BASE_OUTPUT, BASE_PROMPT, LARGE, SMALL, generate_day, mix_shift_day  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hour-s", type=float, default=15.0)
    parser.add_argument("--gpu", default="h100-sxm-80gb", choices=sorted(GPU_PRESETS))
    parser.add_argument("--cost-profile", default="default", choices=("default", "pessimistic"))
    parser.add_argument("--load", type=float, default=0.9)
    args = parser.parse_args()
    node = day_node(args.cost_profile, args.gpu)
    alone = [model_alone_rps(node, m, BASE_PROMPT.mean, BASE_OUTPUT.mean) for m in (SMALL, LARGE)]
    day = mix_shift_day(hours=24.0, hour_s=args.hour_s, load_rps=(args.load * alone[0], args.load * alone[1]))
    requests = generate_day(day, 0)
    print("best static placement ...", file=sys.stderr, flush=True)
    static, _ = best_static(node, day, requests, candidate_layouts(node), "day")
    start = dataclasses.replace(node, instances=tuple(static.initial))
    trace = day_trace(requests)
    rows = []
    for label, by_rule in (("migration rule (now)", True), ("remaining decode (before)", False)):
        t0 = time.perf_counter()
        sim = ElasticStepSim(start, drain_by_rule=by_rule)
        res = sim.run(trace)
        g = summarize(res.sim.records, day.slo, day.duration_s).overall
        print(f"{label}: {g.goodput_rps:.2f} req/s, {len(res.done)} reconfigurations "
              f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
        rows.append((label, g, res, sim))
    print(f"\n{args.gpu}, {args.cost_profile} cost profile, one hour = {args.hour_s:g} s, KV migration on\n")
    print("| drain estimate | goodput req/s | attainment | reconfigurations | migrated / held at drain start | "
          "est. drain (s, median) | measured drain (s, median) | abs. error (s, median; max) | decisions by reason | "
          "lost |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, g, res, _ in rows:
        done = res.done
        est = [r.reconfig.est_drain_s for r in done]
        measured = [r.drain_end_s - r.planned_s for r in done]
        errors = [abs(e - m) for e, m in zip(est, measured)]
        counters = ", ".join(f"{k} {v}" for k, v in sorted(res.counters.items()))
        print(f"| {label} | {g.goodput_rps:.2f} | {g.attainment_offered:.3f} | {len(done)} | "
              f"{sum(r.migrated for r in done)} / {sum(r.held for r in done)} | "
              f"{statistics.median(est) if est else float('nan'):.3f} | "
              f"{statistics.median(measured) if measured else float('nan'):.3f} | "
              f"{statistics.median(errors) if errors else float('nan'):.3f}; {max(errors, default=float('nan')):.3f} | "
              f"{counters} | {res.lost} |")
    print()
    for label, _, res, _ in rows:
        for r in res.done:
            print(f"- {label}: {r.reconfig.reconfig_id} at {r.planned_s:.1f} s retires {', '.join(r.reconfig.retire)}: "
                  f"estimated drain {r.reconfig.est_drain_s:.3f} s, measured {r.drain_end_s - r.planned_s:.3f} s, "
                  f"migrated {r.migrated} of {r.held}, kept {r.kept or {}}")
    label, _, res, sim = rows[0]
    refused_records = sum(1 for r in res.sim.records if r.refused)
    reported_by = sum(1 for r in res.sim.records if r.refused and r.arrival_s <= sim.last_report_s)
    print(f"\nrefusals reported into the balancer's demand window: {sum(sim.reported_refusals.values())} "
          f"({dict(sorted(sim.reported_refusals.items()))}); refused in the records: {refused_records}, of them "
          f"{reported_by} arrived by the last report ({sim.last_report_s:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
