"""Analytic sizing of the node for a workload mix: what fits, what the hardware can serve, which placement to try.

Four answers, each from the model/GPU specs and the cost model alone (no simulation):

1. Sizing table per model: weights, KV bytes per token and per mean sequence, and for each TP the KV capacity
   of one instance in tokens and in mean sequences.
2. Roofline bound (DESIGN.md section 1): a request costs 2 x params x (uncached prompt + output) FLOPs, with the
   prefix-cache hit rate removing cached prompt tokens; the node at 100 % of peak serves
   num_gpus x peak / (mix-weighted FLOPs per request) req/s. No scheduler can beat it; real ones get well under.
3. SLO-aware bound: the best any scheduler could do under the cost model when every decode step must fit the ITL
   SLO and one request's prefill the TTFT SLO. Per instance:
   - decode (disaggregated): the largest batch B whose step at the mean decode context is <= ITL and whose KV
     (B x mean sequence) fits gives B / step output tokens/s, i.e. B / (step x mean output) req/s;
   - prefill (disaggregated): prefill throughput at the instance's chunk / mean uncached prompt req/s, zero when
     one mean prompt alone overruns the TTFT SLO;
   - colocated: each step carries B decodes plus a prefill chunk C = B x uncached / output (so prefill keeps up
     with decode), raised if needed so a mean prompt prefills within the TTFT SLO, capped by the step token
     budget; the largest B whose step is <= ITL and whose KV fits gives min(B / (step x output),
     C / (step x uncached)) req/s.
   A model's capacity is the sum over its instances (disaggregated: min of the prefill and decode pools); the node
   serves R req/s of the mix when every model keeps up: R = min over models of capacity / share; under overload,
   shedding each model's excess, it serves goodput = sum over models of min(offered, capacity). Maximising over
   allocations (`candidate_placements`, ranked by `rank_placements`) gives the bound and the order in which the
   simulator then checks them.
   It ignores queueing (TTFT P95 under Poisson bursts is worse than a mean prompt's prefill), preemption and
   KV transfer time. It is a bound for "every step within the ITL SLO" at the mean request, not a forecast: the
   simulator's goodput (DistServe: mean TPOT <= ITL SLO, over the arrival window, completions during the drain
   included) can exceed it on short runs and on long-tailed lengths, where most requests are shorter than the mean.
4. Candidate placements: splits of the GPUs between the models, TP degrees that fit (at least one KV block), and
   colocated vs disaggregated (every prefill/decode split of a model's instances) per model, as NodeConfigs.

Invariants: pure and clock-free; every number is a function of the arguments; candidates pass `check_placement`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.core.cost_model import CostModel
from services.core.placement import (
    InstanceConfig,
    NodeConfig,
    PolicyConfig,
    SloConfig,
    check_placement,
    num_kv_blocks_for,
)
from services.core.specs import GpuSpec, ModelSpec, num_kv_blocks
from services.core.types import Role

TP_OPTIONS = (1, 2, 4, 8)


@dataclass(frozen=True, slots=True)
class ModelLoad:
    """One model's share of a workload mix, in means."""

    model: str
    share: float  # fraction of all requests
    mean_prompt_tokens: float
    mean_output_tokens: float
    cached_fraction: float = 0.0  # fraction of prompt tokens served by the prefix cache

    @property
    def uncached_prompt_tokens(self) -> float:
        return self.mean_prompt_tokens * (1.0 - self.cached_fraction)

    @property
    def mean_sequence_tokens(self) -> float:
        return self.mean_prompt_tokens + self.mean_output_tokens


@dataclass(frozen=True, slots=True)
class WorkloadMix:
    rate_rps: float  # offered load
    models: tuple[ModelLoad, ...]

    def of(self, model: str) -> ModelLoad:
        return next(m for m in self.models if m.model == model)


# --- 1. sizing ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class SizingRow:
    model: str
    tp: int
    weight_bytes: int  # whole model
    weight_bytes_per_gpu: int
    kv_bytes_per_token: int  # K + V over all layers and KV heads
    kv_bytes_per_sequence: int  # for the mean sequence (prompt + output)
    kv_tokens_per_instance: int  # 0: the weights leave no room at this TP
    kv_sequences_per_instance: float


def sizing_table(
    models: Mapping[str, ModelSpec], gpu: GpuSpec, mix: WorkloadMix, *, gpu_memory_utilization: float = 0.9,
    max_num_batched_tokens: int = 2048, block_size: int = 16,
) -> list[SizingRow]:
    rows = []
    for name, spec in models.items():
        seq_tokens = mix.of(name).mean_sequence_tokens
        for tp in TP_OPTIONS:
            if spec.num_attention_heads % tp or spec.weight_bytes_per_gpu(tp) >= gpu.memory_bytes:
                continue
            blocks = num_kv_blocks(spec, gpu, tp, gpu_memory_utilization, max_num_batched_tokens, block_size)
            tokens = blocks * block_size
            rows.append(SizingRow(
                name, tp, spec.weight_bytes, spec.weight_bytes_per_gpu(tp), spec.kv_bytes_per_token,
                round(spec.kv_bytes_per_token * seq_tokens), tokens, tokens / seq_tokens,
            ))
    return rows


# --- 2. roofline ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RooflineBound:
    flops_per_request: Mapping[str, float]  # model -> 2 x params x (uncached prompt + output)
    prefill_flops_per_request: Mapping[str, float]  # model -> the uncached-prompt part
    mix_flops_per_request: float
    peak_flops_per_s: float  # num_gpus x GPU peak (dense BF16)
    capacity_rps: float  # peak / mix FLOPs per request
    offered_rps: float
    demand_flops_per_s: float  # offered x mix FLOPs per request

    @property
    def load_factor(self) -> float:
        """offered / capacity: above 1, no scheduler can serve the offered load."""
        return self.offered_rps / self.capacity_rps


def roofline_bound(models: Mapping[str, ModelSpec], gpu: GpuSpec, num_gpus: int, mix: WorkloadMix) -> RooflineBound:
    per_req, prefill = {}, {}
    for m in mix.models:
        two_params = 2.0 * models[m.model].num_params
        prefill[m.model] = two_params * m.uncached_prompt_tokens
        per_req[m.model] = prefill[m.model] + two_params * m.mean_output_tokens
    total_share = sum(m.share for m in mix.models)
    mix_flops = sum(m.share * per_req[m.model] for m in mix.models) / total_share
    peak = num_gpus * gpu.peak_bf16_flops
    return RooflineBound(per_req, prefill, mix_flops, peak, peak / mix_flops, mix.rate_rps, mix.rate_rps * mix_flops)


def verdict(offered_rps: float, bound_rps: float, by: str = "compute") -> str:
    """One sentence: does the offered load fit under a bound, and by how much it misses or clears it."""
    ratio = offered_rps / bound_rps
    if ratio > 1.0:
        return (f"{offered_rps:.0f} req/s exceeds the node by {ratio:.1f}x by {by} (bound {bound_rps:.0f} req/s): "
                f"shed or queue at least {offered_rps - bound_rps:.0f} req/s")
    return f"{offered_rps:.0f} req/s fits the {by} bound of {bound_rps:.0f} req/s ({ratio:.0%} of it)"


# --- 3. SLO-aware bound --------------------------------------------------------------------------------------------


def decode_capacity_rps(cost: CostModel, kv_tokens: int, load: ModelLoad, itl_s: float, max_num_seqs: int) -> float:
    """A decode-only instance: largest batch within the ITL SLO and the KV, as requests/s."""
    ctx = int(load.mean_prompt_tokens + load.mean_output_tokens / 2)
    max_by_kv = int(kv_tokens // load.mean_sequence_tokens)
    best = 0.0
    for b in range(1, min(max_num_seqs, max_by_kv) + 1):
        step_s = cost.decode_step_time_s(b, ctx)
        if step_s > itl_s:
            break
        best = b / (step_s * load.mean_output_tokens)
    return best


def prefill_capacity_rps(cost: CostModel, chunk_tokens: int, load: ModelLoad, ttft_s: float) -> float:
    """A prefill-only instance: throughput at its chunk over the mean uncached prompt; 0 if one prompt overruns."""
    uncached = max(1, round(load.uncached_prompt_tokens))
    if cost.prefill_time_s(uncached) > ttft_s:
        return 0.0
    return cost.prefill_tokens_per_s(chunk_tokens) / uncached


def colocated_capacity_rps(
    cost: CostModel, kv_tokens: int, load: ModelLoad, slo: SloConfig, max_num_seqs: int, token_budget: int
) -> float:
    """Decodes plus a prefill chunk in every step, the step within the ITL SLO and a mean prompt's chunks within
    the TTFT SLO (see the module doc). For each batch B the chunk is the balanced one, B x uncached / output, or
    the prompt split into n equal chunks for every n whose steps fit the TTFT; the best rate over both wins."""
    itl_s, ttft_s = slo.itl_ms / 1000.0, slo.ttft_ms / 1000.0
    uncached, out = max(1.0, load.uncached_prompt_tokens), max(1.0, load.mean_output_tokens)
    ctx = int(load.mean_prompt_tokens + out / 2)
    best = 0.0
    for b in range(1, min(max_num_seqs, int(kv_tokens // load.mean_sequence_tokens)) + 1):
        decodes = [(1, ctx)] * b
        floor_s = cost.step_time_s([*decodes, (1, 0)])
        if floor_s > itl_s:
            break
        chunks = {math.ceil(b * uncached / out)} | {math.ceil(uncached / n) for n in range(1, int(ttft_s / floor_s) + 1)}
        for chunk in sorted(c for c in chunks if 1 <= c <= token_budget - b):
            step_s = cost.step_time_s([*decodes, (chunk, 0)])
            if step_s <= itl_s and math.ceil(uncached / chunk) * step_s <= ttft_s:
                best = max(best, min(b / (step_s * out), chunk / (step_s * uncached)))
    return best


@dataclass(frozen=True, slots=True)
class SloBound:
    model_capacity_rps: Mapping[str, float]  # model -> req/s its instances sustain within the SLOs
    node_rps: float  # req/s of the mix the node sustains: min over models of capacity / share
    limiting_model: str
    goodput_rps: float  # at the offered rate, shedding each model's excess: sum of min(offered, capacity)

    @property
    def serves_every_model(self) -> bool:
        return all(v > 0 for v in self.model_capacity_rps.values())


def instance_capacity_rps(config: NodeConfig, inst: InstanceConfig, load: ModelLoad) -> float:
    cost = CostModel(config.models[inst.model], config.gpu, inst.tp)
    kv_tokens = num_kv_blocks_for(config, inst) * inst.block_size
    slo = config.slo
    if inst.role is Role.DECODE:
        return decode_capacity_rps(cost, kv_tokens, load, slo.itl_ms / 1000.0, inst.max_num_seqs)
    if inst.role is Role.PREFILL:
        return prefill_capacity_rps(cost, inst.max_num_batched_tokens, load, slo.ttft_ms / 1000.0)
    return colocated_capacity_rps(cost, kv_tokens, load, slo, inst.max_num_seqs, inst.max_num_batched_tokens)


def slo_bound(config: NodeConfig, mix: WorkloadMix, cache: dict | None = None) -> SloBound:
    """`cache` (optional, shared across calls) memoises instance capacities by everything they depend on."""
    cache = {} if cache is None else cache
    caps: dict[str, float] = {}
    for m in mix.models:
        per_role: dict[Role, float] = {r: 0.0 for r in Role}
        for inst in config.instances_of(m.model):
            key = (inst.model, inst.role, inst.tp, inst.max_num_seqs, inst.max_num_batched_tokens,
                   inst.gpu_memory_utilization, inst.block_size, m, config.gpu, config.slo.ttft_ms, config.slo.itl_ms)
            if key not in cache:
                cache[key] = instance_capacity_rps(config, inst, m)
            per_role[inst.role] += cache[key]
        disagg = per_role[Role.PREFILL] + per_role[Role.DECODE] > 0
        caps[m.model] = per_role[Role.COLOCATED] + (min(per_role[Role.PREFILL], per_role[Role.DECODE]) if disagg else 0.0)
    total_share = sum(m.share for m in mix.models)
    rates = {m.model: (caps[m.model] / (m.share / total_share) if m.share > 0 else math.inf) for m in mix.models}
    limiting = min(rates, key=lambda k: (rates[k], k))
    goodput = sum(min(mix.rate_rps * m.share / total_share, caps[m.model]) for m in mix.models)
    return SloBound(caps, rates[limiting], limiting, goodput)


# --- 4. candidate placements ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Placement:
    label: str  # e.g. "llama-3-70b TP4 x1 colocated | llama-3-8b TP1 x4 colocated"
    config: NodeConfig


def _model_layouts(spec: ModelSpec, gpu: GpuSpec, num_gpus: int, tps: Sequence[int]) -> list[tuple[int, int, int]]:
    """(tp, num_prefill, num_decode) layouts of one model on `num_gpus` GPUs; num_prefill 0 means colocated."""
    out = []
    for tp in tps:
        if num_gpus % tp or spec.num_attention_heads % tp:
            continue
        if num_kv_blocks(spec, gpu, tp, 0.9, 8192, 16) <= 0:  # must fit with a prefill-sized token budget too
            continue
        n = num_gpus // tp
        out.append((tp, 0, n))
        out += [(tp, p, n - p) for p in range(1, n)]
    return out


def _instances(model: str, prefix: str, layout: tuple[int, int, int], first_gpu: int) -> list[InstanceConfig]:
    tp, num_prefill, n = layout
    out, gpu = [], first_gpu
    roles = [Role.PREFILL] * num_prefill + [Role.DECODE] * n if num_prefill else [Role.COLOCATED] * n
    counters: dict[Role, int] = {}
    for role in roles:
        k = counters[role] = counters.get(role, -1) + 1
        tag = {Role.COLOCATED: "", Role.PREFILL: "p", Role.DECODE: "d"}[role]
        tokens = 8192 if role is Role.PREFILL else 2048
        out.append(InstanceConfig(f"{prefix}-{tag}{k}", model, role, tp, tuple(range(gpu, gpu + tp)),
                                  max_num_batched_tokens=tokens))
        gpu += tp
    return out


def _label(model: str, layout: tuple[int, int, int]) -> str:
    tp, p, n = layout
    return f"{model} TP{tp} x{n} colocated" if p == 0 else f"{model} TP{tp} {p}P+{n}D"


def candidate_placements(
    gpu: GpuSpec, models: Mapping[str, ModelSpec], num_gpus: int = 8, *, slo: SloConfig = SloConfig(),
    policies: PolicyConfig = PolicyConfig(),
) -> list[Placement]:
    """Every split of the GPUs between two models (the larger first, TP 2/4/8; the smaller at TP 1), colocated or
    disaggregated per model. One model alone gets all GPUs. GPUs are exclusive, so TP=8 for the large model only
    appears when it is the only model (time-sharing the node is the scheduler's gang lease, not a placement)."""
    names = sorted(models, key=lambda n: -models[n].num_params)
    large = names[0]
    out = []
    if len(names) == 1:
        for layout in _model_layouts(models[large], gpu, num_gpus, TP_OPTIONS):
            insts = _instances(large, "lm", layout, 0)
            out.append(Placement(_label(large, layout), NodeConfig(gpu, num_gpus, dict(models), tuple(insts), slo, policies)))
        return [p for p in out if not check_placement(p.config)]
    small = names[1]
    for large_gpus in range(1, num_gpus):
        for lay_l in _model_layouts(models[large], gpu, large_gpus, (2, 4, 8)):
            for lay_s in _model_layouts(models[small], gpu, num_gpus - large_gpus, (1,)):
                insts = _instances(large, "lm", lay_l, 0) + _instances(small, "sm", lay_s, large_gpus)
                cfg = NodeConfig(gpu, num_gpus, dict(models), tuple(insts), slo, policies)
                out.append(Placement(f"{_label(large, lay_l)} | {_label(small, lay_s)}", cfg))
    return [p for p in out if not check_placement(p.config)]


def rank_placements(placements: Sequence[Placement], mix: WorkloadMix) -> list[tuple[Placement, SloBound]]:
    """Placements that serve every model first (dropping a model is not a placement, it is an outage), then the
    highest goodput bound at the offered rate, then the highest mix rate; ties by label, so the order is fixed."""
    cache: dict = {}
    scored = [(p, slo_bound(p.config, mix, cache)) for p in placements]
    return sorted(scored, key=lambda ps: (not ps[1].serves_every_model, -ps[1].goodput_rps, -ps[1].node_rps, ps[0].label))
