"""The router policy: admit or refuse, then pick an instance (llm-d style filter -> scorers -> picker).

The same `RouterPolicy` object runs in the simulator (virtual clock) and in the live router: it takes load
snapshots and `now` as arguments and owns no clock, no I/O and no unseeded randomness.

route(spec, loads, now):
1. unknown model -> Refuse(UnknownModel).
2. a prompt whose own uncached prefill exceeds its TTFT SLO on every instance of the model, even idle ->
   Refuse(SloInfeasible) at once, with the numbers and what to change (retrying cannot help; BATCH's 10 s SLO
   or a larger ttft_slo_ms can); likewise Refuse(ItlInfeasible) when every instance that would decode it takes
   longer than the ITL SLO per step even with nothing else in its batch.
3. per-tier queue bound (outstanding no-first-token requests of this model and tier) -> Refuse(Overloaded).
4. candidates = the model's colocated / prefill instances; the configured filters drop those that cannot take it
   ("model", "healthy": healthy, not paused, has a snapshot; "kv_headroom": prompt + reservation fits).
4b. BATCH while more urgent requests of the model are being shed: only to an instance where BATCH holds fewer
   than ceil(`batch_min_share` x its decode slots).
5. disaggregated models: the decode instance with the most KV headroom (then fewest running, then id) that can
   reserve prompt + reservation; none -> Refuse.
6. TTFT feasibility: predicted TTFT = max(prefill queue ahead of this tier / instance prefill throughput, wait
   for a decode slot not counting lower tiers the batcher would preempt) + own uncached prefill time (at the rate
   the running decodes leave it, never faster than idle); a candidate
   is kept while predicted + the calibrated correction of the model and tier (admission.TtftCalibrator) is within
   the SLO; none left -> Refuse with retry_after_ms = how long until the best candidate would become feasible.
7. scorers (each a pure function of the candidate set, returning [0, 1], 0 = best) are weighted from config and
   summed into a cost; the picker takes the lowest cost, ties broken by one seeded `rng.random()` per candidate.
   `policies.picker: round_robin` instead takes the model's entry instances in turn (id order), skipping those
   the filters dropped: the baseline that ignores load and cache. `policies.prefix_aware_routing: false` makes
   every candidate's expected cache hit 0 (the router ignores its prefix index; engines still cache).
With `policies.admission: false` only steps 1, 4 (model and health filters) and 7 run: the baseline that sheds
nothing. `route(..., admitted=True)` places a request the node admitted before and must place again (its instance
was lost: a re-route, or a continuation of a stream, services/core/continuation.py): the arrival gates (2, 3, 4b
and 6) are not run again, since they guard first tokens that request has already waited for or received, and
shedding it would lose work the node took on; the capacity checks stay (4's filters, 5's fit), so an instance still
needs KV for it, and none with room refuses it as on arrival.

Warm busy vs cold idle (seed 003 follow-up): with prompt N, a warm instance caching h·N of it and a queue of W
seconds ahead, versus a cold idle instance, waiting for the warm one is faster exactly when
    W + prefill_time(N − hN | hN cached) < prefill_time(N),
i.e. when the queue ahead drains in less time than the cache saves. With linear prefill cost and h = 0.8 that is
W < 0.8 · N / throughput: a busy warm GPU wins while its backlog is under 80 % of one prompt's prefill. The TTFT
scorer makes exactly this comparison, because it ranks by predicted TTFT, which includes both terms
(`warm_beats_cold` states the rule on its own, for the planner and the tests).

Why one module past 600 lines: admission and routing of one request, compiled as one module (mypyc: calls inside
a module are native, across modules they are not).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from octoserve.services.core import admission as adm
from octoserve.services.core.errors import ItlInfeasible, Overloaded, SloInfeasible, UnknownModel
from octoserve.services.core.placement import InstanceConfig, NodeConfig
from octoserve.services.core.registry import Registry
from octoserve.services.core.types import EngineLoad, KVEvent, Priority, RequestSpec, Role


class CostModelLike(Protocol):
    def prefill_time_s(self, num_tokens: int, num_context_tokens: int = 0) -> float: ...

    def prefill_tokens_per_s(self, chunk_tokens: int) -> float: ...

    def decode_step_time_s(self, batch_size: int, context_len: int) -> float: ...


@dataclass(frozen=True, slots=True, init=False)  # __init__ written out: see core/types.py
class Route:
    instance_id: str  # prefill or colocated instance
    decode_instance_id: str | None  # None for colocated
    predicted_ttft_ms: float  # rounded to 0.001 ms
    expected_cached_tokens: int  # prompt tokens the prefix cache should serve on instance_id

    def __init__(
        self,
        instance_id: str,
        decode_instance_id: str | None,
        predicted_ttft_ms: float,
        expected_cached_tokens: int,
    ) -> None:
        object.__setattr__(self, "instance_id", instance_id)
        object.__setattr__(self, "decode_instance_id", decode_instance_id)
        object.__setattr__(self, "predicted_ttft_ms", predicted_ttft_ms)
        object.__setattr__(self, "expected_cached_tokens", expected_cached_tokens)


# Why admission refused a request, as a short key (`Refuse.reason`): what the routers report to the scheduler's
# balancer per model (router/demand_report.py) and what its log lines say.
# "decode_reserve": routed, then the decode instance had no KV left to reserve (`refused_after_routing`).
REFUSAL_REASONS = ("unknown_model", "slo_infeasible", "itl_infeasible", "tier_bound", "no_healthy_instance",
                   "kv_headroom", "batch_share", "long_prompt", "ttft", "decode_reserve")


@dataclass(frozen=True, slots=True, init=False)  # __init__ written out: see core/types.py
class Refuse:
    error: Overloaded | UnknownModel | SloInfeasible | ItlInfeasible
    retry_after_ms: int  # 0 for UnknownModel and the infeasible ones: retrying will not help
    reason: str = ""  # one of REFUSAL_REASONS

    def __init__(
        self,
        error: Overloaded | UnknownModel | SloInfeasible | ItlInfeasible,
        retry_after_ms: int,
        reason: str = "",
    ) -> None:
        object.__setattr__(self, "error", error)
        object.__setattr__(self, "retry_after_ms", retry_after_ms)
        object.__setattr__(self, "reason", reason)


class Candidate(NamedTuple):
    """One instance as the filters and scorers see it for one request.

    Immutable like a frozen dataclass, but a named tuple: the router builds one per instance of the model at every
    arrival (~60,000 in a one-minute simulated peak), and a tuple is built ~2.5x faster."""

    instance: InstanceConfig
    load: EngineLoad
    headroom_blocks: int  # free blocks once work sent since the snapshot lands
    required_blocks: int  # blocks this request takes here
    queue_ahead_tokens: float  # prefill tokens that run before it
    num_queued: int  # waiting in the snapshot + dispatched since
    cached_tokens: int  # expected prefix-cache hit
    wait_s: float  # queue_ahead_tokens / prefill throughput
    own_prefill_s: float  # its own uncached prefill on the idle instance
    model: str  # the requested model
    slot_wait_s: float = 0.0  # wait for a decode slot when the instance's batch is full (colocated)
    loaded_prefill_s: float = 0.0  # its own prefill at the rate the instance's running decodes leave
    ttft_slo_s: float = math.inf  # the request's TTFT SLO
    step_wait_s: float = 0.0  # until the instance's step in flight ends (a long prefill step holds every newcomer)
    # Its first token if the prompts queued here and its own ran in steps past the ITL SLO (whole prompts at once),
    # once the instance's ITL tail budget affords them; inf when it never does.
    rescue_ttft_s: float = math.inf

    @property
    def steps_ttft_s(self) -> float:
        """Its first token in steps within the ITL SLO. The prefill queue and the slot queue drain in parallel; the
        longer one decides when the prefill starts. Then its own chunks run at the rate the decodes beside them
        leave, never faster than on an idle instance."""
        return self.step_wait_s + max(self.wait_s, self.slot_wait_s) + max(self.own_prefill_s, self.loaded_prefill_s)

    @property
    def predicted_ttft_s(self) -> float:
        """Its first token under the batcher's policy: in steps within the ITL SLO when those meet its TTFT SLO,
        else in a step past the ITL SLO when the tail budget affords one (batcher.py, `_long_step_tokens`)."""
        steps = self.steps_ttft_s
        if steps <= self.ttft_slo_s:
            return steps
        return min(steps, self.step_wait_s + max(self.rescue_ttft_s, self.own_prefill_s))

    @property
    def earliest_ttft_s(self) -> float:
        """The earliest first token any affordable schedule gives it: what admission holds against the SLO (a
        prompt the steps within the ITL SLO would bring in just in time is rescued by a long step if they slip),
        never sooner than its own prefill on the idle instance."""
        return min(self.steps_ttft_s, self.step_wait_s + max(self.rescue_ttft_s, self.own_prefill_s))


# queue ahead (tokens), prefill throughput (tokens/s), KV headroom (blocks), queued count, queue wait (s), slot wait (s)
_Figures = tuple[float, float, int, int, float, float]
Filter = Callable[[Candidate], bool]
Scorer = Callable[[Sequence[Candidate]], dict[str, float]]

FILTERS: Registry[Filter] = Registry("routing filter")
SCORERS: Registry[Scorer] = Registry("routing scorer")
ENTRY_ROLES = (Role.COLOCATED, Role.PREFILL)


@FILTERS.register("model")
def filter_model(c: Candidate) -> bool:
    return c.instance.model == c.model and c.instance.role in ENTRY_ROLES


@FILTERS.register("healthy")
def filter_healthy(c: Candidate) -> bool:
    return c.load.healthy and not c.load.paused


@FILTERS.register("kv_headroom")
def filter_kv_headroom(c: Candidate) -> bool:
    return c.required_blocks <= c.headroom_blocks


def _relative(values: Mapping[str, float]) -> dict[str, float]:
    """Divide by the largest value so the worst candidate scores 1 and an empty one 0."""
    top = max(values.values(), default=0.0)
    return {k: (v / top if top > 0 else 0.0) for k, v in values.items()}


@SCORERS.register("ttft")
def score_ttft(cands: Sequence[Candidate]) -> dict[str, float]:
    """Predicted TTFT relative to the slowest candidate: queue wait and prefix-cache savings in one number."""
    return _relative({c.instance.id: c.predicted_ttft_s for c in cands})


@SCORERS.register("kv_headroom")
def score_kv_headroom(cands: Sequence[Candidate]) -> dict[str, float]:
    """KV usage after taking this request: fuller instances cost more (they preempt sooner)."""
    out = {}
    for c in cands:
        total = c.load.num_total_blocks
        left = c.headroom_blocks - c.required_blocks
        out[c.instance.id] = 1.0 if total <= 0 else min(1.0, max(0.0, 1.0 - left / total))
    return out


@SCORERS.register("queue")
def score_queue(cands: Sequence[Candidate]) -> dict[str, float]:
    """Waiting requests relative to the longest queue."""
    return _relative({c.instance.id: float(c.num_queued) for c in cands})


def pick(costs: Mapping[str, float], rng: Any) -> str:
    """Lowest cost; one rng.random() per candidate, drawn in id order, breaks exact ties reproducibly."""
    draws = {iid: rng.random() for iid in sorted(costs)}
    return min(sorted(costs), key=lambda iid: (round(costs[iid], 12), draws[iid]))


def warm_beats_cold(
    cost: CostModelLike, num_prompt_tokens: int, cached_tokens: int, warm_wait_s: float, cold_wait_s: float = 0.0
) -> bool:
    """True when queueing `warm_wait_s` behind a warm instance gives an earlier first token than a cold one."""
    warm = warm_wait_s + cost.prefill_time_s(num_prompt_tokens - cached_tokens, cached_tokens)
    cold = cold_wait_s + cost.prefill_time_s(num_prompt_tokens)
    return warm < cold


class RouterPolicy:
    """Admission + routing for every model of one node; see the module docstring.

    cost_models: instance id -> CostModel (a model name is accepted as a fallback key), for own-prefill times and
    a throughput fallback when a snapshot reports none. prefix_index / block_hasher default to
    octoserve.services.core.kv_cache's PrefixIndex and prefix_block_hashes (an index given instead takes an instance's
    events with `apply_all(instance_id, events)`, `overlap_blocks` and `remove_instance`); `extra_key` must equal the
    engines' KVCacheManager extra_key so hashes match: None (default) uses the model name, as
    octoserve.services.core.instance does.
    """

    def __init__(
        self,
        config: NodeConfig,
        cost_models: MutableMapping[str, CostModelLike],  # the simulator adds an instance's as it joins
        rng: Any,
        *,
        prefix_index: Any = None,
        block_hasher: Callable[[Sequence[int], int, str], list[int]] | None = None,
        extra_key: str | None = None,
    ) -> None:
        self.config = config
        self.cost_models = cost_models
        self.rng = rng
        if prefix_index is None or block_hasher is None:
            from octoserve.services.core import kv_cache  # noqa: PLC0415 - keeps tests with fakes independent of it

            prefix_index = prefix_index if prefix_index is not None else kv_cache.PrefixIndex()
            block_hasher = block_hasher or kv_cache.prefix_block_hashes
        self.prefix_index = prefix_index
        self.block_hasher = block_hasher
        # With the default hasher, an index that can hash a prompt itself stops at the first block nobody caches.
        from octoserve.services.core.kv_cache import prefix_block_hashes  # noqa: PLC0415

        self._lazy_overlap = (getattr(prefix_index, "prompt_overlap_blocks", None)
                              if block_hasher is prefix_block_hashes else None)
        self.extra_key = extra_key
        self.ledger = adm.InFlightLedger()
        p = config.policies
        self.calibrator = adm.TtftCalibrator(p.ttft_quantile, p.ttft_window, p.ttft_min_samples, p.ttft_max_risk)
        self.pressure = adm.TierPressure()
        self.shortest_first = adm.ShortestFirst()
        self._shortest_tokens = -1  # the decision in progress: its uncached prompt tokens, if ShortestFirst counts it
        self._filters = [FILTERS.get(n) for n in config.policies.routing_filters]
        self._scorers = [(SCORERS.get(n), w) for n, w in sorted(config.policies.scorer_weights.items()) if w > 0]
        self._next_turn: dict[str, int] = {}  # model -> round-robin position among its entry instances
        self.observers: list[Callable[[RequestSpec], None]] = []  # told of every request routed (headroom summary)
        self.refusal_observers: list[Callable[[RequestSpec, Refuse], None]] = []  # told of every refusal (demand)
        # (instance, tier) -> (ledger version, load, (ledger, config, instance, cost model), figures): _instance_figures
        self._figures: dict[tuple[str, Priority], tuple[int, EngineLoad, tuple, _Figures]] = {}
        self._now = 0.0  # the clock of the decision in progress (`route`)
        # (model, roles) -> config.instances_of(model, roles) of the config object `_instances_config`: _instances_of
        self._instances_config: NodeConfig | None = None
        self._instances: dict[tuple[str, tuple[Role, ...]], tuple[InstanceConfig, ...]] = {}
        self._itl_contexts: dict[int, tuple[CostModelLike, float, int]] = {}  # id(cost) -> _longest_itl_context

    # --- hooks --------------------------------------------------------------------------------------------------

    def on_kv_events(self, instance_id: str, events: Sequence[KVEvent]) -> None:
        self.prefix_index.apply_all(instance_id, events)

    def forget_instance(self, instance_id: str) -> None:
        """The instance's KV events stopped (its load stream ended): drop what the prefix index holds for it."""
        self.prefix_index.remove_instance(instance_id)

    def on_dispatched(self, request_id: str, route: Route, spec: RequestSpec) -> None:
        cfg = self.config
        entry = cfg.instance(route.instance_id)
        colocated = route.decode_instance_id is None
        decode = None if route.decode_instance_id is None else cfg.instance(route.decode_instance_id)
        self.ledger.on_dispatched(
            adm.Dispatched(
                request_id=request_id,
                model=spec.model,
                tier=spec.priority,
                instance_id=entry.id,
                decode_instance_id=route.decode_instance_id,
                uncached_prefill_tokens=spec.num_prompt_tokens - route.expected_cached_tokens,
                entry_blocks=adm.kv_blocks_required(spec, entry, cfg.policies, with_output=colocated),
                decode_blocks=0 if decode is None else adm.kv_blocks_required(spec, decode, cfg.policies, with_output=True),
                arrival_s=spec.arrival_s,
                predicted_ttft_s=route.predicted_ttft_ms / 1000.0,
                deadline_s=spec.arrival_s + cfg.slo.for_model(spec.model).ttft_ms_for_request(spec) / 1000.0,
            )
        )

    def on_first_token(self, request_id: str, now: float | None = None) -> None:
        """`now` (the clock arrivals are on) feeds the TTFT calibration; None only clears the ledger entry."""
        record = self.ledger.on_first_token(request_id)
        if record is not None and now is not None:
            self.calibrator.observe(record.model, record.tier, (now - record.arrival_s) - record.predicted_ttft_s)

    def ttft_correction_s(self, model: str, tier, slo_ms: float, queued_s: float = 0.0) -> float:
        """Seconds added to a prediction before it is compared with the SLO: the calibrated error quantile, or
        until calibrated the prior: the step model's known relative error (`ttft_prior_error`) on the part of the
        prediction spent waiting behind other work (`queued_s`; a prompt alone on an idle instance is predicted by
        the same cost model that times its steps), plus (1 - ttft_slack) x SLO."""
        policies = self.config.policies
        prior_s = (1.0 - policies.ttft_slack) * slo_ms / 1000.0 + policies.ttft_prior_error * queued_s
        return self.calibrator.correction_s(model, tier, prior_s, MAX_CORRECTION * slo_ms / 1000.0)

    def candidate_correction_s(self, spec: RequestSpec, c: Candidate, slo_ms: float) -> float:
        return self.ttft_correction_s(spec.model, spec.priority, slo_ms, c.earliest_ttft_s - c.own_prefill_s)

    def candidate_risk(self, spec: RequestSpec, c: Candidate, slo_ms: float) -> float:
        """How likely `spec` misses its TTFT SLO on `c`: the calibrated share of errors over its slack (the prior
        decides until calibrated; see `ttft_correction_s`)."""
        policies = self.config.policies
        slo_s = slo_ms / 1000.0
        prior_s = (1.0 - policies.ttft_slack) * slo_s + policies.ttft_prior_error * (c.earliest_ttft_s - c.own_prefill_s)
        return self.calibrator.miss_probability(spec.model, spec.priority, slo_s - c.earliest_ttft_s, prior_s,
                                                MAX_CORRECTION * slo_s)

    def on_finished(self, request_id: str) -> None:
        self.ledger.on_finished(request_id)

    # --- the decision ---------------------------------------------------------------------------------------------

    def route(self, spec: RequestSpec, loads: Mapping[str, EngineLoad] | Sequence[EngineLoad], now: float,
              admitted: bool = False) -> Route | Refuse:
        """Admit and place `spec`, or refuse it. `now` (the modelled clock the engines' snapshots are on) dates the
        step each instance has in flight (`EngineLoad.busy_until_s`). `admitted`: the node admitted it before and
        places it again (module doc): capacity checks only, and it is no arrival for the shedding pressure."""
        for observe in self.observers:
            observe(spec)
        self._now = now
        self._shortest_tokens = -1
        decision = self._route(spec, loads, admitted)
        if isinstance(decision, Refuse):
            for observe_refusal in self.refusal_observers:
                observe_refusal(spec, decision)
        if spec.priority < Priority.BATCH and self.config.policies.admission and not admitted:
            self.pressure.observe(spec.model, isinstance(decision, Refuse) and isinstance(decision.error, Overloaded))
        if self._shortest_tokens >= 0:
            self.shortest_first.observe(spec.model, spec.priority, self._shortest_tokens,
                                        not isinstance(decision, Refuse))
            self._shortest_tokens = -1
        return decision

    def refused_after_routing(self, spec: RequestSpec, error: Overloaded, reason: str) -> None:
        """A routed request refused afterwards (its decode reservation failed): the refusal observers hear of it as
        of one of `route`'s own refusals."""
        refusal = Refuse(error, error.retry_after_ms, reason)
        for observe in self.refusal_observers:
            observe(spec, refusal)

    def candidates(self, spec: RequestSpec, loads: Mapping[str, EngineLoad]) -> list[Candidate]:
        """The entry instances of `spec`'s model as route() sees them, before any filter, changing no state: what a
        node's headroom summary (octoserve.services.cluster) is computed from."""
        return self._candidates(spec, loads)

    def passes_filters(self, c: Candidate) -> bool:
        for keep in self._filters:
            if not keep(c):
                return False
        return True

    def _instances_of(self, model: str, roles: tuple[Role, ...]) -> tuple[InstanceConfig, ...]:
        """`config.instances_of(model, roles)`, remembered while the config object stays the same (a placement
        change replaces it whole): every arrival asks for its model's entry instances, and more."""
        config = self.config
        if self._instances_config is not config:
            self._instances_config, self._instances = config, {}
        found = self._instances.get((model, roles))
        if found is None:
            found = self._instances[model, roles] = config.instances_of(model, roles)
        return found

    def _is_disaggregated(self, model: str) -> bool:
        return bool(self._instances_of(model, (Role.PREFILL,)))

    def _route(self, spec: RequestSpec, loads: Mapping[str, EngineLoad] | Sequence[EngineLoad],
               admitted: bool = False) -> Route | Refuse:
        if type(loads) is not dict and not isinstance(loads, Mapping):  # a dict skips the ABC's isinstance hook
            loads = {load.instance_id: load for load in loads}
        held = self.ledger.snapshots
        for load in loads.values():
            if held.get(load.instance_id) is not load:  # the simulator hands back unchanged snapshots as they were
                self.ledger.observe_load(load)
        if spec.model not in self.config.models:
            return Refuse(UnknownModel(spec.model, self.config.models), 0, "unknown_model")
        admit = self.config.policies.admission
        gate = admit and not admitted  # the arrival gates (module doc)
        cands = self._candidates(spec, loads)
        slo_ms = self.config.slo.for_model(spec.model).ttft_ms_for_request(spec)
        if gate and (refusal := self._infeasible(spec, cands, slo_ms)) is not None:
            return refusal
        if gate and (refusal := self._tier_bound(spec, cands)) is not None:
            return refusal
        if gate and self.config.policies.shortest_first:
            if (refusal := self._longer_than_served(spec, cands)) is not None:
                return refusal
        kept = [c for c in cands if self.passes_filters(c)] if admit else [c for c in cands if filter_model(c) and filter_healthy(c)]
        if not kept:
            return self._refuse_no_instance(spec, cands)
        if gate and spec.priority is Priority.BATCH and self.pressure.under_pressure(spec.model):
            kept = [c for c in kept if self._below_batch_share(c)]
            if not kept:
                return self._refuse(spec, cands, "more urgent requests of this model are being shed and BATCH "
                                    "holds its minimum share of every instance", "batch_share")
        decode_id = None
        if self._is_disaggregated(spec.model):
            decode_id = self._pick_decode(spec, loads, require_fit=admit)
            if decode_id is None:
                # A colocated instance needs no decode side (a placement in mid-reconfiguration can hold both).
                colocated = [c for c in kept if c.instance.role is Role.COLOCATED]
                if not colocated:
                    return self._refuse(spec, kept, "no decode instance has KV headroom for prompt + reservation",
                                        "kv_headroom")
                kept = colocated
        risks: dict[str, float] = {}
        if gate:
            spend = self.pressure.refused_share(spec.model) < RISK_PRESSURE
            allowance = self.calibrator.risk_allowance(spec.model, spec.priority, spend) + 1e-12
            for c in kept:
                risks[c.instance.id] = self.candidate_risk(spec, c, slo_ms)
            feasible = [c for c in kept if risks[c.instance.id] <= allowance]
            if not feasible:
                return self._refuse_ttft(spec, kept, slo_ms)
            kept = feasible
        chosen = self._pick(kept)
        if gate:
            self.calibrator.note_admitted(spec.model, spec.priority, risks[chosen.instance.id])
        if chosen.instance.role is not Role.PREFILL:
            decode_id = None  # a colocated entry of a mixed placement runs the whole request: no decode side
        # Rounded to the microsecond: sub-microsecond float noise is not a prediction.
        return Route(chosen.instance.id, decode_id, round(chosen.predicted_ttft_s * 1000.0, 3), chosen.cached_tokens)

    def _candidates(self, spec: RequestSpec, loads: Mapping[str, EngineLoad]) -> list[Candidate]:
        overlaps: dict[int, dict[str, int]] = {}  # block size -> instance -> cached blocks of the prompt
        required: dict[tuple[int, bool], int] = {}  # (block size, with output) -> blocks the request takes
        ttft_slo_s = self.config.slo.for_model(spec.model).ttft_ms_for_request(spec) / 1000.0  # once per request
        out = []
        for inst in self._instances_of(spec.model, ENTRY_ROLES):
            load = loads.get(inst.id)
            if load is None:
                continue  # no snapshot yet: the instance is not known to be up
            overlap = overlaps.get(inst.block_size)
            if overlap is None:
                overlap = overlaps[inst.block_size] = self._prompt_overlap(spec, inst.block_size)
            colocated = inst.role is Role.COLOCATED
            blocks = required.get((inst.block_size, colocated))
            if blocks is None:
                blocks = required[inst.block_size, colocated] = adm.kv_blocks_required(
                    spec, inst, self.config.policies, with_output=colocated)
            out.append(self._candidate(spec, inst, load, overlap.get(inst.id, 0), blocks, ttft_slo_s))
        return out

    def _prompt_overlap(self, spec: RequestSpec, block_size: int) -> dict[str, int]:
        """instance -> leading blocks of the prompt (in `block_size` blocks) it caches, per the prefix index."""
        if not self.config.policies.prefix_aware_routing:
            return {}
        key = spec.model if self.extra_key is None else self.extra_key
        if self._lazy_overlap is not None:  # the default hasher: hash only as far as the index matches
            return self._lazy_overlap(spec.prompt_token_ids, block_size, key)
        return self.prefix_index.overlap_blocks(self.block_hasher(spec.prompt_token_ids, block_size, key))

    def _candidate(self, spec: RequestSpec, inst: InstanceConfig, load: EngineLoad, overlap_blocks: int,
                   required_blocks: int, ttft_slo_s: float) -> Candidate:
        num_prompt_tokens = len(spec.prompt_token_ids)
        cached = self._cached_tokens(num_prompt_tokens, inst, overlap_blocks)
        cost = self._cost_model(inst)
        ahead, throughput, headroom, num_queued, wait_s, slot_wait = self._instance_figures(inst, load, spec.priority,
                                                                                          cost)
        policies = self.config.policies
        if policies.queue == "edf":  # the less urgent requests whose deadlines came first run first
            edf = adm.edf_figures(load, self.ledger, spec.priority, spec.arrival_s + ttft_slo_s)
            if edf.aged_tokens > 0.0:
                ahead += edf.aged_tokens
                wait_s = adm.prefill_wait_s(ahead, throughput)
            if edf.num_later < edf.num_lower:
                # The tier's figure counts every less urgent slot as preemptible; those the queue order puts
                # ahead of this request are not (the batcher keeps them), so its slot may not be free.
                slot_wait = adm.slot_wait_s(load, self.ledger, adm.preemptible_slots(
                    load, self.ledger, spec.priority, policies.batch_min_share, (edf.num_later, edf.num_later_batch)))
        return Candidate(
            instance=inst,
            load=load,
            headroom_blocks=headroom,
            required_blocks=required_blocks,
            queue_ahead_tokens=ahead,
            num_queued=num_queued,
            cached_tokens=cached,
            wait_s=wait_s,
            own_prefill_s=_chunked_prefill_s(cost, num_prompt_tokens - cached, cached, inst.max_num_batched_tokens),
            loaded_prefill_s=adm.prefill_wait_s(num_prompt_tokens - cached, throughput),
            ttft_slo_s=ttft_slo_s,
            step_wait_s=max(0.0, load.busy_until_s - self._now) if load.busy_until_s > 0 else 0.0,
            rescue_ttft_s=self._rescue_ttft_s(load, ahead + num_prompt_tokens - cached, slot_wait),
            model=spec.model,
            slot_wait_s=slot_wait,
        )

    @staticmethod
    def _rescue_ttft_s(load: EngineLoad, num_tokens: float, slot_wait_s: float) -> float:
        """`Candidate.rescue_ttft_s`: the queued prompts and its own (`num_tokens`) in long steps: once the tail
        budget affords one, the burst it affords at the long-step rate, the rest at the rate it sustains."""
        rate = load.long_prefill_tokens_per_s
        if rate <= 0:
            return math.inf
        burst = min(num_tokens, load.long_burst_tokens) if load.long_sustained_tokens_per_s > 0 else num_tokens
        sustained_s = (num_tokens - burst) / load.long_sustained_tokens_per_s if num_tokens > burst else 0.0
        return max(slot_wait_s, load.long_step_wait_s, 0.0) + burst / rate + sustained_s

    def _instance_figures(self, inst: InstanceConfig, load: EngineLoad, tier: Priority,
                          cost: CostModelLike) -> _Figures:
        """The candidate's figures that do not depend on the prompt: queue ahead of `tier`, prefill throughput, KV
        headroom, queued count, queue wait and slot wait. They read only the snapshot, the ledger's records of the
        instance, the tier, the policies and the cost model, so they are reused while the same snapshot object is
        held and the ledger's version of the instance is unchanged (arrivals between two steps of an instance)."""
        ledger = self.ledger
        version = ledger.versions.get(inst.id, 0)
        inputs = (ledger, self.config, inst, cost)
        held = self._figures.get((inst.id, tier))
        # Equal inputs (the same objects, as a rule) give equal figures.
        if (held is not None and held[0] == version and held[1] is load and held[2] == inputs
                and load.instance_id == inst.id):
            return held[3]
        policies = self.config.policies
        ahead = adm.queue_ahead_tokens(load, ledger, tier, policies.queue)
        throughput = load.prefill_tokens_per_s or cost.prefill_tokens_per_s(inst.max_num_batched_tokens)
        figures = (
            ahead,
            throughput,
            adm.kv_headroom_blocks(load, ledger, policies),
            load.num_waiting + ledger.num_pending(inst.id),
            adm.prefill_wait_s(ahead, throughput),
            adm.slot_wait_s(load, ledger, adm.preemptible_slots(load, ledger, tier, policies.batch_min_share)),
        )
        self._figures[inst.id, tier] = (version, load, inputs, figures)
        return figures

    def _cached_tokens(self, num_prompt_tokens: int, inst: InstanceConfig, overlap_blocks: int) -> int:
        """Whole cached blocks, and never the whole prompt: the last token is always computed (to sample)."""
        if not inst.enable_prefix_caching:
            return 0
        bs = inst.block_size
        return min(overlap_blocks * bs, (num_prompt_tokens - 1) // bs * bs)

    def _cost_model(self, inst: InstanceConfig) -> CostModelLike:
        return self.cost_models[inst.id] if inst.id in self.cost_models else self.cost_models[inst.model]

    def cost_model_of(self, inst: InstanceConfig) -> CostModelLike:
        """The cost model the router predicts `inst`'s steps with (the cluster headroom summary uses it too)."""
        return self._cost_model(inst)

    def _pick(self, cands: Sequence[Candidate]) -> Candidate:
        if self.config.policies.picker == "round_robin":
            return self._pick_round_robin(cands)
        costs = {c.instance.id: 0.0 for c in cands}
        for scorer, weight in self._scorers:
            for iid, s in scorer(cands).items():
                costs[iid] += weight * s
        chosen = pick(costs, self.rng)
        return next(c for c in cands if c.instance.id == chosen)

    def _pick_round_robin(self, cands: Sequence[Candidate]) -> Candidate:
        """The next entry instance of the model in id order that survived the filters; the turn then moves past it."""
        model = cands[0].model
        order = sorted(i.id for i in self._instances_of(model, ENTRY_ROLES))
        by_id = {c.instance.id: c for c in cands}
        start = self._next_turn.get(model, 0)
        for k in range(len(order)):
            pos = (start + k) % len(order)
            if order[pos] in by_id:
                self._next_turn[model] = pos + 1
                return by_id[order[pos]]
        raise ValueError("round-robin pick over no candidates")  # route() never calls with none

    def _pick_decode(self, spec: RequestSpec, loads: Mapping[str, EngineLoad], require_fit: bool) -> str | None:
        """Most KV headroom, then fewest running, then id: decode capacity is reserved before prefill starts."""
        best: tuple[int, int, str] | None = None
        for inst in self._instances_of(spec.model, (Role.DECODE,)):
            load = loads.get(inst.id)
            if load is None or not load.healthy or load.paused:
                continue
            headroom = adm.kv_headroom_blocks(load, self.ledger, self.config.policies)
            need = adm.kv_blocks_required(spec, inst, self.config.policies, with_output=True)
            if require_fit and (need > headroom or not adm.decode_slot_free(load, self.ledger)):
                continue
            key = (-(headroom - need), load.num_running, inst.id)
            best = key if best is None or key < best else best
        return None if best is None else best[2]

    # --- refusals ------------------------------------------------------------------------------------------------

    def _overloaded(self, spec: RequestSpec, wait_s: float, reason: str, key: str) -> Refuse:
        retry = adm.retry_after_ms(wait_s, self.config.policies)
        return Refuse(Overloaded(spec.model, spec.priority, retry, reason), retry, key)

    def _below_batch_share(self, c: Candidate) -> bool:
        slots = c.load.max_num_seqs or c.instance.max_num_seqs
        floor = max(1, math.ceil(self.config.policies.batch_min_share * slots))
        return self.ledger.num_dispatched_by_tier(c.instance.id)[Priority.BATCH] < floor

    def _infeasible(self, spec: RequestSpec, cands: Sequence[Candidate], slo_ms: float) -> Refuse | None:
        """SloInfeasible when the fastest instance's own prefill of the prompt, idle, is over the SLO; ItlInfeasible
        when the fastest decoder's batch-1 step is over the ITL SLO."""
        if not cands:
            return None
        decoders = (self._instances_of(spec.model, (Role.DECODE,)) if self._is_disaggregated(spec.model)
                    else ()) or [c.instance for c in cands]  # no decode instance (mid-reconfiguration): its own
        num_prompt_tokens = len(spec.prompt_token_ids)
        itl_ms = self.config.slo.for_model(spec.model).itl_ms
        if all(num_prompt_tokens > self._longest_itl_context(self._cost_model(i), itl_ms) for i in decoders):
            step_s = min(self._cost_model(i).decode_step_time_s(1, num_prompt_tokens) for i in decoders)
            error = ItlInfeasible(spec.model, spec.priority, num_prompt_tokens, step_s * 1000.0, itl_ms)
            return Refuse(error, 0, "itl_infeasible")
        if min(c.own_prefill_s for c in cands) * 1000.0 <= slo_ms:
            return None
        best = min(cands, key=lambda c: (c.own_prefill_s, c.instance.id))
        cost = self._cost_model(best.instance)
        lo, hi = 1, spec.num_prompt_tokens  # the longest uncached prompt that fits: prefill time grows with length
        while lo < hi:
            mid = (lo + hi + 1) // 2
            fits = _chunked_prefill_s(cost, mid, 0, best.instance.max_num_batched_tokens) * 1000.0 <= slo_ms
            lo, hi = (mid, hi) if fits else (lo, mid - 1)
        too_long = SloInfeasible(spec.model, spec.priority, spec.num_prompt_tokens, best.own_prefill_s * 1000.0,
                                 slo_ms, lo + best.cached_tokens)
        return Refuse(too_long, 0, "slo_infeasible")

    def _longest_itl_context(self, cost: CostModelLike, itl_ms: float) -> int:
        """The longest context whose batch-1 decode step on `cost` is within `itl_ms` (-1: none is). A step grows
        with its context, so a prompt's batch-1 step is over the SLO exactly when the prompt is longer than this:
        found once per cost model by bisection instead of a step time per decoder at every arrival."""
        held = self._itl_contexts.get(id(cost))
        if held is not None and held[0] is cost and held[1] == itl_ms:
            return held[2]
        lo, hi = -1, MAX_CONTEXT_TOKENS
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if cost.decode_step_time_s(1, mid) * 1000.0 <= itl_ms else (lo, mid - 1)
        self._itl_contexts[id(cost)] = (cost, itl_ms, lo)  # holding the cost model keeps its id from being reused
        return lo

    def _tier_bound(self, spec: RequestSpec, cands: Sequence[Candidate]) -> Refuse | None:
        count = adm.tier_bound_reached(self.ledger, spec, self.config.policies.tier_queue_bound)
        if count is None:
            return None
        # A slot frees when the first outstanding request of this tier gets its first token: the shortest
        # tier queue-ahead drain among the instances that hold one.
        holding = {r.instance_id for r in self.ledger.outstanding.values() if r.model == spec.model and r.tier == spec.priority}
        wait_s = min((c.wait_s for c in cands if filter_healthy(c) and c.instance.id in holding), default=0.0)
        return self._overloaded(spec, wait_s, f"{count} {spec.priority.name} requests already wait for a first token",
                                "tier_bound")

    def _refuse(self, spec: RequestSpec, cands: Sequence[Candidate], reason: str, key: str) -> Refuse:
        wait_s = min((c.wait_s for c in cands), default=math.inf)
        return self._overloaded(spec, wait_s, reason, key)

    def _longer_than_served(self, spec: RequestSpec, cands: Sequence[Candidate]) -> Refuse | None:
        """Under overload, a prompt longer than its model and tier now admit (`adm.ShortestFirst`); counts the
        decision."""
        uncached = spec.num_prompt_tokens - max((c.cached_tokens for c in cands), default=0)
        self._shortest_tokens = uncached
        cap = self.shortest_first.cap_tokens(spec.model, spec.priority)
        if cap < 0 or uncached <= cap:
            return None
        return self._refuse(spec, cands, f"{spec.model} is refusing part of its {spec.priority.name} load and admits "
                            f"the shortest prompts first: this one's {uncached} uncached tokens are over the {cap} it "
                            "admits now; retry later or send a shorter prompt", "long_prompt")

    def _refuse_no_instance(self, spec: RequestSpec, cands: Sequence[Candidate]) -> Refuse:
        healthy = [c for c in cands if filter_healthy(c)]
        if not healthy:
            return self._overloaded(spec, math.inf, "no healthy instance serves it right now", "no_healthy_instance")
        return self._refuse(spec, healthy, "no instance has KV headroom for prompt + reservation", "kv_headroom")

    def _refuse_ttft(self, spec: RequestSpec, cands: Sequence[Candidate], slo_ms: float) -> Refuse:
        """Retry once the best candidate's queue has drained by the amount its corrected TTFT exceeds the SLO."""
        best = min(cands, key=lambda c: (c.earliest_ttft_s, c.instance.id))
        correction_s = self.candidate_correction_s(spec, best, slo_ms)
        excess_s = adm.ttft_excess_s(best.earliest_ttft_s, correction_s, slo_ms)
        reason = (
            f"predicted TTFT {best.earliest_ttft_s * 1000:.0f} ms + {correction_s * 1000:.0f} ms calibrated margin "
            f"exceeds the {slo_ms:.0f} ms {spec.priority.name} SLO"
        )
        return self._overloaded(spec, excess_s, reason, "ttft")


def _chunked_prefill_s(cost: CostModelLike, num_tokens: int, num_cached: int, max_chunk: int) -> float:
    """A prompt's prefill alone on the instance, in chunks of at most its step's token ceiling (one step below it)."""
    if num_tokens <= max_chunk or max_chunk <= 0:
        return cost.prefill_time_s(num_tokens, num_cached)
    total_s, done = 0.0, 0
    while done < num_tokens:
        chunk = min(max_chunk, num_tokens - done)
        total_s += cost.prefill_time_s(chunk, num_cached + done)
        done += chunk
    return total_s


# Above any context a model serves (2**31 tokens): `_longest_itl_context` searches up to it.
MAX_CONTEXT_TOKENS = 2**31

# The calibrated TTFT correction never exceeds this fraction of the SLO: requests predicted under the rest still
# get in, so errors keep being observed and the correction can come down when the load does.
MAX_CORRECTION = 0.8

# The admission risk budget (admission.py, TtftCalibrator) is spent only while a model refuses less than this share
# of its recent INTERACTIVE and STANDARD requests: past it the model is overloaded, and a risky admission would take
# the capacity of safe ones behind it.
RISK_PRESSURE = 0.25


def build_cost_models(config: NodeConfig) -> dict[str, Any]:
    """instance id -> CostModel for every instance of `config` under its cost profile (the simulator's and the
    router's default)."""
    return {i.id: config.cost_model(i) for i in config.instances}

