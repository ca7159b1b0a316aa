"""A node shutting down, with real processes on 127.0.0.1:

- both fronts agree: once the node drains, a new request is refused by both, HTTP 503 `draining` and gRPC
  UNAVAILABLE, while an HTTP stream already in flight finishes (before: the front inside the router drained its
  own streams first, answering 503 while the router still admitted gRPC; the front as its own process was stopped
  before the router was signalled at all);
- a worker started after the node (by a model change, from the placement keeper's thread) stops in order with the
  others and exits 0 (before: the kernel sent it SIGTERM when the keeper's thread ended, PR_SET_PDEATHSIG being
  per thread, ahead of the router's drain, and it could die of the launcher's second SIGTERM: exit -15).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import grpc
import pytest

from octoserve.services.node import processes
from octoserve.services.node.launcher import start_node
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.server import LAUNCHER_PID_ENV
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from tests.service_fixtures import COLOCATED_MODEL, MAX_CONTEXT, request

TIME_SCALE = 10.0  # the in-flight stream below lasts seconds, so the shutdown is watched while it streams
INSTANCE = {"tp": 1, "max_num_seqs": 16, "max_num_batched_tokens": 512}
OTHER_MODEL = "llama-3-8b-other"


def config(*, other: bool = False) -> dict:
    spec = {"preset": "llama-3-8b", "max_context_len": MAX_CONTEXT}
    models = {COLOCATED_MODEL: spec, **({OTHER_MODEL: spec} if other else {})}
    instances = [{"id": "c0", "model": COLOCATED_MODEL, "role": "colocated", "gpu_ids": [0], **INSTANCE},
                 {"id": "c1", "model": COLOCATED_MODEL, "role": "colocated", "gpu_ids": [1], **INSTANCE}]
    if other:
        instances.append({"id": "y0", "model": OTHER_MODEL, "role": "colocated", "gpu_ids": [2], **INSTANCE})
    return {"gpu": "h100-sxm-80gb", "num_gpus": 4, "models": models, "instances": instances}


def _post(url: str, body: dict, timeout_s: float = 60.0) -> tuple[int, bytes]:
    req = urllib.request.Request(url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def _grpc_code(address: str) -> tuple[grpc.StatusCode, str]:
    with grpc.insecure_channel(address) as ch:
        try:
            for _ in gen_grpc.GenerationStub(ch).Generate(request(max_tokens=2), timeout=30):
                pass
            return grpc.StatusCode.OK, ""
        except grpc.RpcError as e:
            return e.code(), e.details()


def test_the_front_answers_the_routers_draining_status_as_its_own_draining():
    from octoserve.http_front import protocol
    from octoserve.services.core.errors import Draining

    assert protocol.ROUTER_DRAINING == Draining().message
    mapped = protocol.error_for_status(grpc.StatusCode.UNAVAILABLE, Draining().message)
    assert (mapped.status, mapped.message, mapped.code) == (503, DRAINING_HTTP["error"]["message"], "draining")


SHORT = {"model": COLOCATED_MODEL, "prompt": [100 + i for i in range(32)], "max_tokens": 2}
DRAINING_HTTP = {"error": {"message": "the node is draining (shutting down) and accepts no new requests; retry on "
                                      "another node", "type": "unavailable_error", "param": None, "code": "draining"}}
DRAINING_GRPC = (grpc.StatusCode.UNAVAILABLE, "the server is draining and takes no new requests; retry on another "
                                              "replica")


@pytest.mark.slow
@pytest.mark.parametrize("inside", [True, False], ids=["front-inside-router", "front-own-process"])
def test_both_fronts_refuse_from_the_same_moment_while_an_http_stream_finishes(tmp_path, inside):
    node = start_node(config(), time_scale=TIME_SCALE, run_dir=tmp_path, startup_timeout_s=90, grace_s=40,
                      http_port=0, http_inside=inside)
    stopper = None
    try:
        assert _post(node.http_url, SHORT)[0] == 200 and _grpc_code(node.router_address)[0] == grpc.StatusCode.OK
        long_reply: dict = {}
        long_body = {**SHORT, "max_tokens": 300, "ignore_eos": True}
        streaming = threading.Thread(target=lambda: long_reply.update(zip(("status", "body"),
                                                                            _post(node.http_url, long_body, 120))))
        streaming.start()
        time.sleep(1.0)  # the long request is admitted and streaming (it runs for seconds at this time scale)
        assert streaming.is_alive()
        stopper = threading.Thread(target=node.stop)  # SIGTERM to the router (and the front's own process)
        stopper.start()
        deadline = time.monotonic() + 20
        while True:  # the first moment HTTP refuses ...
            status, body = _post(node.http_url, SHORT)
            if status == 503:
                break
            assert status == 200 and time.monotonic() < deadline, (status, body)
            time.sleep(0.05)
        assert json.loads(body) == DRAINING_HTTP
        assert streaming.is_alive()  # the in-flight stream still runs: the node is draining, not stopped
        assert _grpc_code(node.router_address) == DRAINING_GRPC  # ... gRPC refuses too, the same way
        streaming.join(120)
        assert long_reply["status"] == 200
        assert json.loads(long_reply["body"])["usage"]["completion_tokens"] == 300
        stopper.join(120)
        assert node.exit_codes == {"http_front": 0, "router": 0, "worker:c0": 0, "worker:c1": 0, "scheduler": 0}
    finally:
        if stopper is None:
            node.stop()
        else:
            stopper.join(120)


CHILD = ("import sys, time; from octoserve.services.rpc.server import stop_with_launcher; stop_with_launcher(); "
         "print('up', flush=True); time.sleep(30)")


def test_a_process_started_from_a_thread_outlives_that_thread(tmp_path):
    """The cause of the -15: a service asks for SIGTERM when its launcher dies (PR_SET_PDEATHSIG), which Linux
    sends when the thread that started it ends. The launcher starts every process from one thread that lives as
    long as it does."""
    env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid()),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(processes.REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    started: list[subprocess.Popen] = []
    t = threading.Thread(target=lambda: started.append(
        processes.popen((sys.executable, "-c", CHILD), tmp_path / "child.log", env)))
    t.start()
    t.join(30)
    (proc,) = started
    try:
        deadline = time.monotonic() + 30
        while "up" not in (tmp_path / "child.log").read_text():  # it asked for the signal
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "child.log").read_text()
            time.sleep(0.05)
        time.sleep(1.0)  # a SIGTERM from the ended thread would have arrived
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)
    assert proc.returncode == -9  # killed by us, not by a SIGTERM (-15)


@pytest.mark.slow
def test_a_worker_started_by_a_model_change_stops_in_order_and_exits_0(tmp_path):
    node = start_node(config(other=True), time_scale=3.0, run_dir=tmp_path, startup_timeout_s=90, grace_s=5)
    try:
        with grpc.insecure_channel(node.scheduler.address) as ch:
            reply = s_grpc.SchedulerStub(ch).Reconfigure(s_pb.ReconfigureRequest(model_change=s_pb.ModelChange(
                retire=["c1"], model=OTHER_MODEL, role=w_pb.COLOCATED, tensor_parallel=1)), timeout=120)
        (new_id,) = reply.started
        deadline = time.monotonic() + 30
        while "c1" in node.workers or new_id not in node.workers:  # the keeper stopped c1 and started the new one
            assert time.monotonic() < deadline
            time.sleep(0.05)
        new = node.workers[new_id]
        node.keeper.stop()  # what Node.stop() does first: the keeper's thread ends
        time.sleep(2.0)  # the worker drains and exits within this if the thread's end signalled it
        assert new.proc.poll() is None, "the new worker was stopped when the keeper's thread ended"
    finally:
        codes = node.stop()
    assert codes == {"router": 0, "worker:c0": 0, f"worker:{new_id}": 0, "worker:y0": 0, "scheduler": 0}
