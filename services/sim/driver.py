"""The discrete-event simulator of the whole node: the same core objects as the live services, on a virtual clock.

Pop an event, set the time, let the event produce new events (as in Vidur). Entities:
- the router policy (`octoserve.services.core.routing.RouterPolicy`): admission and routing on fresh load snapshots;
- one `_Instance` per engine instance: a core `Batcher`, a `SimExecutor` and the instance's cost model; an instance
  is either idle or running exactly one step, whose end is an event;
- KV hand-offs between prefill and decode instances, each an event after its modelled NVLink time;
- injected faults (`services/sim/faults.py`): an instance lost at time t and back after its restart time, handled as
  the live router does: requests with no token yet are placed again (their other instance's KV freed first), those
  with tokens are continued on another instance of their model (`services/core/continuation.py`: the prompt plus
  the tokens streamed, admission applied, at most `policies.max_continuations` times) or fail; the instance takes
  no request while down and comes back empty (a fresh batcher and KV).

Invariants: virtual time never goes backwards; a request is refused, or admitted to exactly one (colocated or
prefill) instance, with its decode KV reserved before its prefill starts when the model is disaggregated; every
admitted request ends finished or is reported unfinished when the run stops. Nothing here reads the wall clock except
to report how fast the simulation ran.

Measurement: every second the driver samples KV use and busy time per instance and the node's occupancy (requests
admitted and not yet finished). The occupancy series gives the warm-up and steadiness (`metrics.detect_window`);
the summary, busy fractions and KV figures cover that window only: arrivals after the warm-up up to the last
arrival, never the drain.

Why one module past 600 lines: the whole node's event loop, compiled as one module (mypyc: calls inside a module are
native, across modules they are not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import heapq
import itertools
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mypy_extensions import mypyc_attr

from octoserve.services.core.batch_state import Request, RequestStatus
from octoserve.services.core.batcher import Batcher
from octoserve.services.core.step_builders import CompactOutputs, CompactStep
from octoserve.services.core.continuation import continuation_spec, may_continue
from octoserve.services.core.instance import LoadReporter, gang_share, instance_parts
from octoserve.services.core.placement import InstanceConfig, NodeConfig
from octoserve.services.core.sim_executor import SimExecutor
from octoserve.services.sim.steady_batcher import SteadyBatcher
from octoserve.services.core.reconfig import in_place_role
from octoserve.services.core.types import (
    EngineLoad, FinishReason, HandoffReady, RequestOutput, RequestSpec, Role, StepOutputs, StepPlan, StepResult,
)
from octoserve.services.metrics import (MIN_WARMUP_S, RequestRecord, Summary, Window, detect_window,
                                        slo_spec_of, summarize)
from octoserve.services.sim.gang_sim import GangReport, build_gangs
from octoserve.services.workload import TraceRequest

if TYPE_CHECKING:
    from octoserve.services.core.routing import CostModelLike, Route

_ARRIVAL, _STEP_DONE, _TRANSFER_DONE, _SAMPLE, _FAULT, _RECOVER, _CALL = range(7)
MAX_REROUTES = 3  # as the live router (router/failover.py)
# What a fault did to the requests it found on its instance (`SimResult.fault_counts`): "lost" is every failure,
# "failed_bound" (its continuations spent, or placed again MAX_REROUTES times before its first token) +
# "failed_refused" (its continuation refused); "reroute_refused" ends as a refusal, as on arrival.
FAULT_COUNT_KEYS = ("rerouted", "reroute_refused", "continued", "failed_bound", "failed_refused", "lost")
FAST_PATH_ENV = "OCTOSERVE_SIM_FAST"  # "0" turns the simulator's fast path off (NodeSimulator's `fast`)


class _Instance:
    __slots__ = ("cfg", "batcher", "executor", "cost", "reporter", "busy", "busy_s", "steps", "_load", "_load_version",
                 "_load_free", "_load_decode_s", "_load_shared")

    def __init__(self, node: NodeConfig, cfg: InstanceConfig, steady: bool = False) -> None:
        parts = instance_parts(node, cfg)
        self.cfg = cfg
        # steady: decodes advanced implicitly (services/sim/steady_batcher.py), on the fast path outside gangs
        # (an arbiter asks each member for its requests' deadlines every step).
        batcher_type = SteadyBatcher if steady else Batcher
        self.batcher = batcher_type(parts.batcher_config, parts.new_kv(cfg))
        self.cost = parts.cost_model
        # A SimExecutor, or a wrapper of one that offers only `execute` (services/cluster/sim.py squeezes steps)
        self.executor: Any = SimExecutor(self.cost, cfg.block_size, parts.batcher_config.eos_token_id)
        self.reporter = LoadReporter(cfg.id, cfg.model, self.batcher, self.cost, gang_share(node, cfg))
        self.busy = False
        self.busy_s = 0.0  # modelled GPU-busy seconds so far
        self.steps = 0
        self._load: EngineLoad | None = None
        # what `_load` was built from (`cached_load`): the batcher's state version, free KV blocks, decode EMA
        self._load_version = -1
        self._load_free = -1
        self._load_decode_s = 0.0
        self._load_shared = (False, False, 1.0, math.inf)  # the reporter's gang notices and lending record

    def load(self) -> EngineLoad:
        return self.reporter.load()

    def cached_load(self) -> EngineLoad:
        """`load()`, reused while nothing it reads has changed: every arrival asks every instance of its model,
        and several arrivals fall inside one step. The key covers all of the snapshot's inputs: the batcher's
        state version (bumped by each of its mutating calls), its free KV blocks, the reporter's decode EMA, its
        gang notices (shared, and the other side lending its ITL tail) and its lending record (share, period)."""
        batcher = self.batcher
        version, free, decode_s = batcher.state_version, batcher.kv.num_free_blocks, self.reporter.decode_step_time_s
        rep = self.reporter
        shared = (rep.shared, rep.tail_lent, rep.lent_share, rep.lent_period_s)
        load = self._load
        if (load is None or version != self._load_version or free != self._load_free or decode_s != self._load_decode_s
                or shared != self._load_shared):
            load = self._load = self.reporter.load()
            self._load_version, self._load_free, self._load_decode_s = version, free, decode_s
            self._load_shared = shared
        return load


@contextlib.contextmanager
def cycle_collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off inside, as it was after: for a whole command (`simulate`: the trace,
    the run, the report), not one run inside a longer-lived process.

    A simulation allocates millions of containers (token tuples, events, snapshots, candidates, records) but
    builds no reference cycles (a one-minute seed-000 peak leaves ~300 unreachable objects), so the collector's
    ~280 passes found nothing and cost ~0.6 s of a ~7 s command, ~0.35 s net (a process that goes on allocating
    after the pause pays one pass over the survivors, hence whole commands only). Reference counting still frees
    every object when its last reference goes; no result depends on the collector."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class _Tracker:
    """What the simulator learns about one request as it runs."""

    __slots__ = ("trace", "route", "first_token_s", "token_times_s", "finish_s", "num_cached",
                 "preemptions", "refused", "retry_after_ms", "error", "committed", "reroutes", "spec",
                 "continuations", "awaiting_first")

    def __init__(self, trace: TraceRequest) -> None:
        self.trace = trace
        self.route: Route | None = None
        self.first_token_s: float | None = None
        self.token_times_s: list[float] = []
        self.finish_s: float | None = None
        self.num_cached = 0
        self.preemptions = 0
        self.refused = False
        self.retry_after_ms: float | None = None
        self.error = ""
        self.committed = False  # decode side has taken the KV
        self.reroutes = 0  # times it was placed again after losing its instance
        self.spec: RequestSpec | None = None  # the continuation now running (None: the request as it arrived)
        self.continuations = 0  # times it was continued on another instance after losing its own with tokens
        self.awaiting_first = False  # a continuation placed whose first token the router has not heard of yet

    @property
    def num_output(self) -> int:
        return len(self.token_times_s)

    @property
    def placed(self) -> int:
        """Which placement of the request this is (0: on arrival; one more per re-route or continuation)."""
        return self.reroutes + self.continuations

    def record(self) -> RequestRecord:
        trace = self.trace
        # `TraceRequest.record`'s fields, without its two dicts per request, and positional: the record's generated
        # __init__ is interpreted code, and binding 15 keywords from a compiled caller costs twice the call.
        return RequestRecord(
            trace.request_id,  # request_id
            trace.model,  # model
            trace.priority,  # priority
            trace.arrival_s,  # arrival_s
            trace.ttft_slo_ms,  # ttft_slo_ms
            len(trace.prompt_token_ids),  # num_prompt_tokens
            self.num_cached,  # num_cached_prompt_tokens
            self.num_output,  # num_output_tokens: one time per token, so the count of times
            self.first_token_s,  # first_token_s
            tuple(self.token_times_s),  # token_times_s
            self.finish_s,  # finish_s
            self.refused,  # refused
            self.retry_after_ms,  # retry_after_ms
            self.error,  # error
            self.preemptions,  # num_preemptions
            self.continuations,  # num_continuations
        )


@dataclass(frozen=True, slots=True)
class InstanceStats:
    instance_id: str
    model: str
    role: str
    num_steps: int  # whole run
    busy_fraction: float  # GPU-busy share of the measurement window
    num_preemptions: int  # whole run
    kv_mean: float = 0.0  # mean KV utilisation over the measurement window's samples
    kv_max: float = 0.0


@dataclass(frozen=True, slots=True)
class SimResult:
    records: tuple[RequestRecord, ...]
    summary: Summary
    instances: tuple[InstanceStats, ...]
    # series name -> [(virtual time s, value)]: "kv:<instance>" utilisation, "busy:<instance>" fraction of the
    # second before, "occupancy" requests admitted and not finished (node-wide)
    timeseries: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    virtual_s: float = 0.0
    wall_s: float = 0.0
    # FAULT_COUNT_KEYS -> requests, over every fault (empty without faults); and the same for each fault, in order
    fault_counts: dict[str, int] = field(default_factory=dict)
    fault_counts_by_fault: tuple[dict[str, int], ...] = ()
    gangs: tuple[GangReport, ...] = ()  # one per gang group (whole run)

    @property
    def window(self) -> Window:
        """The measurement window: warm-up end (and how it was chosen) to the last arrival, steadiness."""
        window = self.summary.window
        assert window is not None  # `summarize` always sets it
        return window

    @property
    def speed(self) -> float:
        """Virtual seconds simulated per wall second."""
        return self.virtual_s / self.wall_s if self.wall_s > 0 else float("inf")


def _arrival_time(req: TraceRequest) -> float:
    return req.arrival_s


def fast_path_default() -> bool:
    """The fast path is on unless the environment says OCTOSERVE_SIM_FAST=0 (for checking it against the plain
    path; `NodeSimulator(fast=...)` decides per run)."""
    return os.environ.get(FAST_PATH_ENV, "1").strip() not in ("0", "false", "no", "off")


@mypyc_attr(allow_interpreted_subclasses=True)  # tools and tests log its steps from a subclass
class NodeSimulator:
    """`fast` (default: `fast_path_default()`): steps go through `Batcher.schedule_compact` / `update_compact` and
    `SimExecutor.execute_compact`, load snapshots are reused while unchanged, and plain decode tokens skip their
    per-token messages. The plain path runs the message API that the live engine uses. Both give identical
    records (tests/test_sim_speed.py)."""

    def __init__(self, config: NodeConfig, *, seed: int = 0, sample_interval_s: float = 1.0, router=None,
                 faults: Sequence = (), fast: bool | None = None) -> None:
        from octoserve.services.core.routing import RouterPolicy

        self.fast = fast_path_default() if fast is None else fast
        self.config = config
        self.instances = {cfg.id: self._new_instance(cfg) for cfg in config.instances}
        # Gang groups: members' steps start only through their group's arbiter (services/sim/gang_sim.py).
        self.gangs = build_gangs(config, self.instances, self._start_capped_step)
        cost_models: dict[str, CostModelLike] = {iid: inst.cost for iid, inst in self.instances.items()}
        self.router = router or RouterPolicy(config, cost_models, random.Random(seed))
        self.sample_interval_s = sample_interval_s
        self._events: list = []
        self._seq = itertools.count()
        self._num_pending = 0  # events other than samples still in the heap
        self._trackers: dict[str, _Tracker] = {}
        self._series: dict[str, list[tuple[float, float]]] = {}
        self._last_busy: dict[str, float] = {iid: 0.0 for iid in self.instances}
        self._in_flight = 0  # admitted, not yet finished or failed
        self.now = 0.0
        self.faults = tuple(faults)
        self.down: set[str] = set()
        # Over every fault: requests placed again (no token yet), continued (tokens streamed), failed because their
        # continuations were spent ("bound"), because admission refused the continuation ("refused"), or placed
        # again and refused then ("reroute_refused": an admitted request lost before its first token).
        self.fault_counts: dict[str, int] = dict.fromkeys(FAULT_COUNT_KEYS, 0)
        self.fault_counts_by_fault: list[dict[str, int]] = [dict.fromkeys(FAULT_COUNT_KEYS, 0) for _ in faults]
        self._migrations: dict[str, list] = {}  # source instance -> migrations waiting for its step boundary
        for fault in self.faults:
            if fault.instance_id not in self.instances:
                raise ValueError(f"fault names instance {fault.instance_id!r}; the node has {', '.join(self.instances)}")

    def _new_instance(self, cfg: InstanceConfig) -> _Instance:
        gang = self.config.gang
        return _Instance(self.config, cfg, steady=self.fast and (gang is None or gang.group_of(cfg.id) is None))

    def _drain_token_times(self, inst: _Instance) -> None:
        """Append the token times a steady batcher wrote out (its implicit decode tokens) to their trackers."""
        drain = getattr(inst.batcher, "drain_token_times", None)
        if drain is not None:
            trackers = self._trackers
            for request_id, times in drain():
                trackers[request_id].token_times_s.extend(times)

    def _write_out(self, inst: _Instance) -> None:
        """Every request of `inst` explicit, and its token times with their trackers (before reading them)."""
        sync_all = getattr(inst.batcher, "sync_all", None)
        if sync_all is not None:
            sync_all()
            self._drain_token_times(inst)

    # ---- the loop -----------------------------------------------------------------------------------------

    def run(
        self,
        trace: Sequence[TraceRequest],
        *,
        drain_s: float = 120.0,
        progress: Callable[[float], None] | None = None,
        warmup_s: float | None = None,
        min_warmup_s: float = MIN_WARMUP_S,
    ) -> SimResult:
        wall_start = time.perf_counter()
        # Arrivals stay out of the heap (a heap of ~18,000 of them made every push and pop deeper): a list in the
        # order the heap would pop them, (time, push order), each taking the sequence number its push would have
        # had, and merged with the heap's head as the loop goes.
        arrivals = list(trace)
        if any(b.arrival_s < a.arrival_s for a, b in zip(arrivals, arrivals[1:])):
            arrivals.sort(key=_arrival_time)  # stable: push order among equal times
        num_arrivals = len(arrivals)
        first_seq = next(self._seq)  # arrival i: first_seq + i
        self._seq = itertools.count(first_seq + num_arrivals)
        self._num_pending += num_arrivals
        last_arrival = trace[-1].arrival_s if trace else 0.0
        end_s = last_arrival + drain_s
        self._push(0.0, _SAMPLE, None)
        for i, fault in enumerate(self.faults):
            self._push(fault.at_s, _FAULT, i)
            self._push(fault.at_s + fault.down_s, _RECOVER, fault)
        handlers: dict[int, Callable[[Any], None]] = {  # event kind -> its handler, given the event's payload
            _ARRIVAL: self._on_arrival,
            _STEP_DONE: self._on_step_done,
            _TRANSFER_DONE: self._on_transfer_done,
            _SAMPLE: self._on_sample,
            _FAULT: self._on_fault,
            _RECOVER: self._on_recover,
            _CALL: lambda fn: fn(),
        }
        next_progress = 0.0
        events = self._events
        index = 0  # of the next arrival
        next_arrival_s = arrivals[0].arrival_s if arrivals else 0.0
        payload: Any
        while True:
            if index < num_arrivals and (not events or next_arrival_s < events[0][0]
                                          or (next_arrival_s == events[0][0] and first_seq + index < events[0][1])):
                t, kind, payload = next_arrival_s, _ARRIVAL, arrivals[index]
                index += 1
                if index < num_arrivals:
                    next_arrival_s = arrivals[index].arrival_s
            elif events:
                t, _, kind, payload = heapq.heappop(events)
            else:
                break
            if t > end_s:
                break
            if kind != _SAMPLE:
                self._num_pending -= 1
            self.now = t
            handlers[kind](payload)
            if progress is not None and t >= next_progress:
                progress(t)
                next_progress = t + 1.0
            if kind == _SAMPLE and not self._work_left():
                break
        return self._result(trace, last_arrival, time.perf_counter() - wall_start, warmup_s, min_warmup_s)

    def _push(self, t: float, kind: int, payload) -> None:
        heapq.heappush(self._events, (t, next(self._seq), kind, payload))
        if kind != _SAMPLE:
            self._num_pending += 1

    def _work_left(self) -> bool:
        return self._num_pending > 0 or any(i.batcher.has_work for i in self.instances.values())

    # ---- arrivals and routing ------------------------------------------------------------------------------

    def _on_arrival(self, req: TraceRequest) -> None:
        tracker = _Tracker(req)
        self._trackers[req.request_id] = tracker
        retry_after_ms = self._place(tracker, req.to_request_spec())
        if retry_after_ms is not None:
            tracker.refused = True
            tracker.retry_after_ms = retry_after_ms

    def _request_spec(self, tracker: _Tracker) -> RequestSpec:
        """What the engines run for `tracker` now: its continuation, else the request as it arrived."""
        return tracker.spec if tracker.spec is not None else tracker.trace.to_request_spec()

    def _place(self, tracker: _Tracker, spec: RequestSpec, admitted: bool = False) -> float | None:
        """Admit and place `spec` (the tracker's request, or its continuation); None when placed (or failed at once
        with `tracker.error`), else refused: the refusal's retry hint (ms), for the caller to give the request.
        `admitted`: placed again after a fault (`RouterPolicy.route`: capacity checks only)."""
        from octoserve.services.core.routing import Refuse

        loads = {iid: (inst.cached_load() if self.fast else inst.load()) for iid, inst in self.instances.items()
                 if inst.cfg.model == spec.model and iid not in self.down}
        decision = self.router.route(spec, loads, self.now, admitted)
        if isinstance(decision, Refuse):
            return decision.retry_after_ms
        if decision.decode_instance_id is not None:
            decode = self.instances[decision.decode_instance_id]
            if not decode.batcher.reserve(spec, self.now):
                from octoserve.services.core.errors import Overloaded  # noqa: PLC0415 (a rare path)

                # The live router's hint for this refusal: the policies' floor (router/servicer.py).
                retry_after_ms = self.config.policies.min_retry_after_ms
                self.router.refused_after_routing(spec, Overloaded(
                    spec.model, spec.priority, retry_after_ms, f"decode instance {decision.decode_instance_id} has "
                    "no KV left to reserve"), "decode_reserve")
                return float(retry_after_ms)
        tracker.route = decision
        instance = self.instances[decision.instance_id]
        try:
            instance.batcher.add_request(spec, self.now)
        except ValueError as e:  # larger than the instance's whole KV pool (only reachable with admission off)
            tracker.error = str(e)
            if decision.decode_instance_id is not None:
                self.instances[decision.decode_instance_id].batcher.release_reservation(spec.request_id)
            return None
        self._in_flight += 1
        self.router.on_dispatched(spec.request_id, decision, spec)
        self._wake(instance)
        return None

    def _wake(self, inst: _Instance) -> None:
        gang = self.gangs.get(inst.cfg.id)
        if gang is not None:
            gang.kick(self.now)
        elif not inst.busy:
            self._start_step(inst)

    # ---- steps -------------------------------------------------------------------------------------------

    def _start_step(self, inst: _Instance) -> None:
        self._start_capped_step(inst, None)

    def _start_capped_step(self, inst: _Instance, step_cap_s: float | None) -> float | None:
        """Start `inst`'s next step (cut to `step_cap_s` when given); its duration, or None when it planned nothing."""
        if self.fast and hasattr(inst.executor, "execute_compact"):  # a wrapped executor may offer only `execute`
            return self._start_compact_step(inst, step_cap_s)
        plan = inst.batcher.schedule(self.now, step_cap_s)
        if plan.is_empty and not inst.batcher.has_pending_outputs:
            inst.busy = False
            return None
        result = inst.executor.execute(plan, inst.batcher)
        inst.busy = True
        inst.busy_s += result.step_time_s
        self._push(self.now + result.step_time_s, _STEP_DONE, (inst, plan, result))
        return result.step_time_s

    def _start_compact_step(self, inst: _Instance, step_cap_s: float | None) -> float | None:
        step = inst.batcher.schedule_compact(self.now, step_cap_s)
        if step.is_empty and not inst.batcher.has_pending_outputs:
            inst.busy = False
            return None
        sampled, step_s = inst.executor.execute_compact(step)
        inst.busy = True
        inst.busy_s += step_s
        self._push(self.now + step_s, _STEP_DONE, (inst, step, (sampled, step_s)))
        return step_s

    def _on_step_done(self, payload: tuple[_Instance, Any, Any]) -> None:
        # (instance, StepPlan, StepResult) from `_start_capped_step`, or (instance, CompactStep, (sampled, step
        # time s)) from `_start_compact_step`: the plan's class says which.
        inst, plan, result = payload
        if self.instances[inst.cfg.id] is not inst:
            return  # a step of an instance that was lost meanwhile
        out: CompactOutputs | StepOutputs
        if isinstance(plan, CompactStep):
            sampled, step_s = result
            out = inst.batcher.update_compact(plan, sampled, self.now)
            inst.reporter.note_step_shape(plan.num_chunks, plan.num_batched_tokens, step_s)
            self._drain_token_times(inst)  # earlier tokens of the requests below first
            now = self.now
            trackers = self._trackers
            for req in out.plain:  # one more token, neither first nor last: only its time is recorded
                tracker = trackers[req.request_id]
                if tracker.first_token_s is None:  # not reached (the first token has an output); kept exact
                    self._on_output(RequestOutput(req.request_id, (req.token_ids[-1],), None, req.num_prompt_tokens,
                                                  req.num_cached_tokens, req.num_output_tokens))
                    continue
                tracker.token_times_s.append(now)
        else:
            out = inst.batcher.update(plan, result, self.now)
            inst.reporter.note_step(plan, result.step_time_s)
        inst.steps += 1
        for request_id in plan.preempted_ids:
            self._trackers[request_id].preemptions += 1
        for output in out.outputs:
            self._on_output(output)
        for handoff in out.handoffs:
            self._start_transfer(inst, handoff)
        if out.kv_events:
            self.router.on_kv_events(inst.cfg.id, out.kv_events)
        if self._migrations:  # live migrations wait for this step boundary (`migrate`)
            self._start_migrations(inst)
        gang = self.gangs.get(inst.cfg.id)
        if gang is None:
            self._start_step(inst)
        else:
            inst.busy = False
            gang.step_done(inst, self.now)

    def _on_output(self, output: RequestOutput) -> None:
        tracker = self._trackers[output.request_id]
        if output.new_token_ids:
            if tracker.first_token_s is None:
                tracker.first_token_s = self.now
                tracker.num_cached = output.num_cached_prompt_tokens
                self.router.on_first_token(output.request_id, self.now)
            elif tracker.awaiting_first:  # a continuation's first token: to the client, one more inter-token gap
                tracker.awaiting_first = False
                self.router.on_first_token(output.request_id, self.now)
            tracker.token_times_s.extend([self.now] * len(output.new_token_ids))
        if output.finish_reason not in (None, FinishReason.HANDOFF):
            self._finish(tracker)

    def _finish(self, tracker: _Tracker) -> None:
        tracker.finish_s = self.now
        self._in_flight -= 1
        route = tracker.route
        if route is not None and route.decode_instance_id is not None and not tracker.committed:
            # The first token ended the request on the prefill side: the decode reservation is not needed.
            self.instances[route.decode_instance_id].batcher.release_reservation(tracker.trace.request_id)
        self.router.on_finished(tracker.trace.request_id)

    # ---- KV hand-off ---------------------------------------------------------------------------------------

    def _start_transfer(self, source: _Instance, handoff: HandoffReady) -> None:
        transfer_s = source.cost.kv_transfer_time_s(handoff.num_prompt_tokens)
        self._push(self.now + transfer_s, _TRANSFER_DONE, (source, handoff, self._trackers[handoff.request_id].placed))

    def _on_transfer_done(self, payload: tuple[_Instance, HandoffReady, int]) -> None:
        source, handoff, placed = payload
        tracker = self._trackers[handoff.request_id]
        if self.instances[source.cfg.id] is not source or tracker.route is None or tracker.error \
                or tracker.route.instance_id != source.cfg.id or tracker.finish_s is not None \
                or tracker.placed != placed:
            return  # one end was lost mid-transfer: the fault already moved, continued or failed the request
        source.batcher.release_handoff(handoff.request_id)
        self._wake(source)  # freed blocks may unblock its queue
        decode_id = tracker.route.decode_instance_id
        assert decode_id is not None  # a hand-off goes to a decode instance
        decode = self.instances[decode_id]
        tracker.committed = True
        done = decode.batcher.commit_handoff(handoff.request_id, handoff.first_token_id, self.now)
        if done is not None:
            self._finish(tracker)
            return
        self._wake(decode)

    # ---- faults --------------------------------------------------------------------------------------------

    def _on_fault(self, index: int) -> None:
        fault = self.faults[index]
        iid = fault.instance_id
        old = self.instances[iid]
        for inst in self.instances.values():
            self._write_out(inst)
        fresh = self._new_instance(old.cfg)  # what restarts: empty queue, empty KV; routable at recovery
        fresh.busy_s, fresh.steps = old.busy_s, old.steps
        self.instances[iid] = fresh
        self.down.add(iid)
        self.router.prefix_index.remove_instance(iid)  # its cache died with it
        counts = self.fault_counts_by_fault[index]
        for tracker in list(self._trackers.values()):
            route = tracker.route
            if route is None or tracker.finish_s is not None or tracker.error or tracker.refused:
                continue
            # A request the decode side has taken (its KV committed there) no longer needs its prefill instance.
            if iid != route.decode_instance_id and (iid != route.instance_id or tracker.committed):
                continue
            request_id = tracker.trace.request_id
            streamed = self._streamed_token_ids(tracker, old) if tracker.first_token_s is not None else []
            for other in (route.instance_id, route.decode_instance_id):
                if other is not None and other != iid:
                    self.instances[other].batcher.abort(request_id)  # frees its reservation / hand-off / KV
                    self._wake(self.instances[other])
            self._in_flight -= 1
            self.router.on_finished(request_id)
            tracker.route, tracker.committed, tracker.awaiting_first = None, False, False
            if tracker.first_token_s is not None:
                self._continue(tracker, iid, streamed, counts)
            elif tracker.reroutes < MAX_REROUTES:
                tracker.reroutes += 1
                counts["rerouted"] += 1
                retry_after_ms = self._place(tracker, self._request_spec(tracker), admitted=True)
                if retry_after_ms is not None:  # as a refusal on arrival: the client has seen nothing
                    tracker.refused = True
                    tracker.retry_after_ms = retry_after_ms
                    counts["reroute_refused"] += 1
            else:
                tracker.error = f"instance {iid} was lost before the request's first token, {MAX_REROUTES} times"
                counts["failed_bound"] += 1
                counts["lost"] += 1
        for key, n in counts.items():
            self.fault_counts[key] += n
        for inst in self.instances.values():
            self._drain_token_times(inst)

    def _streamed_token_ids(self, tracker: _Tracker, lost: _Instance) -> list[int]:
        """The output tokens `tracker`'s client has seen, from the instance that holds them (the decode side once it
        took the KV, else the entry instance; `lost` if that is the one the fault took)."""
        route = tracker.route
        assert route is not None
        holder_id = route.decode_instance_id if tracker.committed else route.instance_id
        assert holder_id is not None
        holder = lost if holder_id == lost.cfg.id else self.instances[holder_id]
        req = holder.batcher.request(tracker.trace.request_id)
        assert req is not None, f"{tracker.trace.request_id} is not on {holder_id}"
        streamed = req.token_ids[len(tracker.trace.prompt_token_ids):]
        assert len(streamed) == tracker.num_output, (tracker.trace.request_id, len(streamed), tracker.num_output)
        return streamed

    def _continue(self, tracker: _Tracker, iid: str, streamed: list[int], counts: dict[str, int]) -> None:
        """A request that lost instance `iid` after streaming `streamed`: continued as a new request (the prompt
        plus those tokens) on another instance of its model, or failed: its continuations spent, or refused."""
        bound = self.config.policies.max_continuations
        if not may_continue(tracker.continuations, bound):
            tracker.error = (f"instance {iid} was lost after the request's first token; its continuations are "
                             f"spent ({tracker.continuations} of policies.max_continuations = {bound})")
            counts["failed_bound"] += 1
            counts["lost"] += 1
            return
        spec = continuation_spec(tracker.trace.to_request_spec(), streamed, self.now)
        retry_after_ms = self._place(tracker, spec, admitted=True)
        if retry_after_ms is not None:
            tracker.error = f"instance {iid} was lost after the request's first token; its continuation was refused"
            tracker.retry_after_ms = retry_after_ms
            counts["failed_refused"] += 1
        if tracker.error:  # refused, or (admission off) larger than the instance's whole KV pool
            counts["lost"] += 1
            return
        tracker.spec = spec
        tracker.continuations += 1
        tracker.awaiting_first = True
        counts["continued"] += 1

    def _on_recover(self, fault) -> None:
        self.down.discard(fault.instance_id)

    # ---- reconfiguration hooks (the elastic balancer on this simulator: services/sim/elastic_step.py) ------------

    def call_at(self, t_s: float, fn: Callable[[], None]) -> None:
        """Run `fn()` at virtual time `t_s` (>= now), in order with the other events."""
        self._push(max(t_s, self.now), _CALL, fn)

    def route_only_to(self, instances: Sequence[InstanceConfig]) -> None:
        """New requests go to `instances` only (draining ones left out), as the live router follows the placement;
        requests already placed keep their instances."""
        self.router.config = dataclasses.replace(self.config, instances=tuple(instances))

    def requests_on(self, instance_id: str) -> int:
        """Requests admitted and not ended that still hold `instance_id` (its queue, KV, a decode reservation or a
        hand-off in flight); 0 once it has drained."""
        n = 0
        for t in self._trackers.values():
            route = t.route
            if route is None or t.finish_s is not None or t.error or t.refused:
                continue
            if route.decode_instance_id == instance_id or (route.instance_id == instance_id and not t.committed):
                n += 1
        return n

    def remove_instance(self, instance_id: str) -> int:
        """Take `instance_id` off the node (its GPUs switch); returns the requests it still held (lost: they end
        with an error). Its steps and figures stop with it."""
        self._write_out(self.instances[instance_id])
        held = [t for t in self._trackers.values() if t.route is not None and t.finish_s is None and not t.error
                and not t.refused and (t.route.decode_instance_id == instance_id
                                       or (t.route.instance_id == instance_id and not t.committed))]
        for t in held:
            t.error = f"instance {instance_id} was removed by a reconfiguration"
            self._in_flight -= 1
            self.router.on_finished(t.trace.request_id)
        self.instances.pop(instance_id)
        self.router.prefix_index.remove_instance(instance_id)
        return len(held)

    def running_decodes(self, instance_id: str) -> list:
        """The batcher requests decoding on `instance_id` now (prompt done, one token to compute each step)."""
        inst = self.instances[instance_id]
        self._write_out(inst)  # a steady batcher's implicit decodes: explicit, with their tokens, before reading
        out: list[Request] = []
        for t in self._trackers.values():
            route = t.route
            if route is None or t.finish_s is not None or t.error or t.refused:
                continue
            if (route.decode_instance_id or route.instance_id) != instance_id:
                continue
            req = inst.batcher.request(t.trace.request_id)
            if req is not None and req.status is RequestStatus.RUNNING and req.num_uncomputed_tokens == 1:
                out.append(req)
        return out

    def migrate(self, request_id: str, source_id: str, target_id: str, on_done: Callable[[str], None]) -> None:
        """Live migration of a running decode, as on the live node (services/rpc/migration.py): at the source's next
        step boundary the request leaves its batch keeping its KV and the target reserves room for it (none: it
        stays and decodes on, `on_done("target_refused")`); after the modelled transfer of its context the target
        decodes on from its last token, the source frees the KV, and `on_done("migrate")`. `on_done("gone")`: it was
        no longer a running decode there (finished meanwhile), or a fault ended it."""
        self._migrations.setdefault(source_id, []).append((request_id, target_id, on_done))
        source = self.instances[source_id]
        if not source.busy:
            self._start_migrations(source)

    def _start_migrations(self, source: _Instance) -> None:
        pending = self._migrations.pop(source.cfg.id, ())
        if pending:
            self._write_out(source)  # (at a step boundary) every request explicit before one leaves the batch
        for request_id, target_id, on_done in pending:
            tracker = self._trackers[request_id]
            target = self.instances.get(target_id)
            tokens = source.batcher.suspend_running(request_id)
            if tokens is None:
                on_done("gone")
                continue
            if target is None or target_id in self.down \
                    or not target.batcher.reserve_migrated(self._request_spec(tracker), tokens, self.now):
                source.batcher.resume_suspended(request_id)
                on_done("target_refused")
                continue
            transfer_s = source.cost.kv_transfer_time_s(len(self._request_spec(tracker).prompt_token_ids) + len(tokens) - 1)
            self.call_at(self.now + transfer_s, functools.partial(self._migrated, source, target, request_id, on_done))

    def _migrated(self, source: _Instance, target: _Instance, request_id: str, on_done) -> None:
        tracker = self._trackers[request_id]
        if self.instances.get(target.cfg.id) is not target or tracker.error or tracker.finish_s is not None:
            source.batcher.abort(request_id)  # a fault took one end meanwhile: it already ended the request
            on_done("gone")
            return
        source.batcher.release_handoff(request_id)
        target.batcher.commit_migrated(request_id, self.now)
        route = tracker.route
        assert route is not None  # a migrated request was placed
        tracker.route = dataclasses.replace(route, decode_instance_id=target.cfg.id) if route.decode_instance_id \
            else dataclasses.replace(route, instance_id=target.cfg.id)
        self._wake(target)
        self._wake(source)
        on_done("migrate")

    def set_role_in_place(self, instance_id: str, role: Role) -> InstanceConfig:
        """Decode <-> colocated with no drain: the instance keeps its queue, KV, running requests and reservations,
        and takes new work in `role` once `route_only_to` names it so. Returns its new config."""
        inst = self.instances[instance_id]
        if not in_place_role(inst.cfg.role, role):
            raise ValueError(f"{instance_id}: only decode <-> colocated changes in place, not "
                             f"{inst.cfg.role.value} -> {role.value}")
        inst.cfg = dataclasses.replace(inst.cfg, role=role)
        # The batcher's budgets are sized per role (SLO sizing: a decode instance's token budget is not a colocated
        # one's): the new role's, on the same KV and requests.
        inst.batcher.reconfigure(instance_parts(self.config, inst.cfg, inst.cost).batcher_config)
        inst._load = None  # the next snapshot reports the new role
        return inst.cfg

    def add_instance(self, cfg: InstanceConfig) -> None:
        """A fresh instance (empty queue and KV) on the node; routable once `route_only_to` names it."""
        inst = self._new_instance(cfg)
        self.instances[cfg.id] = inst
        self.router.cost_models[cfg.id] = inst.cost
        self._last_busy[cfg.id] = 0.0

    # ---- sampling and results -----------------------------------------------------------------------------

    def _on_sample(self, _payload) -> None:
        dt = self.sample_interval_s
        for iid, inst in self.instances.items():
            self._series.setdefault(f"kv:{iid}", []).append((self.now, inst.batcher.kv.usage))
            busy = min(1.0, (inst.busy_s - self._last_busy[iid]) / dt) if self.now > 0 else 0.0
            self._series.setdefault(f"busy:{iid}", []).append((self.now, busy))
            self._last_busy[iid] = inst.busy_s
        self._series.setdefault("occupancy", []).append((self.now, float(self._in_flight)))
        self._push(self.now + dt, _SAMPLE, None)

    def _result(
        self, trace: Sequence[TraceRequest], last_arrival: float, wall_s: float, warmup_s: float | None,
        min_warmup_s: float,
    ) -> SimResult:
        for inst in self.instances.values():
            self._write_out(inst)
        records = []
        for req in trace:
            tracker = self._trackers.get(req.request_id)
            if tracker is None:
                tracker = _Tracker(req)
                tracker.error = "not reached: the simulation stopped first"
            elif not tracker.refused and tracker.finish_s is None and not tracker.error:
                tracker.error = "unfinished when the simulation stopped"
            records.append(tracker.record())
        window = detect_window(self._series.get("occupancy", []), max(last_arrival, 1e-9), warmup_s=warmup_s,
                               min_warmup_s=min_warmup_s)
        slo = slo_spec_of(self.config.slo)
        virtual_s = max(self.now, last_arrival)
        stats = tuple(self._instance_stats(iid, inst, window) for iid, inst in self.instances.items())
        gangs = tuple({id(g): g.report(virtual_s) for g in self.gangs.values()}.values())
        return SimResult(tuple(records), summarize(records, slo, window), stats, self._series, virtual_s, wall_s,
                         fault_counts=dict(self.fault_counts) if self.faults else {},
                         fault_counts_by_fault=tuple(dict(c) for c in self.fault_counts_by_fault),
                         gangs=gangs)

    def _instance_stats(self, iid: str, inst: _Instance, window: Window) -> InstanceStats:
        # A busy sample covers the second before it: keep those lying inside the window (all overlapping ones
        # for a window shorter than a sample). KV samples are instants: keep those inside the window.
        dt = self.sample_interval_s
        busy_points = self._series.get(f"busy:{iid}", [])
        busy = [v for t, v in busy_points if t - dt >= window.start_s - 1e-9 and t <= window.end_s + 1e-9]
        busy = busy or [v for t, v in busy_points if t > window.start_s and t - dt < window.end_s]
        kv = [v for t, v in self._series.get(f"kv:{iid}", []) if window.start_s <= t <= window.end_s] or [0.0]
        return InstanceStats(
            instance_id=iid,
            model=inst.cfg.model,
            role=inst.cfg.role.value,
            num_steps=inst.steps,
            busy_fraction=sum(busy) / len(busy) if busy else 0.0,
            num_preemptions=inst.batcher.num_preemptions_total,
            kv_mean=sum(kv) / len(kv),
            kv_max=max(kv),
        )


def run_simulation(
    config: NodeConfig,
    trace: Sequence[TraceRequest],
    *,
    seed: int = 0,
    progress: Callable[[float], None] | None = None,
    drain_s: float = 120.0,
    warmup_s: float | None = None,
    min_warmup_s: float = MIN_WARMUP_S,
    faults: Sequence = (),
    fast: bool | None = None,
    keep: list | None = None,
) -> SimResult:
    """Simulate `trace` on the node `config`; the one entry point for `simulate`, `plan` and the benchmarks.

    `warmup_s` None detects the warm-up (`metrics.detect_window`: MSER-5 on the occupancy series, at least
    `min_warmup_s`); a number states it. The result's summary and instance figures cover the measurement window
    (`SimResult.window`); `records` and `timeseries` hold the whole run, warm-up and drain included. `fast`: see
    `NodeSimulator` (None: on unless OCTOSERVE_SIM_FAST=0). `keep`: the simulator is appended to it (a command
    that ends its process without freeing the run keeps it from being freed here, `usage.exit_process`)."""
    sim = NodeSimulator(config, seed=seed, faults=faults, fast=fast)
    if keep is not None:
        keep.append(sim)
    return sim.run(trace, drain_s=drain_s, progress=progress, warmup_s=warmup_s, min_warmup_s=min_warmup_s)
