"""`octoserve plan`: size the node for a workload, say whether it fits, then rank placements by simulated goodput.

Prints, in order: the sizing table; the roofline bound and verdict (DESIGN.md section 1); the SLO-aware bound of
the configured placement; the analytic ranking of candidate placements; then a short simulation of the top N with
`services.sim.driver.run_simulation`, ranked by goodput, with the recommendation and the reason.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, replace

from services.core import planner
from services.core.placement import NodeConfig
from services.sim.cli_simulate import add_cost_profile_argument, load_with_overrides


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="node config YAML (default: the embedded default placement)")
    parser.add_argument("--profile", default="seed-000", help="workload profile (seed-000, seed-003)")
    parser.add_argument("--rate", type=float, help="offered req/s (default: the profile's)")
    parser.add_argument("--duration", type=float, default=20.0, help="simulated seconds per candidate")
    parser.add_argument("--top", type=int, default=4, help="how many analytically best candidates to simulate")
    parser.add_argument("--seed", type=int, default=0)
    add_cost_profile_argument(parser)
    parser.add_argument("--json", help="write every figure and ranking to this JSON file")


def _mean(dist) -> float:
    """Nominal mean of a services.workload.LengthDist (clipping ignored: it moves seed 000's means by < 1 %)."""
    if dist.kind == "fixed":
        return float(dist.value)
    if dist.kind == "uniform":
        return (dist.lo + dist.hi) / 2.0
    return float(dist.mean)


def mix_from_profile(profile, rate_rps: float | None = None) -> planner.WorkloadMix:
    """Means per model; the cached fraction is the share of requests with a group prefix x prefix / prompt
    (the first request of each group misses; with a handful of groups that is noise)."""
    total = sum(t.share for t in profile.traffic)
    loads = []
    for t in profile.traffic:
        prompt = _mean(t.prompt_len)
        cached = t.prefix_hit_rate * min(t.prefix_len_tokens, prompt) / prompt if prompt else 0.0
        loads.append(planner.ModelLoad(t.model, t.share / total, prompt, _mean(t.output_len), cached))
    return planner.WorkloadMix(rate_rps or profile.rate_rps, tuple(loads))


def length_samples(profile, num_requests: int = 4000, seed: int = 0) -> dict[str, planner.LengthSample]:
    """Per model, `num_requests` draws of (uncached prompt, output, TTFT SLO ms) from the profile's distributions,
    for `planner.slo_upper_bound`: a request with a group prefix has the prefix cached (whole blocks, never the
    whole prompt); the first request of each group missing is ignored, which only loosens the bound."""
    import random

    rng = random.Random(seed)
    out = {}
    for t in profile.traffic:
        tiers = [(x.share, x.ttft_slo_ms or profile.slo.ttft_ms) for x in t.tiers]
        total = sum(s for s, _ in tiers)
        reqs = []
        for _ in range(num_requests):
            prompt, output = t.prompt_len.sample(rng), t.output_len.sample(rng)
            prompt = min(prompt, t.max_context_len - 1)
            output = max(1, min(output, t.max_context_len - prompt))
            cached = 0
            if t.prefix_hit_rate > 0 and rng.random() < t.prefix_hit_rate and prompt > t.prefix_len_tokens:
                cached = min(t.prefix_len_tokens, prompt - 1) // 16 * 16
            pick, ttft_ms = rng.random() * total, tiers[-1][1]
            for share, slo in tiers:
                if pick < share:
                    ttft_ms = slo
                    break
                pick -= share
            reqs.append((prompt - cached, output, float(ttft_ms)))
        out[t.model] = planner.LengthSample(t.model, tuple(reqs))
    return out


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _print_sizing(rows: list[planner.SizingRow]) -> None:
    print("Sizing (BF16, gpu_memory_utilization 0.9, 2,048-token step budget, mean sequence of the workload)")
    print(f"  {'model':12s} {'TP':>2s} {'weights/GPU':>12s} {'KV/token':>9s} {'KV/seq':>9s} {'KV tokens/inst':>15s} {'seqs/inst':>9s}")
    for r in rows:
        print(f"  {r.model:12s} {r.tp:2d} {_gb(r.weight_bytes_per_gpu):>12s} {r.kv_bytes_per_token // 1024:>5d} KiB "
              f"{r.kv_bytes_per_sequence / 2**20:>5.0f} MiB {r.kv_tokens_per_instance:>15,d} {r.kv_sequences_per_instance:>9.1f}")


def _print_roofline(b: planner.RooflineBound, mix: planner.WorkloadMix) -> None:
    print("\nRoofline (2 x params x (uncached prompt + output) FLOPs per request, 100 % of dense BF16 peak)")
    for m in mix.models:
        rate = mix.rate_rps * m.share
        print(f"  {m.model:12s} {rate:6.1f} req/s x {b.flops_per_request[m.model] / 1e12:6.1f} TFLOP = "
              f"{rate * b.flops_per_request[m.model] / 1e15:5.2f} PFLOP/s "
              f"(prefill {rate * b.prefill_flops_per_request[m.model] / 1e15:.2f}; prefix cache {m.cached_fraction:.1%})")
    print(f"  demand {b.demand_flops_per_s / 1e15:.1f} PFLOP/s vs node peak {b.peak_flops_per_s / 1e15:.1f} PFLOP/s: "
          f"at most {b.capacity_rps:.1f} req/s of this mix")
    print(f"  verdict: {planner.verdict(mix.rate_rps, b.capacity_rps)}")


def _print_ranking(ranked, limit: int) -> None:
    print("\nSLO-aware bound per placement (decode steps <= ITL SLO, a mean prompt's prefill <= TTFT SLO, KV fits)")
    for placement, sb in ranked[:limit]:
        caps = ", ".join(f"{k} {v:.1f}" for k, v in sb.model_capacity_rps.items())
        print(f"  goodput <= {sb.goodput_rps:6.1f} req/s  mix rate <= {sb.node_rps:6.1f}  [{caps}]  {placement.label}")


def _simulate(ranked, profile, args) -> list[dict] | None:
    try:
        from services.sim.driver import run_simulation
        from services.workload import generate_trace, scaled
    except ImportError as e:
        print(f"\nSimulation skipped: the simulator is not available here ({e}); ranking is analytic only.")
        return None
    prof = scaled(profile, rate_rps=args.rate, duration_s=args.duration)
    trace = generate_trace(prof, args.seed)
    print(f"\nSimulating the top {min(args.top, len(ranked))} for {args.duration:g} s at {prof.rate_rps:g} req/s "
          f"({len(trace)} requests)")
    results = []
    for placement, sb in ranked[: args.top]:
        res = run_simulation(placement.config, trace, seed=args.seed)
        s = res.summary
        goodput = s.overall.goodput_rps
        per_model = ", ".join(f"{g.name} {g.goodput_rps:.1f}" for g in s.per_model)
        results.append({"label": placement.label, "goodput_rps": goodput, "bound_goodput_rps": sb.goodput_rps,
                        "summary": _plain(s)})
        print(f"  goodput {goodput:6.1f} req/s [{per_model}] (bound {sb.goodput_rps:6.1f}; simulated "
              f"{res.virtual_s:.0f} s in {res.wall_s:.1f} s)  {placement.label}")
    results.sort(key=lambda r: (-(r["goodput_rps"] if not math.isnan(r["goodput_rps"]) else -1.0), r["label"]))
    return results


def _plain(summary) -> dict:
    try:
        return asdict(summary)
    except TypeError:
        return {}


def _recommend(ranked, simulated) -> str:
    if simulated:
        best = simulated[0]
        runner_up = f"; next: {simulated[1]['label']} at {simulated[1]['goodput_rps']:.1f}" if len(simulated) > 1 else ""
        return (f"recommend {best['label']}: the highest simulated goodput, {best['goodput_rps']:.1f} req/s "
                f"meeting both SLOs{runner_up}")
    placement, sb = ranked[0]
    return (f"recommend {placement.label}: the highest SLO-aware goodput bound, {sb.goodput_rps:.1f} req/s "
            f"(limited by {sb.limiting_model}); not yet checked by simulation")


def _with_profile_slo(config: NodeConfig, profile) -> NodeConfig:
    """Size against the workload's own SLO (seed 003: TTFT 200 ms), keeping the config's tier overrides."""
    slo = replace(config.slo, ttft_ms=profile.slo.ttft_ms, itl_ms=profile.slo.itl_ms)
    return replace(config, slo=slo)


def run(args: argparse.Namespace) -> int:
    from services.workload import PROFILES

    if args.profile not in PROFILES:
        print(f"unknown profile {args.profile!r}; choose one of: {', '.join(sorted(PROFILES))}")
        return 2
    profile = PROFILES[args.profile]
    config: NodeConfig = _with_profile_slo(load_with_overrides(args.config, [], args.cost_profile), profile)
    mix = mix_from_profile(profile, args.rate)
    rows = planner.sizing_table(config.models, config.gpu, mix)
    bound = planner.roofline_bound(config.models, config.gpu, config.num_gpus, mix)
    _print_sizing(rows)
    _print_roofline(bound, mix)
    current = planner.slo_bound(config, mix)
    print(f"\nConfigured placement: goodput <= {current.goodput_rps:.1f} req/s, mix rate <= {current.node_rps:.1f} "
          f"(limited by {current.limiting_model}); {planner.verdict(mix.rate_rps, current.node_rps, 'the SLOs')}")
    upper = planner.slo_upper_bound(config, mix, length_samples(profile))
    print(f"SLO-aware upper bound of the configured placement (any scheduler, cheapest requests kept): goodput <= "
          f"{upper.goodput_rps:.1f} req/s at {mix.rate_rps:g} req/s offered")
    candidates = planner.candidate_placements(config.gpu, config.models, config.num_gpus, slo=config.slo,
                                              policies=config.policies, cost_profile=config.cost_profile)
    ranked = planner.rank_placements(candidates, mix)
    _print_ranking(ranked, max(args.top * 2, 8))
    simulated = _simulate(ranked, profile, args) if args.top > 0 else None
    recommendation = _recommend(ranked, simulated)
    print(f"\n{recommendation}")
    if args.json:
        _write_json(args.json, rows, bound, current, ranked, simulated, recommendation)
    return 0


def _write_json(path, rows, bound, current, ranked, simulated, recommendation) -> None:
    doc = {
        "sizing": [asdict(r) for r in rows],
        "roofline": {**{k: v for k, v in asdict(bound).items()}, "load_factor": bound.load_factor},
        "configured": asdict(current),
        "analytic_ranking": [{"label": p.label, **asdict(sb)} for p, sb in ranked],
        "simulated_ranking": simulated,
        "recommendation": recommendation,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, default=str)
