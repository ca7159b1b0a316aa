"""A killed worker is restarted on its port, and on another one when its port was taken meanwhile (real processes on
127.0.0.1, the supervisor on).

- Killed with streams open (its side of those connections left in TIME_WAIT), it comes back on the same port.
- Killed while another process takes its port, it serves on a free port instead, registers that address with the
  scheduler, the supervisor records the new port, and the router follows it there: requests reach it again.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time

import grpc
import pytest

from octoserve.services.node.launcher import start_node
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from tests.fault_fixtures import until, Stream, access_log, prompt, two_replica_config, wait_all_free
from tests.service_fixtures import COLOCATED_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="function")]


_salt = iter(range(1000, 100_000))


async def _served_by(node, stub, instance: str) -> bool:
    s = Stream(gen_pb.GenerateRequest(model=COLOCATED_MODEL, token_ids=prompt(32, next(_salt)), max_tokens=2,
                                      ignore_eos=True))
    await s.run(stub)
    return s.code == grpc.StatusCode.OK and access_log(node, wait_for=[s])[s.request_id]["instances"] == [instance]


def _take_port(port: int, timeout_s: float = 5.0) -> socket.socket:
    """Listens on 127.0.0.1:port as soon as the killed worker's listener is gone (before its restart)."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            s.listen(1)
            return s
        except OSError:
            s.close()
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def _kill_and_take_port(node, c0, port: int) -> socket.socket:
    with node.supervisor.held():
        os.kill(c0.pid, signal.SIGKILL)
        c0.proc.wait(timeout=30)
        return _take_port(port)


async def test_worker_restarts_on_its_port_then_on_a_free_one_when_taken(tmp_path):
    node = start_node(two_replica_config(), time_scale=1.0, run_dir=tmp_path, startup_timeout_s=90, grace_s=3,
                      router_args=("--access-log", "all"), supervise=True)
    try:
        c0 = node.workers["c0"]
        port = c0.port
        async with grpc.aio.insecure_channel(node.router_address) as channel:
            stub = gen_grpc.GenerationStub(channel)
            # 1. Killed with streams open: back on the same port.
            streams = [Stream(gen_pb.GenerateRequest(model=COLOCATED_MODEL, token_ids=prompt(64, i), max_tokens=2000,
                                                     ignore_eos=True)) for i in range(6)]
            tasks = [asyncio.create_task(s.run(stub)) for s in streams]
            for s in streams:
                await asyncio.wait_for(s.first_token.wait(), 60)
            os.kill(c0.pid, signal.SIGKILL)
            await asyncio.gather(*tasks)
            await asyncio.to_thread(node.supervisor.wait_for, "worker:c0", "ready", 1, 60)
            ready = [e.detail for e in node.supervisor.events if e.service == "worker:c0" and e.event == "ready"]
            assert ready == [f"pid {c0.pid} port {port}"]
            await until(lambda: _served_by(node, stub, "c0"), 60, "c0 serves again on its port")

            # 2. Its port taken while it is down: it serves on another one, and the router follows it there. The
            # supervisor is held from the kill until the port is taken, so it cannot restart c0 first, however slow
            # this test's thread is (a 1 s backoff once lost that race on a loaded machine).
            blocker = await asyncio.to_thread(_kill_and_take_port, node, c0, port)
            try:
                await asyncio.to_thread(node.supervisor.wait_for, "worker:c0", "ready", 2, 60)
                ready = [e.detail for e in node.supervisor.events if e.service == "worker:c0" and e.event == "ready"]
                assert c0.port != port
                assert ready[1] == f"pid {c0.pid} port {c0.port} (port {port} was taken)"
                async with grpc.aio.insecure_channel(node.scheduler.address) as sch:
                    async def registered_there():
                        p = await s_grpc.SchedulerStub(sch).GetPlacement(s_pb.GetPlacementRequest(), timeout=5)
                        return {i.instance_id: i.address for i in p.instances}["c0"] == f"127.0.0.1:{c0.port}"
                    await until(registered_there, 30, "the scheduler has c0's new address")
                await until(lambda: _served_by(node, stub, "c0"), 60, "c0 serves again on its new port")
                await wait_all_free(node)
            finally:
                blocker.close()
        warned = [line for line in c0.log_file.read_text().splitlines() if "port taken; serving on a free port" in line]
        assert len(warned) == 1 and f'"wanted": {port}' in warned[0] and f'"port": {c0.port}' in warned[0], warned
        assert node.supervisor.restarts("worker:c0") == 2
    finally:
        node.stop()
