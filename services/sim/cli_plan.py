"""`octoserve plan`: size the node for a workload, say whether it fits, then rank placements by what users ask.

Prints, in order: the sizing table; the compute roofline (the one upper bound: FLOPs at 100 % of peak) and its
verdict; the two SLO-aware ESTIMATES of the configured placement (not bounds: a simulation
can beat them); the analytic ranking of candidate placements by the SLO-aware estimate; then, with `--top N`, a
check that the configured placement's simulated goodput stays under the upper bound, and the top N candidates
simulated in steady state (`--warmup` excluded) and ranked twice: by per-model SLO capacity (multi-seed bisection,
`octoserve.services.sim.capacity`: every model's own requests judged against its own SLOs, so a placement that
serves the 8B well cannot win while its 70B misses) and by goodput at the offered rate, with both recommendations.

Time is bounded: at most N x (1 + capacity_steps x capacity_seeds) + 1 simulations of `--duration` seconds each,
each one announced on stderr as it starts.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, replace

from octoserve.services.config import add_cost_profile_argument, config_file, load_with_overrides
from octoserve.services.core import planner
from octoserve.services.core.placement import NodeConfig
from octoserve.services.flags import parse_duration_s


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", type=config_file, help="node config YAML (default: the embedded default placement)")
    from octoserve.services.workload_io import add_workload_arguments

    add_workload_arguments(parser)  # --profile | --workload FILE.yaml | --trace FILE.jsonl (fitted), --only-served
    parser.add_argument("--rate", type=float, help="offered req/s (default: the profile's)")
    parser.add_argument("--duration", type=parse_duration_s, default=30.0,
                        help="arrival window of each simulation, e.g. 30s (default 30 s)")
    parser.add_argument("--warmup", type=parse_duration_s, default=10.0,
                        help="arrivals excluded as warm-up, e.g. 10s (default 10 s)")
    parser.add_argument("--top", type=int, default=2, help="how many analytically best candidates to simulate")
    parser.add_argument("--capacity-steps", type=int, default=5, help="bisection steps of each SLO capacity")
    parser.add_argument("--capacity-seeds", type=int, default=2, help="seeds per capacity probe")
    parser.add_argument("--seed", type=int, default=0, help="trace seed of the simulated candidates")
    add_cost_profile_argument(parser)
    parser.add_argument("--json", help="write every figure and ranking to this JSON file")


def _mean(dist) -> float:
    """Nominal mean of a octoserve.services.workload.LengthDist (clipping ignored: it moves seed 000's means by < 1 %)."""
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
    return {t.model: planner.LengthSample(t.model, tuple((prompt - cached, output, ttft_ms) for prompt, cached, output,
                                                         ttft_ms in draw_lengths(profile, t, num_requests, rng)))
            for t in profile.traffic}


def draw_lengths(profile, traffic, num_requests: int, rng):
    """`num_requests` draws of one model's (prompt, cached prefix, output, TTFT SLO ms) from `traffic`'s
    distributions, the prompt capped by the context and a group prefix counted cached (whole blocks)."""
    tiers = [(x.share, x.ttft_slo_ms or profile.slo.ttft_ms) for x in traffic.tiers]
    total = sum(s for s, _ in tiers)
    for _ in range(num_requests):
        prompt, output = traffic.prompt_len.sample(rng), traffic.output_len.sample(rng)
        prompt = min(prompt, traffic.max_context_len - 1)
        output = max(1, min(output, traffic.max_context_len - prompt))
        cached = 0
        if traffic.prefix_hit_rate > 0 and rng.random() < traffic.prefix_hit_rate and prompt > traffic.prefix_len_tokens:
            cached = min(traffic.prefix_len_tokens, prompt - 1) // 16 * 16
        pick, ttft_ms = rng.random() * total, tiers[-1][1]
        for share, slo in tiers:
            if pick < share:
                ttft_ms = slo
                break
            pick -= share
        yield prompt, cached, output, float(ttft_ms)


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def _print_sizing(rows: list[planner.SizingRow]) -> None:
    print("Sizing (BF16, gpu_memory_utilization 0.9, 2,048-token step budget, mean sequence of the workload)")
    print(f"  {'model':12s} {'TP':>2s} {'weights/GPU':>12s} {'KV/token':>9s} {'KV/seq':>9s} {'KV tokens/inst':>15s} {'seqs/inst':>9s}")
    for r in rows:
        print(f"  {r.model:12s} {r.tp:2d} {_gb(r.weight_bytes_per_gpu):>12s} {r.kv_bytes_per_token // 1024:>5d} KiB "
              f"{r.kv_bytes_per_sequence / 2**20:>5.0f} MiB {r.kv_tokens_per_instance:>15,d} {r.kv_sequences_per_instance:>9.1f}")


def _print_roofline(b: planner.RooflineBound, mix: planner.WorkloadMix) -> None:
    print("\nCompute roofline, an upper bound by FLOPs (2 x params x (uncached prompt + output) per request, 100 % "
          "of dense BF16 peak)")
    for m in mix.models:
        rate = mix.rate_rps * m.share
        print(f"  {m.model:12s} {rate:6.1f} req/s x {b.flops_per_request[m.model] / 1e12:6.1f} TFLOP = "
              f"{rate * b.flops_per_request[m.model] / 1e15:5.2f} PFLOP/s "
              f"(prefill {rate * b.prefill_flops_per_request[m.model] / 1e15:.2f}; prefix cache {m.cached_fraction:.1%})")
    print(f"  demand {b.demand_flops_per_s / 1e15:.1f} PFLOP/s vs node peak {b.peak_flops_per_s / 1e15:.1f} PFLOP/s: "
          f"at most {b.capacity_rps:.1f} req/s of this mix")
    print(f"  verdict: {planner.verdict(mix.rate_rps, b.capacity_rps)}")


UPPER_BOUND = "upper bound"
ESTIMATE = "SLO-aware estimate"
OPTIMISTIC_ESTIMATE = "SLO-aware optimistic estimate"


def upper_bound_rps(offered_rps: float, roofline: planner.RooflineBound) -> float:
    """The one printed upper bound on goodput: no more than is offered, and no more than the FLOPs allow."""
    return min(offered_rps, roofline.capacity_rps)


def bound_check(simulated_goodput_rps: float, bound_rps: float) -> str:
    """One line: does the simulation stay under the upper bound (a bound a simulation beats is a bug)."""
    if simulated_goodput_rps <= bound_rps:
        return f"simulated goodput {simulated_goodput_rps:.1f} req/s <= {UPPER_BOUND} {bound_rps:.1f} req/s: ok"
    return (f"BOUND VIOLATED: simulated goodput {simulated_goodput_rps:.1f} req/s > {UPPER_BOUND} "
            f"{bound_rps:.1f} req/s (a bug in the bound or the simulator)")


def _print_bounds(mix, roofline, current, optimistic) -> None:
    print(f"\nConfigured placement at {mix.rate_rps:g} req/s offered:")
    print(f"  {UPPER_BOUND} on goodput: {upper_bound_rps(mix.rate_rps, roofline):.1f} req/s = min(offered, compute "
          f"roofline {roofline.capacity_rps:.1f}); the only figure here no scheduler can beat")
    print(f"  {ESTIMATE} (mean request, one operating point; not a bound): goodput ~ {current.goodput_rps:.1f} "
          f"req/s, mix rate ~ {current.node_rps:.1f} (limited by {current.limiting_model})")
    print(f"  {OPTIMISTIC_ESTIMATE} (any scheduler, cheapest requests kept, per-resource relaxation; not a bound on "
          f"a measured window): goodput ~ {optimistic.goodput_rps:.1f} req/s")
    print("  How they relate: the estimates rank placements cheaply and may sit above the upper bound (then the "
          "bound is what limits) or below a simulated goodput; the simulation below decides.")


RANKING_ORDER = ("placements that serve every model first, then by estimated goodput, then by mix rate (the order "
                 "--top N simulates)")


def _print_ranking(ranked, limit: int) -> None:
    """`ranked`: `planner.rank_placements`' order, which the list keeps (its header says what the order is)."""
    print(f"\n{ESTIMATE} per placement (decode steps <= ITL SLO, a mean prompt's prefill <= TTFT SLO, KV fits), "
          f"ranked: {RANKING_ORDER}")
    # The best time-shared (gang) candidate is listed with its rank even when it falls below the limit.
    first_gang = next((i for i, (p, _) in enumerate(ranked) if p.config.gang is not None), None)
    shown = list(range(min(limit, len(ranked)))) + ([first_gang] if first_gang is not None and first_gang >= limit else [])
    for i in shown:
        placement, sb = ranked[i]
        caps = ", ".join(f"{k} {v:.1f}" for k, v in sb.model_capacity_rps.items())
        rank = f"  (rank {i + 1} of {len(ranked)}: best time-shared)" if i >= limit else ""
        unserved = [m for m, v in sb.model_capacity_rps.items() if v <= 0]
        missing = f"  (serves no {', '.join(unserved)})" if unserved else ""
        print(f"  goodput ~ {sb.goodput_rps:6.1f} req/s  mix rate ~ {sb.node_rps:6.1f}  [{caps}]  "
              f"{placement.label}{missing}{rank}")


class _Runs:
    """Counts and announces simulations against the planned total (stderr, so --json stdout stays clean)."""

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def __call__(self, config, trace, seed: int, warmup_s: float, what: str):
        from octoserve.services.sim.capacity import measured_run

        self.done += 1
        print(f"  [{self.done}/<={self.total}] {what}", file=sys.stderr, flush=True)
        return measured_run(config, trace, seed=seed, drain_s=30.0, warmup_s=warmup_s)


def _trace(profile, rate_rps: float, duration_s: float, seed: int):
    from octoserve.services.workload import generate_trace, scaled

    return generate_trace(scaled(profile, rate_rps=rate_rps, duration_s=duration_s), seed)


def _check_configured(config, profile, mix, roofline, args, runs: _Runs) -> dict:
    res, summary = runs(config, _trace(profile, mix.rate_rps, args.duration, args.seed), args.seed, args.warmup,
                        f"configured placement at {mix.rate_rps:g} req/s")
    o = summary.overall
    bound = upper_bound_rps(o.num_offered / summary.duration_s, roofline)
    line = bound_check(o.goodput_rps, bound)
    print(f"\nConfigured placement, simulated {args.duration:g} s ({args.warmup:g} s warm-up excluded): {line}")
    return {"goodput_rps": o.goodput_rps, "upper_bound_rps": bound, "check": line}


def _simulate(top, profile, mix, roofline, args, runs: _Runs) -> dict:
    """label -> figures of the candidates `top` ((placement, estimate) pairs): goodput at the offered rate and
    per-model SLO capacity by bisection."""
    from octoserve.services.sim.capacity import (CAPACITY_ATTAINMENT, Probe, bisect_capacity, passes_per_model,
                                                 start_search)

    configs = {p.label: p.config for p, _ in top}
    seeds = [args.seed + k for k in range(args.capacity_seeds)]
    out = {}
    trace = _trace(profile, mix.rate_rps, args.duration, args.seed)
    print(f"\nSimulating the top {len(top)} in steady state: goodput at {mix.rate_rps:g} req/s, then SLO capacity "
          f"({args.capacity_seeds} seeds x {args.capacity_steps} steps)")
    for placement, sb in top:
        _, summary = runs(placement.config, trace, args.seed, args.warmup, f"goodput of {placement.label}")
        out[placement.label] = {"goodput_rps": summary.overall.goodput_rps, "estimate_rps": sb.goodput_rps}

    def run_step(asks):
        probes = {}
        for label, rate in asks:
            passed, attained = [], []
            for seed in seeds:
                _, s = runs(configs[label], _trace(profile, rate, args.duration, seed), seed, args.warmup,
                            f"capacity probe {rate:g} req/s seed {seed}: {label}")
                ok, worst = passes_per_model(s)
                passed.append(ok)
                attained.append(worst)
            probes[(label, rate)] = Probe(rate, tuple(passed), tuple(attained))
        return probes

    ceiling = roofline.capacity_rps / CAPACITY_ATTAINMENT
    searches = bisect_capacity({label: start_search([], ceiling) for label in configs}, run_step,
                               args.capacity_steps)
    for label, s in searches.items():
        out[label].update(capacity_rps=s.capacity_rps, capacity_spread=s.spread(),
                          first_failing_rps=None if math.isinf(s.hi) else s.hi)
    return out


def _print_recommendations(simulated: dict, rate_rps: float) -> list[str]:
    from octoserve.services.sim.capacity import rank_by_both

    by_cap, by_goodput, rec = rank_by_both({k: (v["capacity_rps"], v["goodput_rps"]) for k, v in simulated.items()})
    print("\nRanked by per-model SLO capacity (every model: >= 90 % of its offered requests good, its TTFT and ITL "
          "P95 inside its SLO; per seed min / median / max):")
    for label in by_cap:
        v = simulated[label]
        lo, med, hi = v["capacity_spread"]
        print(f"  {v['capacity_rps']:6.1f} req/s ({lo:.1f} / {med:.1f} / {hi:.1f})  {label}")
    print(f"Ranked by steady-state goodput at {rate_rps:g} req/s:")
    for label in by_goodput:
        print(f"  {simulated[label]['goodput_rps']:6.1f} req/s ({ESTIMATE} {simulated[label]['estimate_rps']:.1f})  "
              f"{label}")
    return [f"recommend for SLO capacity: {rec.by_capacity} ({simulated[rec.by_capacity]['capacity_rps']:.1f} req/s)",
            f"recommend for goodput at {rate_rps:g} req/s: {rec.by_goodput} "
            f"({simulated[rec.by_goodput]['goodput_rps']:.1f} req/s)"]


def _analytic_recommendation(ranked) -> str:
    placement, sb = ranked[0]
    return (f"recommend {placement.label}: the highest {ESTIMATE} of goodput, {sb.goodput_rps:.1f} req/s "
            f"(limited by {sb.limiting_model}); not checked by simulation (--top 0)")


def _with_profile_slo(config: NodeConfig, profile) -> NodeConfig:
    """Size against the workload's own SLO (seed 003: TTFT 200 ms), keeping the config's tier overrides."""
    slo = replace(config.slo, ttft_ms=profile.slo.ttft_ms, itl_ms=profile.slo.itl_ms)
    return replace(config, slo=slo)


def run(args: argparse.Namespace) -> int:
    from octoserve.services.workload_io import node_workload, with_workload_slos

    configured = load_with_overrides(args.config, [], args.cost_profile)
    # Only the models the config serves (else a clear error before any figure): a trace is fitted to a profile.
    profile, _ = node_workload(args, configured, replays=False)
    config: NodeConfig = with_workload_slos(_with_profile_slo(configured, profile), profile)
    mix = mix_from_profile(profile)  # --rate is applied to the profile, before unserved models are dropped
    rows = planner.sizing_table(config.models, config.gpu, mix)
    bound = planner.roofline_bound(config.models, config.gpu, config.num_gpus, mix)
    _print_sizing(rows)
    _print_roofline(bound, mix)
    current = planner.slo_bound(config, mix)
    optimistic = planner.slo_upper_bound(config, mix, length_samples(profile))
    _print_bounds(mix, bound, current, optimistic)
    candidates = planner.candidate_placements(config.gpu, config.models, config.num_gpus, slo=config.slo,
                                              policies=config.policies, cost_profile=config.cost_profile)
    ranked = planner.rank_placements(candidates, mix)
    _print_ranking(ranked, max(args.top * 2, 8))
    check, simulated = None, None
    if args.top > 0:
        # The configured placement is simulated beside the top N (when its layout is not among them): the estimate
        # ranks cheaply and can put it below placements that serve less.
        top = ranked[: args.top]
        label = planner.placement_label(config)
        if all(p.label != label for p, _ in top):
            top = [*top, (planner.Placement(f"configured: {label}", config), current)]
        runs = _Runs(1 + len(top) * (1 + args.capacity_steps * args.capacity_seeds))
        check = _check_configured(config, profile, mix, bound, args, runs)
        simulated = _simulate(top, profile, mix, bound, args, runs)
        recommendations = _print_recommendations(simulated, mix.rate_rps)
    else:
        recommendations = [_analytic_recommendation(ranked)]
    print("\n" + "\n".join(recommendations))
    if args.json:
        _write_json(args.json, rows, bound, current, optimistic, ranked, check, simulated, recommendations)
    return 0 if check is None or not check["check"].startswith("BOUND VIOLATED") else 1


def _write_json(path, rows, bound, current, optimistic, ranked, check, simulated, recommendations) -> None:
    doc = {
        "sizing": [asdict(r) for r in rows],
        "roofline": {**{k: v for k, v in asdict(bound).items()}, "load_factor": bound.load_factor},
        "upper_bound_rps": upper_bound_rps(bound.offered_rps, bound),
        "configured_estimate": asdict(current),
        "configured_optimistic_estimate": asdict(optimistic),
        "analytic_ranking": [{"label": p.label, **asdict(sb)} for p, sb in ranked],
        "configured_check": check,
        "simulated": simulated,
        "recommendations": recommendations,
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2, default=str)
