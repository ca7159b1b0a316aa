"""Stream continuation on the node as separate processes on 127.0.0.1 (what `octoserve up` runs, sim engine,
supervisor on): 24 streams of 600 tokens on an 8B served by two replicas, one replica lost mid-stream.

What each probe holds the node to:
- 24 of 24 streams complete, each with exactly the tokens an uninterrupted greedy run gives (no token lost at the
  seam, none repeated) and usage reporting the original prompt and all 600 completion tokens;
- every stream that was on the lost replica was continued once on the other, for the loss's cause (crash for
  SIGKILL, hang for SIGSTOP: the router's watchdog), in the access log and in
  `octoserve_router_continuations_total{cause, outcome="continued"}`; no stream was on it past its loss.
Nothing here asserts a duration.
"""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request

import grpc
import pytest

from octoserve.services.core.sim_executor import sim_token_id
from octoserve.services.node.launcher import start_node
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from tests.fault_fixtures import Stream, access_log, prompt, two_replica_config, until
from tests.service_fixtures import COLOCATED_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="function")]

NUM_STREAMS = 24
PROMPT_TOKENS = 64
MAX_TOKENS = 600
TOKENS_AT_LOSS = 100  # the seam lands well inside every stream
ROUTER_HUNG_AFTER_S = 3.0
SUPERVISOR_HUNG_AFTER_S = 30.0  # the router's watchdog must find a stopped worker long before the supervisor kills it
def _metric(port: int, name: str, labels: dict[str, str]) -> float:
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as http:
        for line in http.read().decode().splitlines():
            if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{{{want}}}")


def _start(tmp_path):
    config = two_replica_config(gpu_memory_utilization=0.5)  # room for all 24 streams on one replica
    node = start_node(config, time_scale=3.0, run_dir=tmp_path, startup_timeout_s=90, grace_s=3,
                      router_args=("--access-log", "all", "--hung-after-s", str(ROUTER_HUNG_AFTER_S)), supervise=True)
    node.supervisor.hang_watch.hung_after_s = SUPERVISOR_HUNG_AFTER_S
    return node


async def _probe(node, sig: int, cause: str) -> None:
    async with grpc.aio.insecure_channel(node.router_address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        streams = [Stream(gen_pb.GenerateRequest(model=COLOCATED_MODEL, token_ids=prompt(PROMPT_TOKENS, i),
                                                   max_tokens=MAX_TOKENS, ignore_eos=True))
                   for i in range(NUM_STREAMS)]
        tasks = [asyncio.create_task(s.run(stub, timeout_s=180.0)) for s in streams]
        await until(lambda: all(len(s.tokens) >= TOKENS_AT_LOSS or s.code is not None for s in streams), 90,
                    f"every stream has {TOKENS_AT_LOSS} tokens")
        assert all(s.code is None for s in streams), [(s.code, s.details) for s in streams]
        os.kill(node.workers["c0"].pid, sig)
        await asyncio.wait_for(asyncio.gather(*tasks), 240)

    log = access_log(node, wait_for=streams)
    for s in streams:
        ids = list(s.request.token_ids.ids)
        expected = [sim_token_id(len(ids), ids[0], p) for p in range(MAX_TOKENS)]
        assert (s.code, s.details) == (grpc.StatusCode.OK, ""), (s.request_id, s.code, s.details, len(s.tokens))
        assert s.tokens == expected, s.request_id
        assert s.usage == (PROMPT_TOKENS, MAX_TOKENS)
        assert (log[s.request_id]["outcome"], log[s.request_id]["tokens_out"]) == ("ok", MAX_TOKENS)
    on_c0 = [s for s in streams if log[s.request_id]["instances"][0] == "c0"]
    assert on_c0, "no stream was on c0"
    for s in streams:
        line = log[s.request_id]
        if s in on_c0:
            assert (line["instances"], line["continued"], line["continued_causes"]) == (["c0", "c1"], 1, [cause])
        else:
            assert line["instances"] == ["c1"] and "continued" not in line
    port = node.router.metrics_port
    assert _metric(port, "octoserve_router_continuations_total", {"cause": cause, "outcome": "continued"}) == len(on_c0)


async def test_24_streams_survive_a_sigkilled_8b_replica(tmp_path):
    node = _start(tmp_path)
    try:
        await _probe(node, signal.SIGKILL, "crash")
        node.supervisor.wait_for("worker:c0", "ready", timeout_s=60)
    finally:
        node.stop()


async def test_24_streams_survive_a_sigstopped_8b_replica(tmp_path):
    node = _start(tmp_path)
    pid = node.workers["c0"].pid
    try:
        await _probe(node, signal.SIGSTOP, "hang")
    finally:
        os.kill(pid, signal.SIGCONT)  # resumed for a clean stop: its late tokens are dropped, its copies aborted
        node.stop()
