"""What the router does when a worker is lost under its requests (the worker process died, or an RPC to it failed
UNAVAILABLE: gone, or draining).

- The instance is unroutable from the moment its token session or load stream breaks (`WorkerClient.mark_down`),
  until the session is re-established (the launcher restarts the worker on the same port and the pool's loops
  reconnect).
- A request that has no token at the router yet is placed again: the surviving instances of its old placement
  are told to Abort it first (that frees the decode reservation when the prefill worker died, and the held hand-off
  when the decode worker died), then the policy routes it as if it had just arrived, with the lost instance
  excluded. At most `MAX_REROUTES` times; a request the policy refuses now gets that refusal (RESOURCE_EXHAUSTED
  with its retry hint).
- Its entries in the prefix index are dropped (its cache died with it).
- A request that has tokens ends UNAVAILABLE with a retry hint: the client has seen tokens, a replay would repeat
  them, and the SDK never retries after the first token.
Counted in `octoserve_router_failovers_total{outcome=rerouted|lost}`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

import grpc

from octoserve.services.rpc import status as rpc_status
from octoserve.services.rpc.gen import worker_pb2 as w_pb

log = logging.getLogger("octoserve.router.failover")

MAX_REROUTES = 3
ABORT_TIMEOUT_S = 2.0


class WorkerLost(Exception):
    """An RPC to a worker failed UNAVAILABLE: the worker is gone (or draining), the request may move."""

    def __init__(self, instance_id: str, reason: str) -> None:
        super().__init__(reason)
        self.instance_id = instance_id
        self.reason = reason


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
                raise WorkerLost(instance_id, f"{instance_id} unavailable: {e.details() or 'connection lost'}") from None
            raise

    def lost_status(self, reason: str) -> rpc_status.RpcStatus:
        """UNAVAILABLE with a retry hint: the node still serves the model on its other instances."""
        hint_ms = int(round(self.s.config.policies.min_retry_after_ms * self.s.settings.time_scale))
        message = f"{reason}; the request had already streamed tokens, so it was not moved: retry it"
        return rpc_status.RpcStatus(grpc.StatusCode.UNAVAILABLE, message,
                                    rpc_status.retry_trailers(grpc.StatusCode.UNAVAILABLE, message, hint_ms))

    def worker_down(self, instance_id: str, reason: str) -> None:
        """The worker's token session broke: move or end every request placed on it."""
        client = self.s.pool.clients.get(instance_id)
        if client is not None:
            client.mark_down()
        self.forget_cache(instance_id)
        for st in list(self.s.requests.values()):
            if instance_id not in st.instance_ids or st.closed:
                continue
            if st.dispatch is not None and not st.dispatch.done():
                continue  # its dispatch is mid-RPC: that RPC fails too, and the dispatch moves the request
            if st.streamed or st.rerouted >= MAX_REROUTES:
                self._lose(st, reason)
            else:
                st.dispatch = asyncio.create_task(self._move(st, instance_id, reason))

    async def _move(self, st, instance_id: str, reason: str) -> None:
        route = await self.replace_route(st, instance_id, reason)
        if route is not None:
            await self.s._dispatch(st, route, remaining_s(st))

    def forget_cache(self, instance_id: str) -> None:
        """A lost worker's prefix cache died with it (no BlockRemoved will come): stop steering prompts there."""
        self.s.policy.prefix_index.remove_instance(instance_id)

    def _lose(self, st, reason: str) -> None:
        self.metrics.failovers.labels("lost").inc()
        st.fail(self.lost_status(reason))

    async def replace_route(self, st, lost_id: str, reason: str):
        """A new placement for a request whose worker was lost, or None (then the request has failed)."""
        if st.closed:
            return None
        if st.streamed or st.rerouted >= MAX_REROUTES:
            self._lose(st, reason)
            return None
        request_id = st.spec.request_id
        self.forget_cache(lost_id)
        survivors = [i for i in st.instance_ids if i != lost_id and self.s.pool[i].reachable]
        st.instance_ids = ()
        self.s.policy.on_finished(request_id)
        await asyncio.gather(
            *(self.s.pool[i].stub.Abort(w_pb.AbortRequest(request_id=request_id), timeout=ABORT_TIMEOUT_S)
              for i in survivors),
            return_exceptions=True,
        )
        if st.closed:  # the client left while the old placement was being freed
            return None
        loads = dict(self.s.pool.loads())
        if lost_id in loads:
            loads[lost_id] = dataclasses.replace(loads[lost_id], healthy=False)
        decision = self.s.policy.route(st.spec, loads, time.monotonic() / self.s.settings.time_scale)
        if not hasattr(decision, "instance_id"):
            error = self.s._wall_clock_error(decision.error)
            st.fail(rpc_status.status_for(error))
            self.metrics.failovers.labels("refused").inc()
            return None
        st.rerouted += 1
        st.instance_ids = (decision.instance_id,) + ((decision.decode_instance_id,) if decision.decode_instance_id else ())
        st.served_by.extend(st.instance_ids)
        self.s.policy.on_dispatched(request_id, decision, st.spec)
        self.metrics.failovers.labels("rerouted").inc()
        log.info("request moved off a lost worker", extra={"fields": {
            "request_id": request_id, "lost": lost_id, "to": list(st.instance_ids), "reason": reason}})
        return decision


def remaining_s(st) -> float | None:
    """What is left of the client's deadline for a request's next worker RPC (None: no deadline)."""
    if st.timeout_s is None:
        return None
    return max(0.0, st.timeout_s - (time.monotonic() - st.wall_start_s))
