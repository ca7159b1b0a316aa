"""A worker whose process lives but makes no progress (SIGSTOP), on the node as separate processes on 127.0.0.1.

What each test holds the node to:
- the router's watchdog declares the silent worker hung (its log says so, and the access log gives the streams it
  continued the cause `hang`, not a broken connection) and routes around it: requests sent afterwards are all served
  elsewhere, none moved;
- a stream that had tokens on it is continued on the other replica and completes with exactly the uninterrupted
  greedy tokens (router/failover.py);
- a request that had no token on it is moved and served in full, exactly max_tokens tokens: none is repeated, even
  when the stopped worker resumes and finishes its old copy (its late tokens are dropped, and the router aborts
  the copy there, so every KV block comes back free);
- the supervisor kills the stopped process (a "hung" event) and restarts it, and it serves again;
- a worker whose engine loop is stuck (injected; the process and its load reports carry on) exits by its own
  progress check, its streams are continued as on a crash, and it is restarted.
Nothing here asserts a duration.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import grpc
import pytest

from octoserve.services.core.sim_executor import sim_token_id
from octoserve.services.node.launcher import start_node
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from tests.fault_fixtures import until, Stream, access_log, load, prompt, router_log, two_replica_config, wait_all_free
from tests.service_fixtures import COLOCATED_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="function")]

# The limits apply to every worker, the healthy c1 too: each is several times what a loaded machine may keep a
# healthy worker quiet (1 s once declared a healthy worker hung or stalled). The router's watchdog (3 s, its default)
# must find the stopped c0 well before the supervisor's hang check kills it (15 s here), or its streams would end as
# on a crash rather than by the watchdog.
ROUTER_HUNG_AFTER_S = 3.0
SUPERVISOR_HUNG_AFTER_S = 15.0
STALL_AFTER_S = 5.0
ROUTER_ARGS = ("--access-log", "all", "--hung-after-s", str(ROUTER_HUNG_AFTER_S))
CONTINUED = "request continued on another worker"


def _start(tmp_path):
    node = start_node(two_replica_config(), time_scale=3.0, run_dir=tmp_path, startup_timeout_s=90, grace_s=3,
                      router_args=ROUTER_ARGS, supervise=True)
    node.supervisor.hang_watch.hung_after_s = SUPERVISOR_HUNG_AFTER_S
    return node


async def _load_c0_then_stop(node, stub):
    """8 long streams with tokens, then 4 long prompts still prefilling on c0; then c0 is SIGSTOPped."""
    streaming = [Stream(gen_pb.GenerateRequest(model=COLOCATED_MODEL, token_ids=prompt(64, i), max_tokens=400,
                                               ignore_eos=True)) for i in range(8)]
    tasks = [asyncio.create_task(s.run(stub)) for s in streaming]
    for s in streaming:
        await asyncio.wait_for(s.first_token.wait(), 60)
    assert all(s.code is None for s in streaming), [s.details for s in streaming]
    waiting = [Stream(gen_pb.GenerateRequest(model=COLOCATED_MODEL, token_ids=prompt(1500, 100 + i), max_tokens=16,
                                             ignore_eos=True, priority=gen_pb.BATCH)) for i in range(4)]
    tasks += [asyncio.create_task(s.run(stub)) for s in waiting]

    async def c0_is_prefilling():
        l = await load(node.workers["c0"].address)
        return l.queued_prefill_tokens > 0 or l.num_waiting > 0
    await until(c0_is_prefilling, 30, "c0 has a prompt in prefill")
    no_token_at_stop = [s for s in waiting if not s.tokens]
    os.kill(node.workers["c0"].pid, signal.SIGSTOP)
    return streaming, waiting, no_token_at_stop, tasks


def _greedy(s: Stream) -> list[int]:
    """The sim engine's uninterrupted output for the stream's prompt, as long as it asked for."""
    ids = list(s.request.token_ids.ids)
    return [sim_token_id(len(ids), ids[0], p) for p in range(s.request.max_tokens)]


async def _routed_around(node, stub) -> list[Stream]:
    """Once the router declared c0 hung (it continued a stream that was on it), new requests are all served, and not
    on c0."""
    async def a_stream_continued():
        return any(e.get("msg") == CONTINUED for e in router_log(node))
    await until(a_stream_continued, 30, "a stream on the stopped c0 is continued")
    after = [Stream(gen_pb.GenerateRequest(model=COLOCATED_MODEL, token_ids=prompt(32, 200 + i), max_tokens=4,
                                           ignore_eos=True, priority=gen_pb.BATCH)) for i in range(6)]
    await asyncio.gather(*(s.run(stub) for s in after))
    return after


def _check_outcomes(node, streaming, waiting, no_token_at_stop, after) -> list[Stream]:
    log = access_log(node, wait_for=[*streaming, *waiting, *after])
    on_c0 = [s for s in streaming if log[s.request_id]["instances"][0] == "c0"]
    assert on_c0, "no stream was on c0"
    for s in streaming:
        assert (s.code, s.tokens) == (grpc.StatusCode.OK, _greedy(s)), (s.code, s.details, len(s.tokens))
        line = log[s.request_id]
        if s in on_c0:  # continued by the watchdog's verdict, not a broken connection
            assert (line["instances"], line["continued_causes"]) == (["c0", "c1"], ["hang"]), line
        else:
            assert line["instances"] == ["c1"] and "continued" not in line, line
    assert [(s.code, len(s.tokens)) for s in waiting] == [(grpc.StatusCode.OK, 16)] * 4, \
        [(s.code, s.details, len(s.tokens)) for s in waiting]
    moved = [s for s in no_token_at_stop if log[s.request_id].get("rerouted")]
    assert moved, "no request without tokens was on c0 when it stopped"
    for s in moved:
        assert log[s.request_id]["instances"] == ["c0", "c1"]
    assert [(s.code, len(s.tokens)) for s in after] == [(grpc.StatusCode.OK, 4)] * 6
    assert all(log[s.request_id]["instances"] == ["c1"] and "rerouted" not in log[s.request_id] for s in after)
    hung = [e for e in router_log(node) if e.get("msg") == "worker hung: routing around it"]
    assert [e["instance"] for e in hung] == ["c0"], hung
    return moved


_probe_salt = iter(range(300, 10_000))


async def _served_by_c0(node, stub) -> bool:
    """A fresh prompt each time (a repeated one would follow its cached prefix to the other replica)."""
    s = Stream(gen_pb.GenerateRequest(model=COLOCATED_MODEL, token_ids=prompt(32, next(_probe_salt)), max_tokens=2,
                                      ignore_eos=True))
    await s.run(stub)
    return s.code == grpc.StatusCode.OK and access_log(node, wait_for=[s])[s.request_id]["instances"] == ["c0"]


async def test_stopped_worker_is_routed_around_then_killed_and_restarted(tmp_path):
    node = _start(tmp_path)
    try:
        old_pid = node.workers["c0"].pid
        async with grpc.aio.insecure_channel(node.router_address) as channel:
            stub = gen_grpc.GenerationStub(channel)
            streaming, waiting, no_token_at_stop, tasks = await _load_c0_then_stop(node, stub)
            after = await _routed_around(node, stub)
            await asyncio.gather(*tasks)
            _check_outcomes(node, streaming, waiting, no_token_at_stop, after)

            # The supervisor's hang check kills the stopped process and restarts it; the router routes to it again.
            node.supervisor.wait_for("worker:c0", "ready", timeout_s=60)
            events = [(e.event, e.detail) for e in node.supervisor.events if e.service == "worker:c0"]
            assert [e for e, _ in events] == ["hung", "exited", "restarting", "ready"], events
            assert events[0][1].startswith(f"pid {old_pid}: process stopped for ")
            assert events[1][1] == f"exit code {-signal.SIGKILL}"
            assert node.workers["c0"].pid != old_pid
            await until(lambda: _served_by_c0(node, stub), 60, "a request is served by the restarted c0")
            await wait_all_free(node)
        assert node.supervisor.restarts("worker:c0") == 1
    finally:
        node.stop()


async def test_stopped_worker_that_resumes_repeats_no_token_and_frees_its_copies(tmp_path):
    node = _start(tmp_path)
    node.supervisor.hang_watch.hung_after_s = 3600.0  # the router alone: the supervisor does not kill it here
    try:
        pid = node.workers["c0"].pid
        async with grpc.aio.insecure_channel(node.router_address) as channel:
            stub = gen_grpc.GenerationStub(channel)
            streaming, waiting, no_token_at_stop, tasks = await _load_c0_then_stop(node, stub)
            after = await _routed_around(node, stub)
            os.kill(pid, signal.SIGCONT)  # c0 resumes with its copies of the moved requests
            await asyncio.gather(*tasks)
            moved = _check_outcomes(node, streaming, waiting, no_token_at_stop, after)

            # The router aborts its copies on c0 as soon as it reports again, and routes to it (not restarted).
            async def copies_aborted():
                return any(e.get("msg") == "requests moved off a hung worker aborted there" for e in router_log(node))
            await until(copies_aborted, 30, "the router aborts the moved requests on c0")
            aborted = [e for e in router_log(node) if e.get("msg") == "requests moved off a hung worker aborted there"]
            on_c0 = [s for s in streaming if access_log(node)[s.request_id]["instances"][0] == "c0"]
            assert [(e["instance"], e["requests"], e["failed"]) for e in aborted] == \
                [("c0", len(on_c0) + len(moved), 0)]
            await until(lambda: _served_by_c0(node, stub), 60, "a request is served by the resumed c0")
            await wait_all_free(node)
        assert node.workers["c0"].pid == pid and node.supervisor.restarts("worker:c0") == 0
        assert [e.event for e in node.supervisor.events if e.service == "worker:c0"] == []
    finally:
        node.stop()


async def test_stuck_engine_loop_exits_its_worker_which_is_restarted(tmp_path):
    """The engine's step loop stops (injected) while the process, its gRPC server and its load reports carry on:
    the worker's own progress check exits it, its requests fail over as on a crash, and it is restarted."""
    node = start_node(two_replica_config(), time_scale=3.0, run_dir=tmp_path, startup_timeout_s=90, grace_s=3,
                      router_args=("--access-log", "all"), supervise=True,
                      extra_env={"OCTOSERVE_FAULTS": "engine_stall=c0@150"},
                      worker_args=("--stall-after-s", str(STALL_AFTER_S)))
    try:
        old_pid = node.workers["c0"].pid
        async with grpc.aio.insecure_channel(node.router_address) as channel:
            stub = gen_grpc.GenerationStub(channel)
            streaming = [Stream(gen_pb.GenerateRequest(model=COLOCATED_MODEL, token_ids=prompt(64, i), max_tokens=400,
                                                       ignore_eos=True)) for i in range(8)]
            await asyncio.gather(*(s.run(stub) for s in streaming))
            log = access_log(node, wait_for=streaming)
            on_c0 = [s for s in streaming if log[s.request_id]["instances"][0] == "c0"]
            assert on_c0, "no stream was on c0"
            for s in streaming:  # the ones on c0 continued on c1 once it exited: the uninterrupted tokens
                assert (s.code, s.tokens) == (grpc.StatusCode.OK, _greedy(s)), (s.code, s.details, len(s.tokens))
                if s in on_c0:
                    line = log[s.request_id]
                    assert (line["instances"], line["continued_causes"]) == (["c0", "c1"], ["crash"]), line
            node.supervisor.wait_for("worker:c0", "ready", timeout_s=60)
            events = [(e.event, e.detail) for e in node.supervisor.events if e.service == "worker:c0"]
            assert events[:3] == [("exited", "exit code 70"), ("restarting", f"port {node.workers['c0'].port}, "
                                                                              "restart 1 in a row"),
                                  ("ready", f"pid {node.workers['c0'].pid} port {node.workers['c0'].port}")], events
            stalled = [json.loads(line) for line in node.workers["c0"].log_file.read_text().splitlines()
                       if "engine made no step" in line]
            assert [(e["steps"], e["exit_code"]) for e in stalled] == [(150, 70)], stalled
            assert stalled[0]["running"] == len(on_c0)
            assert node.workers["c0"].pid != old_pid
            await until(lambda: _served_by_c0(node, stub), 60, "a request is served by the restarted c0")
            await wait_all_free(node)
    finally:
        node.stop()
