"""A router's worker session retired gracefully (router/pool.py `WorkerClient.retire`), over real gRPC on 127.0.0.1.

After a role change or a removal the router retires the instance's old client. The worker ends the old token
stream itself once its drain is over, and the last tokens of requests that finished in the drain can still be on
the way when the placement change reaches the router: a vLLM worker flipped under load lost a request's final
delta that way when the old session was cut at once. Retired gracefully, the session is read to its end, its end
is not taken for a lost worker, and it does not reconnect (a new session to the same worker shares the router's
session id).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from octoserve.router.pool import WorkerClient, WorkerEndpoint
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc
from octoserve.v1 import generate_pb2 as gen_pb

pytestmark = pytest.mark.asyncio(loop_scope="function")


class _Worker(w_grpc.WorkerServicer):
    """Attach confirms the session, then sends one request's last delta when `release` is set, then ends the
    stream (what a worker's SetRole does to its old session after the drain)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.attach_calls = 0

    async def Attach(self, request, context):
        self.attach_calls += 1
        yield w_pb.StepBatch(seq=0)
        await self.release.wait()
        yield w_pb.StepBatch(seq=1, deltas=[w_pb.TokenDelta(request_id="r0", token_ids=[7],
                                                            finish_reason=gen_pb.LENGTH, num_output_tokens=24)])

    async def WatchLoad(self, request, context):
        await asyncio.Event().wait()  # no report: the client's load stream only waits
        yield w_pb.LoadReport()


async def test_a_retired_session_delivers_its_last_tokens_and_neither_goes_down_nor_reconnects():
    worker = _Worker()
    server = grpc.aio.server()
    w_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    deltas, downs = [], []
    client = WorkerClient(WorkerEndpoint("d1", f"127.0.0.1:{port}", True), "router-session", deltas.append,
                          lambda iid, reason, cause: downs.append((iid, reason)), lambda iid, events: None)
    try:
        client.start()
        await asyncio.wait_for(client.attached.wait(), 10)
        client.retire()  # the placement change arrives before the drain's last delta
        worker.release.set()
        # The attach loop returns once the worker ended the stream (no reconnect); the load loop was cancelled.
        results = await asyncio.wait_for(asyncio.gather(*client._tasks, return_exceptions=True), 10)
        assert [type(r) for r in results] == [asyncio.CancelledError, type(None)]
        assert [(d.request_id, list(d.token_ids), d.finish_reason) for d in deltas] == [("r0", [7], gen_pb.LENGTH)]
        assert downs == []
        assert worker.attach_calls == 1
    finally:
        await client.close()
        await server.stop(None)
