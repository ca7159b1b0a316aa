"""The part of a worker servicer every role shares: load reports (polled and pushed, with KV events), Abort,
Release, Pause/Resume, drain, and the worker's Prometheus metrics.

A worker process hosts exactly one `Engine` instance. Role-specific RPCs live in `decode_worker/` (colocated and
decode: they stream tokens) and `prefill_worker/` (prefill: returns a hand-off). RPCs a role does not serve answer
FAILED_PRECONDITION naming the role that does.

Invariants: after `drain()` starts, every RPC that would start work answers UNAVAILABLE; `in_flight` counts work the
drain waits for (running request tasks, prefills, held hand-offs).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

import grpc
import prometheus_client as prom

from octoserve.services.core.errors import Draining, InvalidArgument
from octoserve.services.core.types import EngineLoad, KVEvent
from octoserve.services.engine.base import Engine
from octoserve.services.rpc import convert
from octoserve.services.rpc import status as rpc_status
from octoserve.services.rpc import submit
from octoserve.services.rpc.limits import check_worker_spec
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc

log = logging.getLogger("octoserve.worker")

DEFAULT_LOAD_INTERVAL_MS = 20  # ~ one decode step of the 70B at TP=4: the router's view is at most a step old
MIN_LOAD_INTERVAL_MS = 5
MAX_LOAD_INTERVAL_MS = 10_000  # a longer interval would park the stream (and its KV-event buffer) for nothing

# Latency buckets in seconds (modelled time x time_scale on the live clock), from 1 ms to 20 s.
LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0)


class WorkerMetrics:
    """One registry per worker so several servicers can live in one test process."""

    def __init__(self, instance_id: str) -> None:
        self.registry = prom.CollectorRegistry()
        self.instance_id = instance_id
        self.num_running = self._gauge("running_requests", "requests in the running batch, count")
        self.num_waiting = self._gauge("waiting_requests", "requests queued (waiting or swapped out), count")
        self.free_blocks = self._gauge("kv_free_blocks", "free KV blocks (cached-evictable included), blocks")
        self.kv_usage = self._gauge("kv_usage_ratio", "used / total KV blocks, ratio 0-1")
        self.queued_prefill = self._gauge("queued_prefill_tokens", "prompt tokens admitted, not yet computed, tokens")
        self.preemptions = self._gauge("preemptions", "preemptions so far (engine counter, when it has one), count")
        self.requests = prom.Counter("octoserve_worker_requests", "requests by outcome, count", ["instance", "outcome"],
                                     registry=self.registry)
        self.tokens = prom.Counter("octoserve_worker_output_tokens", "tokens streamed, tokens", ["instance"],
                                   registry=self.registry).labels(instance_id)
        self.step_batch = self._histogram("step_batch_requests", "requests per streamed step batch, count",
                                          (1, 2, 4, 8, 16, 32, 64, 128, 256))
        self.prefill_s = self._histogram("prefill_seconds", "Prefill RPC time, wall seconds (modelled x --time-scale under a dilated sim node)", LATENCY_BUCKETS_S)
        self.handoff_s = self._histogram("kv_transfer_seconds", "KV transfer + commit time, wall seconds (modelled x --time-scale under a dilated sim node)", LATENCY_BUCKETS_S)

    def _gauge(self, name: str, help_text: str):
        return prom.Gauge(f"octoserve_worker_{name}", help_text, ["instance"], registry=self.registry).labels(
            self.instance_id)

    def _histogram(self, name: str, help_text: str, buckets):
        return prom.Histogram(f"octoserve_worker_{name}", help_text, ["instance"], buckets=buckets,
                              registry=self.registry).labels(self.instance_id)

    def observe_load(self, load: EngineLoad, num_preemptions: int | None) -> None:
        self.num_running.set(load.num_running)
        self.num_waiting.set(load.num_waiting)
        self.free_blocks.set(load.num_free_blocks)
        self.kv_usage.set(load.kv_usage)
        self.queued_prefill.set(load.queued_prefill_tokens)
        if num_preemptions is not None:
            self.preemptions.set(num_preemptions)

    def outcome(self, outcome: str) -> None:
        self.requests.labels(self.instance_id, outcome).inc()


class KVEventFanout:
    """Engine KV events copied to every WatchLoad subscriber; drained from the engine once per report tick."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._subscribers: list[list[KVEvent]] = []

    def subscribe(self) -> list[KVEvent]:
        buf: list[KVEvent] = []
        self._subscribers.append(buf)
        return buf

    def unsubscribe(self, buf: list[KVEvent]) -> None:
        self._subscribers = [b for b in self._subscribers if b is not buf]  # by identity: empty buffers are equal

    def _take(self) -> list[KVEvent]:
        # Optional engine capability (not in the Engine protocol): the sim engine appends to `kv_events`.
        events = getattr(self._engine, "kv_events", None)
        if not events:
            return []
        taken = events[:]
        events.clear()
        return taken

    def pump(self) -> None:
        events = self._take()
        if events and self._subscribers:
            for buf in self._subscribers:
                buf.extend(events)


class WorkerBase(w_grpc.WorkerServicer):
    role_name = "worker"

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.metrics = WorkerMetrics(engine.instance_id)
        self.kv_events = KVEventFanout(engine)
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._seq = 0
        self.model_spec = None  # the served model's ModelSpec, when known: requests are validated against it

    async def _checked_spec(self, msg: w_pb.RequestSpec, context: grpc.aio.ServicerContext):
        """The request as the core sees it, or INVALID_ARGUMENT: a worker does not trust its caller's input."""
        spec = convert.spec_from_pb(msg)
        try:
            check_worker_spec(spec, self.engine.model, self.model_spec)
        except InvalidArgument as e:
            await rpc_status.abort(context, e)
        return spec

    # ---- lifecycle --------------------------------------------------------------------------------------------

    async def start(self) -> None:
        await self.engine.start()

    async def drain(self, grace_s: float) -> None:
        """Refuse new work, then wait (the caller bounds the wait by the grace) until in-flight work finished."""
        self.draining = True
        log.info("worker draining", extra={"fields": {"in_flight": self.in_flight}})
        await self._idle.wait()

    async def close(self) -> None:
        await self.engine.stop()

    def _begin(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def _end(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def _refuse_if_draining(self, context: grpc.aio.ServicerContext) -> None:
        if self.draining:
            await rpc_status.abort(context, Draining(f"worker {self.engine.instance_id} is draining; route elsewhere"))

    async def _wrong_role(self, context: grpc.aio.ServicerContext, rpc: str, roles: str) -> None:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"{rpc} is served by {roles} instances; {self.engine.instance_id} is a {self.engine.role.value} instance",
        )

    # ---- role-specific RPCs: a role that serves one overrides it -----------------------------------------------

    async def Attach(self, request, context):
        await self._wrong_role(context, "Attach", "colocated or decode")

    async def Generate(self, request, context):
        await self._wrong_role(context, "Generate", "colocated")

    def Submit(self, request_iterator, context):
        """Generate's requests on one open stream (services/rpc/submit.py): each goes through this servicer's own
        Generate, so a role without it answers each with Generate's FAILED_PRECONDITION."""
        return submit.serve_submit(self.Generate, request_iterator, context)

    async def Prefill(self, request, context):
        await self._wrong_role(context, "Prefill", "prefill")

    async def Reserve(self, request, context):
        await self._wrong_role(context, "Reserve", "decode")

    async def Decode(self, request, context):
        await self._wrong_role(context, "Decode", "decode")

    # ---- shared RPCs ------------------------------------------------------------------------------------------

    def _report(self, events=()) -> w_pb.LoadReport:
        load = self.engine.load()
        self.metrics.observe_load(load, getattr(self.engine, "num_preemptions", None))
        self._seq += 1
        return convert.load_to_pb(load, seq=self._seq, kv_events=events)

    async def GetLoad(self, request, context):
        return self._report()

    async def WatchLoad(self, request, context) -> AsyncIterator[w_pb.LoadReport]:
        interval_ms = request.interval_ms or DEFAULT_LOAD_INTERVAL_MS
        interval_s = min(max(interval_ms, MIN_LOAD_INTERVAL_MS), MAX_LOAD_INTERVAL_MS) / 1000.0
        buf = self.kv_events.subscribe()
        try:
            while not (self.draining and self.in_flight == 0):  # a drained worker ends its streams: stop is quick
                self.kv_events.pump()
                events = buf[:]
                buf.clear()
                yield self._report(events)
                await asyncio.sleep(interval_s)
        finally:
            self.kv_events.unsubscribe(buf)

    async def Abort(self, request, context):
        await self.abort_request(request.request_id)
        return w_pb.AbortReply()

    async def abort_request(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def Release(self, request, context):
        await self.engine.release(request.request_id)
        return w_pb.ReleaseReply()

    async def Pause(self, request, context):
        await self.engine.pause()
        return w_pb.PauseReply()

    async def Resume(self, request, context):
        await self.engine.resume()
        return w_pb.ResumeReply()
