"""Worker RPCs of the colocated and decode roles: Attach sessions, Generate, Reserve, Decode (transfer + commit).

Streaming: each router holds one Attach stream (a `Session`). A request task pushes every engine output of its
request into its session; the session coalesces all outputs pushed in one event-loop pass into one `StepBatch`
(the sim engine wakes every request of a step in the same pass, so a batch is one engine step), which keeps the
per-token cost at one repeated-field append on both ends.

Hand-off: `Reserve` holds KV and arms a TTL timer; `Decode` cancels the timer, runs the engine's decode (which
takes the KV in: the sim engine waits the modelled NVLink time) up to its first output, which marks the commit,
and replies; the rest streams on the session. A failed or timed-out transfer releases the reservation, answers
UNAVAILABLE with the `x-octoserve-kv-transfer-failed` trailer (the router continues the request elsewhere, this
instance included; its prefill side is released) and is counted in
`octoserve_worker_kv_transfer_failures_total{reason=timeout|corrupt|error}`. Injected transfer faults
(services/faults.py) are applied here.

Drain (SIGTERM): work in flight finishes within the grace; whatever still streams `DRAIN_END_MARGIN_S` before
the grace ends has its router session ended cleanly (the router continues those requests elsewhere, cause `drain`).

Live migration (services/rpc/migration.py) uses the same two RPCs: `Reserve` with the output tokens a running
request already produced elsewhere, then `Decode` with a hand-off carrying them (colocated instances take these
too); the request decodes on from its last token. On the source, a handed-over request's stream ends with the
migration marker, and its KV is held until the router's `Release`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
import prometheus_client as prom

from octoserve.services.core.types import FinishReason, RequestOutput, Role
from octoserve.services.engine.base import EngineError, HandoffError
from octoserve.services.faults import FaultPlan
from octoserve.services.rpc import convert
from octoserve.services.rpc import migration
from octoserve.services.rpc import seam_stop
from octoserve.services.rpc import status as rpc_status
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.worker_base import WorkerBase

log = logging.getLogger("octoserve.decode_worker")

DEFAULT_RESERVE_TTL_MS = 10_000  # a reservation nobody decodes into is returned after this long
MAX_RESERVE_TTL_MS = 60_000  # longer would let one caller hold KV for days
DEFAULT_TRANSFER_TIMEOUT_S = 5.0
# A drain whose grace runs out with requests still streaming ends the router sessions this long before the grace
# does (at most a quarter of it), cleanly: the router reads the end as a drain (and continues those requests
# elsewhere), where a stream cut by the server's stop would read as a crash.
DRAIN_END_MARGIN_S = 0.5


class Session:
    """One router's Attach stream: outputs pushed in one loop pass leave as one StepBatch."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id
        self.batches: asyncio.Queue[w_pb.StepBatch | None] = asyncio.Queue()
        self._pending: list[w_pb.TokenDelta] = []
        self._seq = 0
        self.request_ids: set[str] = set()
        self.closed = False

    def push(self, delta: w_pb.TokenDelta) -> None:
        if self.closed:
            return
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(delta)

    def _flush(self) -> None:
        if not self._pending or self.closed:
            return
        self._seq += 1
        self.batches.put_nowait(w_pb.StepBatch(seq=self._seq, deltas=self._pending))
        self._pending = []

    def close(self) -> None:
        self._flush()  # outputs pushed in this loop pass (a request's last token) still leave before the end
        self.closed = True
        self.batches.put_nowait(None)


class DecodeWorkerServicer(WorkerBase):
    role_name = "decode_worker"

    def __init__(self, engine, *, reserve_ttl_ms: int = DEFAULT_RESERVE_TTL_MS,
                 transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S, faults: FaultPlan | None = None) -> None:
        super().__init__(engine)
        self.faults = faults if faults is not None else FaultPlan()  # none injected
        self.transfer_failures = prom.Counter(
            "octoserve_worker_kv_transfer_failures", "KV transfers that did not commit, by reason",
            ["instance", "reason"], registry=self.metrics.registry)
        self.sessions: dict[str, Session] = {}
        self.tasks: dict[str, asyncio.Task] = {}  # request_id -> the task streaming it
        self.reservations: dict[str, asyncio.TimerHandle] = {}  # request_id -> TTL timer
        self.reserve_ttl_ms = reserve_ttl_ms
        self.transfer_timeout_s = transfer_timeout_s
        self.migrating: dict[str, migration.Handover] = {}  # handed to another instance, KV held until Release

    async def drain(self, grace_s: float) -> None:
        margin_s = min(DRAIN_END_MARGIN_S, grace_s / 4)
        try:
            await asyncio.wait_for(super().drain(grace_s), timeout=grace_s - margin_s)
        except TimeoutError:
            log.warning("drain grace nearly over with requests streaming: ending the router sessions",
                        extra={"fields": {"in_flight": self.in_flight, "sessions": len(self.sessions)}})
            for session in list(self.sessions.values()):
                session.close()

    # ---- sessions ---------------------------------------------------------------------------------------------

    async def Attach(self, request, context) -> AsyncIterator[w_pb.StepBatch]:
        session = Session(request.session_id)
        old = self.sessions.pop(request.session_id, None)
        if old is not None:
            old.close()
        self.sessions[request.session_id] = session
        try:
            yield w_pb.StepBatch(seq=0)  # confirms the session: the router may submit requests from now on
            while (batch := await session.batches.get()) is not None:
                batch, closed = _coalesce(batch, session.batches)
                self.metrics.step_batch.observe(len(batch.deltas))
                yield batch
                if closed:
                    break
        finally:
            await self._detach(session)

    async def _detach(self, session: Session) -> None:
        """The router went away: nobody will read these requests' tokens, so free their KV now."""
        session.close()
        if self.sessions.get(session.session_id) is session:
            del self.sessions[session.session_id]
        for request_id in list(session.request_ids):
            await self.abort_request(request_id)

    async def _session(self, session_id: str, context) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"no Attach stream for session {session_id!r} on {self.engine.instance_id}; call Attach first",
            )
        return session

    # ---- colocated --------------------------------------------------------------------------------------------

    async def Generate(self, request, context):
        if self.engine.role is not Role.COLOCATED:
            await self._wrong_role(context, "Generate", "colocated")
        await self._refuse_if_draining(context)
        session = await self._session(request.session_id, context)
        spec = await self._checked_spec(request.spec, context)
        outputs = self.engine.generate(spec)
        k = seam_stop.seam_tokens(context.invocation_metadata())
        check = seam_stop.checker(self.engine, spec.sampling.stop, spec.prompt_token_ids[len(spec.prompt_token_ids) - k:])
        self._start_stream(session, spec.request_id, outputs if check is None else seam_stop.stop_at_seam(outputs, check))
        return w_pb.SubmitReply()

    def _start_stream(self, session: Session, request_id: str, outputs: AsyncIterator[RequestOutput],
                      first: RequestOutput | None = None) -> None:
        session.request_ids.add(request_id)
        self._begin()
        self.tasks[request_id] = asyncio.create_task(self._stream(session, request_id, outputs, first))

    async def _stream(self, session: Session, request_id: str, outputs: AsyncIterator[RequestOutput],
                      first: RequestOutput | None) -> None:
        outcome = "finished"
        try:
            if first is not None:
                self._push(session, first)
            async for out in outputs:
                if out.finish_reason is FinishReason.HANDOFF:  # migrated away (services/rpc/migration.py)
                    outcome = "migrated"
                    await migration.wait_released(self, session, request_id)
                    break
                self._push(session, out)
        except asyncio.CancelledError:
            outcome = "aborted"
        except EngineError as e:
            outcome = "engine_error"
            st = rpc_status.status_for(e)
            session.push(w_pb.TokenDelta(request_id=request_id, finish_reason=gen_pb.ABORT,
                                         error_code=st.code.value[0], error_message=st.message))
        except Exception:
            outcome = "internal_error"
            log.exception("request stream failed", extra={"fields": {"request_id": request_id}})
            session.push(w_pb.TokenDelta(request_id=request_id, finish_reason=gen_pb.ABORT,
                                         error_code=grpc.StatusCode.INTERNAL.value[0],
                                         error_message=f"worker {self.engine.instance_id} failed the request"))
        finally:
            self.tasks.pop(request_id, None)
            session.request_ids.discard(request_id)
            self.metrics.outcome(outcome)
            self._end()

    def _push(self, session: Session, out: RequestOutput) -> None:
        session.push(convert.output_to_delta(out))
        self.metrics.tokens.inc(len(out.new_token_ids))

    # ---- decode: reserve -> (prefill elsewhere) -> transfer + commit -> stream ---------------------------------

    def _takes(self, migrated: bool) -> bool:
        """Decode instances take hand-offs; a migrated running decode may also go to a colocated one."""
        return self.engine.role is Role.DECODE or (migrated and self.engine.role is Role.COLOCATED)

    async def Reserve(self, request, context):
        migrated = bool(request.output_token_ids)
        if not self._takes(migrated):
            await self._wrong_role(context, "Reserve", "decode or colocated" if migrated else "decode")
        await self._refuse_if_draining(context)
        spec = await self._checked_spec(request.spec, context)
        if request.ttl_ms > MAX_RESERVE_TTL_MS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"ttl_ms {request.ttl_ms} is over {MAX_RESERVE_TTL_MS}; send at most that (0: the default)")
        if migrated:
            reserve_migrated = getattr(self.engine, "reserve_migrated", None)
            if reserve_migrated is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"{self.engine.instance_id} runs an engine that cannot take a migrated request")
            ok = await reserve_migrated(spec, tuple(request.output_token_ids))
        else:
            ok = await self.engine.reserve(spec)
        if not ok:
            return w_pb.ReserveReply(reserved=False)
        ttl_s = (request.ttl_ms or self.reserve_ttl_ms) / 1000.0
        loop = asyncio.get_running_loop()
        self.reservations[spec.request_id] = loop.call_later(ttl_s, self._expire, spec.request_id)
        return w_pb.ReserveReply(reserved=True)

    def _expire(self, request_id: str) -> None:
        if self.reservations.pop(request_id, None) is not None:
            log.warning("reservation expired unused", extra={"fields": {"request_id": request_id}})
            asyncio.get_running_loop().create_task(self.engine.release(request_id))

    async def Decode(self, request, context):
        migrated = bool(request.handoff.output_token_ids)
        # A reservation made here is served whatever the role now (a decode instance turned colocated in place).
        if not self._takes(migrated) and request.spec.request_id not in self.reservations:
            await self._wrong_role(context, "Decode", "decode or colocated" if migrated else "decode")
        session = await self._session(request.session_id, context)
        spec = await self._checked_spec(request.spec, context)
        timer = self.reservations.pop(spec.request_id, None)
        if timer is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"no live reservation for {spec.request_id} on {self.engine.instance_id}; "
                                "Reserve first and Decode within its ttl_ms")
        timer.cancel()
        handoff = convert.handoff_from_pb(request.handoff)
        outputs = self.engine.decode(spec, handoff)
        if not migrated:  # the prefill's first token, and any output at the end of the prompt, precede this stream
            k = seam_stop.seam_tokens(context.invocation_metadata())
            before = (*spec.prompt_token_ids[len(spec.prompt_token_ids) - k:], handoff.first_token_id)
            check = seam_stop.checker(self.engine, spec.sampling.stop, before)
            outputs = outputs if check is None else seam_stop.stop_at_seam(outputs, check)
        outputs = aiter(outputs)
        t0 = time.monotonic()
        try:
            first = await asyncio.wait_for(self._transfer_and_commit(handoff, outputs), self.transfer_timeout_s)
        except (TimeoutError, EngineError, StopAsyncIteration) as e:
            reason = "timeout" if isinstance(e, TimeoutError) else "corrupt" if isinstance(e, _Corrupt) else "error"
            self.transfer_failures.labels(self.engine.instance_id, reason).inc()
            log.warning("KV transfer failed", extra={"fields": {"request_id": spec.request_id, "reason": reason}})
            await self.engine.release(spec.request_id)
            await self.engine.abort(spec.request_id)
            err = e if isinstance(e, EngineError) else HandoffError(
                f"KV transfer of {spec.request_id} into {self.engine.instance_id} did not commit within "
                f"{self.transfer_timeout_s:g} s; retry the request")
            st = rpc_status.status_for(err)
            await context.abort(st.code, st.message,
                                trailing_metadata=(*st.trailing_metadata, (rpc_status.KV_TRANSFER_FAILED_KEY, reason)))
        self.metrics.handoff_s.observe(time.monotonic() - t0)
        self._start_stream(session, spec.request_id, outputs, first)
        return w_pb.SubmitReply()

    async def _transfer_and_commit(self, handoff, outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
        """Moves the KV in, then commits it: the engine's first decode output proves the request joined the batch."""
        modelled = getattr(self.engine, "transfer_time_s", None)  # sim engines model the NVLink copy
        if modelled is not None:
            await asyncio.sleep(await modelled(handoff))
        fault = self.faults.next_kv_transfer()
        if fault is not None and fault.kind == "slow":
            await asyncio.sleep(fault.delay_s)
        elif fault is not None and fault.kind == "corrupt":
            raise _Corrupt(f"KV of {handoff.request_id} failed verification on {self.engine.instance_id}; retry the request")
        return await anext(outputs)

    async def Release(self, request, context):
        timer = self.reservations.pop(request.request_id, None)
        if timer is not None:
            timer.cancel()
        if request.request_id in self.migrating:  # a migrated request's KV: freed when its stream task ends
            migration.released(self, request.request_id)
            return w_pb.ReleaseReply()
        await self.engine.release(request.request_id)
        return w_pb.ReleaseReply()

    # ---- abort -----------------------------------------------------------------------------------------------

    async def abort_request(self, request_id: str) -> None:
        timer = self.reservations.pop(request_id, None)
        if timer is not None:
            timer.cancel()
            await self.engine.release(request_id)
        migration.released(self, request_id)
        task = self.tasks.pop(request_id, None)
        await self.engine.abort(request_id)
        if task is not None:
            task.cancel()


class _Corrupt(HandoffError):
    """A transfer that arrived but failed verification."""


def _coalesce(batch: w_pb.StepBatch, queue: asyncio.Queue) -> tuple[w_pb.StepBatch, bool]:
    """Fold the step batches already queued behind `batch` into it: when the router reads slower than the engine
    steps, it then gets several steps' tokens per message instead of a growing backlog of one-step messages
    (gRPC's per-message cost, not the tokens, is what bounds a router). Deltas keep their order; the merged
    batch carries the newest seq. Returns (batch, whether the session was closed behind it)."""
    while not queue.empty():
        more = queue.get_nowait()
        if more is None:
            return batch, True
        batch.deltas.extend(more.deltas)
        batch.seq = more.seq
    return batch, False

