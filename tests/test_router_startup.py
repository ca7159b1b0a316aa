"""A router that has bound its port but not yet connected to its workers (it has just started, or a supervisor has
restarted it and resumed streams come back at once): a call waits for the workers within its deadline and is then
served, instead of being refused for want of a healthy instance; a call whose deadline passes first gets
DEADLINE_EXCEEDED saying why. Real gRPC on 127.0.0.1, sim-engine workers; the router's placement source is held
back by the test, so "not yet connected" lasts exactly as long as the test says.
"""

from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from octoserve.router.app import router_spec
from octoserve.router.servicer import RouterSettings
from octoserve.services.rpc.server import start_service
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from tests.service_fixtures import collect, request, small_config, start_workers

pytestmark = pytest.mark.asyncio(loop_scope="function")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_calls_before_the_workers_are_connected_wait_for_them_within_their_deadline():
    config = small_config()
    workers, _ = await start_workers(config)
    release = asyncio.Event()

    async def endpoints():  # the placement source answers when the test says
        await release.wait()
        return {iid: running.address for iid, running in workers.items()}

    port = _free_port()
    spec, servicer = router_spec(config, endpoints, settings=RouterSettings(), port=port, metrics_port=None,
                                 grace_s=2.0, startup_timeout_s=20.0)
    starting = asyncio.create_task(start_service(spec))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        await asyncio.wait_for(channel.channel_ready(), 10)  # bound, not connected to any worker
        stub = gen_grpc.GenerationStub(channel)
        waiting = asyncio.create_task(collect(stub.Generate(request(max_tokens=6), timeout=30)))
        with pytest.raises(grpc.aio.AioRpcError) as late:
            await collect(stub.Generate(request(max_tokens=6), timeout=0.5))
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert not servicer.connected.is_set() and not waiting.done()

        release.set()
        router = await asyncio.wait_for(starting, 20)
        responses = await asyncio.wait_for(waiting, 20)
    try:
        assert sum(len(r.token_ids) for r in responses) == 6
        assert responses[-1].usage.completion_tokens == 6
    finally:
        await router.shutdown()
        for running in workers.values():
            await running.shutdown()
