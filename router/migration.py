"""The router's side of a live migration: a draining worker handed one of its running decodes to another instance.

The source ends the request's stream on its session with a marker (`TokenDelta.migration`, after every token it
produced), once the target reserved room for it. The router then does what it does for a disaggregated request's
decode step: `Decode` on the target with the hand-off (the target takes the KV in and decodes on from the last
token, streaming on this router's session there), then `Release` on the source, which frees the KV there. The
request keeps its id and its client stream; the router's record of where it runs moves from the source to the
target, so the source's retirement (its session closes) no longer concerns it.

A hand-off that fails (the target went away mid-transfer, or the router does not know it) is continued as any
other lost stream is (router/failover.py, cause `drain`): prompt plus the tokens already streamed, on an instance
the policy picks; past `policies.max_continuations`, or refused, it ends UNAVAILABLE with a retry hint.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import prometheus_client as prom

from octoserve.services.rpc import convert
from octoserve.services.rpc.gen import worker_pb2 as w_pb

log = logging.getLogger("octoserve.router.migration")

DECODE_TIMEOUT_S = 30.0


def _counter(metrics):
    counter = getattr(metrics, "migrations", None)
    if counter is None:
        counter = prom.Counter("octoserve_router_migrations", "running requests handed from a draining instance to "
                               "another, by outcome (followed: the target decodes on; failed: the request ended "
                               "UNAVAILABLE), count", ["model", "outcome"], registry=metrics.registry)
        metrics.migrations = counter
    return counter


def follow(s, st, delta: w_pb.TokenDelta) -> None:
    """`s`: the GenerationServicer; `st`: the request's RequestState; `delta`: the source's migration marker."""
    target_id, source_id = delta.migration_target, delta.migration.source_instance_id
    source = s.pool.clients.get(source_id)
    target = s.pool.clients.get(target_id)
    if st.closed:
        _release(s, source, st.spec.request_id)
        return
    if target is None:
        _counter(s.metrics).labels(st.spec.model, "failed").inc()
        _release(s, source, st.spec.request_id)
        _continue(s, st, source_id, f"{source_id} handed the request to {target_id}, which this router does not "
                  "know yet")
        return
    st.instance_ids = tuple(i for i in st.instance_ids if i != source_id) + (target_id,)
    st.served_by.append(target_id)
    log.info("request migrated", extra={"fields": {
        "request_id": st.spec.request_id, "from": source_id, "to": target_id,
        "tokens": len(delta.migration.output_token_ids)}})
    task = asyncio.create_task(_hand_over(s, st, delta, source, target))
    s._background.add(task)
    task.add_done_callback(s._background.discard)


async def _hand_over(s, st, delta: w_pb.TokenDelta, source, target) -> None:
    request = w_pb.DecodeRequest(session_id=s.session_id, spec=convert.spec_to_pb(st.worker_spec), handoff=delta.migration,
                                 source_address=source.address if source is not None else "")
    failed = None
    try:
        await target.stub.Decode(request, timeout=DECODE_TIMEOUT_S)
        _counter(s.metrics).labels(st.spec.model, "followed").inc()
    except grpc.aio.AioRpcError as e:
        _counter(s.metrics).labels(st.spec.model, "failed").inc()
        log.warning("migration hand-off failed", extra={"fields": {
            "request_id": st.spec.request_id, "to": target.instance_id, "code": e.code().name, "details": e.details()}})
        failed = f"the hand-off of this running request to {target.instance_id} failed ({e.code().name})"
    finally:
        _release(s, source, st.spec.request_id)
    if failed is not None:
        _continue(s, st, target.instance_id, failed)


def _continue(s, st, lost_id: str, reason: str) -> None:
    """The hand-off failed: continue the request from the tokens it streamed (or end it, past the bound)."""
    if st.dispatch is None or st.dispatch.done():
        st.dispatch = asyncio.create_task(s.failover.move(st, lost_id, reason, "drain"))
    else:  # cannot happen while a migration marker arrives (the dispatch ended with the submission); kept safe
        st.fail(s.failover.lost_status(reason))


def _release(s, source, request_id: str) -> None:
    if source is not None and source.reachable:
        s._spawn(source.stub.Release(w_pb.ReleaseRequest(request_id=request_id), timeout=5.0))
