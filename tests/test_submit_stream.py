"""The Submit stream (services/rpc/submit.py) over real gRPC on 127.0.0.1: a router's colocated requests start as
messages on one open stream per worker, and each gets exactly what a unary Generate call would have given it.

- results: started (OK), the worker's abort with its trailers (a `-bin` one included), a servicer bug as INTERNAL,
  and the call metadata passed through to Generate; answers out of order reach their own requests;
- a worker that dies with requests waiting: each fails UNAVAILABLE (the router then places it elsewhere), and the
  next request opens a new stream to the restarted worker;
- a worker without the method (an older build): the router falls back to unary Generate calls.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from octoserve.services.rpc import submit
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc
from octoserve.services.rpc.hardening import add_servicer
from octoserve.services.rpc.submit import SubmitStream

pytestmark = pytest.mark.asyncio(loop_scope="function")

SERVICE = w_pb.DESCRIPTOR.services_by_name["Worker"]


class _Worker(w_grpc.WorkerServicer):
    """Generate's behaviour is picked by the request id; `calls` records (request id, metadata) of each call."""

    def __init__(self, with_submit: bool = True) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.release: dict[str, asyncio.Event] = {}
        self.entered = asyncio.Event()
        self.with_submit = with_submit

    async def Generate(self, request, context):
        rid = request.spec.request_id
        self.calls.append((rid, tuple(context.invocation_metadata() or ())))
        if rid in self.release:
            self.entered.set()
            await self.release[rid].wait()
        if rid.startswith("full"):
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "no KV left; retry after 50 ms",
                                trailing_metadata=(("retry-after-ms", "50"), ("x-detail-bin", b"\x00\xff")))
        if rid.startswith("bug"):
            raise ZeroDivisionError("division by zero")
        return w_pb.SubmitReply()

    def Submit(self, request_iterator, context):
        return submit.serve_submit(self.Generate, request_iterator, context)


async def _serve(worker: _Worker, port: int = 0):
    server = grpc.aio.server()
    if worker.with_submit:
        add_servicer(worker, SERVICE, server)
    else:  # an older worker: Generate only, Submit answers UNIMPLEMENTED
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE.full_name, {
            "Generate": grpc.unary_unary_rpc_method_handler(
                worker.Generate, request_deserializer=w_pb.WorkerGenerateRequest.FromString,
                response_serializer=w_pb.SubmitReply.SerializeToString)}),))
    port = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, port


def _request(request_id: str) -> w_pb.WorkerGenerateRequest:
    return w_pb.WorkerGenerateRequest(session_id="s", spec=w_pb.RequestSpec(request_id=request_id, model="m"))


async def test_each_request_gets_what_generate_answers_with_its_metadata_and_out_of_order():
    worker = _Worker()
    worker.release["slow"] = asyncio.Event()
    server, port = await _serve(worker)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream = SubmitStream(w_grpc.WorkerStub(channel), "c0")
    try:
        await stream.submit(_request("ok-1"), (("octoserve-seam-tokens", "3"),), timeout_s=5.0)
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await stream.submit(_request("full-1"), None, timeout_s=5.0)
        assert (full.value.code(), full.value.details()) == (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                             "no KV left; retry after 50 ms")
        assert tuple(full.value.trailing_metadata()) == (("retry-after-ms", "50"), ("x-detail-bin", b"\x00\xff"))
        with pytest.raises(grpc.aio.AioRpcError) as bug:
            await stream.submit(_request("bug-1"), None, timeout_s=5.0)
        assert (bug.value.code(), bug.value.details()) == (grpc.StatusCode.INTERNAL,
                                                           "ZeroDivisionError: division by zero")
        # The first request waits inside Generate while the second is answered: each result reaches its own.
        slow = asyncio.create_task(stream.submit(_request("slow"), None, timeout_s=5.0))
        await asyncio.wait_for(worker.entered.wait(), 5.0)
        await stream.submit(_request("ok-2"), None, timeout_s=5.0)
        assert not slow.done()
        worker.release["slow"].set()
        await asyncio.wait_for(slow, 5.0)
        assert [rid for rid, _ in worker.calls] == ["ok-1", "full-1", "bug-1", "slow", "ok-2"]
        assert worker.calls[0][1] == (("octoserve-seam-tokens", "3"),)
        assert worker.calls[1][1] == ()
        assert not stream.unary  # every request went on the one stream
    finally:
        stream.close()
        await channel.close()
        await server.stop(None)


async def test_a_dead_worker_fails_the_waiting_requests_unavailable_and_a_new_stream_serves_the_next():
    worker = _Worker()
    worker.release["stuck"] = asyncio.Event()  # never set: the worker dies first
    server, port = await _serve(worker)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream = SubmitStream(w_grpc.WorkerStub(channel), "c0")
    try:
        stuck = asyncio.create_task(stream.submit(_request("stuck"), None, timeout_s=10.0))
        await asyncio.wait_for(worker.entered.wait(), 5.0)
        await server.stop(None)  # the process is gone: connections reset
        with pytest.raises(grpc.aio.AioRpcError) as lost:
            await asyncio.wait_for(stuck, 5.0)
        assert lost.value.code() is grpc.StatusCode.UNAVAILABLE
        restarted = _Worker()
        server, _ = await _serve(restarted, port)  # the supervisor's restart, same address
        await stream.submit(_request("after"), None, timeout_s=10.0)
        assert [rid for rid, _ in restarted.calls] == ["after"]
    finally:
        stream.close()
        await channel.close()
        await server.stop(None)


async def test_a_worker_without_submit_gets_unary_generate_calls():
    worker = _Worker(with_submit=False)
    server, port = await _serve(worker)
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    stream = SubmitStream(w_grpc.WorkerStub(channel), "c0")
    try:
        await stream.submit(_request("ok-1"), (("octoserve-seam-tokens", "2"),), timeout_s=5.0)
        assert stream.unary
        with pytest.raises(grpc.aio.AioRpcError) as full:
            await stream.submit(_request("full-1"), None, timeout_s=5.0)
        assert full.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert [rid for rid, _ in worker.calls] == ["ok-1", "full-1"]
        assert ("octoserve-seam-tokens", "2") in worker.calls[0][1]
    finally:
        stream.close()
        await channel.close()
        await server.stop(None)
