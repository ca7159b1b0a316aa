"""Cluster-tier benchmarks in the simulator: scaling, skew, spill; markdown tables for BENCHMARKS.md.

    python -m octoserve.services.cluster.bench [--duration 20] [--nodes 2,4,8] [--cost-profile default pessimistic]
        [--out cluster.md] [--json cluster.json]

Per cost profile:
- scaling on seed 000 (300 req/s per node, the seed's peak): one node alone; N nodes behind the cluster picker;
  N nodes behind round-robin (independent nodes) and the ideal single pool (one router over every node's
  instances) at the middle N. Scaling efficiency = goodput of N nodes / (N x one node's goodput).
- skew: `skewed_profile` (hot 8B system prompts: 64 groups of 1,536 tokens, 80 % of 8B prompts, Zipf) at 60 req/s
  per node on 4 nodes (below the cluster's capacity, so other nodes have room to take spilled work), with an LM gang lease squeezing node 0's SM instances to half their GPU time from 5 s on;
  cluster picker vs round-robin, and each without the squeeze: SM attainment of node 0's traffic (requests round-robin
  would send there) with and without it, spill counts, prefix hit rate.
The cluster picker's runs go down each pick's fallbacks when a node refuses (`ClusterPolicy.max_node_tries`, 4);
round-robin's do not (independent nodes). Every figure is over the steady-state window (services/metrics.py) of
its run.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
import json
import sys
import time

from octoserve.services.cluster.sim import ClusterSimulator, Squeeze, single_pool_config
from octoserve.services.metrics import group_stats
from octoserve.services.config import raw_config_with_overrides
from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.sim.driver import run_simulation
from octoserve.services.workload import PROFILES, generate_trace, scaled

CONFIG = "services/configs/node-default.yaml"
SM, LM = "llama-3-8b", "llama-3-70b"


def skewed_profile(rate_rps: float, duration_s: float):
    base = scaled(PROFILES["seed-000"], rate_rps=rate_rps, duration_s=duration_s)
    traffic = tuple(
        dataclasses.replace(t, num_prefix_groups=64, prefix_len_tokens=1536, prefix_hit_rate=0.8,
                            prefix_zipf_exponent=1.0) if t.model == SM else t
        for t in base.traffic)
    return dataclasses.replace(base, name="skewed", traffic=traffic)


def _row(label: str, summary, *, spilled: int = 0, extra: dict | None = None) -> dict:
    o = summary.overall
    return {"run": label, "goodput_rps": o.goodput_rps, "attainment_admitted": o.attainment_admitted,
            "refused": o.refused_fraction, "prefix_hit": o.prefix_hit_fraction, "spilled": spilled,
            "steady": summary.window.steady, **(extra or {})}


def _log(msg: str) -> None:
    print(f"[cluster-bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def _cluster(raw: dict, n: int, picker: str, trace, squeezes=()):
    config = node_config_from_dict(raw)
    t0 = time.perf_counter()
    result = ClusterSimulator(config, n, picker=picker, squeezes=squeezes).run(trace)
    _log(f"{picker} x{n}: goodput {result.summary.overall.goodput_rps:.1f} req/s ({time.perf_counter() - t0:.0f} s)")
    return result


def scaling(raw: dict, nodes: list[int], duration_s: float, workload: str = "seed-000", rate_per_node: float = 300.0,
            compare: str = "mid", on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """One node alone, then N nodes behind the cluster picker for every N; round-robin and the ideal single pool
    at every N (`compare="all"`), only at the middle one ("mid"), or at the listed node counts ("2,4").
    `on_row` sees the rows so far after every run (long runs save as they go)."""
    config = node_config_from_dict(raw)
    tag = {"workload": workload, "rate_per_node": rate_per_node, "duration_s": duration_s}
    one = run_simulation(config, generate_trace(scaled(PROFILES[workload], rate_rps=rate_per_node,
                                                       duration_s=duration_s), 0))
    base = one.summary.overall.goodput_rps
    _log(f"{workload}, one node: goodput {base:.1f} req/s")
    rows = [_row("1 node alone", one.summary, extra={"nodes": 1, "efficiency": 1.0, **tag})]
    mid = nodes[len(nodes) // 2]
    compare_at = set(nodes) if compare == "all" else {mid} if compare == "mid" else {int(x) for x in compare.split(",")}
    for n in nodes:
        if on_row is not None:
            on_row(rows)
        trace = generate_trace(scaled(PROFILES[workload], rate_rps=rate_per_node * n, duration_s=duration_s), 0)
        others = n in compare_at
        runs = [("cluster picker", "cluster")] + ([("round-robin", "round_robin")] if others else [])
        for label, picker in runs:
            r = _cluster(raw, n, picker, trace)
            rows.append(_row(f"{n} nodes, {label}", r.summary, spilled=r.num_spilled,
                             extra={"nodes": n, "efficiency": r.summary.overall.goodput_rps / (n * base), **tag}))
            if on_row is not None:
                on_row(rows)
        if others:
            pool = single_pool_config(config, n, raw)
            t0 = time.perf_counter()
            p = run_simulation(pool, trace)
            _log(f"ideal pool x{n}: goodput {p.summary.overall.goodput_rps:.1f} req/s ({time.perf_counter() - t0:.0f} s)")
            rows.append(_row(f"{n} nodes, ideal single pool", p.summary,
                             extra={"nodes": n, "efficiency": p.summary.overall.goodput_rps / (n * base), **tag}))
    return rows


def skew(raw: dict, duration_s: float, n: int = 4, rate_per_node: float = 60.0, modes=((False, True)),
         pickers: tuple[str, ...] = ("cluster", "round_robin")) -> list[dict]:
    trace = generate_trace(skewed_profile(rate_per_node * n, duration_s), 0)
    squeeze = (Squeeze(node=0, model=SM, start_s=5.0, end_s=duration_s + 60.0, capacity_fraction=0.5),)
    rows = []
    for label, picker in (("cluster picker", "cluster"), ("round-robin", "round_robin")):
        if picker not in pickers:
            continue
        attainment = {}
        for burst in modes:
            r = _cluster(raw, n, picker, trace, squeeze if burst else ())
            window = r.summary.window
            home0 = [x for x in r.home_records[0] if x.model == SM and window.contains(x)]
            sm0 = group_stats("sm@node-0", home0, r.summary.slo, window.duration_s)
            attainment[burst] = sm0.attainment_offered
            rows.append(_row(f"{label}, {'LM lease on node 0' if burst else 'no lease'}", r.summary,
                             spilled=r.num_spilled,
                             extra={"sm_node0_attainment": sm0.attainment_offered, "rate_per_node": rate_per_node,
                                    "node_share": [round(s, 3) for s in r.node_share]}))
        if len(attainment) == 2:
            rows[-1]["sm_node0_vs_no_lease"] = attainment[True] / attainment[False] if attainment[False] else float("nan")
    return rows


def _pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def markdown(results: dict) -> str:
    out = []
    for profile, res in results.items():
        out.append(f"\n### Cost profile `{profile}`\n")
        if res["scaling"]:
            out += _scaling_table(res["scaling"])
        by_rate: dict[float, list[dict]] = {}
        for r in res["skew"]:
            by_rate.setdefault(r.get("rate_per_node", 60.0), []).append(r)
        for rows in by_rate.values():
            out += _skew_table(rows)
    return "\n".join(out) + "\n"


def _workload_of(row: dict) -> tuple[str, float, float | None]:
    return row.get("workload", "seed-000"), row.get("rate_per_node", 300.0), row.get("duration_s")


def _scaling_table(rows: list[dict]) -> list[str]:
    out = []
    groups: dict[tuple[str, float, float | None], list[dict]] = {}
    for r in rows:
        groups.setdefault(_workload_of(r), []).append(r)
    for (workload, rate, duration), group in groups.items():
        runs = f", {duration:g}-s runs" if duration else ""
        out.append(f"{chr(10) if out else ''}Scaling, {workload.replace('-', ' ')} at {rate:g} req/s per node{runs}:\n")
        out.append("| run | goodput req/s | efficiency | admitted within SLO | refused | prefix hit | spilled | steady |")
        out.append("|---|---:|---:|---:|---:|---:|---:|:-:|")
        for r in sorted(group, key=lambda r: r["nodes"]):  # stable: picker, round-robin, pool within a node count
            out.append(f"| {r['run']} | {r['goodput_rps']:.1f} | {r['efficiency']:.3f} "
                       f"| {_pct(r['attainment_admitted'])} | {_pct(r['refused'])} | {_pct(r['prefix_hit'])} "
                       f"| {r.get('spilled', 0)} | {'yes' if r['steady'] else 'no'} |")
    return out


def _skew_table(rows: list[dict]) -> list[str]:
    out = []
    rate = rows[0].get("rate_per_node", 60.0)
    out.append(f"\nSkewed workload, 4 nodes at {rate:g} req/s each; in the lease runs node 0's SM instances get half "
               "their GPU time from 5 s on:\n")
    out.append("| run | goodput req/s | admitted within SLO | refused | prefix hit | spilled | SM attainment, node 0's "
               "traffic | share served by node 0..3 |")
    out.append("|---|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        ratio = f" ({r['sm_node0_vs_no_lease']:.2f} of no lease)" if "sm_node0_vs_no_lease" in r else ""
        out.append(f"| {r['run']} | {r['goodput_rps']:.1f} | {_pct(r['attainment_admitted'])} | {_pct(r['refused'])} "
                   f"| {_pct(r['prefix_hit'])} | {r['spilled']} | {_pct(r['sm_node0_attainment'])}{ratio} "
                   f"| {' / '.join(f'{s:.2f}' for s in r['node_share'])} |")
    picker_goodput = next((r["goodput_rps"] for r in rows if r["run"] == "cluster picker, LM lease on node 0"), None)
    rr_goodput = next((r["goodput_rps"] for r in rows if r["run"] == "round-robin, LM lease on node 0"), None)
    if picker_goodput and rr_goodput:
        out.append(f"\nWith the lease, the cluster picker's goodput is {picker_goodput / rr_goodput:.2f}x round-robin's.")
    return out


def plot(results: dict, path: str) -> None:
    """Scaling efficiency of every multi-node run, per cost profile, as bars (docs/bench/cluster_scaling.png)."""
    from octoserve.services.plots import _save, plt  # noqa: PLC0415 - matplotlib only when plotting

    def key(r: dict) -> str:
        workload, rate, _ = _workload_of(r)
        return f"{workload} @{rate:g}/node\n{r['run']}"

    labels: list[str] = []
    for res in results.values():
        for r in res["scaling"]:
            if r["nodes"] > 1 and key(r) not in labels:
                labels.append(key(r))
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(labels)), 4.0))
    width = 0.8 / max(1, len(results))
    for k, (profile, res) in enumerate(results.items()):
        by_key = {key(r): r["efficiency"] for r in res["scaling"] if r["nodes"] > 1}
        xs = [i + k * width for i, label in enumerate(labels) if label in by_key]
        ax.bar(xs, [by_key[label] for label in labels if label in by_key], width, label=f"{profile} profile")
    ax.axhline(0.95, color="grey", linestyle="--", linewidth=1, label="target 0.95")
    ax.set_xticks([i + width * (len(results) - 1) / 2 for i in range(len(labels))], labels, fontsize=6, rotation=30,
                  ha="right")
    ax.set_ylabel("goodput / (N x one node)")
    ax.set_title("scaling efficiency, steady state")
    ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m octoserve.services.cluster.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals per run")
    parser.add_argument("--nodes", default="2,4,8", help="node counts for the scaling table")
    parser.add_argument("--workload", default="seed-000", choices=sorted(PROFILES), help="workload of the scaling runs")
    parser.add_argument("--rate-per-node", type=float, default=300.0, help="offered req/s per node (scaling)")
    parser.add_argument("--skew-rate", type=float, default=60.0, help="offered req/s per node (skew runs)")
    parser.add_argument("--skew-pickers", nargs="+", default=["cluster", "round_robin"],
                        choices=["cluster", "round_robin"], help="which pickers the skew runs compare")
    parser.add_argument("--compare", default="mid",
                        help="round-robin and ideal pool: 'mid' (the middle node count), 'all', or node counts '2,4'")
    parser.add_argument("--cost-profile", nargs="+", default=["default", "pessimistic"])
    parser.add_argument("--parts", nargs="+", default=["scaling", "skew"], choices=["scaling", "skew"])
    parser.add_argument("--out", default="-", help="markdown output ('-': stdout)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--from-json", nargs="+", default=None, help="skip the runs: tables and plot from saved JSON")
    parser.add_argument("--plot", default=None, help="write the scaling plot (PNG) here")
    args = parser.parse_args(argv)
    if args.from_json:
        results = {}
        for path in args.from_json:
            with open(path) as f:
                for profile, parts in json.load(f).items():  # files hold one part each: merge the non-empty ones
                    merged = results.setdefault(profile, {"scaling": [], "skew": []})
                    # scaling files add up (node counts, workloads); the one-node baseline that several runs of
                    # the same workload and duration share is listed once
                    merged["scaling"] += [r for r in parts.get("scaling", []) if r not in merged["scaling"]]
                    merged["skew"] += parts.get("skew", [])  # skew files add up too (loads)
        return _emit(results, args)
    nodes = [int(x) for x in args.nodes.split(",")]
    results = {}
    for profile in args.cost_profile:
        raw = raw_config_with_overrides(CONFIG, [], profile)
        _log(f"cost profile {profile}")

        def save(rows, profile=profile):  # partial results survive a run cut short
            if args.json:
                with open(args.json, "w") as f:
                    json.dump({**results, profile: {"scaling": rows, "skew": []}}, f, indent=1, default=str)

        results[profile] = {
            "scaling": scaling(raw, nodes, args.duration, args.workload, args.rate_per_node, args.compare, save)
            if "scaling" in args.parts else [],
            "skew": skew(raw, args.duration, rate_per_node=args.skew_rate, pickers=tuple(args.skew_pickers))
            if "skew" in args.parts else [],
        }
    return _emit(results, args)


def _emit(results: dict, args: argparse.Namespace) -> int:
    text = markdown(results)
    if args.plot:
        plot(results, args.plot)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
    if args.json and not args.from_json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
