"""A burst of 1,500 concurrent Generate calls on one channel, through the node as separate processes: every call
ends served or RESOURCE_EXHAUSTED with a retry hint, none CANCELLED (gRPC drops calls it queued past its default
limits with a bare CANCELLED that never reaches the router; services/rpc/server.py raises those limits).

Also the mechanism alone, in-process: a service built by `start_service` with a handler that holds each call for
a while takes 4,000 calls at once on one channel and answers every one (gRPC's defaults cancelled ~35 % of them).
"""

from __future__ import annotations

import asyncio
import collections

import grpc
import pytest

from octoserve.services.node.launcher import start_node
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc
from octoserve.services.rpc.server import ServiceSpec, start_service
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from tests.service_fixtures import COLOCATED_MODEL, NUM_KV_BLOCKS, small_config_dict

PROMPT = " ".join(("the scheduler admits each request against its budget and routes it to a replica " * 20).split()[:200])


async def _burst(address: str, n: int, request: gen_pb.GenerateRequest) -> collections.Counter:
    outcomes: collections.Counter = collections.Counter()

    async def one(stub) -> None:
        received = 0
        try:
            async for response in stub.Generate(request, timeout=300):
                received += len(response.token_ids)
            outcomes["served" if received == request.max_tokens else f"short:{received}"] += 1
        except grpc.aio.AioRpcError as e:
            trailers = dict(e.trailing_metadata() or ())
            hinted = e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and int(trailers.get("retry-after-ms", 0)) > 0
            outcomes[f"{e.code().name}{'+hint' if hinted else ''}{'+tokens' if received else ''}"] += 1

    async with grpc.aio.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        await asyncio.gather(*(one(stub) for _ in range(n)))
    return outcomes


async def _loads_once_idle(node, timeout_s: float = 30.0) -> dict[str, tuple[int, int, int, int]]:
    """Every worker's (free blocks, total blocks, running, waiting), polled until all are idle or `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    channels = {iid: grpc.aio.insecure_channel(sp.address) for iid, sp in node.workers.items()}
    try:
        while True:
            loads = {}
            for iid, channel in channels.items():
                r = await w_grpc.WorkerStub(channel).GetLoad(w_pb.GetLoadRequest(), timeout=5)
                loads[iid] = (r.num_free_blocks, r.num_total_blocks, r.num_running, r.num_waiting)
            if all(free == total and running == waiting == 0 for free, total, running, waiting in loads.values()) \
                    or loop.time() > deadline:
                return loads
            await asyncio.sleep(0.1)
    finally:
        for channel in channels.values():
            await channel.close()


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="function")
async def test_1500_call_burst_is_only_served_or_refused_with_a_hint(tmp_path):
    node = start_node(small_config_dict(), time_scale=1.0, run_dir=tmp_path, startup_timeout_s=60, grace_s=5)
    try:
        request = gen_pb.GenerateRequest(model=COLOCATED_MODEL, text=PROMPT, max_tokens=400, ignore_eos=True)
        outcomes = await _burst(node.router_address, 1500, request)
        loads = await _loads_once_idle(node)
    finally:
        node.stop()
    # After the burst every worker has every KV block back and nothing running or queued.
    assert loads == {inst["id"]: (NUM_KV_BLOCKS, NUM_KV_BLOCKS, 0, 0) for inst in small_config_dict()["instances"]}
    assert sum(outcomes.values()) == 1500
    assert set(outcomes) <= {"served", "RESOURCE_EXHAUSTED+hint"}, outcomes
    assert outcomes["served"] > 0 and outcomes["RESOURCE_EXHAUSTED+hint"] > 0, outcomes


class _HoldThenRefuse(gen_grpc.GenerationServicer):
    async def Generate(self, request, context):
        await asyncio.sleep(0.5)
        await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full", trailing_metadata=(("retry-after-ms", "5"),))
        yield  # pragma: no cover  (a streaming handler)


@pytest.mark.asyncio(loop_scope="function")
async def test_4000_queued_calls_all_reach_the_handler():
    servicer = _HoldThenRefuse()
    spec = ServiceSpec(name="burst", metrics_port=None,
                       add_servicers=lambda server: gen_grpc.add_GenerationServicer_to_server(servicer, server))
    running = await start_service(spec)
    try:
        outcomes = await _burst(running.address, 4000, gen_pb.GenerateRequest(model="m", max_tokens=1))
    finally:
        await running.shutdown()
    assert outcomes == {"RESOURCE_EXHAUSTED+hint": 4000}
