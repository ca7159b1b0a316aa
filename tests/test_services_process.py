"""The node as separate processes (`start_node`, what `octoserve up` runs): scheduler placement, health on every
service, end-to-end streaming through real processes, and SIGTERM drain (in-flight stream completes, exit 0).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from octoserve.services.node.launcher import REPO_ROOT, start_node
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
from tests.service_fixtures import COLOCATED_MODEL, DISAGG_MODEL, request, small_config_dict

pytestmark = pytest.mark.slow


@pytest.fixture
def node(tmp_path):
    n = start_node(small_config_dict(), time_scale=1.0, run_dir=tmp_path, startup_timeout_s=60, grace_s=10)
    yield n
    n.stop()  # idempotent: already-stopped processes are only waited for


@pytest.mark.asyncio(loop_scope="function")
async def test_node_serves_both_paths_and_drains_on_sigterm(node):
    async with grpc.aio.insecure_channel(node.router_address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        for model in (COLOCATED_MODEL, DISAGG_MODEL):
            responses = [r async for r in stub.Generate(request(model, max_tokens=10), timeout=20)]
            assert sum(len(r.token_ids) for r in responses) == 10 and responses[-1].finish_reason == gen_pb.LENGTH

        # SIGTERM every process while a 300-token stream (~1.5 s of modelled decode) is in flight.
        call = stub.Generate(request(DISAGG_MODEL, max_tokens=300), timeout=30)
        stream = call.__aiter__()
        received = len((await stream.__anext__()).token_ids)
        stopping = asyncio.get_running_loop().run_in_executor(None, node.stop)
        rest = [r async for r in stream]
        received += sum(len(r.token_ids) for r in rest)
        assert received == 300 and rest[-1].finish_reason == gen_pb.LENGTH
        codes = await stopping
    assert codes == {name: 0 for name in ("router", "worker:c0", "worker:p0", "worker:d0", "scheduler")}
    router_log = [json.loads(line) for line in node.router.log_file.read_text().splitlines() if line.startswith("{")]
    assert [e["msg"] for e in router_log if e["msg"] in ("serving", "draining", "stopped")] == ["serving", "draining", "stopped"]


def test_every_service_is_healthy_and_the_scheduler_has_the_placement(node):
    for sp in node.processes:
        with grpc.insecure_channel(sp.address) as channel:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, sp.name
        with urllib.request.urlopen(f"http://127.0.0.1:{sp.metrics_port}/metrics", timeout=5) as http:
            assert http.status == 200
    with grpc.insecure_channel(node.scheduler.address) as channel:
        placement = s_grpc.SchedulerStub(channel).GetPlacement(s_pb.GetPlacementRequest(), timeout=5)
    assert placement.complete
    assert {p.instance_id: p.address for p in placement.instances} == {
        iid: sp.address for iid, sp in node.workers.items()
    }


def test_octoserve_up_prints_endpoints_and_exits_0_on_sigterm(tmp_path):
    import yaml

    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump(small_config_dict()))
    cmd = [sys.executable, "-m", "octoserve.services.cli", "up", "--config", str(config), "--port", "0",
           "--http-port", "0", "--run-dir", str(tmp_path / "run"), "--grace-s", "5"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        while not any(line.startswith("logs") for line in lines):  # bounded by the launcher's startup timeout
            line = proc.stdout.readline()
            assert line, f"octoserve up exited early: {''.join(lines)}"
            lines.append(line)
        assert lines[0].startswith("router     127.0.0.1:")
        assert lines[1].startswith("http       http://127.0.0.1:")
        proc.terminate()
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert "exit codes: all 0" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_services_stop_when_the_launcher_is_killed(tmp_path):
    """SIGKILL of `octoserve up` leaves no orphaned service: each one is told to drain when its parent dies."""
    import os
    import signal
    import time

    import yaml

    config = tmp_path / "node.yaml"
    config.write_text(yaml.safe_dump(small_config_dict()))
    run_dir = tmp_path / "run"
    cmd = [sys.executable, "-m", "octoserve.services.cli", "up", "--config", str(config), "--port", "0",
           "--http-port", "0", "--run-dir", str(run_dir), "--grace-s", "2"]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids = []
    try:
        lines = []
        while not any(line.startswith("logs") for line in lines):
            line = proc.stdout.readline()
            assert line, f"octoserve up exited early: {''.join(lines)}"
            lines.append(line)
        import json

        pids = [json.loads(p.read_text())["pid"] for p in run_dir.glob("*.ready.json")]
        assert len(pids) >= 4  # scheduler, workers, router, HTTP front
        proc.kill()
        proc.wait()
        deadline = time.monotonic() + 30
        alive = pids
        while alive and time.monotonic() < deadline:
            alive = [pid for pid in alive if _alive(pid)]
            time.sleep(0.2)
        assert alive == [], f"services outlived the launcher: {alive}"
    finally:
        for pid in pids:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False
