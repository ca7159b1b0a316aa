"""What the router does when a worker is lost under its requests (the worker process died, it hung, an RPC to it
failed UNAVAILABLE: gone, or draining, or a KV transfer into it failed).

- The instance is unroutable from the moment its token session or load stream breaks (`WorkerClient.mark_down`),
  until the session is re-established (the launcher restarts the worker on the same port and the pool's loops
  reconnect). A failed KV transfer does not make its decode instance unroutable: the worker answered.
- A request that has no token at the router yet is placed again: the surviving instances of its old placement
  are told to Abort it first (that frees the decode reservation when the prefill worker died, and the held hand-off
  when the decode worker died), then the policy places it again as a request the node admitted before
  (`RouterPolicy.route(..., admitted=True)`: capacity checks only), with the lost instance excluded. At most
  `MAX_REROUTES` times; a request the policy refuses now gets that refusal (RESOURCE_EXHAUSTED with its retry hint).
- A request that has tokens is continued, by the rule the simulator follows too (services/core/continuation.py):
  the policy places, as admitted before, a new request with the same id whose prompt is the original prompt plus
  every token the router received for it, `max_tokens` (and a sim node's output length) less them, the same
  sampling parameters and tier, arriving now. Its tokens go on the same
  client stream after the ones already there, so the client sees one longer gap; usage still reports the original
  prompt and every completion token. Greedy decoding gives exactly the uninterrupted run's tokens (a model's next
  token depends only on the sequence so far); seeded sampling restarts its generator at the seam (vLLM seeds per
  request), so it continues with valid samples but not the uninterrupted run's. An engine matches stop strings in
  its own output only: the router names the seam (`servicer.seam_metadata`) and the worker ends the stream at a
  stop string that spans it (services/rpc/seam_stop.py), where the uninterrupted run would have stopped.
- At most `policies.max_continuations` continuations per request (0: none). Past the bound, or when the policy
  refuses the continuation (an overloaded node), the stream ends UNAVAILABLE with a retry hint.
- Its entries in the prefix index are dropped (its cache died with it).
Counted in `octoserve_router_failovers_total{outcome=rerouted|lost|refused}` (requests without tokens, and every
stream that ended UNAVAILABLE after tokens) and `octoserve_router_continuations_total{cause, outcome}` with cause
crash (the token session broke, an RPC failed UNAVAILABLE), hang (router/watchdog.py), kv_transfer (the decode
worker could not take the hand-off's KV) or drain (the worker closed its stream itself, or a live migration's
hand-off failed; decode_worker ends its sessions that way when a drain's grace runs out), and outcome continued,
refused (by the policy) or bound (past max_continuations).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from octoserve.services.core.continuation import continuation_spec, may_continue
from octoserve.services.rpc import status as rpc_status
from octoserve.services.rpc.gen import worker_pb2 as w_pb

log = logging.getLogger("octoserve.router.failover")

MAX_REROUTES = 3
ABORT_TIMEOUT_S = 2.0
CAUSES = ("crash", "hang", "kv_transfer", "drain")
# Causes where the instance answered and stays routable: only the request's hand-off failed there.
_INSTANCE_LIVES = frozenset({"kv_transfer", "drain"})
_REROUTED_ENOUGH = f"the request was already placed again {MAX_REROUTES} times"


class WorkerLost(Exception):
    """An RPC to a worker failed UNAVAILABLE: the worker is gone (or draining), or it could not take a KV transfer;
    the request may move. `cause`: one of CAUSES."""

    def __init__(self, instance_id: str, reason: str, cause: str = "crash") -> None:
        super().__init__(reason)
        self.instance_id = instance_id
        self.reason = reason
        self.cause = cause


class Failover:
    def __init__(self, servicer) -> None:
        self.s = servicer
        self.metrics = servicer.metrics

    async def call(self, instance_id: str, rpc):
        """Awaits a worker RPC; UNAVAILABLE becomes `WorkerLost` so the dispatch can place the request again."""
        try:
            return await rpc
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                transfer = any(k == rpc_status.KV_TRANSFER_FAILED_KEY for k, _ in e.trailing_metadata() or ())
                raise WorkerLost(instance_id, f"{instance_id} unavailable: {e.details() or 'connection lost'}",
                                 "kv_transfer" if transfer else "crash") from None
            raise

    def lost_status(self, reason: str, why: str = "the request had already streamed tokens, so it was not moved"
                    ) -> rpc_status.RpcStatus:
        """UNAVAILABLE with a retry hint: the node still serves the model on its other instances."""
        hint_ms = int(round(self.s.config.policies.min_retry_after_ms * self.s.settings.time_scale))
        message = f"{reason}; {why}: retry it"
        return rpc_status.RpcStatus(grpc.StatusCode.UNAVAILABLE, message,
                                    rpc_status.retry_trailers(grpc.StatusCode.UNAVAILABLE, message, hint_ms))

    def worker_down(self, instance_id: str, reason: str, cause: str = "crash") -> None:
        """The worker's token session broke (or it hung): move, continue or end every request placed on it."""
        client = self.s.pool.clients.get(instance_id)
        if client is not None:
            client.mark_down()
        self.forget_cache(instance_id)
        for st in list(self.s.requests.values()):
            if instance_id not in st.instance_ids or st.closed or st.ending:
                continue
            if st.dispatch is not None and not st.dispatch.done():
                continue  # its dispatch is mid-RPC: that RPC fails too, and the dispatch moves the request
            if not st.streamed and st.rerouted >= MAX_REROUTES:
                self._lose(st, reason, _REROUTED_ENOUGH)
            else:
                st.dispatch = asyncio.create_task(self.move(st, instance_id, reason, cause))

    async def move(self, st, instance_id: str, reason: str, cause: str = "crash") -> None:
        """Places (or continues) a request whose worker was lost, then dispatches it there."""
        route = await self.replace_route(st, instance_id, reason, cause)
        if route is not None:
            await self.s._dispatch(st, route, remaining_s(st))

    def forget_cache(self, instance_id: str) -> None:
        """A lost worker's prefix cache died with it (no BlockRemoved will come): stop steering prompts there."""
        self.s.policy.prefix_index.remove_instance(instance_id)

    def _lose(self, st, reason: str, *why: str) -> None:
        self.metrics.failovers.labels("lost").inc()
        st.fail(self.lost_status(reason, *why))

    def _may_continue(self, st, cause: str, reason: str) -> bool:
        """A streamed request: within the bound it may be continued; past it, it ends here."""
        bound = self.s.config.policies.max_continuations
        if may_continue(len(st.continued), bound):
            return True
        self.metrics.continuation(cause, "bound")
        if bound == 0:
            self._lose(st, reason, "the request had already streamed tokens and this node does not continue streams "
                       "(policies.max_continuations is 0)")
        else:
            self._lose(st, reason, f"the request had already streamed tokens and was continued {len(st.continued)} "
                       f"time(s), the most policies.max_continuations allows")
        return False

    async def replace_route(self, st, lost_id: str, reason: str, cause: str = "crash"):
        """A new placement for a request whose worker was lost (a continuation when it had streamed tokens), or
        None (then the request has failed)."""
        if st.closed or st.ending:
            return None
        continuing = st.streamed
        if continuing and not self._may_continue(st, cause, reason):
            return None
        if not continuing and st.rerouted >= MAX_REROUTES:
            self._lose(st, reason, _REROUTED_ENOUGH)
            return None
        request_id = st.spec.request_id
        instance_lives = cause in _INSTANCE_LIVES
        if not instance_lives:
            self.forget_cache(lost_id)
        survivors = [i for i in st.instance_ids if i != lost_id and self.s.pool[i].reachable]
        st.instance_ids = ()
        self.s.policy.on_finished(request_id)
        await asyncio.gather(
            *(self.s.pool[i].stub.Abort(w_pb.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S)
              for i in survivors),
            return_exceptions=True,
        )
        if st.closed or st.ending:  # the client left (or the stream ended) while the old placement was being freed
            return None
        loads = dict(self.s.pool.loads())
        if lost_id in loads and not instance_lives:
            loads[lost_id] = dataclasses.replace(loads[lost_id], healthy=False)
        now = time.monotonic() / self.s.settings.time_scale
        spec = continuation_spec(st.spec, st.received_ids(), now) if continuing else st.worker_spec
        decision = self.s.policy.route(spec, loads, now, admitted=True)
        if not hasattr(decision, "instance_id"):
            if continuing:
                self.metrics.continuation(cause, "refused")
                self._lose(st, reason, f"the request had already streamed tokens, and continuing it on another "
                           f"instance was refused ({decision.error.message})")
            else:
                error = self.s._wall_clock_error(decision.error)
                st.fail(rpc_status.status_for(error))
                self.metrics.failovers.labels("refused").inc()
            return None
        if continuing:
            st.continue_as(spec, cause)
            self.metrics.continuation(cause, "continued")
        else:
            st.rerouted += 1
            self.metrics.failovers.labels("rerouted").inc()
        st.instance_ids = (decision.instance_id,) + ((decision.decode_instance_id,) if decision.decode_instance_id else ())
        st.served_by.extend(st.instance_ids)
        self.s.policy.on_dispatched(request_id, decision, spec)
        log.info("request continued on another worker" if continuing else "request moved off a lost worker",
                 extra={"fields": {"request_id": request_id, "lost": lost_id, "to": list(st.instance_ids),
                                   "reason": reason, "cause": cause, "tokens_streamed": st.output_base}})
        return decision


def remaining_s(st) -> float | None:
    """What is left of the client's deadline for a request's next worker RPC (None: no deadline)."""
    if st.timeout_s is None:
        return None
    return max(0.0, st.timeout_s - (time.monotonic() - st.wall_start_s))
