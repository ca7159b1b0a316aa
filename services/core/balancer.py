"""The elastic balancer: from windowed load to reconfigurations (role changes and model changes), with guards.

Input (`NodeLoad`, built each balancing period by the simulator or the live scheduler):
- per instance (`InstanceLoad`): prefill backlog against its TTFT slack, decode batch and KV use against its ITL
  headroom, whether it still takes requests;
- per model (`ModelDemand`): the windowed arrival rate, its trend (req/s per s, least squares over the window, see
  `demand_trend`), the recent rate and its step score (`step_score`, optional) and the mean prompt / output lengths
  of the window;
- the current placement (the instances, draining ones included).

Output: `Reconfiguration`s (services/core/reconfig.py). The balancer forecasts each model's demand (rate + trend x
half of min(`forecast_window_s`, the load window): the mean of a linear trend, extrapolated no further than it was
measured; within `step_hold_s` of a step, a recent rate `step_z` standard errors off the window's earlier part, the
recent rate itself), scores every candidate placement by the goodput it would serve (`placement_goodput_rps`: sum
over models of weight x min(demand, capacity), the weights from `objective`: 1 for request goodput, or the largest
alone capacity over the model's own for load-weighted goodput), keeps only candidates that give every model some
capacity (`unserved`) and that are `reachable` from the current placement with every model served at each step,
and, when the best beats the current one, splits the difference into reconfigurations, one per group of GPUs that
changes hands (a move under way keeps its target while that stays within the hysteresis margin of the best):
- same GPUs, same model and TP, another role: ROLE (no weights move; `role_switch_s`). Between decode and colocated
  it may run in place (`role_in_place`; by default with a forward ranker): no drain, the instance serves throughout,
  in its old role until the switch, so it costs nothing and never leaves its model unserved (services/core/reconfig.py);
- anything else: MODEL, whose started instances load weights (`weight_load_s`: from pinned host memory over each
  GPU's own PCIe link, or from one local NVMe drive shared by the loading GPUs) plus `engine_init_s`.

Capacity estimate (per instance, from the cost model at the forecast mean lengths): a prefill instance serves
prefill_tokens_per_s(its chunk) / uncached prompt req/s; a decode instance B / (step(B) x output) req/s at the
largest B whose step fits `decode_step_fraction` x ITL SLO and whose KV fits; a colocated instance time-shares both:
1 / (1 / prefill rate + 1 / decode rate). A disaggregated model serves min(prefill pool, decode pool) plus its
colocated instances. It ignores queueing: the guards' margins absorb that. With `measured_corrections` (off by
default), each model shape's capacity is scaled by what it was measured to serve while saturated (`Corrections`,
each observation a `measured:observed` decision).

Guards, in the order they are checked (each refusal counted by reason in `counters`, each decision logged in `log`):
- `hold:unreachable`: a candidate that serves every model beats the current placement by the hysteresis margin, but
  it is not `reachable` (every order of its changes leaves a model with no instance taking requests for a moment),
  and no reachable one does; the log line names it, its forecast and the model that blocks it (`stranded_models`).
- `hold:no_gain`: the best candidate is the current placement.
- `hold:hysteresis`: the forecast gain is below `min_gain_fraction` of the current goodput (or `min_gain_rps`),
  or the same target has not been best for `confirm_periods` consecutive periods (one period after a step).
- `hold:noise`: the forecast gain is within `gain_noise_z` standard errors of the demand forecast's own noise
  (`gain_noise`: each model's rate measured over its window is Poisson, sd sqrt(rate / window); the gain's sd is
  what moving each rate by one sd does to it), so the next window may well reverse the ranking.
- `hold:cost`: the requests lost to the move (the retired instances' share of goodput x (drain + load + switch))
  exceed the gain x what is left of the horizon once its slowest change is done. The horizon is `cost_horizon_s`,
  or (unset) the observed demand dwell (`DwellTracker`: how long the mix has held, at most `forecast_window_s`).
- `hold:in_flight`: already `max_in_flight` reconfigurations not DONE.
- `hold:dwell`: a GPU of the change was reconfigured less than `min_dwell_s` ago.
- `hold:last_instance`: the change would leave a model unable to take requests (no colocated instance, and not
  both a prefill and a decode instance, among those still taking requests).
- `planned:role` / `planned:model`: a reconfiguration was emitted.
- `hold:settle` (with a forward ranker): a step was seen less than `step_settle_s` ago; moves with a model change
  wait for its recent rate (role changes are ranked at once).

Optional forward ranker (`ForwardRanker`, off unless one is given): the estimate proposes, a forward simulation
disposes; the estimate's own hysteresis, confirmation and cost checks are then not used. At most every
`forward_refresh_s` (at once after a step), and not while a move it chose is still under way (that move's
remaining changes are emitted through the in-flight, dwell and last-instance guards), the balancer builds `MoveCandidate`s: "hold" (the
placement in place, its in-flight changes continuing), the estimate's best reachable targets that serve every model
(`forward_top_k`) and the way back (the placement the last move started from), each with every change that reaches
it (`changes_to`, in an order that keeps every model served). The ranker plays each forward from the node's current
state, every candidate serving the same forecast arrivals (at each model's forecast rate), its changes paying their
drain, migration and load, and scores it over two horizons: the cost horizon and `forward_short_s`. A move of role
changes only is judged over the short one (a role change is cheap to undo at the next ranking, and demand whose
lengths alternate, prefill-heavy then decode-heavy, pays it back within a phase), a move with a model change over
the cost horizon (its load must pay). The move with the largest gain over hold among those beating hold by the
hysteresis margin (`min_gain_rps`, `min_gain_fraction` of hold's score, each over its horizon) is taken:
`ranked:NAME`, with every candidate's scores; otherwise `hold:forward`, with the same figures (and, between
rankings, the standing verdict).

Invariants: pure and clock-free (`now_s` is the caller's clock); every emitted reconfiguration passes
`check_reconfiguration` against the placement after the in-flight ones; while it runs every model can still take
requests (a colocated instance, or a prefill and a decode instance, not retiring); no GPU is reconfigured twice
within `min_dwell_s`; every target gives every model capacity.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from octoserve.services.core.placement import InstanceConfig, NodeConfig, num_kv_blocks_for
from octoserve.services.core.planner import ModelLoad, decode_capacity_rps
from octoserve.services.core.reconfig import ReconfigKind, Reconfiguration, apply, check_reconfiguration, in_place_role
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


# --- the input ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """One instance over the last window."""

    instance_id: str
    prefill_backlog_tokens: float = 0.0  # uncached prompt tokens waiting or in prefill
    ttft_slack_s: float = math.inf  # TTFT SLO minus the predicted TTFT of a request arriving now (< 0: late)
    decode_batch: int = 0  # running decodes
    decode_batch_limit: int = 0  # the largest batch whose step fits the ITL SLO (0: not a decoding instance)
    kv_used: float = 0.0  # fraction of its KV blocks in use
    itl_headroom: float = 1.0  # 1 - step time / ITL SLO over the window (< 0: steps overran)
    accepting: bool = True  # False while it drains for a reconfiguration
    running: int = 0  # requests admitted and not finished
    est_drain_s: float = 0.0  # until its last running request finishes, if it stopped taking requests now
    good_rps: float = 0.0  # requests it finished within their SLO per second over the window


@dataclass(frozen=True, slots=True)
class ModelDemand:
    """One model's demand over the last window."""

    model: str
    arrival_rps: float  # requests arriving per second (refused ones included)
    trend_rps_per_s: float = 0.0  # slope of the arrival rate over the window (`demand_trend`)
    mean_prompt_tokens: float = 1000.0
    mean_output_tokens: float = 400.0
    cached_fraction: float = 0.0  # share of prompt tokens the prefix cache served
    refused_rps: float = 0.0  # requests admission refused per second, every reason (the routers' reports live)
    recent_rps: float | None = None  # the rate over the window's last part (`step_score`); None: not measured
    step_z: float = 0.0  # how many standard errors the recent rate is off the earlier part's (`step_score`)

    def forecast_rps(self, horizon_s: float, step: bool = False) -> float:
        """Mean rate over the next `horizon_s` under a linear trend, never below 0; with `step` (a step change was
        seen) the recent rate, held flat: a ramp fitted across a step is neither the old level nor the new one."""
        if step and self.recent_rps is not None:
            return max(0.0, self.recent_rps)
        return max(0.0, self.arrival_rps + self.trend_rps_per_s * horizon_s / 2.0)

    def as_model_load(self, share: float) -> ModelLoad:
        return ModelLoad(self.model, share, max(1.0, self.mean_prompt_tokens), max(1.0, self.mean_output_tokens),
                         self.cached_fraction)


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """What `ElasticBalancer.plan` reads each period."""

    window_s: float  # the length of the window the figures cover
    placement: tuple[InstanceConfig, ...]  # every instance now on the node, draining ones included
    instances: tuple[InstanceLoad, ...]  # one per instance of `placement` (missing ones count as idle)
    demand: tuple[ModelDemand, ...]  # one per model

    def load_of(self, instance_id: str) -> InstanceLoad:
        for load in self.instances:
            if load.instance_id == instance_id:
                return load
        return InstanceLoad(instance_id)

    def demand_of(self, model: str) -> ModelDemand:
        for d in self.demand:
            if d.model == model:
                return d
        return ModelDemand(model, 0.0)


def demand_trend(samples: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of [(t_s, rate)] samples (req/s per s); 0 with fewer than two distinct times."""
    n = len(samples)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var <= 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in samples) / var


RECENT_SHARE = 0.4  # a step's recent rate is counted over this share of the window (2 of the callers' 5 bins)


def step_score(counts: Sequence[int], bin_s: float, recent_bins: int = 2) -> tuple[float, float]:
    """(recent rate, z) from per-bin arrival counts of one window: the rate over the last `recent_bins` bins and how
    many Poisson standard errors it lies from the rate over the earlier bins (signed: > 0 when demand jumped up).
    A step change shows as a large |z| at once, where the window's least-squares trend only tilts; a steady or
    slowly drifting rate keeps |z| near 1."""
    n = len(counts)
    if n <= recent_bins or bin_s <= 0:
        return (sum(counts) / (n * bin_s) if n and bin_s > 0 else 0.0), 0.0
    recent_s, early_s = recent_bins * bin_s, (n - recent_bins) * bin_s
    recent, early = sum(counts[-recent_bins:]) / recent_s, sum(counts[:-recent_bins]) / early_s
    var = max(recent, 1.0 / recent_s) / recent_s + max(early, 1.0 / early_s) / early_s
    return recent, (recent - early) / math.sqrt(var)


# --- the policy and the explanations -----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BalancerPolicy:
    forecast_window_s: float = 60.0  # the horizon a move must pay for itself over
    min_gain_fraction: float = 0.05  # hysteresis: the gain must be at least this share of the current goodput
    min_gain_rps: float = 0.5  # ... and at least this many req/s
    confirm_periods: int = 2  # the same target must be best this many consecutive periods
    min_dwell_s: float = 20.0  # a GPU is not reconfigured again sooner than this after its last change
    max_in_flight: int = 2  # reconfigurations not yet DONE, at most
    weight_source: str = "host"  # where started instances load weights from (see `weight_load_s`)
    engine_init_s: float = 2.0  # assumed: engine start on loaded weights (KV pool allocation, warm-up), per MODEL change
    role_switch_s: float = 0.5  # assumed: flipping an instance's KV connector role, per ROLE change
    # A role change between decode and colocated runs in place (no drain; the instance serves throughout), as the
    # live node and both simulators carry it out. None (default): in place with a forward ranker, drained without
    # one (the estimate alone over-uses a change that costs nothing: on the mix-shift day it lost goodput).
    role_in_place: bool | None = None
    decode_step_fraction: float = 0.9  # a decode instance is sized to steps of this share of the ITL SLO
    allow_model_changes: bool = True  # False: only role changes (a fixed split of GPUs between the models)
    allow_role_changes: bool = True
    objective: str = "requests"  # what a placement is scored by: see `OBJECTIVES`
    step_z: float = 4.0  # a model's recent rate this many standard errors off the window's earlier part is a step
    step_hold_s: float = 20.0  # after a step, forecasts use the recent rate and need no confirmation for this long
    gain_noise_z: float = 2.0  # a move's gain must exceed this many standard errors of the forecast's noise (0: off)
    # The horizon of the cost check: a fixed one in seconds, or None to derive it from the observed demand dwell
    # (`DwellTracker`: how long the node's mix has held, at most `forecast_window_s`).
    cost_horizon_s: float | None = None
    dwell_tolerance: float = 0.3  # the mix has moved when the load-weighted rates change by this share of the load
    # Correct the capacity estimate by what each placement shape served (`Corrections`). Off by default: in the
    # mix-shift day runs it made the balancer worse (the factors compare shapes seen under different loads).
    measured_corrections: bool = False
    correction_weight: float = 0.3  # the weight of each new observation in a measured correction factor (EMA)
    correction_min_load: float = 0.5  # a model's shape is observed only at demand >= this share of its estimate
    # With a `ForwardRanker`: how many of the estimate's best reachable targets are played forward (the way back
    # comes on top), and how long a hold verdict on the same target stands before it is played forward again.
    forward_top_k: int = 3
    forward_refresh_s: float = 10.0
    # A move may also win over this shorter horizon than the cost check's (None: only that one): demand whose
    # lengths alternate faster than the mix changes (prefill-heavy and decode-heavy phases) pays a role change back
    # before the next phase, and over the whole horizon the two phases cancel out.
    forward_short_s: float | None = 20.0
    forward_window_s: float = 60.0  # the forecast arrivals' lengths come from the arrivals over this last window
    # With a `ForwardRanker`: once a step is first seen, moves with a model change wait this long (role changes do
    # not). The step's forecast is the recent rate, measured over the window's last bins (4 s of the live node's
    # 10-s window), so a second after the step it holds a quarter of the new rate, and a weight load ranked on it
    # goes a quarter of the way.
    step_settle_s: float = 2.0

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.step_z <= 0 or self.step_hold_s < 0:
            raise ValueError("step_z must be > 0 and step_hold_s >= 0")
        if self.weight_source not in WEIGHT_SOURCES:
            raise ValueError(f"weight_source must be one of {WEIGHT_SOURCES}, got {self.weight_source!r}")
        if self.max_in_flight < 1 or self.confirm_periods < 1 or self.forward_top_k < 1:
            raise ValueError("max_in_flight, confirm_periods and forward_top_k must be >= 1")
        if self.cost_horizon_s is not None and self.cost_horizon_s < 0:
            raise ValueError(f"cost_horizon_s must be >= 0 or None, got {self.cost_horizon_s}")
        if not 0 < self.correction_weight <= 1 or not 0 < self.dwell_tolerance:
            raise ValueError("correction_weight must be in (0, 1] and dwell_tolerance > 0")
        for name in ("forecast_window_s", "min_gain_fraction", "min_gain_rps", "min_dwell_s", "engine_init_s",
                     "role_switch_s", "forward_refresh_s", "forward_window_s", "gain_noise_z", "step_settle_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if not 0 < self.decode_step_fraction <= 1:
            raise ValueError(f"decode_step_fraction must be in (0, 1], got {self.decode_step_fraction}")


@dataclass(frozen=True, slots=True)
class Decision:
    now_s: float
    reason: str  # the counter key: "planned:role", "hold:cost", ...
    detail: str  # the log line, with the figures that decided it


@dataclass(frozen=True, slots=True)
class MoveCandidate:
    """One candidate of a forward ranking: a target placement and every change that reaches it."""

    name: str  # "hold", "estimate", "top 2", "way back": what the log line calls it
    layout: tuple[InstanceConfig, ...]  # the placement once every change is done
    changes: tuple[Reconfiguration, ...]  # from the placement after the in-flight ones, in a serving order; () hold
    estimate: float  # its capacity-estimate score (the balancer's units)


RANKERS = ("none", "forward")  # the balancer's candidate ranking: the estimate alone, or played forward


class ForwardRanker(Protocol):
    """Plays candidate moves forward from the node's current state (module doc). Clock-free: `now_s` is the
    caller's clock."""

    name: str  # the decision reason's suffix: `ranked:NAME`

    def forecast(self, now_s: float, moves: Sequence[MoveCandidate], rates_rps: Mapping[str, float],
                 horizons_s: Sequence[float]) -> Sequence[Sequence[float]]:
        """Per move, one score per horizon, in the balancer's units (req/s within the SLOs, weighted by the
        objective) of the arrivals over [now_s, now_s + horizon): the node's current state (queues, running
        requests, in-flight changes) with the move's changes started as the guards allow, every move serving the
        same arrivals at `rates_rps` per model."""
        ...


# --- capacity ------------------------------------------------------------------------------------------------------


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


def shape_of(instances: Sequence[InstanceConfig], model: str) -> tuple:
    """One model's placement shape: how many instances of each (TP, role) it has (where they sit does not matter)."""
    return tuple(sorted(Counter((i.tp, i.role.value) for i in instances if i.model == model).items()))


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
        gpus = _gpus(shape)
        seen = [v for (m, sh), v in self.factors.items() if m == model and _gpus(sh) == gpus]
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
            out.append(f"{model} {_shape_text(shape)} served {ratio:.2f} of its estimated capacity, saturated "
                       f"(factor {new:.2f})")
        return out

    def text(self) -> str:
        return ", ".join(f"{m} {_shape_text(sh)} x{f:.2f}" for (m, sh), f in sorted(self.factors.items()))


def _gpus(shape: tuple) -> int:
    return sum(tp * n for (tp, _), n in shape)


def _shape_text(shape: tuple) -> str:
    return " ".join(f"TP{tp}{role[0].upper()}x{n}" for (tp, role), n in shape)


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


def _role_splits(n: int) -> list[tuple[Role, ...]]:
    """Roles of n same-shaped instances, in canonical order (prefill, decode, colocated): every (p, d, c) with
    p + d + c = n (the model as a whole must have both sides or neither: `_model_instances` checks that)."""
    out = []
    for p in range(n + 1):
        for d in range(n + 1 - p):
            out.append((Role.PREFILL,) * p + (Role.DECODE,) * d + (Role.COLOCATED,) * (n - p - d))
    return out


def _tp_groups(num_gpus: int, tps: Sequence[int]) -> list[tuple[int, ...]]:
    """Multisets of TP degrees (largest first) that add up to `num_gpus`."""
    if num_gpus == 0:
        return [()]
    out = []
    for tp in sorted(tps, reverse=True):
        if tp <= num_gpus:
            out += [(tp, *rest) for rest in _tp_groups(num_gpus - tp, [t for t in tps if t <= tp])]
    return out


def _model_instances(model: str, tps: tuple[int, ...], first_gpu: int,
                     smallest_first: bool = False) -> list[list[InstanceConfig]]:
    """Every role assignment of instances of TP degrees `tps` laid out from `first_gpu`, the largest TP first (or,
    with `smallest_first`, the smallest; same-TP instances in canonical role order), as lists of instances."""
    by_tp: dict[int, int] = {}
    for tp in tps:
        by_tp[tp] = by_tp.get(tp, 0) + 1
    per_tp = [[(tp, roles) for roles in _role_splits(n)]
              for tp, n in sorted(by_tp.items(), reverse=not smallest_first)]
    combos: list[list[tuple[int, tuple[Role, ...]]]] = [[]]
    for options in per_tp:
        combos = [c + [o] for c in combos for o in options]
    out = []
    for combo in combos:
        roles_all = [r for _, roles in combo for r in roles]
        if (Role.PREFILL in roles_all) != (Role.DECODE in roles_all):
            continue
        insts, gpu = [], first_gpu
        for tp, roles in combo:
            for role in roles:
                insts.append(_instance(model, role, tp, tuple(range(gpu, gpu + tp))))
                gpu += tp
        out.append(insts)
    return out


def candidate_layouts(node: NodeConfig, small_tps: Sequence[int] = (1,)) -> list[tuple[InstanceConfig, ...]]:
    """The placements the balancer may move to, for two models: the larger on the first (or the last, its instances
    then in either TP order) GPUs as instances of any mix of TP degrees (2, 4, 8) whose weights leave KV room, the
    smaller on the rest at
    `small_tps`, every role split of each model (`_role_splits`); each model keeps at least one instance. One model alone: its layouts on
    every GPU. Layouts that fail `check_placement` are left out."""
    from octoserve.services.core.placement import check_placement  # noqa: PLC0415 (a cycle-free local import)

    names = sorted(node.models, key=lambda n: -node.models[n].num_params)
    large = names[0]

    def tps_of(model: str, options: Sequence[int]) -> list[int]:
        spec = node.models[model]
        ok = []
        for tp in options:
            if tp > node.num_gpus or spec.num_attention_heads % tp:
                continue
            probe = InstanceConfig("probe", model, Role.PREFILL, tp, tuple(range(tp)), max_num_batched_tokens=8192)
            if num_kv_blocks_for(replace(node, instances=(probe,)), probe) > 0:
                ok.append(tp)
        return ok

    large_tps = tps_of(large, (1, 2, 4, 8))
    layouts: list[tuple[InstanceConfig, ...]] = []
    if len(names) == 1:
        for groups in _tp_groups(node.num_gpus, large_tps):
            layouts += [tuple(l) for l in _model_instances(large, groups, 0)]
    else:
        small = names[1]
        s_tps = tps_of(small, small_tps)
        for large_gpus in range(1, node.num_gpus):
            small_gpus = node.num_gpus - large_gpus
            for lg in _tp_groups(large_gpus, large_tps):
                for sg in _tp_groups(small_gpus, s_tps):
                    for li in _model_instances(large, lg, 0):
                        layouts += [tuple(li + si) for si in _model_instances(small, sg, large_gpus)]
                    # and mirrored (the smaller model first), so a pool can grow or shrink from either end; there
                    # the larger model's instances also in the other order, so that it grows and shrinks at its
                    # inner edge too (a TP 4 on GPUs 4-7 gains a TP 2 on GPUs 2-3 without moving)
                    orders = (False, True) if len(set(lg)) > 1 else (False,)
                    for si in _model_instances(small, sg, 0):
                        layouts += [tuple(si + li) for o in orders for li in _model_instances(large, lg, small_gpus, o)]
    return [l for l in layouts if not check_placement(replace(node, instances=l, gang=None))]


def _signature(inst: InstanceConfig) -> tuple:
    return (inst.model, inst.role, inst.tp, inst.gpu_ids)


def diff_components(current: Sequence[InstanceConfig], target: Sequence[InstanceConfig]
                    ) -> list[tuple[tuple[InstanceConfig, ...], tuple[InstanceConfig, ...]]]:
    """Groups of (current instances, target instances) that hold the same GPUs and differ; unchanged ones left out.

    Two instances are in one group when their GPUs overlap, transitively; a group is unchanged when its current and
    target instances have the same model, role, TP and GPUs. Ordered by first GPU."""
    cur_sig = {_signature(i) for i in current}
    tgt_sig = {_signature(i) for i in target}
    cur = [i for i in current if _signature(i) not in tgt_sig]
    tgt = [i for i in target if _signature(i) not in cur_sig]
    groups: list[tuple[set[int], list[InstanceConfig], list[InstanceConfig]]] = []
    for inst, side in [(i, 0) for i in cur] + [(i, 1) for i in tgt]:
        gpus = set(inst.gpu_ids)
        merged = [g for g in groups if g[0] & gpus]
        new = (gpus, [], [])
        for g in merged:
            groups.remove(g)
            new[0].update(g[0])
            new[1].extend(g[1])
            new[2].extend(g[2])
        new[1 + side].append(inst)
        groups.append(new)
    out = [(tuple(sorted(c, key=lambda i: i.gpu_ids)), tuple(sorted(t, key=lambda i: i.gpu_ids)))
           for _, c, t in sorted(groups, key=lambda g: min(g[0]))]
    return [(c, t) for c, t in out if c and t]


def serving_models(instances: Sequence[InstanceConfig]) -> set[str]:
    """Models that `instances` can serve a request of: a colocated instance, or a prefill and a decode instance."""
    roles: dict[str, set[Role]] = {}
    for i in instances:
        roles.setdefault(i.model, set()).add(i.role)
    return {m for m, r in roles.items() if Role.COLOCATED in r or {Role.PREFILL, Role.DECODE} <= r}


def pressure(loads: NodeLoad, model: str) -> str:
    """One model's load figures for a log line: prefill backlog against the tightest TTFT slack, decode batch
    against its limit, KV use and the ITL headroom, over its instances that take requests."""
    ids = {i.id for i in loads.placement if i.model == model}
    mine = [l for l in loads.instances if l.instance_id in ids and l.accepting]
    if not mine:
        return "no instance taking requests"
    slack = min(l.ttft_slack_s for l in mine)
    limit = sum(l.decode_batch_limit for l in mine)
    return (f"prefill backlog {sum(l.prefill_backlog_tokens for l in mine):.0f} tok, TTFT slack "
            f"{'inf' if math.isinf(slack) else f'{slack * 1000:.0f} ms'}, decode {sum(l.decode_batch for l in mine)}/"
            f"{limit}, KV {max(l.kv_used for l in mine):.0%}, ITL headroom {min(l.itl_headroom for l in mine):.0%}")


# --- the balancer --------------------------------------------------------------------------------------------------


class ElasticBalancer:
    """Implements the `Balancer` protocol of services/core/reconfig.py over `NodeLoad`.

    `node` gives the GPU, the models, the SLOs and the cost profile (its instances are ignored: the placement comes
    with every `NodeLoad`). `layouts` are the candidate placements (default: `candidate_layouts(node)`)."""

    def __init__(self, node: NodeConfig, policy: BalancerPolicy = BalancerPolicy(),
                 layouts: Sequence[Sequence[InstanceConfig]] | None = None,
                 ranker: ForwardRanker | None = None) -> None:
        self.node = node
        self.ranker = ranker  # None: the estimate decides alone (module doc)
        self.policy = policy
        # Decode <-> colocated role changes in place (`BalancerPolicy.role_in_place`; unset: with a forward ranker).
        self.in_place = policy.role_in_place if policy.role_in_place is not None else ranker is not None
        self.capacity = CapacityModel(node, policy.decode_step_fraction)
        self.layouts = [tuple(l) for l in (layouts if layouts is not None else candidate_layouts(node))]
        if not self.layouts:
            raise ValueError("no candidate placement: the balancer has nowhere to move")
        # The layouts by shape (each model's instances' TP degrees and roles): one shape laid out on other GPUs
        # scores the same, so the forward ranking plays each shape once, laid out as near the current one as it can.
        self._by_shape: dict[tuple, list[tuple[InstanceConfig, ...]]] = {}
        for layout in self.layouts:
            self._by_shape.setdefault(layout_shape(layout), []).append(layout)
        self.counters: Counter[str] = Counter()
        self.log: list[Decision] = []
        self._gpu_changed_s: dict[int, float] = {}
        self._streak_target: tuple | None = None
        self._streak = 0
        self._next_id = 0
        self.weights = objective_weights(node, policy.objective)  # per-model weight of the score (`OBJECTIVES`)
        self._step_until_s = -math.inf  # forecasts follow the recent rates until then (a step was seen)
        self._step_seen_s = -math.inf  # when the last step was first seen (`step_settle_s`)
        self._committed: tuple | None = None  # the target of a move under way
        self._before: tuple[InstanceConfig, ...] | None = None  # where the last move started from: the way back
        # The forward ranking (with a ranker): when it may run next, its last verdict, a move's target and gain.
        self._next_forward_s = -math.inf
        self._verdict = ""
        self._forward_layout: tuple[InstanceConfig, ...] = ()
        self._forward_gain = 0.0
        # Measured corrections of the capacity estimate, per (model, shape), and the observed demand dwell.
        self.corrections = Corrections(policy.correction_weight, policy.correction_min_load)
        self.dwell = DwellTracker(objective_weights(node, "load"), policy.dwell_tolerance, policy.forecast_window_s)

    # - helpers -

    def _decide(self, now_s: float, reason: str, detail: str) -> None:
        self.counters[reason] += 1
        self.log.append(Decision(now_s, reason, detail))

    def _allowed(self, current: Sequence[InstanceConfig], layout: Sequence[InstanceConfig]) -> bool:
        """Whether `layout` is reachable under the policy's allowed kinds of change."""
        for cur, tgt in diff_components(current, layout):
            role_only = (len(cur) == len(tgt) == 1 and cur[0].gpu_ids == tgt[0].gpu_ids
                         and cur[0].model == tgt[0].model and cur[0].tp == tgt[0].tp)
            if role_only and not self.policy.allow_role_changes:
                return False
            if not role_only and not self.policy.allow_model_changes:
                return False
        return True

    def _fresh_id(self, inst: InstanceConfig, taken: set[str]) -> str:
        base = f"{inst.model}-{inst.role.value}-g{inst.gpu_ids[0]}"
        name, k = base, 1
        while name in taken:
            k += 1
            name = f"{base}-{k}"
        taken.add(name)
        return name

    def _load_s(self, started: Sequence[InstanceConfig]) -> float:
        if not started:
            return 0.0
        return max(weight_load_s(self.node.models[i.model], self.node.gpu, i.tp, self.policy.weight_source)
                   for i in started) + self.policy.engine_init_s

    # - the plan -

    def plan(self, now_s: float, loads: NodeLoad, in_flight: Sequence[Reconfiguration]) -> list[Reconfiguration]:
        """The reconfigurations to start now (often none), each decision counted and logged (module doc)."""
        ctx = self._context(now_s, loads, in_flight)
        if self.ranker is not None:
            target = self._forward(now_s, ctx)
            if target is None:
                return []
        else:
            target = self._choose(now_s, ctx)
            if target is None or not self._confirmed(now_s, ctx, target) or not self._pays_off(now_s, ctx, target):
                return []
        out = self._emit(now_s, ctx, target)
        if out:
            if self._committed != _key(target.layout):
                self._before = tuple(ctx.current.values())
            self._streak_target, self._streak = None, 0
            self._committed = _key(target.layout)
        return out

    def _score(self, instances: Sequence[InstanceConfig], ctx: "_Context") -> tuple[float, dict[str, float]]:
        return placement_goodput_rps(self.capacity, instances, ctx.demand, ctx.trend_s, self.weights, ctx.step,
                                     self.corrections)

    def horizon_s(self, now_s: float) -> float:
        """The cost check's horizon: `cost_horizon_s`, or the observed demand dwell (`DwellTracker`)."""
        if self.policy.cost_horizon_s is not None:
            return self.policy.cost_horizon_s
        return self.dwell.horizon_s(now_s)

    def _context(self, now_s: float, loads: NodeLoad, in_flight: Sequence[Reconfiguration]) -> "_Context":
        policy = self.policy
        demand = {m: loads.demand_of(m) for m in sorted(self.node.models)}
        stepped = [m for m, d in demand.items() if abs(d.step_z) >= policy.step_z and d.recent_rps is not None]
        if stepped:
            if now_s >= self._step_until_s:
                self._step_seen_s = now_s
            self._step_until_s = now_s + policy.step_hold_s
        self.dwell.update(now_s, {m: d.arrival_rps for m, d in demand.items()})
        changing = {i.model for r in in_flight for i in r.start} | {
            i.model for i in loads.placement for r in in_flight if i.id in r.retire}
        observed = self.corrections.observe(now_s, self.capacity, loads, changing) if policy.measured_corrections else []
        for line in observed:
            self.counters["measured:observed"] += 1
            self.log.append(Decision(now_s, "measured:observed", line))
        # The placement once the in-flight reconfigurations are DONE: the base every new one is checked against.
        current = {i.id: i for i in loads.placement}
        for r in in_flight:
            if not check_reconfiguration(current, r):
                current = apply(current, r)
            elif not any(i in current for i in r.retire):
                # Switching: its retired instances are gone already, and the started ones (weights loading) count
                # as placed, whether the caller lists them yet (live: as starting) or not (the simulator).
                current.update({i.id: i for i in r.start})
        busy = {i for r in in_flight for i in r.retire}
        live = [i for i in loads.placement if i.id not in busy and i.id in current and loads.load_of(i.id).accepting]
        # The trend is extrapolated no further than the window it was measured over: a step seen through a short
        # window looks like a steep ramp, and carrying that ramp over the whole forecast window overshoots (and the
        # next period undoes the move). Within `step_hold_s` of a step the recent rates are the forecast instead.
        ctx = _Context(loads, demand, min(policy.forecast_window_s, loads.window_s), now_s < self._step_until_s,
                       stepped, current, busy, live, 0.0, {}, len(in_flight))
        ctx.now_good, ctx.now_caps = self._score(list(current.values()), ctx)
        return ctx

    def _choose(self, now_s: float, ctx: "_Context") -> "_Target | None":
        """The best reachable candidate that serves every model (ties: the one whose changes can start now, then the
        fewest changes); None (and the hold decided) when it is not worth moving to."""
        current = list(ctx.current.values())
        policy = self.policy
        scored, stranded = [], []
        for layout in self.layouts:
            if self._allowed(current, layout):
                good, caps = self._score(layout, ctx)
                if not unserved(caps):
                    (scored if reachable(current, layout, self.in_place) else stranded).append(
                        (good, layout, caps))
        margin = max(policy.min_gain_rps, policy.min_gain_fraction * ctx.now_good)
        if not scored:
            if not self._stranded(now_s, ctx, stranded, margin):
                self._decide(now_s, "hold:no_gain", "no candidate placement reachable under the allowed changes")
            return None
        top = max(s[0] for s in scored)
        committed = [s for s in scored if self._committed is not None and _key(s[1]) == self._committed]
        if committed and committed[0][0] >= top - margin and _key(current) != self._committed:
            # A move under way (some of its changes done or in flight) keeps its target while that stays within the
            # hysteresis margin of the best: a noisy forecast must not turn it around halfway.
            scored = committed
            top = committed[0][0]
            stranded = []
        else:
            self._committed = None

        def order(layout) -> tuple[bool, int, int]:
            """Among equally good targets: one with a change that may start now (it leaves every model able to take
            requests) first, then fewer changes that must wait for another, then fewer changes."""
            comps = diff_components(current, layout)
            waiting = sum(1 for cur, tgt in comps
                          if orphaned_by(cur, tgt, [i for i in ctx.live if i not in cur], self.in_place))
            return (waiting == len(comps), waiting, len(comps))

        good, layout, caps = min((s for s in scored if s[0] >= top - 1e-9), key=lambda s: order(s[1]))
        target = _Target(good, layout, caps, diff_components(current, layout), good - ctx.now_good,
                         self._forecast_text(ctx, caps))
        if (not target.components or target.gain < margin) and self._stranded(now_s, ctx, stranded, margin):
            self._streak_target, self._streak = None, 0
            return None
        if not target.components or target.gain <= 0:
            self._streak_target, self._streak = None, 0
            self._decide(now_s, "hold:no_gain",
                         f"current placement is best: goodput {ctx.now_good:.1f} {self._unit}; {target.forecast}")
            return None
        if target.gain < max(policy.min_gain_rps, policy.min_gain_fraction * ctx.now_good):
            self._streak_target, self._streak = None, 0
            self._decide(now_s, "hold:hysteresis",
                         f"gain {target.gain:.2f} {self._unit} below max({policy.min_gain_rps:g}, "
                         f"{policy.min_gain_fraction:.0%} x {ctx.now_good:.1f}) {self._unit}; {target.forecast}")
            return None
        noise = gain_noise(ctx.demand, ctx.now_caps, caps, self.weights, ctx.trend_s, ctx.step, ctx.loads.window_s)
        if target.gain < policy.gain_noise_z * noise:
            self._streak_target, self._streak = None, 0
            self._decide(now_s, "hold:noise",
                         f"gain {target.gain:.2f} {self._unit} within {policy.gain_noise_z:g} x {noise:.2f} "
                         f"{self._unit}, the forecast's noise; {target.forecast}")
            return None
        return target

    def _stranded(self, now_s: float, ctx: "_Context", stranded: Sequence[tuple], margin: float) -> bool:
        """When the best placement that serves every model beats the current one by the hysteresis margin but no
        order of changes reaches it with every model served throughout (`reachable`): decide `hold:unreachable`,
        naming it, its forecast and the models a change toward it would leave without a serving instance, and
        return True (else False, nothing decided). The move is not made (no downtime); the reason tells it apart
        from `hold:no_gain`, where nothing better exists."""
        if not stranded:
            return False
        good, layout, caps = max(stranded, key=lambda s: s[0])
        if good - ctx.now_good < margin:
            return False
        current = list(ctx.current.values())
        self._decide(now_s, "hold:unreachable",
                     f"{_layout_text(layout)} would serve {good:.1f} {self._unit} against {ctx.now_good:.1f} now "
                     f"(+{good - ctx.now_good:.1f}), but every change toward it from {_layout_text(current)} leaves "
                     f"{stranded_models(current, layout, self.in_place)} with no instance taking "
                     "requests for a moment; "
                     f"{self._forecast_text(ctx, caps)}")
        return True

    @property
    def _unit(self) -> str:
        return "req/s" if self.policy.objective == "requests" else "load-weighted req/s"

    def _forecast_text(self, ctx: "_Context", caps: Mapping[str, float]) -> str:
        step = f"step seen in {', '.join(ctx.stepped)}: recent rates; " if ctx.stepped else ""
        measured = self.corrections.text()
        step += f"measured corrections {measured}; " if measured else ""
        return step + ", ".join(
            f"{m} {d.forecast_rps(ctx.trend_s, ctx.step):.1f} req/s (cap {ctx.now_caps[m]:.1f} -> {caps[m]:.1f}; "
            f"{pressure(ctx.loads, m)})" for m, d in ctx.demand.items())

    def _horizon_text(self) -> str:
        if self.policy.cost_horizon_s is not None:
            return "cost_horizon_s"
        if self.dwell.mean_s is None:
            return "forecast window: no mix change seen yet"
        return f"demand dwell, mean {self.dwell.mean_s:.0f} s"

    def _confirmed(self, now_s: float, ctx: "_Context", target: "_Target") -> bool:
        """Hysteresis in time: the same target best `confirm_periods` periods running (one, after a step)."""
        key = _key(target.layout)
        if key == self._committed:
            return True
        self._streak = self._streak + 1 if key == self._streak_target else 1
        self._streak_target = key
        need = 1 if ctx.step else self.policy.confirm_periods
        if self._streak < need:
            self._decide(now_s, "hold:hysteresis", f"target best {self._streak}/{need} periods (gain "
                                                   f"{target.gain:.2f} {self._unit}); {target.forecast}")
            return False
        return True

    def _costs(self, ctx: "_Context", target: "_Target") -> None:
        """Each change's drain, load and requests lost while it is out (`target.costs`, one per component)."""
        policy = self.policy
        target.costs.clear()
        for cur, tgt in target.components:
            without = [i for i in ctx.current.values() if i not in cur]
            good_without, _ = self._score(without, ctx)
            role = _role_only(cur, tgt)
            if self.in_place and _runs_in_place(cur, tgt):
                target.costs.append(_Cost(True, 0.0, 0.0, 0.0, in_place=True))  # it serves throughout
                continue
            drain_s = max((ctx.loads.load_of(i.id).est_drain_s for i in cur), default=0.0)
            load_s = 0.0 if role else self._load_s(tgt)
            out_s = drain_s + (policy.role_switch_s if role else load_s)
            target.costs.append(_Cost(role, drain_s, load_s, max(0.0, ctx.now_good - good_without) * out_s))

    def _pays_off(self, now_s: float, ctx: "_Context", target: "_Target") -> bool:
        """Cost/benefit: what the retired instances serve now is lost for the drain + load (+ switch) of their
        change; the gain only counts from when the slowest change is done to the end of the forecast window."""
        policy = self.policy
        horizon = self.horizon_s(now_s)
        self._costs(ctx, target)
        slowest = max(c.drain_s + (policy.role_switch_s if c.role else c.load_s) for c in target.costs)
        target.benefit = target.gain * max(0.0, horizon - slowest)
        cost = sum(c.lost for c in target.costs)
        if cost >= target.benefit:
            self._decide(now_s, "hold:cost",
                         f"move costs {cost:.0f} requests (drain + load), gains {target.benefit:.0f} over "
                         f"{horizon:.0f} s ({self._horizon_text()}) "
                         f"less its slowest change ({slowest:.1f} s); {target.forecast}")
            return False
        return True

    # - the forward ranking -

    def _forward(self, now_s: float, ctx: "_Context") -> "_Target | None":
        """With a forward ranker (module doc): the target to move to now, or None (the hold decided and logged).
        A move under way keeps its target (it was played forward whole); otherwise, at most every
        `forward_refresh_s` (at once after a step), hold and the candidate moves are played forward."""
        policy = self.policy
        current = list(ctx.current.values())
        if self._committed is not None:
            layout = self._forward_layout
            if _key(current) != self._committed and reachable(current, layout, self.in_place):
                return self._forward_target(ctx, layout, self._forward_gain, "move under way")
            self._committed = None
        settled_s = self._step_seen_s + policy.step_settle_s
        settling = now_s < settled_s
        if now_s < self._next_forward_s and not ctx.stepped:
            self._decide(now_s, "hold:forward", f"verdict of {self._verdict}")
            return None
        self._next_forward_s = settled_s if settling else now_s + policy.forward_refresh_s
        moves = self._move_candidates(ctx)
        waiting = [m for m in moves if any(r.kind is not ReconfigKind.ROLE for r in m.changes)] if settling else []
        if waiting:
            # A move with a model change (weights to load) waits until the step's recent rate is measured; role
            # changes (cheap to undo) are played at once.
            moves = [m for m in moves if m not in waiting]
            self._decide(now_s, "hold:settle", f"a step seen at {self._step_seen_s:.0f} s in "
                                               f"{', '.join(ctx.stepped) or 'the demand'}: "
                                               f"{', '.join(m.name for m in waiting)} (a model change) wait until "
                                               f"{settled_s:.0f} s, when its recent rate is measured")
            if len(moves) < 2:
                return None
        if len(moves) < 2:
            self._verdict = f"{now_s:.0f} s: no reachable candidate move"
            stranded = []
            for layout in self.layouts:
                if self._allowed(current, layout) and not reachable(current, layout, self.in_place):
                    good, caps = self._score(layout, ctx)
                    if not unserved(caps):
                        stranded.append((good, layout, caps))
            if self._stranded(now_s, ctx, stranded, max(policy.min_gain_rps, policy.min_gain_fraction * ctx.now_good)):
                return None
            self._decide(now_s, "hold:no_gain", "no candidate placement reachable under the allowed changes")
            return None
        horizons = [self.horizon_s(now_s)]
        if policy.forward_short_s is not None and policy.forward_short_s < horizons[0]:
            horizons.append(policy.forward_short_s)
        rates = {m: d.forecast_rps(ctx.trend_s, ctx.step) for m, d in ctx.demand.items()}
        scores = [[float(x) for x in per] for per in self.ranker.forecast(now_s, moves, rates, horizons)]
        if len(scores) != len(moves) or any(len(per) != len(horizons) for per in scores):
            raise ValueError(f"ranker {self.ranker.name!r} gave {[len(p) for p in scores]} scores for {len(moves)} "
                             f"moves over {len(horizons)} horizons")
        line = (" / ".join(f"{h:.0f}" for h in horizons) + " s played forward at "
                + ", ".join(f"{m} {r:.1f}" for m, r in rates.items()) + " req/s: "
                + "; ".join(f"{m.name} {_layout_text(m.layout)} " + " / ".join(f"{x:.2f}" for x in per)
                            + f" (estimate {m.estimate:.2f})" for m, per in zip(moves, scores)) + f" {self._unit}")
        self._verdict = f"{now_s:.0f} s: {line}"
        # Each move is judged over the horizon it must pay back in: role changes only (cheap to undo at the next
        # ranking) over the short one, a move with a model change (weights to load) over the cost horizon.
        judged = []
        for k in range(1, len(moves)):
            h = len(horizons) - 1 if all(r.kind is ReconfigKind.ROLE for r in moves[k].changes) else 0
            margin = max(policy.min_gain_rps, policy.min_gain_fraction * scores[0][h])
            judged.append((scores[k][h] - scores[0][h], -k, h, margin))  # ties: the estimate's order
        winners = [j for j in judged if j[0] >= j[3]]
        if not winners:
            self._decide(now_s, "hold:forward", f"no move beats hold by the margin (role changes over "
                                                f"{horizons[-1]:.0f} s, model changes over {horizons[0]:.0f} s): {line}")
            return None
        gain, k, h, margin = max(winners)
        best, horizon = -k, horizons[h]
        self._decide(now_s, f"ranked:{self.ranker.name}",
                     f"{moves[best].name} beats hold by {gain:.2f} {self._unit} over {horizon:.0f} s (margin "
                     f"{margin:.2f}): {line}")
        self._before, self._committed = tuple(current), _key(moves[best].layout)
        return self._forward_target(ctx, moves[best].layout, gain * horizon,
                                    f"played forward over {horizon:.0f} s: {moves[best].name} {scores[best][h]:.2f} "
                                    f"vs hold {scores[0][h]:.2f}")

    def _forward_target(self, ctx: "_Context", layout: Sequence[InstanceConfig], benefit: float,
                        why: str) -> "_Target":
        """A target chosen by the forward ranking, as `_emit` takes it (its costs filled in for the log lines)."""
        good, caps = self._score(layout, ctx)
        target = _Target(good, tuple(layout), caps, diff_components(list(ctx.current.values()), layout),
                         good - ctx.now_good, f"{why}; {self._forecast_text(ctx, caps)}")
        self._costs(ctx, target)
        target.benefit = benefit
        self._forward_layout, self._forward_gain = tuple(layout), benefit
        return target

    def _nearest(self, current: Sequence[InstanceConfig], shape: tuple) -> tuple[InstanceConfig, ...] | None:
        """The layout of `shape` that is allowed, reachable and nearest `current` (`_distance`), among the candidate
        layouts of that shape and, when the shape moves GPUs between instances (a model change: weights to load),
        those `arrange_near` builds around the current instances; None when none is. A shape of role changes only
        keeps the candidate layouts' role order: laid out around the current instances, a role split becomes one
        cheap flip away from the next, and in the mix-shift day's prefill/decode phase the ranker then flipped roles
        back and forth (in the elastic simulator, 8 H200s under the pessimistic profile: more reconfigurations and
        less goodput)."""
        from octoserve.services.core.placement import check_placement  # noqa: PLC0415 (a cycle-free local import)

        options = list(self._by_shape.get(shape, ()))
        moves_gpus = sorted(k[:2] for k in shape) != sorted((i.model, i.tp) for i in current)
        for keep_low in ((True, False) if moves_gpus else ()):
            built = arrange_near(current, shape, self.node.num_gpus, self.in_place, keep_low)
            if built is not None and not check_placement(replace(self.node, instances=built, gang=None)):
                options.append(built)
        options = [l for l in options if self._allowed(current, l) and reachable(current, l, self.in_place)]
        return min(options, key=lambda l: _distance(current, l, self.in_place)) if options else None

    def _move_candidates(self, ctx: "_Context") -> list[MoveCandidate]:
        """Hold, the estimate's best reachable targets (`forward_top_k`) and the way back (module doc). Each is a
        shape not yet among them, laid out nearest the current placement (`_nearest`): the same shape on other GPUs
        serves the same, and moving instances to reach it costs their drain and weight loads for nothing."""
        current = tuple(ctx.current.values())
        seen = {layout_shape(current)}
        moves = [MoveCandidate("hold", current, (), ctx.now_good)]

        def add(name: str, layout: Sequence[InstanceConfig], good: float) -> None:
            shape = layout_shape(layout)
            if shape in seen:
                return
            nearest = self._nearest(current, shape) if shape in self._by_shape else None
            if nearest is None:
                if not self._allowed(current, layout) or not reachable(current, layout, self.in_place):
                    return
                nearest = tuple(layout)
            seen.add(shape)
            moves.append(MoveCandidate(name, nearest, self.changes_to(ctx, nearest), good))

        scored = [(self._score(l, ctx), l) for l in self.layouts]
        for (good, caps), layout in sorted(scored, key=lambda s: -s[0][0]):
            if len(moves) > self.policy.forward_top_k:
                break
            if not unserved(caps):
                add("estimate" if len(moves) == 1 else f"top {len(moves)}", layout, good)
        if self._before is not None and not unserved(self._score(self._before, ctx)[1]):
            add("way back", self._before, self._score(self._before, ctx)[0])
        return moves

    def changes_to(self, ctx: "_Context", layout: Sequence[InstanceConfig]) -> tuple[Reconfiguration, ...]:
        """Every change from the placement after the in-flight ones to `layout`, in an order that keeps every model
        served (`reach_order`), as the reconfigurations `_emit` would build (ids fresh, drain and load estimated)."""
        taken = set(ctx.current) | {i.id for i in ctx.loads.placement}
        out = []
        in_place = self.in_place
        for k, (cur, tgt) in enumerate(reach_order(list(ctx.current.values()), layout, in_place) or []):
            drain_s = max((ctx.loads.load_of(i.id).est_drain_s for i in cur), default=0.0)
            if _role_only(cur, tgt):
                here = in_place and _runs_in_place(cur, tgt)
                out.append(Reconfiguration(f"fw{k + 1}", ReconfigKind.ROLE, tuple(i.id for i in cur),
                                           (replace(tgt[0], id=cur[0].id),), "forward candidate",
                                           est_drain_s=0.0 if here else drain_s, in_place=here))
            else:
                out.append(Reconfiguration(f"fw{k + 1}", ReconfigKind.MODEL, tuple(i.id for i in cur),
                                           tuple(replace(i, id=self._fresh_id(i, taken)) for i in tgt),
                                           "forward candidate", est_drain_s=drain_s, load_s=self._load_s(tgt)))
        return tuple(out)

    def _blocked(self, now_s: float, ctx: "_Context", cur: Sequence[InstanceConfig], tgt: Sequence[InstanceConfig],
                 what: str, busy: set[str], n_in_flight: int) -> bool:
        """Whether a component must wait (the guard decided and logged)."""
        policy = self.policy
        gpus = sorted({g for i in cur for g in i.gpu_ids})
        if n_in_flight >= policy.max_in_flight:
            self._decide(now_s, "hold:in_flight", f"{what}: {n_in_flight} reconfigurations in flight "
                                                   f"(max {policy.max_in_flight})")
            return True
        recent = [g for g in gpus if now_s - self._gpu_changed_s.get(g, -math.inf) < policy.min_dwell_s]
        if recent:
            self._decide(now_s, "hold:dwell", f"{what}: GPUs {recent} changed less than {policy.min_dwell_s:g} s ago")
            return True
        live_ids = {i.id for i in ctx.loads.placement}
        if any(i.id in busy or i.id not in live_ids for i in cur):
            self._decide(now_s, "hold:in_flight", f"{what}: an instance is still being reconfigured or started")
            return True
        retiring = busy | {i.id for i in cur}
        others = [i for i in ctx.loads.placement if i.id not in retiring and i.id in ctx.current
                  and ctx.loads.load_of(i.id).accepting]
        orphaned = sorted(orphaned_by(cur, tgt, others, self.in_place))
        if orphaned:
            self._decide(now_s, "hold:last_instance",
                         f"{what}: would leave {orphaned} with no instance taking requests")
            return True
        return False

    def _emit(self, now_s: float, ctx: "_Context", target: "_Target") -> list[Reconfiguration]:
        """The target's changes that may start now, as reconfigurations (the rest wait on a guard; the target is
        reachable, `reachable`, and stays the target while it is near the best: `_choose`)."""
        policy = self.policy
        current, busy, n_in_flight = dict(ctx.current), set(ctx.busy), ctx.n_in_flight
        taken = set(current) | {i.id for i in ctx.loads.placement}
        ready: list[tuple[Reconfiguration, list[int]]] = []
        for (cur, tgt), cost in zip(target.components, target.costs):
            gpus = sorted({g for i in cur for g in i.gpu_ids})
            what = f"{'+'.join(i.id for i in cur)} -> " + "+".join(f"{i.model} {i.role.value} TP{i.tp}" for i in tgt)
            if self._blocked(now_s, ctx, cur, tgt, what, busy, n_in_flight):
                continue
            if cost.role:
                started, kind = (replace(tgt[0], id=cur[0].id),), ReconfigKind.ROLE
            else:
                started, kind = tuple(replace(i, id=self._fresh_id(i, taken)) for i in tgt), ReconfigKind.MODEL
            switch = policy.role_switch_s if cost.role else cost.load_s
            lost = ("lost: none, in place, serving throughout" if cost.in_place else
                    f"lost to drain {cost.drain_s:.1f} s + {'switch' if cost.role else 'load'} {switch:.1f} s")
            reason = (f"{what} on GPUs {gpus}: forecast goodput {ctx.now_good:.1f} -> {target.good:.1f} {self._unit}, "
                      f"gain {target.benefit:.0f} requests over {self.horizon_s(now_s):.0f} s ({self._horizon_text()}) "
                      f"vs {cost.lost:.0f} {lost}; {target.forecast}")
            r = Reconfiguration(f"rc{self._next_id + len(ready) + 1}", kind, tuple(i.id for i in cur), started,
                                reason, est_drain_s=cost.drain_s, load_s=0.0 if cost.role else cost.load_s,
                                est_gain=target.benefit, in_place=cost.in_place)
            problems = check_reconfiguration(current, r)
            if problems:  # defensive: the diff should never produce these
                self._decide(now_s, "hold:invalid", "; ".join(problems))
                continue
            current = apply(current, r)
            busy |= set(r.retire)
            n_in_flight += 1
            ready.append((r, gpus))
        for r, gpus in ready:
            self._next_id += 1
            for g in gpus:
                self._gpu_changed_s[g] = now_s
            self._decide(now_s, f"planned:{r.kind.value}", r.reason)
        return [r for r, _ in ready]


def _key(layout: Sequence[InstanceConfig]) -> tuple:
    return tuple(sorted(_signature(i) for i in layout))


def layout_shape(layout: Sequence[InstanceConfig]) -> tuple:
    """A layout up to where its instances sit: each instance's model, TP degree and role (what the capacity estimate
    scores)."""
    return tuple(sorted((i.model, i.tp, i.role.value) for i in layout))


def arrange_near(current: Sequence[InstanceConfig], shape: tuple, num_gpus: int, in_place: bool = False,
                 keep_low: bool = True) -> tuple[InstanceConfig, ...] | None:
    """A layout of `shape` (`layout_shape`) built around `current`: the instances that already have a place in it
    stay as they are; then those of a model and TP degree it still needs change role where they are (decode <->
    colocated first, when such changes run in place); what is left is laid out on the GPUs freed and unused, largest
    TP first, each on the lowest contiguous run that fits. `keep_low`: of equal instances, the lowest-numbered GPUs'
    stay (else the highest's). None when the freed GPUs do not fit what is left."""
    want = Counter(shape)
    order = sorted(current, key=lambda i: i.gpu_ids, reverse=not keep_low)
    kept: list[InstanceConfig] = []
    rest = []
    for inst in order:
        key = (inst.model, inst.tp, inst.role.value)
        if want[key] > 0:
            want[key] -= 1
            kept.append(inst)
        else:
            rest.append(inst)
    freed: set[int] = set(range(num_gpus)) - {g for i in current for g in i.gpu_ids}
    for inst in rest:
        roles = [Role(k[2]) for k, n in want.items() if n > 0 and k[:2] == (inst.model, inst.tp)]
        if not roles:
            freed.update(inst.gpu_ids)
            continue
        role = min(roles, key=lambda r: (not (in_place and in_place_role(inst.role, r)), r.value))
        want[(inst.model, inst.tp, role.value)] -= 1
        kept.append(_instance(inst.model, role, inst.tp, inst.gpu_ids))
    for model, tp, role in sorted(want.elements(), key=lambda k: (-k[1], k)):
        free = sorted(freed)
        run = next((free[k:k + tp] for k in range(len(free) - tp + 1) if free[k + tp - 1] - free[k] == tp - 1), None)
        if run is None:
            return None
        kept.append(_instance(model, Role(role), tp, tuple(run)))
        freed.difference_update(run)
    return tuple(sorted(kept, key=lambda i: i.gpu_ids))


def _instance(model: str, role: Role, tp: int, gpus: tuple[int, ...]) -> InstanceConfig:
    """A candidate layout's instance, as `_model_instances` builds them."""
    tokens = 8192 if role is Role.PREFILL else 2048
    return InstanceConfig(f"{model}-{role.value}-g{gpus[0]}", model, role, tp, tuple(gpus), max_num_batched_tokens=tokens)


def _distance(current: Sequence[InstanceConfig], target: Sequence[InstanceConfig], in_place: bool) -> tuple:
    """How far `target` is from `current`, to order layouts of one shape: the GPUs whose weights would load (model
    changes), then the GPUs that would change role with a drain, then those changing role in place, then the
    number of changes."""
    loads = drains = flips = 0
    comps = diff_components(current, target)
    for cur, tgt in comps:
        gpus = len({g for i in cur for g in i.gpu_ids})
        if not _role_only(cur, tgt):
            loads += gpus
        elif in_place and _runs_in_place(cur, tgt):
            flips += gpus
        else:
            drains += gpus
    return loads, drains, flips, len(comps)


def orphaned_by(cur: Sequence[InstanceConfig], tgt: Sequence[InstanceConfig], others: Sequence[InstanceConfig],
                in_place: bool = False) -> set[str]:
    """The models of `cur` that no instance would serve while the change `cur` -> `tgt` is out, `others` serving
    beside it. An in-place role change (`in_place_role`, with `in_place`) keeps its instance serving: in its old
    role until the switch, then in the new one, so `others` with the new role must serve its model."""
    keep = list(tgt) if in_place and _runs_in_place(cur, tgt) else []
    return {i.model for i in cur} - serving_models([*others, *keep])


def reachable(current: Sequence[InstanceConfig], target: Sequence[InstanceConfig], in_place: bool = False) -> bool:
    """Whether `target` can be reached from `current` one change (`diff_components`) at a time with every model
    served throughout: each change, started once the ones before it are done, leaves the models of the instances it
    retires served by the rest (`orphaned_by`). Without in-place role changes (`in_place` False), a 70B whose only
    decoding instance must change role while its other instance goes cannot (it would be unserved for a moment):
    such a target is never chosen, rather than started halfway. With them, the decoding instance changes role in
    place first and the other goes after."""
    return reach_order(current, target, in_place) is not None


def reach_order(current: Sequence[InstanceConfig], target: Sequence[InstanceConfig], in_place: bool = False
                ) -> list[tuple[tuple[InstanceConfig, ...], tuple[InstanceConfig, ...]]] | None:
    """The changes from `current` to `target` in an order that keeps every model served (`reachable`); None when
    there is none."""
    placement = list(current)
    comps = diff_components(current, target)
    out = []
    while comps:
        for k, (cur, tgt) in enumerate(comps):
            rest = [i for i in placement if i not in cur]
            if not orphaned_by(cur, tgt, rest, in_place):
                placement = rest + list(tgt)
                out.append(comps.pop(k))
                break
        else:
            return None
    return out


def stranded_models(current: Sequence[InstanceConfig], target: Sequence[InstanceConfig], in_place: bool = False
                    ) -> list[str]:
    """The models that block `target` (`reachable` False): once the changes that can go first are done, each change
    left would leave one of these without a serving instance (`serving_models`). Empty when `target` is reachable."""
    placement = list(current)
    comps = diff_components(current, target)
    progress = True
    while comps and progress:
        progress = False
        for k, (cur, tgt) in enumerate(comps):
            rest = [i for i in placement if i not in cur]
            if not orphaned_by(cur, tgt, rest, in_place):
                placement = rest + list(tgt)
                comps.pop(k)
                progress = True
                break
    return sorted({m for cur, tgt in comps for m in orphaned_by(cur, tgt, [i for i in placement if i not in cur],
                                                                 in_place)})


def _layout_text(layout: Sequence[InstanceConfig]) -> str:
    return " | ".join(f"{m} {_shape_text(shape_of(layout, m))}" for m in sorted({i.model for i in layout}))


def _role_only(cur: Sequence[InstanceConfig], tgt: Sequence[InstanceConfig]) -> bool:
    """A change of one instance's role on the same GPUs, model and TP (no weights move)."""
    return (len(cur) == len(tgt) == 1 and cur[0].gpu_ids == tgt[0].gpu_ids and cur[0].model == tgt[0].model
            and cur[0].tp == tgt[0].tp)


def _runs_in_place(cur: Sequence[InstanceConfig], tgt: Sequence[InstanceConfig]) -> bool:
    """A role change that may run in place: one instance, same GPUs, model and TP, decode <-> colocated."""
    return _role_only(cur, tgt) and in_place_role(cur[0].role, tgt[0].role)


@dataclass
class _Context:
    """What one `plan` call works from."""

    loads: NodeLoad
    demand: dict[str, ModelDemand]
    trend_s: float  # how far the trend is extrapolated
    step: bool  # within `step_hold_s` of a step: forecasts are the recent rates
    stepped: list[str]  # the models whose step was seen in this window
    current: dict[str, InstanceConfig]  # the placement once the in-flight reconfigurations are done
    busy: set[str]  # instances retired by an in-flight reconfiguration
    live: list[InstanceConfig]  # instances taking requests and not retiring
    now_good: float
    now_caps: dict[str, float]
    n_in_flight: int = 0


@dataclass
class _Cost:
    role: bool
    drain_s: float
    load_s: float
    lost: float  # requests (score units) lost while the change is out
    in_place: bool = False  # a role change that serves throughout (`in_place_role`)


@dataclass
class _Target:
    good: float
    layout: tuple[InstanceConfig, ...]
    caps: dict[str, float]
    components: list[tuple[tuple[InstanceConfig, ...], tuple[InstanceConfig, ...]]]
    gain: float
    forecast: str
    costs: list[_Cost] = field(default_factory=list)
    benefit: float = 0.0
