"""octoserve.v1.Generation: validate -> admit/route (RouterPolicy) -> dispatch to workers -> stream tokens back.

Per request the router holds a `RequestState`: deltas arriving on the worker sessions are appended to it (the hot
path: one dict lookup, one list append, one event set), and the client's handler drains everything pending into one
GenerateResponse per write, so a slow reader gets fewer, larger messages instead of a backlog.

Dispatch: colocated -> worker Generate; disaggregated -> decode Reserve, prefill Prefill (the first token goes to
the client at once), decode Decode (transfer + commit), prefill Release. Every way a handler ends without a
finished stream (client cancel, deadline, cut-off, error) aborts the request on every worker it touched, which
frees its KV there.

A lost worker (its token session or an RPC to it fails UNAVAILABLE, it hung, a KV transfer into it failed): a request
that has not produced a token yet is re-routed (`router/failover.py`), after freeing what the surviving instances
hold for it; one that has is continued on another instance from its prompt plus the tokens already received, on the
same client stream (at most `policies.max_continuations` times; past that, or refused, it ends UNAVAILABLE with a
retry hint). The instance is unroutable from that moment until its session is back.

A client resuming a cut stream (`resume_from`: the tokens it received before a router restart or a refused
continuation) is a new request here: its prompt carries those tokens (`convert.resumed_spec`), and usage moves
them (`RequestState.resumed`) from the prompt count to the completion count, so it reports the whole request.

Token accounting across placements: `output_ids` are the tokens merged for the client; a delta's
`num_output_tokens` counts the tokens of its own placement, so `output_base` (the tokens received before the
current placement) is added to it; usage reports the original prompt and every completion token.

Bounds: at most `max_pending_deltas` undelivered deltas per request. A client that stops reading fills that
bound, is cut off with ABORTED (after the messages already written), and its request is aborted on the workers,
so its worker never waits for it.

Clocks: `arrival_s` and the policy's `now` are on the modelled clock (monotonic / time_scale), matching the sim
engine's batcher; retry hints and deadline checks are on the wall clock (modelled x time_scale).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from dataclasses import dataclass

import grpc

from octoserve.services.core.errors import DeadlineExceeded, Draining, InvalidArgument, OctoserveError, Overloaded, UnknownModel
from octoserve.services.core.placement import NodeConfig
from octoserve.services.core.validation import validate_request
from octoserve.services.rpc import convert
from octoserve.services.rpc import seam_stop
from octoserve.services.rpc import status as rpc_status
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.router import migration
from octoserve.router.access_log import AccessLog
from octoserve.router.failover import Failover, WorkerLost, remaining_s as time_left_s
from octoserve.router.metrics import RouterMetrics
from octoserve.router.pool import WorkerPool
from octoserve.router.tenants import TenantGate, TenantSettings
from octoserve.services.rpc.limits import Limits, check_public_request

log = logging.getLogger("octoserve.router")

DEFAULT_MAX_PENDING_DELTAS = 1024
RESERVE_TTL_MS = 10_000


class RequestState:
    """One in-flight request at the router."""

    __slots__ = (
        "spec", "pending", "wakeup", "num_sent", "num_prompt_tokens", "num_cached_tokens", "finish_reason",
        "error", "instance_ids", "max_pending", "closed", "first_token_s", "last_token_s", "wall_start_s",
        "dispatch", "served_by", "rerouted", "timeout_s", "worker_spec", "output_ids", "output_base", "continued",
        "awaiting_first", "resumed",
    )

    def __init__(self, spec, instance_ids: tuple[str, ...], max_pending: int, wall_start_s: float) -> None:
        self.spec = spec
        self.wall_start_s = wall_start_s
        self.pending: list[w_pb.TokenDelta] = []
        self.wakeup = asyncio.Event()
        self.num_sent = 0
        self.num_prompt_tokens = spec.num_prompt_tokens
        self.num_cached_tokens = 0
        self.finish_reason = gen_pb.FINISH_REASON_UNSPECIFIED
        self.error: rpc_status.RpcStatus | None = None
        self.instance_ids = instance_ids
        self.max_pending = max_pending
        self.closed = False  # no more deltas accepted (finished, failed or cut off)
        self.first_token_s: float | None = None
        self.last_token_s = 0.0
        self.dispatch: asyncio.Task | None = None  # the task placing it on workers (replaced when re-routed)
        self.served_by: list[str] = list(instance_ids)  # every instance it was placed on, in order
        self.rerouted = 0
        self.timeout_s: float | None = None
        self.worker_spec = spec  # what the workers are sent: the original request, or its latest continuation
        self.output_ids: list[int] = []  # every token merged for the client, in order
        self.output_base = 0  # tokens received before the current placement (its deltas count from 0)
        self.continued: list[str] = []  # the cause of each continuation (router/failover.py CAUSES)
        self.awaiting_first = False  # a continuation whose first token the policy has not heard of yet
        self.resumed = 0  # tokens the client resumed from (resume_from): in spec's prompt, counted as output

    @property
    def streamed(self) -> bool:
        """Whether a token reached the router for it: from then on it can no longer move to another worker."""
        return self.first_token_s is not None or self.num_sent > 0 or bool(self.pending)

    @property
    def ending(self) -> bool:
        """Whether its last delta (a finish or an error) already reached the router: nothing is left to move."""
        return any(d.finish_reason or d.error_code for d in self.pending)

    def received_ids(self) -> list[int]:
        """Every token received for this request, merged or still pending; folds the pending deltas into one
        (their counts are relative to the placement that sent them, which is about to change)."""
        ids = list(self.output_ids)
        count = self.num_sent
        prompt = cached = 0
        for d in self.pending:
            if d.error_code or d.finish_reason:
                break
            num_ids = len(d.token_ids)
            total = d.num_output_tokens + self.output_base if d.num_output_tokens else count + num_ids
            num_new = min(total - count, num_ids)
            if num_new > 0:
                ids.extend(d.token_ids[num_ids - num_new:])
                count += num_new
            if d.num_prompt_tokens and not prompt:
                prompt, cached = d.num_prompt_tokens, d.num_cached_prompt_tokens
        if self.pending:
            self.pending = [w_pb.TokenDelta(request_id=self.spec.request_id, token_ids=ids[self.num_sent:],
                                            num_prompt_tokens=prompt, num_cached_prompt_tokens=cached)]
        return ids

    def continue_as(self, spec, cause: str) -> None:
        """From now on the workers serve `spec`, the continuation built from `received_ids()`."""
        self.output_base = len(spec.prompt_token_ids) - len(self.spec.prompt_token_ids)
        self.worker_spec = spec
        self.continued.append(cause)
        self.awaiting_first = True

    def deliver(self, delta: w_pb.TokenDelta) -> bool:
        """Returns False when this delta overflowed the bound (the caller cuts the client off)."""
        if self.closed:
            return True
        self.pending.append(delta)
        self.wakeup.set()
        return len(self.pending) <= self.max_pending

    def fail(self, status: rpc_status.RpcStatus) -> None:
        if self.error is None and not self.closed:
            self.error = status
            self.closed = True
            self.wakeup.set()


@dataclass(frozen=True, slots=True)
class RouterSettings:
    time_scale: float = 1.0
    max_pending_deltas: int = DEFAULT_MAX_PENDING_DELTAS
    access_log: AccessLog | None = None  # None: the default (errors, and one in 100 ok requests)
    tenants: TenantSettings = TenantSettings()  # API keys, rate limits, fair sharing (router/tenants.py)
    limits: Limits = Limits()  # input limits (services/rpc/limits.py)


class GenerationServicer(gen_grpc.GenerationServicer):
    def __init__(self, config: NodeConfig, policy, pool: WorkerPool, session_id: str, settings: RouterSettings,
                 metrics: RouterMetrics) -> None:
        self.config = config
        self.policy = policy
        self.pool = pool
        self.session_id = session_id
        self.settings = settings
        self.metrics = metrics
        self.requests: dict[str, RequestState] = {}
        self.draining = False
        # Set once the router has connected to its workers (router/app.py's start; a servicer built without one
        # serves at once). A call that arrives before, while a restarted router reconnects, waits for it.
        self.connected = asyncio.Event()
        self.connected.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._background: set[asyncio.Task] = set()
        self.access = settings.access_log or AccessLog()
        self.failover = Failover(self)
        self.tenants = TenantGate(settings.tenants)

    # ---- worker session callbacks (hot path) ------------------------------------------------------------------

    def on_delta(self, delta: w_pb.TokenDelta) -> None:
        st = self.requests.get(delta.request_id)
        if st is None:
            return
        if delta.migration_target:  # a draining worker handed it over (router/migration.py)
            migration.follow(self, st, delta)
        elif not st.deliver(delta):
            self._cut_off(st)

    def on_worker_down(self, instance_id: str, reason: str, cause: str = "crash") -> None:
        self.failover.worker_down(instance_id, reason, cause)

    def _cut_off(self, st: RequestState) -> None:
        self.metrics.cutoffs.inc()
        st.fail(rpc_status.RpcStatus(
            grpc.StatusCode.ABORTED,
            f"the client fell more than {st.max_pending} token messages behind and was cut off; read the stream "
            "continuously (or lower max_tokens) and retry",
        ))
        self._abort_on_workers(st)

    # ---- Generate ---------------------------------------------------------------------------------------------

    async def Generate(self, request, context):
        wall_start_s = time.monotonic()
        try:
            await self._until_connected(context)
            spec, route = self._admit(request, context, wall_start_s)
        except OctoserveError as e:
            self.metrics.refused(request.model, e)
            self.access.refused(request, "", e)
            await rpc_status.abort(context, e)
        st = RequestState(spec, route_instances(route), self.settings.max_pending_deltas, wall_start_s)
        st.resumed = len(request.resume_from.ids)
        st.timeout_s = context.time_remaining()
        self._track(st)
        self.policy.on_dispatched(spec.request_id, route, spec)
        st.dispatch = asyncio.create_task(self._dispatch(st, route, st.timeout_s))
        try:
            # The response headers now, while the prompt is computed: the first token's message then carries only
            # itself (~0.1 ms less on its path, measured on a loaded 2-core host). After one turn of the loop, in
            # which the dispatch sends the request: sending headers takes ~0.2 ms of this thread before it yields.
            await asyncio.sleep(0)
            await context.send_initial_metadata(())
            async for response in self._responses(st):
                yield response
            if st.error is not None:
                await context.abort(st.error.code, st.error.message, trailing_metadata=st.error.trailing_metadata)
        finally:
            self._untrack(st)

    async def _until_connected(self, context) -> None:
        """A call that arrives while the router is still connecting to its workers (it has just started or
        restarted, and resumed streams come back at once) waits for them, within its deadline, instead of being
        refused for want of a healthy instance. A router that cannot connect exits at its startup timeout, which
        ends the wait with the connection."""
        if self.connected.is_set():
            return
        try:
            await asyncio.wait_for(self.connected.wait(), context.time_remaining())
        except TimeoutError:
            raise DeadlineExceeded("the deadline passed while the router was still connecting to its workers (it "
                                   "had just started); retry with a longer deadline") from None

    def _admit(self, request: gen_pb.GenerateRequest, context, wall_now_s: float):
        """Validation, then the policy's admission and routing; raises the typed error to send back."""
        if self.draining:
            raise Draining()
        tenant = self.tenants.identify(context.invocation_metadata())
        model = self.config.models.get(request.model)
        check_public_request(request, self.settings.limits, model.max_context_len if model else None)
        request_id = request.request_id or uuid.uuid4().hex
        if request_id in self.requests:
            raise InvalidArgument("request_id", f"request_id {request_id!r} is already in flight; use a unique id or leave it empty")
        spec = convert.spec_from_public(
            request, request_id, wall_now_s / self.settings.time_scale,
            convert.sim_output_len_from_metadata(context.invocation_metadata()),
        )
        model = self.config.models.get(spec.model)
        if model is None:
            raise UnknownModel(spec.model, self.config.models)
        validate_request(spec, model)
        spec = convert.resumed_spec(spec, request, model)  # a client resuming a cut stream (resume_from)
        self.tenants.admit(tenant, spec.model, spec.priority, request_id,
                           int(self.config.policies.min_retry_after_ms * self.settings.time_scale))
        try:
            return spec, self._route(spec, context)
        except OctoserveError as e:
            if isinstance(e, Overloaded):
                self.tenants.on_shed(spec.model)
            self.tenants.release(request_id)
            raise

    def _route(self, spec, context):
        decision = self.policy.route(spec, self.pool.loads(), spec.arrival_s)
        if not hasattr(decision, "instance_id"):  # a Refuse
            raise self._wall_clock_error(decision.error)
        remaining_s = context.time_remaining()
        predicted_s = decision.predicted_ttft_ms / 1000.0 * self.settings.time_scale
        if remaining_s is not None and predicted_s > remaining_s:
            raise DeadlineExceeded(
                f"the first token is predicted in {predicted_s * 1000:.0f} ms but the deadline is in "
                f"{remaining_s * 1000:.0f} ms; raise the deadline or retry later"
            )
        return decision

    def _wall_clock_error(self, error: OctoserveError) -> OctoserveError:
        if isinstance(error, Overloaded) and self.settings.time_scale != 1.0:
            wall_ms = int(round(error.retry_after_ms * self.settings.time_scale))
            return Overloaded(error.model, error.tier, wall_ms, error.reason)
        return error

    def _track(self, st: RequestState) -> None:
        self.requests[st.spec.request_id] = st
        self._idle.clear()
        self.metrics.in_flight.inc()

    def _untrack(self, st: RequestState) -> None:
        if st.dispatch is not None and not st.dispatch.done():
            st.dispatch.cancel()
        if st.finish_reason == gen_pb.FINISH_REASON_UNSPECIFIED:
            st.closed = True
            self._abort_on_workers(st)
        self.requests.pop(st.spec.request_id, None)
        self.tenants.release(st.spec.request_id)
        self.policy.on_finished(st.spec.request_id)
        self.metrics.finished(st)
        self.access.finished(st, time.monotonic())
        if not self.requests:
            self._idle.set()

    def _abort_on_workers(self, st: RequestState) -> None:
        for instance_id in st.instance_ids:
            if not self.pool[instance_id].reachable:
                continue  # a lost worker freed everything with its process; its replacement never saw the request
            stub = self.pool[instance_id].stub
            self._spawn(stub.Abort(w_pb.AbortRequest(request_id=st.spec.request_id), timeout=5.0))

    def _spawn(self, coro) -> None:
        task = asyncio.create_task(_swallow_rpc_errors(coro))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # ---- streaming back ----------------------------------------------------------------------------------------

    async def _responses(self, st: RequestState):
        while True:
            await st.wakeup.wait()
            st.wakeup.clear()
            if st.pending:
                response = self._merge(st)
                if response is not None:
                    self._observe(st, response)
                    yield response
            if st.error is not None or st.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED:
                return

    def _merge(self, st: RequestState) -> gen_pb.GenerateResponse | None:
        """Everything pending as one message; tokens the client already has (the hand-off's first) are skipped."""
        deltas, st.pending = st.pending, []
        tokens: list[int] = []
        for d in deltas:
            if d.error_code:
                st.fail(rpc_status.RpcStatus(rpc_status.CODE_BY_VALUE.get(d.error_code, grpc.StatusCode.INTERNAL), d.error_message))
                break
            ids = d.token_ids  # one upb container lookup: field access is the cost on this path
            num_ids = len(ids)
            total = d.num_output_tokens  # read once: upb field access is the cost here
            total = total + st.output_base if total else st.num_sent + num_ids
            num_new = min(total - st.num_sent, num_ids)
            if num_new > 0:
                tokens.extend(ids if num_new == num_ids else ids[num_ids - num_new:])
                st.num_sent += num_new
            if d.num_prompt_tokens and not st.continued:  # a continuation's prompt holds earlier output tokens
                st.num_prompt_tokens, st.num_cached_tokens = d.num_prompt_tokens, d.num_cached_prompt_tokens
            if d.finish_reason:
                st.finish_reason = d.finish_reason
                st.closed = True
                break
        finished = st.finish_reason != gen_pb.FINISH_REASON_UNSPECIFIED
        if not tokens and not finished:
            return None
        st.output_ids.extend(tokens)
        response = gen_pb.GenerateResponse(token_ids=tokens)
        if st.first_token_s is None:
            response.request_id = st.spec.request_id
        if finished:
            response.finish_reason = st.finish_reason
            response.usage.prompt_tokens = st.num_prompt_tokens - st.resumed
            response.usage.completion_tokens = st.num_sent + st.resumed
            response.usage.cached_prompt_tokens = min(st.num_cached_tokens, st.num_prompt_tokens - st.resumed)
        return response

    def _observe(self, st: RequestState, response: gen_pb.GenerateResponse) -> None:
        now = time.monotonic()
        n = len(response.token_ids)
        if st.first_token_s is None:
            st.first_token_s = now
            self.policy.on_first_token(st.spec.request_id, now / self.settings.time_scale)
            self.metrics.ttft(st.spec.model, now - st.wall_start_s)
        elif n:
            self.metrics.itl(st.spec.model, (now - st.last_token_s) / n, n)
            if st.awaiting_first:  # a continuation's first tokens (their ledger entry waits for them)
                st.awaiting_first = False
                self.policy.on_first_token(st.spec.request_id, now / self.settings.time_scale)
        if n:
            st.last_token_s = now

    # ---- dispatch ----------------------------------------------------------------------------------------------

    async def _dispatch(self, st: RequestState, route, timeout_s: float | None) -> None:
        """Places the request, and places it again elsewhere while a worker is lost before its first token."""
        while route is not None:
            try:
                if route.decode_instance_id is None:
                    await self._colocated(st, route, timeout_s)
                else:
                    await self._disaggregated(st, route, timeout_s)
                return
            except WorkerLost as lost:
                route = await self.failover.replace_route(st, lost.instance_id, lost.reason, lost.cause)
                timeout_s = time_left_s(st)
            except grpc.aio.AioRpcError as e:
                st.fail(self._worker_status(st, e))
                return
            except OctoserveError as e:
                st.fail(rpc_status.status_for(e))
                return

    async def _colocated(self, st: RequestState, route, timeout_s: float | None) -> None:
        request = w_pb.WorkerGenerateRequest(session_id=self.session_id, spec=convert.spec_to_pb(st.worker_spec))
        await self.failover.call(route.instance_id, self.pool[route.instance_id].submits.submit(
            request, seam_metadata(st), timeout_s))

    async def _disaggregated(self, st: RequestState, route, timeout_s: float | None) -> None:
        spec_pb = convert.spec_to_pb(st.worker_spec)
        prefill, decode = self.pool[route.instance_id], self.pool[route.decode_instance_id]
        call = self.failover.call
        reply = await call(decode.instance_id,
                           decode.stub.Reserve(w_pb.ReserveRequest(spec=spec_pb, ttl_ms=RESERVE_TTL_MS), timeout=timeout_s))
        if not reply.reserved:
            error = Overloaded(st.spec.model, st.spec.priority, self.config.policies.min_retry_after_ms,
                               f"decode instance {route.decode_instance_id} has no KV left to reserve")
            self.policy.refused_after_routing(st.worker_spec, error, "decode_reserve")
            raise self._wall_clock_error(error)
        seam = seam_metadata(st)
        handoff = (await call(prefill.instance_id, prefill.stub.Prefill(w_pb.PrefillRequest(spec=spec_pb),
                                                                        timeout=timeout_s, metadata=seam))).handoff
        try:
            if handoff.finish_reason:  # the first token ended it: nothing to decode, return the reservation
                self._spawn(decode.stub.Release(w_pb.ReleaseRequest(request_id=st.spec.request_id), timeout=5.0))
            self._deliver_first_token(st, handoff)
            if handoff.finish_reason:
                return
            decode_request = w_pb.DecodeRequest(
                session_id=self.session_id, spec=spec_pb, handoff=handoff, source_address=prefill.address
            )
            await call(decode.instance_id, decode.stub.Decode(decode_request, timeout=timeout_s, metadata=seam))
        finally:
            if prefill.reachable:
                self._spawn(prefill.stub.Release(w_pb.ReleaseRequest(request_id=st.spec.request_id), timeout=5.0))

    def _deliver_first_token(self, st: RequestState, handoff) -> None:
        finish = {"stop": gen_pb.STOP, "length": gen_pb.LENGTH}.get(handoff.finish_reason, gen_pb.FINISH_REASON_UNSPECIFIED)
        st.deliver(w_pb.TokenDelta(
            request_id=st.spec.request_id, token_ids=[handoff.first_token_id], finish_reason=finish,
            num_prompt_tokens=handoff.num_prompt_tokens, num_cached_prompt_tokens=handoff.num_cached_prompt_tokens,
            num_output_tokens=1,
        ))

    def _worker_status(self, st: RequestState, e: grpc.aio.AioRpcError) -> rpc_status.RpcStatus:
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:  # engine capacity: a shed, with the usual retry hint
            return rpc_status.status_for(self._wall_clock_error(Overloaded(
                st.spec.model, st.spec.priority, self.config.policies.min_retry_after_ms, e.details() or "no capacity")))
        if e.code() == grpc.StatusCode.UNAVAILABLE:  # after the first token: the request cannot move any more
            return self.failover.lost_status(e.details() or "a worker of this request became unavailable")
        return rpc_status.RpcStatus(e.code(), e.details() or e.code().name)

    # ---- ListModels / drain ------------------------------------------------------------------------------------

    async def ListModels(self, request, context):
        """The served models; with tenant keys required, only for a known key, as Generate (context None: the HTTP
        front inside this process asking for itself, not for a client)."""
        if context is not None:
            try:
                self.tenants.identify(context.invocation_metadata())
            except OctoserveError as e:
                await rpc_status.abort(context, e)
        loads = self.pool.loads()
        models = []
        for name, spec in sorted(self.config.models.items()):
            instances = self.config.instances_of(name)
            up = all(loads.get(i.id) is not None and loads[i.id].healthy for i in instances)
            state = gen_pb.DRAINING if self.draining else (gen_pb.READY if up else gen_pb.UNAVAILABLE)
            models.append(gen_pb.Model(name=name, context_window=spec.max_context_len, state=state,
                                       num_instances=len(instances)))
        return gen_pb.ListModelsResponse(models=models)

    async def drain(self, grace_s: float) -> None:
        self.draining = True
        log.info("router draining", extra={"fields": {"in_flight": len(self.requests)}})
        await self._idle.wait()

    async def close(self) -> None:
        for task in list(self._background):
            task.cancel()


def seam_metadata(st: RequestState) -> tuple[tuple[str, str], ...] | None:
    """The worker RPC's metadata naming the output tokens at the end of its prompt (a continuation's streamed
    tokens, a client's resumed ones): the worker matches stop strings across that seam (services/rpc/seam_stop.py)."""
    num = st.output_base + st.resumed
    return ((seam_stop.SEAM_TOKENS_KEY, str(num)),) if num and st.spec.sampling.stop else None


def route_instances(route) -> tuple[str, ...]:
    return (route.instance_id,) + ((route.decode_instance_id,) if route.decode_instance_id else ())


async def _swallow_rpc_errors(coro) -> None:
    """Best-effort cleanup RPCs (Abort, Release): the worker's TTLs cover the case where they fail."""
    try:
        await coro
    except grpc.aio.AioRpcError as e:
        log.warning("cleanup RPC failed", extra={"fields": {"code": e.code().name, "details": e.details()}})


