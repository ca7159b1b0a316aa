"""The elastic balancer: from windowed load to reconfigurations (role changes and model changes), with guards.

Input (`NodeLoad`, built each balancing period by the simulator or the live scheduler):
- per instance (`InstanceLoad`): prefill backlog against its TTFT slack, decode batch and KV use against its ITL
  headroom, whether it still takes requests;
- per model (`ModelDemand`): the windowed arrival rate, its trend (req/s per s, least squares over the window, see
  `demand_trend`), the recent rate and its step score (`step_score`, optional) and the mean prompt / output lengths
  of the window;
- the current placement (the instances, draining ones included).

The balancer composes three modules: what it reads (`NodeLoad`, services/core/elastic_load.py), its capacity
model (services/core/elastic_capacity.py) and the candidate placements and their reachability
(services/core/elastic_layouts.py); it holds the forecast, the guards and the forward ranking.

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

Why one module past 600 lines: one decision loop: forecast, guards and forward ranking in the order they run.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Protocol

from octoserve.services.core.elastic_capacity import (
    OBJECTIVES,
    WEIGHT_SOURCES,
    CapacityModel,
    Corrections,
    DwellTracker,
    gain_noise,
    objective_weights,
    placement_goodput_rps,
    unserved,
    weight_load_s,
)
from octoserve.services.core.elastic_layouts import (
    arrange_near,
    candidate_layouts,
    diff_components,
    layout_distance,
    layout_key,
    layout_shape,
    layout_text,
    orphaned_by,
    reach_order,
    reachable,
    role_only,
    runs_in_place,
    stranded_models,
)
from octoserve.services.core.elastic_load import ModelDemand, NodeLoad, pressure
from octoserve.services.core.placement import InstanceConfig, NodeConfig
from octoserve.services.core.reconfig import ReconfigKind, Reconfiguration, apply, check_reconfiguration

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
            if self._committed != layout_key(target.layout):
                self._before = tuple(ctx.current.values())
            self._streak_target, self._streak = None, 0
            self._committed = layout_key(target.layout)
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
        committed = [s for s in scored if self._committed is not None and layout_key(s[1]) == self._committed]
        if committed and committed[0][0] >= top - margin and layout_key(current) != self._committed:
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
                     f"{layout_text(layout)} would serve {good:.1f} {self._unit} against {ctx.now_good:.1f} now "
                     f"(+{good - ctx.now_good:.1f}), but every change toward it from {layout_text(current)} leaves "
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
        key = layout_key(target.layout)
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
            role = role_only(cur, tgt)
            if self.in_place and runs_in_place(cur, tgt):
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
            if layout_key(current) != self._committed and reachable(current, layout, self.in_place):
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
                + "; ".join(f"{m.name} {layout_text(m.layout)} " + " / ".join(f"{x:.2f}" for x in per)
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
        self._before, self._committed = tuple(current), layout_key(moves[best].layout)
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
        """The layout of `shape` that is allowed, reachable and nearest `current` (`layout_distance`), among the candidate
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
        return min(options, key=lambda l: layout_distance(current, l, self.in_place)) if options else None

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
            if role_only(cur, tgt):
                here = in_place and runs_in_place(cur, tgt)
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
