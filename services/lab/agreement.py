"""Live matches virtual: the same node config and the same trace, run by the live services (dilated by a time
scale K) and by the discrete-event simulator, must give the same SLO picture.

`compare(config, trace, time_scale)` starts the node (`octoserve.services.node.launcher.start_node`), replays the trace with the
load harness (`octoserve.services.loadgen.run_bench`, latencies divided by K), simulates the same trace
(`octoserve.services.sim.driver.run_simulation`), and returns both summaries side by side with their relative differences on
goodput and TTFT / ITL P95. `octoserve`'s tests and BENCHMARKS.md use it; the tolerance is ±15 %.

Where the two differ, it is the live system's own overheads (Python scheduling time that the K-dilation does not
fully hide, gRPC hops, load reports that lag the engines) against the simulator's instantaneous view.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import dataclass, replace

from octoserve.services.config import config_file
from octoserve.services.metrics import SloSpec, Summary, percentile_inf, summarize
from octoserve.services.workload import PROFILES, TraceRequest, generate_trace, scaled

TOLERANCE = 0.15


@dataclass(frozen=True, slots=True)
class Agreement:
    live: Summary
    virtual: Summary
    # model -> (live, virtual) TTFT P95 ms over the window's requests both runs served: the same requests' first
    # tokens, apart from which few requests each side's admission took (goodput and refusals say that).
    both_served_ttft_p95_ms: tuple[tuple[str, float, float], ...] = ()

    def relative_differences(self) -> dict[str, float]:
        live, virt = self.live.overall, self.virtual.overall
        return {
            "goodput": _rel(live.goodput_rps, virt.goodput_rps),
            "ttft_p95": _rel(live.ttft.p95_ms, virt.ttft.p95_ms),
            "itl_p95": _rel(live.itl.p95_ms, virt.itl.p95_ms),
        }

    def within(self, tolerance: float = TOLERANCE) -> bool:
        return all(abs(d) <= tolerance for d in self.relative_differences().values())

    def per_model_ttft_differences(self) -> dict[str, float]:
        """model -> relative difference of its TTFT P95 (live vs virtual), for the models both runs served. A
        pooled P95 over models whose first tokens differ by several times measures the admission mix as much as
        the latency: one more admitted 70B request in a short window moves it."""
        live = {g.name: g.ttft.p95_ms for g in self.live.per_model}
        virt = {g.name: g.ttft.p95_ms for g in self.virtual.per_model}
        return {m: _rel(live[m], virt[m]) for m in sorted(live) if m in virt}

    def both_served_ttft_differences(self) -> dict[str, float]:
        """model -> relative difference of its TTFT P95 over the requests both runs served. A model with a few
        dozen requests in the window has a P95 set by its one or two slowest: one long prompt admitted on one side
        and refused on the other moved the 70B's by 18 % in a 20 s seed-000 window."""
        return {m: _rel(live, virt) for m, live, virt in self.both_served_ttft_p95_ms}

    def table(self) -> str:
        rows = [("goodput req/s", self.live.overall.goodput_rps, self.virtual.overall.goodput_rps)]
        rows.append(("TTFT P95 ms", self.live.overall.ttft.p95_ms, self.virtual.overall.ttft.p95_ms))
        rows.append(("ITL P95 ms", self.live.overall.itl.p95_ms, self.virtual.overall.itl.p95_ms))
        rows.append(("refused %", 100 * self.live.overall.refused_fraction, 100 * self.virtual.overall.refused_fraction))
        diffs = self.relative_differences()
        keys = ["goodput", "ttft_p95", "itl_p95", None]
        lines = ["metric            live (dilated)   virtual   difference"]
        for (name, live, virt), key in zip(rows, keys):
            diff = f"{diffs[key]:+.1%}" if key else ""
            lines.append(f"{name:<16} {live:>15.2f} {virt:>9.2f}   {diff}")
        if len(self.virtual.per_model) > 1:
            live_models = {g.name: g for g in self.live.per_model}
            for model, d in self.per_model_ttft_differences().items():
                virt_p95 = next(g.ttft.p95_ms for g in self.virtual.per_model if g.name == model)
                lines.append(f"{'  ' + model[:14]:<16} {live_models[model].ttft.p95_ms:>15.2f} {virt_p95:>9.2f}   "
                             f"{d:+.1%}   (TTFT P95 of the model)")
            for model, live, virt in self.both_served_ttft_p95_ms:
                lines.append(f"{'  ' + model[:14]:<16} {live:>15.2f} {virt:>9.2f}   {_rel(live, virt):+.1%}   "
                             "(TTFT P95 of the model, requests both served)")
        return "\n".join(lines)


def _rel(live: float, virtual: float) -> float:
    if virtual == 0:
        return 0.0 if live == 0 else float("inf")
    return (live - virtual) / virtual


def cap_outputs(trace: list[TraceRequest], max_output_tokens: int) -> list[TraceRequest]:
    """The same trace with every true output length capped, so a dilated live run finishes in minutes."""
    return [
        replace(t, output_len=min(t.output_len, max_output_tokens), max_tokens=min(t.max_tokens, 4 * max_output_tokens))
        for t in trace
    ]


def compare(config_path: str | None, trace: list[TraceRequest], time_scale: float, *, duration_s: float,
            slo: SloSpec, cost_profile: str | None = None) -> Agreement:
    """Simulate `trace`, then replay it live on a node started from the same config file (None: the default), both
    under `cost_profile` when given (else the config's)."""
    from octoserve.services.node.launcher import start_node
    from octoserve.services.loadgen import BenchOptions, run_bench
    from octoserve.services.config import config_source, load_with_overrides
    from octoserve.services.sim.driver import run_simulation

    virtual = run_simulation(load_with_overrides(config_path, [], cost_profile), trace)
    # Wait for the slowest stream the simulator saw to finish, dilated, with room for the live overheads.
    last_finish_s = max((r.finish_s for r in virtual.records if r.finish_s is not None), default=duration_s)
    drain_s = (last_finish_s - duration_s) * time_scale * 2.0 + 60.0
    node = start_node(config_source(config_path, cost_profile), time_scale)
    try:
        records = asyncio.run(
            run_bench(node.router_address, trace, time_scale=time_scale, options=BenchOptions(drain_timeout_s=drain_s))
        )
    finally:
        node.stop()
    # The live records over the simulator's measurement window: the same warm-up left out on both sides.
    start_s = virtual.window.start_s
    return Agreement(summarize(records, slo, duration_s, warmup_s=start_s), virtual.summary,
                     both_served_ttft_p95(records, virtual.records, start_s, duration_s))


def both_served_ttft_p95(live, virtual, start_s: float, end_s: float) -> tuple[tuple[str, float, float], ...]:
    """Per model, (live, virtual) TTFT P95 ms over the requests arriving in [start_s, end_s] that both completed."""
    virt = {r.request_id: r for r in virtual if r.completed and start_s <= r.arrival_s <= end_s}
    pairs: dict[str, tuple[list[float], list[float]]] = {}
    for r in live:
        v = virt.get(r.request_id)
        if v is not None and r.completed:
            lv, vv = pairs.setdefault(r.model, ([], []))
            lv.append(r.ttft_s * 1000.0)
            vv.append(v.ttft_s * 1000.0)
    return tuple((m, percentile_inf(lv, 95), percentile_inf(vv, 95)) for m, (lv, vv) in sorted(pairs.items()))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=config_file, help="node config YAML (default: the embedded default)")
    parser.add_argument("--profile", default="seed-000", choices=sorted(PROFILES))
    parser.add_argument("--rate", type=float, default=30.0)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--time-scale", type=float, default=10.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-output", type=int, default=96, help="cap on true output lengths (wall time)")
    parser.add_argument("--json", dest="json_path")
    from octoserve.services.config import add_cost_profile_argument

    add_cost_profile_argument(parser)
    args = parser.parse_args(argv)
    profile = scaled(PROFILES[args.profile], rate_rps=args.rate, duration_s=args.duration)
    trace = cap_outputs(generate_trace(profile, args.seed), args.max_output)
    result = compare(args.config, trace, args.time_scale, duration_s=args.duration, slo=profile.slo,
                     cost_profile=args.cost_profile)
    print(result.table())
    ok = result.within()
    print(f"agreement within ±{TOLERANCE:.0%}: {'yes' if ok else 'NO'}")
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({"differences": result.relative_differences(), "within": ok}, f)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
