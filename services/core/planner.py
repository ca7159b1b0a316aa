"""Analytic sizing of the node for a workload mix: what fits, what the hardware can serve, which placement to try.

Four answers, each from the model/GPU specs and the cost model alone (no simulation):

1. Sizing table per model: weights, KV bytes per token and per mean sequence, and for each TP the KV capacity
   of one instance in tokens and in mean sequences.
2. Roofline bound: a request costs 2 x params x (uncached prompt + output) FLOPs, with the
   prefix-cache hit rate removing cached prompt tokens; the node at 100 % of peak serves
   num_gpus x peak / (mix-weighted FLOPs per request) req/s. No scheduler can beat it; real ones get well under.
3. SLO-aware estimate (`slo_bound`; an estimate, not a bound: simulations beat it, see section 5): what a
   scheduler could do under the cost model when every decode step must fit the ITL SLO and one request's prefill
   the TTFT SLO. Per instance:
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
   KV transfer time. It models "every step within the ITL SLO" at the mean request; it is neither a forecast nor a bound: the
   simulator's goodput (DistServe: mean TPOT <= ITL SLO, over the arrival window, completions during the drain
   included) can exceed it on short runs and on long-tailed lengths, where most requests are shorter than the mean.
4. Candidate placements: splits of the GPUs between the models, TP degrees that fit (at least one KV block), and
   colocated vs disaggregated (every prefill/decode split of a model's instances) per model, as NodeConfigs; and
   time-shared ones (gang groups: the large model at TP=8 over SM replicas on all GPUs, and the hybrid of a
   dedicated TP=4 prefill instance with a TP=4 decode instance time-shared with four SMs), at a few LM step
   shares. A gang member is estimated as a colocated instance that owns its GPUs for its step share d of every
   ITL: its steps must fit d x ITL, its prompt's chunks d x TTFT, and it serves d times that instance's rate;
   the barrier (waiting for the slowest SM step) is not in the estimate, the simulator charges it.

Invariants: pure and clock-free; every number is a function of the arguments; candidates pass `check_placement`.

Why one module past 600 lines: the candidates are built from the same sizing and ranked by the same estimate; the
four answers are read together (`octoserve plan` prints them side by side).
"""

from __future__ import annotations

import dataclasses
import math
from bisect import bisect_right
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from octoserve.services.core.cost_model import CostModel, cost_constants
from octoserve.services.core.gang import GangPolicy, with_shared_steps
from octoserve.services.core.placement import (
    GangConfig,
    GangGroup,
    InstanceConfig,
    NodeConfig,
    PolicyConfig,
    SloConfig,
    check_placement,
    num_kv_blocks_for,
)
from octoserve.services.core.specs import GpuSpec, ModelSpec, num_kv_blocks
from octoserve.services.core.types import Role

TP_OPTIONS = (1, 2, 4, 8)
GANG_LM_STEP_SHARES = (0.55, 0.6, 0.65)  # LM step shares of the ITL tried for time-shared candidates
GANG_MEMORY_UTILIZATION = 0.45  # each member's share of a shared GPU (the KV split; they add up to 0.9)


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
    """One row per (model the mix uses, TP that fits); a served model the workload never asks for has no mean
    sequence to size, so it has no rows."""
    rows = []
    used = {m.model for m in mix.models}
    for name, spec in models.items():
        if name not in used:
            continue
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
    if bound_rps <= 0:  # e.g. a model whose decode step alone exceeds the ITL SLO under the chosen cost profile
        return f"{offered_rps:.0f} req/s cannot be served within {by}: the bound is 0 req/s"
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
    cost = config.cost_model(inst)
    kv_tokens = num_kv_blocks_for(config, inst) * inst.block_size
    slo = config.slo.for_model(inst.model)
    if inst.role is Role.DECODE:
        return decode_capacity_rps(cost, kv_tokens, load, slo.itl_ms / 1000.0, inst.max_num_seqs)
    if inst.role is Role.PREFILL:
        return prefill_capacity_rps(cost, inst.max_num_batched_tokens, load, slo.ttft_ms / 1000.0)
    duty = config.step_itl_ms(inst) / slo.itl_ms  # < 1 for a gang member: it owns its GPUs that share of the time
    if duty < 1.0:
        slo = SloConfig(slo.ttft_ms * duty, slo.itl_ms * duty, slo.tier_ttft_ms)
    return duty * colocated_capacity_rps(cost, kv_tokens, load, slo, inst.max_num_seqs, inst.max_num_batched_tokens)


def slo_bound(config: NodeConfig, mix: WorkloadMix, cache: dict | None = None) -> SloBound:
    """`cache` (optional, shared across calls) memoises instance capacities by everything they depend on."""
    cache = {} if cache is None else cache
    caps: dict[str, float] = {}
    for m in mix.models:
        per_role: dict[Role, float] = {r: 0.0 for r in Role}
        for inst in config.instances_of(m.model):
            key = (inst.model, inst.role, inst.tp, inst.max_num_seqs, inst.max_num_batched_tokens,
                   inst.gpu_memory_utilization, inst.block_size, m, config.gpu,
                   config.slo.for_model(inst.model).ttft_ms, config.slo.for_model(inst.model).itl_ms,
                   config.step_itl_ms(inst))
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


def _model_layouts(spec: ModelSpec, gpu: GpuSpec, num_gpus: int, tps: Sequence[int],
                   mixed: bool = False) -> list[tuple[int, int, int, int]]:
    """(tp, num_prefill, num_decode, prefill_tp) layouts of one model on `num_gpus` GPUs; num_prefill 0 means
    colocated. The prefill instances share the decode instances' TP, or with `mixed` may take another (a TP=2
    prefill feeding a TP=4 decode instance, say: prefill is compute-bound and needs no decode batch's KV)."""
    fits = {tp: not (spec.num_attention_heads % tp) and num_kv_blocks(spec, gpu, tp, 0.9, 8192, 16) > 0 for tp in tps}
    out = []
    for tp in tps:
        if num_gpus % tp or not fits[tp]:  # must fit with a prefill-sized token budget too
            continue
        n = num_gpus // tp
        out.append((tp, 0, n, tp))
        out += [(tp, p, n - p, tp) for p in range(1, n)]
    if mixed:
        for tp_d in tps:
            for tp_p in tps:
                if tp_p == tp_d or not (fits[tp_d] and fits[tp_p]):
                    continue
                for n_p in range(1, num_gpus // tp_p + 1):
                    rest = num_gpus - n_p * tp_p
                    if rest >= tp_d and rest % tp_d == 0:
                        out.append((tp_d, n_p, rest // tp_d, tp_p))
    return out


STEP_BUDGETS = (2048, 4096, 8192)  # a candidate's colocated step budget: the first that holds a servable prompt


def servable_prompt_budget(spec: ModelSpec, gpu: GpuSpec, tp: int, ttft_ms: float, cost_profile: str) -> int:
    """The step budget of a colocated instance: the smallest of STEP_BUDGETS that holds, in one step, the longest
    prompt the instance prefills within the TTFT SLO when idle (so a long step takes whole any prompt it can serve
    in time; with 2,048 a 70B prompt of 2,049-3,059 tokens at TP=4 takes two long steps, two slow gaps for every
    running decode), else the largest."""
    cost = CostModel(spec, gpu, tp, cost_constants(cost_profile))
    for budget in STEP_BUDGETS:
        if cost.step_time_s([(budget + 1, 0)]) > ttft_ms / 1000.0:
            return budget
    return STEP_BUDGETS[-1]


def _instances(model: str, prefix: str, layout: tuple[int, int, int, int], first_gpu: int,
               budget: Callable[[int], int]) -> list[InstanceConfig]:
    """The instances of one model's layout from `first_gpu` on; `budget(tp)`: a colocated instance's step budget
    (a decode instance keeps 2,048: its prompts arrive prefilled)."""
    tp, num_prefill, n, prefill_tp = layout
    out, gpu = [], first_gpu
    roles = [Role.PREFILL] * num_prefill + [Role.DECODE] * n if num_prefill else [Role.COLOCATED] * n
    counters: dict[Role, int] = {}
    for role in roles:
        k = counters[role] = counters.get(role, -1) + 1
        tag = {Role.COLOCATED: "", Role.PREFILL: "p", Role.DECODE: "d"}[role]
        tokens = {Role.PREFILL: 8192, Role.DECODE: 2048}.get(role) or budget(tp)
        width = prefill_tp if role is Role.PREFILL else tp
        out.append(InstanceConfig(f"{prefix}-{tag}{k}", model, role, width, tuple(range(gpu, gpu + width)),
                                  max_num_batched_tokens=tokens))
        gpu += width
    return out


def _label(model: str, layout: tuple[int, int, int, int]) -> str:
    tp, p, n, prefill_tp = layout
    if p == 0:
        return f"{model} TP{tp} x{n} colocated"
    if prefill_tp == tp:
        return f"{model} TP{tp} {p}P+{n}D"
    return f"{model} {p}P TP{prefill_tp} + {n}D TP{tp}"


def placement_label(config: NodeConfig) -> str:
    """A config's placement in `candidate_placements`' labels (the larger model first), so a configured placement
    can be told from, or matched with, a candidate."""
    parts = []
    for model in sorted(config.models, key=lambda m: (-config.models[m].num_params, m)):
        prefill = config.instances_of(model, (Role.PREFILL,))
        rest = [i for i in config.instances_of(model) if i.role is not Role.PREFILL]
        if not rest:
            continue
        parts.append(_label(model, (rest[0].tp, len(prefill), len(rest), prefill[0].tp if prefill else rest[0].tp)))
    return " | ".join(parts)


def candidate_placements(
    gpu: GpuSpec, models: Mapping[str, ModelSpec], num_gpus: int = 8, *, slo: SloConfig = SloConfig(),
    policies: PolicyConfig = PolicyConfig(), cost_profile: str = "default",
) -> list[Placement]:
    """Every split of the GPUs between two models (the larger first, TP 2/4/8, its prefill instances at their own
    TP where split; the smaller at TP 1), colocated or disaggregated per model, plus the time-shared placements of
    `gang_placements`, plus the larger model alone on every GPU (TP=8 colocated, a TP=4 prefill + TP=4 decode
    pair, ...): they drop the smaller model, so `rank_placements` puts them after every placement that serves both,
    but they answer what the large model alone could do. One model alone gets all GPUs."""
    names = sorted(models, key=lambda n: -models[n].num_params)
    large = names[0]
    out = []

    def budget_of(model: str) -> Callable[[int], int]:
        return lambda tp: servable_prompt_budget(models[model], gpu, tp, slo.for_model(model).ttft_ms, cost_profile)

    if len(names) == 1:
        for layout in _model_layouts(models[large], gpu, num_gpus, TP_OPTIONS, mixed=True):
            insts = _instances(large, "lm", layout, 0, budget_of(large))
            out.append(Placement(_label(large, layout), NodeConfig(gpu, num_gpus, dict(models), tuple(insts), slo, policies, cost_profile)))
        return [p for p in out if not check_placement(p.config)]
    small = names[1]
    out += gang_placements(gpu, models, num_gpus, slo=slo, policies=policies, cost_profile=cost_profile)
    for large_gpus in range(1, num_gpus):
        for lay_l in _model_layouts(models[large], gpu, large_gpus, (2, 4, 8), mixed=True):
            for lay_s in _model_layouts(models[small], gpu, num_gpus - large_gpus, (1,)):
                insts = (_instances(large, "lm", lay_l, 0, budget_of(large))
                         + _instances(small, "sm", lay_s, large_gpus, budget_of(small)))
                cfg = NodeConfig(gpu, num_gpus, dict(models), tuple(insts), slo, policies, cost_profile)
                out.append(Placement(f"{_label(large, lay_l)} | {_label(small, lay_s)}", cfg))
    for lay_l in _model_layouts(models[large], gpu, num_gpus, (2, 4, 8), mixed=True):
        cfg = NodeConfig(gpu, num_gpus, {large: models[large]}, tuple(_instances(large, "lm", lay_l, 0, budget_of(large))), slo,
                         policies, cost_profile)
        out.append(Placement(f"{_label(large, lay_l)} | {small} not placed", cfg))
    return [p for p in out if not check_placement(p.config)]


def gang_placements(
    gpu: GpuSpec, models: Mapping[str, ModelSpec], num_gpus: int = 8, *, slo: SloConfig = SloConfig(),
    policies: PolicyConfig = PolicyConfig(), cost_profile: str = "default",
    policy: GangPolicy = GangPolicy(max_lm_wait_ms=25.0, max_sm_stall_ms=55.0),
) -> list[Placement]:
    """Time-shared candidates of two models: the large one at TP=`num_gpus` colocated over one small replica per
    GPU, and the hybrid (a TP=half prefill instance on the first half, a TP=half decode instance time-shared with
    one small replica per GPU of the second half), at each of GANG_LM_STEP_SHARES. Those that fail
    `check_placement` (memory, or bounds the floors make unprovable) are left out."""
    large, small = sorted(models, key=lambda n: -models[n].num_params)[:2]
    util = GANG_MEMORY_UTILIZATION
    half = num_gpus // 2
    shapes = []
    full = InstanceConfig("lm-0", large, Role.COLOCATED, num_gpus, tuple(range(num_gpus)), gpu_memory_utilization=util)
    sms = [InstanceConfig(f"sm-{g}", small, Role.COLOCATED, 1, (g,), gpu_memory_utilization=util)
           for g in range(num_gpus)]
    shapes.append((f"{large} TP{num_gpus} colocated gang over {small} TP1 x{num_gpus}", [full, *sms], "lm-0"))
    if half >= 2:
        prefill = InstanceConfig("lm-p0", large, Role.PREFILL, half, tuple(range(half)), max_num_batched_tokens=8192)
        decode = InstanceConfig("lm-d0", large, Role.DECODE, half, tuple(range(half, num_gpus)),
                                gpu_memory_utilization=util)
        gang_sms = [dataclasses.replace(sm) for sm in sms[half:]]
        shapes.append((f"{large} TP{half} 1P + TP{half} 1D gang over {small} TP1 x{half}",
                       [prefill, decode, *gang_sms], "lm-d0"))
    out = []
    for label, insts, lm_id in shapes:
        group = GangGroup(lm_id, tuple(i.id for i in insts if i.model == small))
        for share in GANG_LM_STEP_SHARES:
            gang = GangConfig((group,), with_shared_steps(policy, share, slo.itl_ms), share)
            cfg = NodeConfig(gpu, num_gpus, dict(models), tuple(insts), slo, policies, cost_profile, gang)
            out.append(Placement(f"{label} (LM step share {share:g})", cfg))
    return [p for p in out if not check_placement(p.config)]


def rank_placements(placements: Sequence[Placement], mix: WorkloadMix) -> list[tuple[Placement, SloBound]]:
    """Placements that serve every model first (dropping a model is not a placement, it is an outage), then the
    highest SLO-aware goodput estimate at the offered rate, then the highest mix rate; ties by label, so the order is fixed."""
    cache: dict = {}
    scored = [(p, slo_bound(p.config, mix, cache)) for p in placements]
    return sorted(scored, key=lambda ps: (not ps[1].serves_every_model, -ps[1].goodput_rps, -ps[1].node_rps, ps[0].label))


# --- 5. SLO-aware upper bound --------------------------------------------------------------------------------------
#
# `slo_bound` above judges the mean request at one operating point: a ranking heuristic, not a bound. Simulated
# goodput beat it (97 vs 61 req/s at the seed-000 peak) because (a) goodput counts requests, and a scheduler that
# sheds load keeps the cheap ones: prompts and outputs are long-tailed (lognormal), so the cheapest half of the
# requests costs far less than half the work; (b) goodput judges the mean TPOT of a request, not every step;
# (c) the mean-prompt TTFT test excludes a whole model when its mean prompt is slow, while short prompts still
# meet the SLO. `slo_upper_bound` drops each of those assumptions so that no scheduler can beat it under the cost
# model:
# - every instance is a set of operating points (prefill tokens/s, decode tokens/s): colocated, every step of B
#   decodes plus the largest chunk C with step(B, C) <= ITL SLO (steps over the SLO are allowed only as far as
#   time-sharing between points allows, which the convex hull covers: mean TPOT <= ITL with an affine step time);
#   decode-only, B / step(B) for the largest B within the ITL; prefill-only, its chunk throughput. Decode steps are
#   costed at context 1 (no KV reads) and KV capacity is ignored: both only loosen the bound;
# - a model's region is the Minkowski sum of its instances' hulls, walked along its Pareto boundary;
# - at a boundary point (P, D) the served rate x of a model with offered rate L is at most the largest x such that
#   the cheapest x / L of the requests by uncached prompt need <= P tokens/s AND the cheapest by output need
#   <= D tokens/s (each resource on its own: a relaxation of serving one set that satisfies both);
# - requests whose uncached prefill alone, at full speed on the model's fastest entry instance, exceeds their TTFT
#   SLO can never be good and are dropped.


@dataclass(frozen=True, slots=True)
class LengthSample:
    """Requests of one model as (uncached prompt tokens, output tokens, TTFT SLO in ms) drawn from the workload."""

    model: str
    requests: tuple[tuple[int, int, float], ...]


@dataclass(frozen=True, slots=True)
class UpperBound:
    model_capacity_rps: Mapping[str, float]  # model -> most good req/s at its offered rate
    goodput_rps: float  # sum over models: no scheduler serves more SLO-meeting req/s under the cost model
    feasible_fraction: Mapping[str, float]  # model -> share of its requests whose prefill alone fits the TTFT


def _hull_points(points: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """Upper-right convex hull of (P, D) points (plus the axes' projections), ordered by P ascending."""
    pts = set(points)
    if pts:
        pts |= {(max(p for p, _ in pts), 0.0), (0.0, max(d for _, d in pts))}
    ordered = sorted(pts, key=lambda pd: (pd[0], -pd[1]))
    hull: list[tuple[float, float]] = []
    for p in ordered:
        if hull and p[0] == hull[-1][0]:
            continue  # same prefill rate, less decode (sorted by decode descending within a prefill rate)
        while hull and hull[-1][1] <= p[1]:
            hull.pop()  # dominated
        while len(hull) >= 2 and _cross(hull[-2], hull[-1], p) >= 0:
            hull.pop()  # not convex
        hull.append(p)
    return hull


def _cross(o, a, b) -> float:
    return (a[0] - o[0]) * (b[1] - o[1]) - (a[1] - o[1]) * (b[0] - o[0])


def operating_points(cost: CostModel, role: Role, itl_s: float, max_num_seqs: int, token_budget: int) -> list[tuple[float, float]]:
    """(prefill tokens/s, decode tokens/s) the instance sustains with every decode-carrying step <= ITL."""
    if role is Role.PREFILL:
        return [(cost.prefill_tokens_per_s(token_budget), 0.0)]
    out = []
    for b in range(0, max_num_seqs + 1):
        decodes = [(1, 1)] * b
        if b and cost.step_time_s(decodes) > itl_s:
            break
        lo, hi = 0, max(0, token_budget - b) if role is Role.COLOCATED else 0
        while lo < hi:  # largest chunk that keeps the step within the ITL
            mid = (lo + hi + 1) // 2
            if cost.step_time_s([*decodes, (mid, 0)]) <= itl_s:
                lo = mid
            else:
                hi = mid - 1
        if b or lo:
            step_s = cost.step_time_s([*decodes, (lo, 0)] if lo else decodes)
            out.append((lo / step_s, b / step_s))
    return _hull_points(out)


def _minkowski_support(hulls: Sequence[list[tuple[float, float]]], num_directions: int = 256) -> list[tuple[float, float]]:
    """Support points of the sum of convex sets, in directions from 'all decode' to 'all prefill'; the sum's
    Pareto boundary is the polyline through them (finer directions only add vertices, never move the line out)."""
    support = []
    for k in range(num_directions + 1):
        w = k / num_directions
        p = d = 0.0
        for hull in hulls:
            bp, bd = max(hull, key=lambda pd: (w * pd[0] + (1 - w) * pd[1], pd))
            p, d = p + bp, d + bd
        if not support or support[-1] != (p, d):
            support.append((p, d))
    return support


def _best_on_boundary(support: Sequence[tuple[float, float]], served: Callable[[float, float], tuple[float, float]]) -> float:
    """max over the polyline of min(prefill-limited, decode-limited) served rate. Along a segment toward more
    prefill the first is non-decreasing and the second non-increasing, so the max is where they cross: found by
    bisection on each segment."""
    best = 0.0
    for (p0, d0), (p1, d1) in zip(support, support[1:] or support):
        lo, hi = 0.0, 1.0
        for _ in range(40):
            mid = (lo + hi) / 2
            sp, sd = served(p0 + (p1 - p0) * mid, d0 + (d1 - d0) * mid)
            lo, hi = (mid, hi) if sp < sd else (lo, mid)
        for t in (0.0, lo, hi, 1.0):
            best = max(best, min(served(p0 + (p1 - p0) * t, d0 + (d1 - d0) * t)))
    return best


def _servable_rps(costs_sorted_prefix: Sequence[float], offered_rps: float, budget_per_s: float) -> float:
    """Largest x <= offered with offered x (mean cost over the cheapest x / offered of requests) <= budget,
    fractional. `costs_sorted_prefix[k]` = sum of the k cheapest costs; the sample has n = len - 1 requests."""
    n = len(costs_sorted_prefix) - 1
    if n == 0 or offered_rps <= 0:
        return 0.0
    per_request = offered_rps / n  # req/s each sampled request stands for
    total = budget_per_s / per_request  # budget in "sum of sampled costs"
    k = bisect_right(costs_sorted_prefix, total) - 1
    if k >= n:
        return offered_rps
    step = costs_sorted_prefix[k + 1] - costs_sorted_prefix[k]
    frac = (total - costs_sorted_prefix[k]) / step if step > 0 else 0.0
    return (k + frac) * per_request


def _prefix_sums(values: Sequence[float]) -> list[float]:
    out = [0.0]
    for v in sorted(values):
        out.append(out[-1] + v)
    return out


def model_upper_bound_rps(config: NodeConfig, model: str, sample: LengthSample, offered_rps: float,
                          cache: dict | None = None) -> tuple[float, float]:
    """(most good req/s of `model` at `offered_rps`, fraction of its requests that can meet the TTFT at all).
    `cache` (optional, shared across calls) memoises operating points by what they depend on."""
    cache = {} if cache is None else cache
    insts = config.instances_of(model)
    if not insts or not sample.requests:
        return 0.0, 0.0
    itl_s = config.slo.for_model(model).itl_ms / 1000.0
    costs = {i.id: config.cost_model(i) for i in insts}
    entry = [i for i in insts if i.role is not Role.DECODE]
    fastest = min(entry, key=lambda i: costs[i.id].prefill_time_s(1000))
    # prefill time is increasing in the prompt: one bisection per TTFT SLO value finds the longest feasible prompt
    longest = {}
    for slo_ms in {t for _, _, t in sample.requests}:
        lo, hi = 0, max(p for p, _, _ in sample.requests)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if costs[fastest.id].prefill_time_s(mid) <= slo_ms / 1000.0 else (lo, mid - 1)
        longest[slo_ms] = lo
    feasible = [(p, o) for p, o, ttft_ms in sample.requests if max(1, p) <= longest[ttft_ms]]
    fraction = len(feasible) / len(sample.requests)
    if not feasible:
        return 0.0, 0.0
    # Batch and chunk limits as generous as vLLM's largest defaults: the bound is for any scheduler, not for this
    # config's knobs (a prefill instance keeps its chunk: its activation memory is what the placement sized).
    hulls = []
    for i in insts:
        budget = i.max_num_batched_tokens if i.role is Role.PREFILL else max(i.max_num_batched_tokens, 8192)
        key = ("points", model, i.role, i.tp, budget, max(i.max_num_seqs, 1024), config.gpu, itl_s)
        if key not in cache:
            cache[key] = operating_points(costs[i.id], i.role, itl_s, max(i.max_num_seqs, 1024), budget)
        hulls.append(cache[key])
    hulls = [h for h in hulls if h]
    offered_feasible = offered_rps * fraction
    prompt_sums = _prefix_sums([p for p, _ in feasible])
    output_sums = _prefix_sums([max(0, o - 1) for _, o in feasible])  # the first token comes with the prefill

    def served(p_rate: float, d_rate: float) -> tuple[float, float]:
        return (_servable_rps(prompt_sums, offered_feasible, p_rate), _servable_rps(output_sums, offered_feasible, d_rate))

    return _best_on_boundary(_minkowski_support(hulls), served), fraction


def slo_upper_bound(config: NodeConfig, mix: WorkloadMix, samples: Mapping[str, LengthSample],
                    cache: dict | None = None) -> UpperBound:
    """The SLO-aware upper bound of the node's goodput at `mix.rate_rps` (see the comment above)."""
    cache = {} if cache is None else cache
    total_share = sum(m.share for m in mix.models)
    caps, fractions = {}, {}
    for m in mix.models:
        offered = mix.rate_rps * m.share / total_share
        caps[m.model], fractions[m.model] = model_upper_bound_rps(config, m.model, samples[m.model], offered, cache)
    return UpperBound(caps, sum(caps.values()), fractions)
