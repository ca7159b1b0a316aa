"""The most SLO-good requests per second a scheduler that sees prompts but not outputs can serve, per model.

`python -m octoserve.services.lab.goodput_bound` prints it for the embedded placement at the seed-000 peak under
both cost profiles; BENCHMARKS.md quotes it beside the simulated goodput. It answers "is the target out of reach on
this placement, or is the policy short of it?" more tightly than the planner's SLO-aware estimate
(`planner.slo_upper_bound`), which prices every decode at a context of one token and lets a scheduler pick the
cheapest requests by output length, a length no scheduler knows when it admits (the seed workloads draw outputs
independently of prompts; `max_tokens` is a client's cap, not the output).

The model, per model and colocated instance, in fluid steady state:
- The scheduler serves the requests whose uncached prompt is shortest, up to a threshold (with outputs unknown and
  independent of prompts, a request's expected cost grows with its prompt, so a threshold is the best prompt-only
  choice); every request whose prefill alone misses its TTFT SLO on an idle instance is dropped first.
- Every step carries B decodes at the served set's mean decode context C (each output token after the first reads
  the KV of its prompt and the tokens before it: C = sum over requests of (O - 1) P + (O - 1) O / 2, over the sum
  of O - 1) and the prefill tokens that keep up with them (B x U / D, U the mean uncached prompt, D the mean decode
  tokens), and lasts T(B) by the cost model. A request's TPOT is the mean of its steps, so the best any schedule
  does is uniform steps with T(B) <= the ITL SLO (the cost model is a sum of per-operation maxima of terms linear
  in the batch's totals, so mixing longer and shorter steps costs at least as much). The instance serves
  B / (D x T(B)) req/s at its best B (up to 1,024 sequences, and the contexts within its KV pool).
- A model serves the least of the chosen requests' offered rate and its instances' sum, maximised over the
  threshold.
What it leaves out makes it optimistic: queueing (a first token waits for nothing but its own prefill), the
attention of a prompt chunk over its earlier chunks, the variance of outputs around their mean, and routing. It is
a fluid bound under the cost model, not a proof for a finite window (a window's goodput also counts work finished
in the drain).
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import dataclass

from octoserve.services.core.placement import NodeConfig
from octoserve.services.core.types import Role
from octoserve.services.workload import PROFILES, WorkloadProfile

MAX_BATCH = 1024
THRESHOLDS = 200  # shares of the feasible requests tried as the prompt threshold


@dataclass(frozen=True, slots=True)
class Sample:
    uncached: int  # prompt tokens past a cached system prompt
    prompt: int
    output: int
    ttft_ms: float


@dataclass(frozen=True, slots=True)
class ModelBound:
    model: str
    offered_rps: float
    served_rps: float  # the bound
    feasible_share: float  # requests whose prefill alone fits their TTFT SLO on an idle instance
    served_share: float  # of all offered requests, the share the bound serves (the shortest prompts)
    mean_uncached_prompt: float
    mean_output: float
    mean_decode_context: float
    batch: int  # decodes per step at the best operating point (of the first instance)
    step_s: float


def samples(profile: WorkloadProfile, model: str, num: int, seed: int) -> list[Sample]:
    """`num` draws of one model's requests from the profile's distributions; a request that starts with a system
    prompt has it cached (whole blocks, never the whole prompt), the best case for every scheduler."""
    from octoserve.services.sim.cli_plan import draw_lengths

    draws = draw_lengths(profile, profile.model_traffic(model), num, random.Random(seed))
    return [Sample(prompt - cached, prompt, output, ttft_ms) for prompt, cached, output, ttft_ms in draws]


def instance_rps(cost, itl_s: float, kv_tokens: int, uncached: float, decode_tokens: float,
                 context: float) -> tuple[float, int, float]:
    """(req/s, batch, step s) of one colocated instance at its best uniform step for requests of these means."""
    best = (0.0, 0, 0.0)
    if decode_tokens <= 0:
        return best
    for batch in range(1, MAX_BATCH + 1):
        if batch * context > kv_tokens:
            break
        prefill = round(batch * uncached / decode_tokens)
        step_s = cost.step_time_s([(1, max(1, round(context)))] * batch + ([(prefill, 0)] if prefill else []))
        if step_s > itl_s:
            break
        rps = batch / (decode_tokens * step_s)
        if rps > best[0]:
            best = (rps, batch, step_s)
    return best


def model_bound(config: NodeConfig, model: str, requests: list[Sample], offered_rps: float) -> ModelBound:
    instances = config.instances_of(model)
    if any(i.role is not Role.COLOCATED for i in instances):
        raise ValueError(f"{model}: the prompt-blind bound models colocated instances only")
    costs = [config.cost_model(i) for i in instances]
    kv_tokens = [config.num_kv_blocks_for(i) * i.block_size for i in instances]
    slo = config.slo.for_model(model)
    itl_s = slo.itl_ms / 1000.0
    fastest = min(costs, key=lambda c: c.prefill_time_s(1000))
    feasible = sorted((r for r in requests if fastest.prefill_time_s(max(1, r.uncached)) <= r.ttft_ms / 1000.0),
                      key=lambda r: r.uncached)
    best = ModelBound(model, offered_rps, 0.0, len(feasible) / len(requests), 0.0, 0.0, 0.0, 0.0, 0, 0.0)
    for k in sorted({max(1, len(feasible) * n // THRESHOLDS) for n in range(1, THRESHOLDS + 1)} if feasible else ()):
        chosen = feasible[:k]
        uncached = sum(r.uncached for r in chosen) / k
        decode = sum(r.output - 1 for r in chosen)
        context = sum((r.output - 1) * r.prompt + (r.output - 1) * r.output / 2 for r in chosen) / max(1, decode)
        points = [instance_rps(c, itl_s, kv, uncached, decode / k, context) for c, kv in zip(costs, kv_tokens)]
        served = min(offered_rps * k / len(requests), sum(p[0] for p in points))
        if served > best.served_rps:
            best = ModelBound(model, offered_rps, served, best.feasible_share, served / offered_rps, uncached,
                              sum(r.output for r in chosen) / k, context, points[0][1], points[0][2])
    return best


def goodput_bound(config: NodeConfig, profile: WorkloadProfile, rate_rps: float, num_samples: int = 20_000,
                  seed: int = 0) -> list[ModelBound]:
    total = sum(t.share for t in profile.traffic)
    return [model_bound(config, t.model, samples(profile, t.model, num_samples, seed), rate_rps * t.share / total)
            for t in profile.traffic]


def main(argv: list[str] | None = None) -> int:
    from octoserve.services.config import load_with_overrides

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=float, default=None, help="offered req/s of the mix (default: the profile's)")
    parser.add_argument("--profile", default="seed-000", choices=sorted(PROFILES), help="workload (default seed-000)")
    parser.add_argument("--cost-profiles", default="default,pessimistic", help="comma-separated (default both)")
    parser.add_argument("--samples", type=int, default=20_000, help="requests drawn per model (default 20,000)")
    args = parser.parse_args(argv)
    from octoserve.services.core.cost_model import COST_PROFILES

    cost_profiles = args.cost_profiles.split(",")
    unknown = [p for p in cost_profiles if p not in COST_PROFILES]
    if unknown:
        parser.error(f"--cost-profiles: unknown {', '.join(unknown)}; choose from {', '.join(COST_PROFILES)}")
    profile = PROFILES[args.profile]
    rate = args.rate or profile.rate_rps
    print(f"prompt-blind goodput bound, {profile.name} at {rate:g} req/s, the embedded placement")
    print("| cost profile | model | offered req/s | bound req/s | served: shortest prompts, % of offered "
          "| mean uncached prompt | mean output | mean decode context | batch | step ms |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for cost_profile in cost_profiles:
        config = load_with_overrides(None, [], cost_profile)
        bounds = goodput_bound(config, profile, rate, args.samples)
        for b in bounds:
            print(f"| {cost_profile} | {b.model} | {b.offered_rps:.1f} | {b.served_rps:.1f} | {100 * b.served_share:.1f} "
                  f"| {b.mean_uncached_prompt:,.0f} | {b.mean_output:,.0f} | {b.mean_decode_context:,.0f} | {b.batch} "
                  f"| {1e3 * b.step_s:.1f} |")
        print(f"| {cost_profile} | node | {rate:g} | **{sum(b.served_rps for b in bounds):.1f}** | | | | | | |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
