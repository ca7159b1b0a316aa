"""How often the router asks a worker for its load (router/pool.py `load_interval_ms`): every 10 ms of the modelled
clock, so a node dilated K times hears from each worker as often per modelled step as an undilated one, and at most
every 250 ms of wall (a dozen reports inside the hang watchdog's 3 s). Checked on the function and over real gRPC
on 127.0.0.1: the interval a WorkerClient puts in its WatchLoad request is the one the worker receives."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from octoserve.router.pool import LOAD_INTERVAL_MS, MAX_LOAD_INTERVAL_WALL_MS, REPORTS_PER_HANG_LIMIT, WorkerClient, \
    WorkerEndpoint, load_interval_ms
from octoserve.router.watchdog import DEFAULT_HUNG_AFTER_S
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc


def test_the_interval_is_ten_modelled_ms_capped_in_wall_time():
    assert LOAD_INTERVAL_MS == 10 and MAX_LOAD_INTERVAL_WALL_MS == 250
    assert [load_interval_ms(k) for k in (1.0, 2.5, 10.0, 20.0, 25.0, 100.0)] == [10, 25, 100, 200, 250, 250]
    assert load_interval_ms(0.01) == 1  # a clock run faster than real time: the worker's own floor applies
    assert MAX_LOAD_INTERVAL_WALL_MS * REPORTS_PER_HANG_LIMIT <= DEFAULT_HUNG_AFTER_S * 1000


def test_a_tighter_hang_limit_shortens_the_wall_cap():
    """A dozen reports inside whatever silence limit the router's watchdog is given (`--hung-after-s`)."""
    assert REPORTS_PER_HANG_LIMIT == 12
    assert load_interval_ms(20.0, DEFAULT_HUNG_AFTER_S) == load_interval_ms(20.0) == 200
    assert [load_interval_ms(k, 1.2) for k in (1.0, 10.0, 20.0, 100.0)] == [10, 100, 100, 100]
    assert load_interval_ms(100.0, 60.0) == MAX_LOAD_INTERVAL_WALL_MS  # a looser limit keeps the wall cap
    assert load_interval_ms(10.0, 0.006) == 1  # the worker's own floor
    with pytest.raises(ValueError, match="hung_after_s must be > 0 seconds, got 0.0"):
        load_interval_ms(10.0, 0.0)


@pytest.mark.parametrize("bad", [0.0, -1.0, float("nan")])
def test_a_time_scale_that_is_not_positive_is_refused(bad):
    with pytest.raises(ValueError, match="time_scale must be > 0"):
        load_interval_ms(bad)


class _Worker(w_grpc.WorkerServicer):
    """Records the interval of each WatchLoad request and sends one report."""

    def __init__(self) -> None:
        self.intervals: list[int] = []
        self.asked = asyncio.Event()

    async def WatchLoad(self, request, context):
        self.intervals.append(request.interval_ms)
        self.asked.set()
        yield w_pb.LoadReport(seq=1)
        await asyncio.Event().wait()


@pytest.mark.asyncio(loop_scope="function")
async def test_the_worker_receives_the_interval_the_client_was_given():
    worker = _Worker()
    server = grpc.aio.server()
    w_grpc.add_WorkerServicer_to_server(worker, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    client = WorkerClient(WorkerEndpoint("p0", f"127.0.0.1:{port}", False), "router-session", lambda d: None,
                          lambda iid, reason, cause: None, lambda iid, events: None,
                          load_interval_ms=load_interval_ms(10.0))
    try:
        client.start()
        await asyncio.wait_for(worker.asked.wait(), 10)
        assert worker.intervals == [100]
    finally:
        await client.close()
        await server.stop(None)
