"""The elastic balancer's capacity model and the estimates built on it (services/core/balancer.py composes them).

- `CapacityModel`: each instance's req/s from the cost model at the forecast mean lengths (prefill, decode and
  colocated instances; a split model serves the smaller of its pools plus its colocated instances);
- `placement_goodput_rps`: the goodput a placement would serve, weighted by the objective (`objective_weights`);
- `gain_noise`: how much of a forecast gain the demand's own Poisson noise could explain;
- `Corrections`: each model shape's capacity scaled by what it was measured to serve while saturated;
- `DwellTracker`: how long the demand mix has held (the cost horizon when none is configured);
- `weight_load_s`: the time to put one instance's weights on its GPUs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace

from octoserve.services.core.elastic_layouts import candidate_layouts, shape_gpus, shape_of, shape_text
from octoserve.services.core.elastic_load import RECENT_SHARE, ModelDemand, NodeLoad
from octoserve.services.core.placement import InstanceConfig, NodeConfig, num_kv_blocks_for
from octoserve.services.core.planner import ModelLoad, decode_capacity_rps
from octoserve.services.core.specs import GPUS_PER_PCIE_UPLINK, LOCAL_DISK_READ_BYTES_PER_S, GpuSpec, ModelSpec
from octoserve.services.core.types import Role

WEIGHT_SOURCES = ("host", "disk")
# "requests": goodput in req/s, every request alike; "load": each model's req/s over the req/s it would serve with
# the whole node to itself (`alone_capacity_rps`), so a 70B request weighs what it costs in GPU time.
OBJECTIVES = ("requests", "load")


def weight_load_s(model: ModelSpec, gpu: GpuSpec, tp: int, source: str = "host") -> float:
    """Seconds to put one instance's weights on its GPUs.

    host: the weights are kept pinned in host memory and each GPU copies its shard over PCIe
    (`gpu.pcie_bytes_per_s`, measured 55 GB/s on the H200 machine); the GPUs of a TP group load at once, and two GPUs
    share a switch uplink (`GPUS_PER_PCIE_UPLINK`), so a group of two or more gets half that rate per GPU: 70B at
    TP 4, 35.3 GB per GPU / 27.5 GB/s = 1.28 s; the 8B at TP 1, 16.1 GB / 55 GB/s = 0.29 s.
    disk: every shard comes from one local disk (`LOCAL_DISK_READ_BYTES_PER_S`, measured cold: 2.07 GB/s), shared
    by the loading GPUs, so the whole model / the disk rate (70B: 141 GB / 2.07 GB/s = 68 s); the PCIe hop overlaps."""
    if source == "host":
        shared = min(tp, GPUS_PER_PCIE_UPLINK)
        return model.weight_bytes_per_gpu(tp) / (gpu.pcie_bytes_per_s / shared)
    if source == "disk":
        model.check_tp(tp)
        return model.weight_bytes / LOCAL_DISK_READ_BYTES_PER_S
    raise ValueError(f"unknown weight source {source!r}; use one of {WEIGHT_SOURCES}")


class CapacityModel:
    """Per-instance req/s at given mean lengths (see the module doc), memoised."""

    def __init__(self, node: NodeConfig, decode_step_fraction: float = 0.9) -> None:
        self.node = node
        self.fraction = decode_step_fraction
        self._cache: dict = {}

    def _rates(self, inst: InstanceConfig, load: ModelLoad) -> tuple[float, float]:
        """(prefill req/s, decode req/s) of `inst` alone at `load`'s lengths, as if it did only that."""
        key = (inst.model, inst.tp, inst.max_num_batched_tokens, inst.max_num_seqs, inst.gpu_memory_utilization,
               inst.block_size, round(load.uncached_prompt_tokens), round(load.mean_prompt_tokens),
               round(load.mean_output_tokens))
        if key not in self._cache:
            node = self.node
            cost = node.cost_model(inst)
            chunk = max(2048, inst.max_num_batched_tokens)
            prefill = cost.prefill_tokens_per_s(chunk) / max(1.0, load.uncached_prompt_tokens)
            kv_tokens = num_kv_blocks_for(node, inst) * inst.block_size
            itl_s = node.slo.itl_ms / 1000.0 * self.fraction
            decode = decode_capacity_rps(cost, kv_tokens, load, itl_s, inst.max_num_seqs)
            self._cache[key] = (prefill, decode)
        return self._cache[key]

    def instance_rps(self, inst: InstanceConfig, load: ModelLoad) -> tuple[float, float]:
        """(prefill req/s, decode req/s) this instance contributes in its role."""
        p, d = self._rates(inst, load)
        if inst.role is Role.PREFILL:
            return p, 0.0
        if inst.role is Role.DECODE:
            return 0.0, d
        both = 0.0 if p <= 0 or d <= 0 else 1.0 / (1.0 / p + 1.0 / d)
        return both, both

    def model_capacity_rps(self, instances: Sequence[InstanceConfig], load: ModelLoad) -> float:
        colocated = prefill = decode = 0.0
        for inst in instances:
            p, d = self.instance_rps(inst, load)
            if inst.role is Role.COLOCATED:
                colocated += p
            else:
                prefill, decode = prefill + p, decode + d
        return colocated + min(prefill, decode)


def placement_goodput_rps(capacity: CapacityModel, instances: Sequence[InstanceConfig],
                          demand: Mapping[str, ModelDemand], horizon_s: float,
                          weights: Mapping[str, float] | None = None, step: bool = False,
                          corrections: "Corrections | None" = None) -> tuple[float, dict[str, float]]:
    """Forecast goodput of a placement: sum over models of weight x min(forecast demand, correction x capacity)
    (weights default to 1: req/s; the correction, `Corrections.factor`, is what this model's shape was measured to
    serve when saturated against its estimated capacity, 1 without); and the (uncorrected) capacities. `step`: forecast from the recent
    rates (`ModelDemand.forecast_rps`)."""
    caps: dict[str, float] = {}
    total = 0.0
    for model, d in demand.items():
        mine = [i for i in instances if i.model == model]
        cap = capacity.model_capacity_rps(mine, d.as_model_load(1.0))
        caps[model] = cap
        f = 1.0 if corrections is None else corrections.factor(model, shape_of(mine, model))
        total += (1.0 if weights is None else weights.get(model, 1.0)) * min(d.forecast_rps(horizon_s, step), f * cap)
    return total, caps


def gain_noise(demand: Mapping[str, ModelDemand], caps_now: Mapping[str, float], caps_to: Mapping[str, float],
               weights: Mapping[str, float] | None, horizon_s: float, step: bool, window_s: float) -> float:
    """The standard error of a move's forecast gain from the demand's own noise: each model's rate, counted over
    `window_s` (a step's recent rate over the recent share of it, `RECENT_SHARE`), is Poisson with sd
    sqrt(rate / window); the gain weight x (min(rate, cap after) - min(rate, cap now)) is taken at the rate +- one sd,
    half the difference is that model's share, and the models' shares add in quadrature."""
    var = 0.0
    for model, d in demand.items():
        rate = d.forecast_rps(horizon_s, step)
        span = window_s * (RECENT_SHARE if step and d.recent_rps is not None else 1.0)
        sd = math.sqrt(max(rate, 1.0 / span) / span)
        now, to = caps_now.get(model, 0.0), caps_to.get(model, 0.0)

        def gain(x: float) -> float:
            return min(x, to) - min(x, now)

        w = 1.0 if weights is None else weights.get(model, 1.0)
        var += (w * (gain(rate + sd) - gain(max(0.0, rate - sd))) / 2.0) ** 2
    return math.sqrt(var)


SATURATED = 0.05  # a model refusing at least this share of its arrivals is serving all it can


class Corrections:
    """Measured correction factors of the capacity estimate, per (model, shape) (`shape_of`).

    The estimate counts capacity and ignores queueing, so it can rank two placements the other way round from what
    they serve. Each period, a model whose shape has held (no instance of it changed, none draining) for a whole load
    window and that was saturated over it (refusals >= `SATURATED` of its arrivals, and demand >= `min_load` of the
    shape's estimated capacity: only then does what it served say what it can serve) is observed: ratio = measured
    goodput (arrivals - refusals) / estimated capacity, clamped to [0.2, 1.5], blended into the shape's factor
    with `weight`; `factor` (relative to the model's other observed shapes) scales the shape's capacity in
    `placement_goodput_rps`. A shape not yet observed, or the only one observed on its number of GPUs, is left
    at 1: the measurements shift the ranking only between splits of the same GPUs that were seen. Clock-free: the caller passes its time."""

    def __init__(self, weight: float = 0.3, min_load: float = 0.5) -> None:
        self.weight, self.min_load = weight, min_load
        self.factors: dict[tuple[str, tuple], float] = {}
        self._held: dict[str, tuple[tuple, float]] = {}  # model -> (shape, since when it has held)

    def factor(self, model: str, shape: tuple) -> float:
        """The shape's measured factor over the mean of the observed ones of the model on as many GPUs (1 when
        unobserved): relative, so the measurements re-rank the role and TP splits of a model's GPUs that were seen,
        and leave how many GPUs each model gets to the estimate (shapes on other GPU counts were seen at other
        times of the day, under other loads, and their factors do not compare)."""
        f = self.factors.get((model, shape))
        if f is None:
            return 1.0
        gpus = shape_gpus(shape)
        seen = [v for (m, sh), v in self.factors.items() if m == model and shape_gpus(sh) == gpus]
        return f / (sum(seen) / len(seen))

    def observe(self, now_s: float, capacity: CapacityModel, loads: NodeLoad, changing: set[str]) -> list[str]:
        """Update from one window; `changing`: models with a reconfiguration in flight. The lines it observed."""
        out = []
        for model in sorted({i.model for i in loads.placement}):
            mine = [i for i in loads.placement if i.model == model]
            shape = shape_of(mine, model)
            if model in changing or not all(loads.load_of(i.id).accepting for i in mine):
                self._held.pop(model, None)
                continue
            held = self._held.get(model)
            if held is None or held[0] != shape:
                self._held[model] = (shape, now_s)
                continue
            if now_s - held[1] < loads.window_s:
                continue
            d = loads.demand_of(model)
            cap = capacity.model_capacity_rps(mine, d.as_model_load(1.0))
            if cap <= 0 or d.arrival_rps < self.min_load * cap or d.refused_rps < SATURATED * d.arrival_rps:
                continue
            ratio = min(1.5, max(0.2, max(0.0, d.arrival_rps - d.refused_rps) / cap))
            old = self.factors.get((model, shape))
            new = ratio if old is None else old + self.weight * (ratio - old)
            self.factors[(model, shape)] = new
            out.append(f"{model} {shape_text(shape)} served {ratio:.2f} of its estimated capacity, saturated "
                       f"(factor {new:.2f})")
        return out

    def text(self) -> str:
        return ", ".join(f"{m} {shape_text(sh)} x{f:.2f}" for (m, sh), f in sorted(self.factors.items()))


class DwellTracker:
    """How long the node's demand mix holds: the horizon the cost check uses when `cost_horizon_s` is None.

    The mix is the per-model window rates weighted by the load weights (`objective_weights(..., "load")`: each
    model's req/s over its alone capacity). It has moved when the weighted rates differ from the segment's first
    ones by more than `tolerance` of the segment's total weighted load; a segment ends there. The horizon is the
    longer of the mean completed segment (EMA, weight 0.5) and the current one's age, at most `cap_s`; with no
    segment completed yet, `cap_s`. A day compressed tenfold holds its mix a tenth as long, and so does the
    horizon a move must pay for itself over."""

    def __init__(self, weights: Mapping[str, float], tolerance: float, cap_s: float) -> None:
        self.weights, self.tolerance, self.cap_s = weights, tolerance, cap_s
        self._ref: dict[str, float] | None = None
        self._since = 0.0
        self.mean_s: float | None = None

    def update(self, now_s: float, rates: Mapping[str, float]) -> None:
        w = {m: self.weights.get(m, 1.0) * r for m, r in rates.items()}
        if self._ref is None:
            self._ref, self._since = w, now_s
            return
        total = max(sum(self._ref.values()), sum(w.values()), 1e-9)
        moved = sum(abs(w.get(m, 0.0) - self._ref.get(m, 0.0)) for m in set(w) | set(self._ref)) / total
        if moved > self.tolerance:
            held = now_s - self._since
            self.mean_s = held if self.mean_s is None else 0.5 * (self.mean_s + held)
            self._ref, self._since = w, now_s

    def horizon_s(self, now_s: float) -> float:
        if self.mean_s is None:
            return self.cap_s
        return min(self.cap_s, max(self.mean_s, now_s - self._since))


def unserved(caps: Mapping[str, float]) -> list[str]:
    """Models a placement gives no capacity at all (say a 70B TP 2 instance whose decode step cannot meet the ITL
    SLO at any batch): such a placement keeps an instance of the model but serves none of its requests."""
    return sorted(m for m, c in caps.items() if c <= 0)


def alone_capacity_rps(node: NodeConfig, model: str, prompt_tokens: float, output_tokens: float) -> float:
    """The req/s `model` would serve with the whole node to itself (the best of its one-model layouts)."""
    alone = replace(node, models={model: node.models[model]}, instances=())
    capacity = CapacityModel(alone)
    load = ModelDemand(model, 0.0, 0.0, prompt_tokens, output_tokens).as_model_load(1.0)
    return max((capacity.model_capacity_rps(layout, load) for layout in candidate_layouts(alone)), default=0.0)


def objective_weights(node: NodeConfig, objective: str, prompt_tokens: float = 1000.0,
                      output_tokens: float = 250.0) -> dict[str, float]:
    """Per-model weights of a placement's score (`OBJECTIVES`). "load": the largest alone capacity over each model's
    own (at the given mean lengths), so the score stays in req/s of the fastest model: on 8 H100s at 1000/250
    tokens, the 8B weighs 1 and the 70B 142.2 / 13.5 = 10.5."""
    if objective == "requests":
        return {m: 1.0 for m in node.models}
    alone = {m: alone_capacity_rps(node, m, prompt_tokens, output_tokens) for m in node.models}
    top = max(alone.values())
    return {m: (top / a if a > 0 else 1.0) for m, a in alone.items()}
