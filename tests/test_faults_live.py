"""Faults injected into the node as separate processes on 127.0.0.1 (what `octoserve up` runs), with the
supervisor on: workers SIGKILLed mid-stream, the scheduler and the router killed, KV transfers made slow or corrupt.

What each test holds the node to:
- a request that had no token when its worker died is moved and served in full (no token lost, none repeated);
- a request that had tokens is continued on another instance (router/failover.py) and completes with exactly the
  tokens an uninterrupted greedy run gives (none lost at the seam, none repeated);
- a KV transfer that times out or fails verification is continued (the decode worker lives: it may take the
  continuation's own transfer), not failed;
- the dead instance gets no new request once the router has noticed the loss (the first requests sent after the
  first stream on it ended are all served, none re-routed);
- KV held elsewhere for the lost requests is freed (every surviving worker back to all blocks free);
- the launcher restarts the process on its port and it serves again (requests reach it afterwards).
Nothing here asserts a duration; the router's access log says where each request went.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import grpc
import pytest

from octoserve.services.core.sim_executor import sim_token_id
from octoserve.services.node.launcher import start_node
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from tests.fault_fixtures import (
    until,
    Stream, access_log, disagg_config, load, prompt, router_log, two_replica_config, wait_all_free,
)
from tests.service_fixtures import COLOCATED_MODEL, DISAGG_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="function")]

ROUTER_ARGS = ("--access-log", "all")


@pytest.fixture
def live_node(tmp_path):
    """`start(config, time_scale, **kw)`: the node of a config dict as processes, supervisor on, access log of every
    request; every node it started is stopped at teardown."""
    started = []

    def start(config: dict, time_scale: float, **kw):
        node = start_node(config, time_scale=time_scale, run_dir=tmp_path, startup_timeout_s=90, grace_s=3,
                          router_args=ROUTER_ARGS, supervise=True, **kw)
        started.append(node)
        return node

    yield start
    for node in started:
        node.stop()


@contextlib.asynccontextmanager
async def _generation(node):
    """A Generation stub on the node's router, over a channel closed on exit."""
    async with grpc.aio.insecure_channel(node.router_address) as channel:
        yield gen_grpc.GenerationStub(channel)


def _greedy(s: Stream) -> list[int]:
    """The sim engine's uninterrupted output for the stream's prompt, as long as it asked for."""
    ids = list(s.request.token_ids.ids)
    return [sim_token_id(len(ids), ids[0], p) for p in range(s.request.max_tokens)]


def _continued(node) -> bool:
    return any(e.get("msg") == "request continued on another worker" for e in router_log(node))


def _stream(model: str, prompt_len: int, salt: int, max_tokens: int, **kw) -> Stream:
    """A Generate call of a distinct prompt of `prompt_len` tokens and exactly `max_tokens` output tokens."""
    return Stream(gen_pb.GenerateRequest(model=model, token_ids=prompt(prompt_len, salt), max_tokens=max_tokens,
                                         ignore_eos=True, **kw))


async def _streaming(stub, streams: list[Stream]) -> list[asyncio.Task]:
    """Starts `streams` and returns their tasks once every one has its first token and none has ended."""
    tasks = [asyncio.create_task(s.run(stub)) for s in streams]
    for s in streams:
        await asyncio.wait_for(s.first_token.wait(), 60)
    assert all(s.code is None for s in streams), [s.details for s in streams]
    return tasks


async def test_colocated_worker_killed_mid_stream(live_node):
    node = live_node(two_replica_config(), time_scale=3.0)
    async with _generation(node) as stub:
        # 8 long streams, each with tokens before the kill: about half on c0.
        streaming = [_stream(COLOCATED_MODEL, 64, i, 400) for i in range(8)]
        tasks = await _streaming(stub, streaming)
        # Then long prompts: still prefilling (no token) when c0 dies.
        waiting = [_stream(COLOCATED_MODEL, 1500, 100 + i, 16, priority=gen_pb.BATCH) for i in range(4)]
        tasks += [asyncio.create_task(s.run(stub)) for s in waiting]

        async def c0_is_prefilling():
            l = await load(node.workers["c0"].address)
            return l.queued_prefill_tokens > 0 or l.num_waiting > 0
        await until(c0_is_prefilling, 30, "c0 has a prompt in prefill")
        no_token_at_kill = [s for s in waiting if not s.tokens]
        os.kill(node.workers["c0"].pid, signal.SIGKILL)

        # Once the router has noticed (it continued a stream that was on c0), no new request may be placed there.
        await until(lambda: _continued(node), 30, "a stream on c0 is continued")
        after = [_stream(COLOCATED_MODEL, 32, 200 + i, 4, priority=gen_pb.BATCH) for i in range(6)]
        await asyncio.gather(*(s.run(stub) for s in after))
        await asyncio.gather(*tasks)
        node.supervisor.wait_for("worker:c0", "ready", timeout_s=60)
        log = access_log(node)

        # Streams that had tokens: the ones on c0 were continued on c1; every one has the uninterrupted tokens.
        on_c0 = [s for s in streaming if log[s.request_id]["instances"][0] == "c0"]
        assert on_c0, "no stream was on c0"
        for s in streaming:
            assert (s.code, s.tokens) == (grpc.StatusCode.OK, _greedy(s)), (s.code, s.details, len(s.tokens))
            line = log[s.request_id]
            if s in on_c0:
                assert (line["outcome"], line["instances"], line["continued_causes"]) == ("ok", ["c0", "c1"], ["crash"])
            else:
                assert line["instances"] == ["c1"] and "continued" not in line
        # Requests with no token when c0 died: served in full; the ones that were on c0 were moved.
        assert all(s.code == grpc.StatusCode.OK and len(s.tokens) == 16 for s in waiting), \
            [(s.code, s.details, len(s.tokens)) for s in waiting]
        moved = [s for s in no_token_at_kill if log[s.request_id].get("rerouted")]
        assert moved, "no request without tokens was on c0 at the kill"
        for s in moved:
            assert log[s.request_id]["instances"] == ["c0", "c1"]
        # After the kill: every one served, none placed on c0 (a placement there would have been moved).
        assert all(s.code == grpc.StatusCode.OK and len(s.tokens) == 4 for s in after)
        assert all("rerouted" not in log[s.request_id] for s in after)

        # c0 was restarted on its port; the router routes to it again.
        salts = iter(range(300, 10_000))

        async def c0_serves():
            # A fresh prompt each try: a repeated one would be cached on c1, and prefix-aware routing would keep it there.
            s = _stream(COLOCATED_MODEL, 32, next(salts), 2)
            await s.run(stub)
            return s.code == grpc.StatusCode.OK and access_log(node)[s.request_id]["instances"] == ["c0"]
        await until(c0_serves, 60, "a request is served by the restarted c0")
        await wait_all_free(node)
    assert node.supervisor.restarts("worker:c0") == 1


def _expiry_warnings(node) -> list[str]:
    """Reservations or hand-offs freed by their TTL instead of by the router: a leak the TTL papered over."""
    found = []
    for sp in node.workers.values():
        for line in sp.log_file.read_text().splitlines():
            if "reservation expired unused" in line or "hand-off expired unreleased" in line:
                found.append(f"{sp.name}: {line}")
    return found


async def test_disaggregated_prefill_then_decode_worker_killed(live_node):
    node = live_node(disagg_config(), time_scale=3.0)
    async with _generation(node) as stub:
        streaming = [_stream(DISAGG_MODEL, 64, i, 300) for i in range(6)]
        tasks = await _streaming(stub, streaming)

        # A prefill worker dies with prompts in prefill: their decode reservations are freed, they move.
        waiting = [_stream(DISAGG_MODEL, 1500, 100 + i, 16, priority=gen_pb.BATCH) for i in range(4)]
        waiting_tasks = [asyncio.create_task(s.run(stub)) for s in waiting]
        busy: list[str] = []

        async def a_prefill_is_busy():
            for iid in ("p0", "p1"):
                l = await load(node.workers[iid].address)
                if l.queued_prefill_tokens > 0 or l.num_waiting > 0:
                    busy.append(iid)
                    return True
            return False
        await until(a_prefill_is_busy, 30, "a prefill worker has a prompt in prefill")
        victim = busy[0]
        os.kill(node.workers[victim].pid, signal.SIGKILL)
        await asyncio.gather(*waiting_tasks)
        log = access_log(node)
        assert all(s.code == grpc.StatusCode.OK and len(s.tokens) == 16 for s in waiting), \
            [(s.code, s.details, len(s.tokens)) for s in waiting]
        moved = [s for s in waiting if log[s.request_id].get("rerouted")]
        assert moved, "no prompt was in prefill on the killed worker"
        for s in moved:
            assert log[s.request_id]["instances"][0] == victim and victim not in log[s.request_id]["instances"][2:]

        # A decode worker dies under streams with tokens: those are continued (a prefill, then d1), all finish whole.
        os.kill(node.workers["d0"].pid, signal.SIGKILL)
        await asyncio.gather(*tasks)
        log = access_log(node, wait_for=streaming)
        on_d0 = [s for s in streaming if log[s.request_id]["instances"][1] == "d0"]
        assert on_d0, "no stream was decoding on d0"
        for s in streaming:
            assert (s.code, s.tokens) == (grpc.StatusCode.OK, _greedy(s)), (s.code, s.details, len(s.tokens))
            line = log[s.request_id]
            if s in on_d0:
                assert line.get("continued_causes") == ["crash"] and line["instances"][3] == "d1", line
            else:
                assert "continued" not in line, line

        node.supervisor.wait_for(f"worker:{victim}", "ready", timeout_s=60)
        node.supervisor.wait_for("worker:d0", "ready", timeout_s=60)
        await wait_all_free(node)
        # Past every TTL (10 s): nothing was left for a TTL to free.
        await asyncio.sleep(11)
        assert _expiry_warnings(node) == []


async def test_scheduler_then_router_killed(live_node):
    from octoserve.client import AsyncClient, RetryPolicy, UnavailableError
    from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
    from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc

    node = live_node(two_replica_config(), time_scale=1.0)
    async with grpc.aio.insecure_channel(node.scheduler.address) as channel:
        before = await s_grpc.SchedulerStub(channel).GetPlacement(s_pb.GetPlacementRequest(), timeout=5)
    assert before.complete

    # The scheduler dies: the router keeps serving on the placement it has.
    os.kill(node.scheduler.pid, signal.SIGKILL)
    async with _generation(node) as stub:
        served = [_stream(COLOCATED_MODEL, 32, i, 8) for i in range(6)]
        await asyncio.gather(*(s.run(stub) for s in served))
    assert [(s.code, len(s.tokens)) for s in served] == [(grpc.StatusCode.OK, 8)] * 6
    # It comes back on its port with no state and rebuilds the placement from the workers' re-registration.
    node.supervisor.wait_for("scheduler", "ready", timeout_s=60)
    async with grpc.aio.insecure_channel(node.scheduler.address) as channel:
        scheduler = s_grpc.SchedulerStub(channel)

        async def placement_rebuilt():
            p = await scheduler.GetPlacement(s_pb.GetPlacementRequest(), timeout=5)
            loads = await scheduler.GetLoads(s_pb.GetLoadsRequest(), timeout=5)
            return p.complete and len(loads.loads) == 2
        await until(placement_rebuilt, 30, "the restarted scheduler has every worker back")
        after = await scheduler.GetPlacement(s_pb.GetPlacementRequest(), timeout=5)
    assert {p.instance_id: p.address for p in after.instances} == {p.instance_id: p.address for p in before.instances}

    # The router dies: a stream in flight ends UNAVAILABLE; a call without retries fails UNAVAILABLE; the SDK
    # with a retry policy retries (each wait recorded) until the restarted router serves it.
    delays: list[float] = []

    async def recorded_sleep(s: float) -> None:
        delays.append(s)
        await asyncio.sleep(s)

    policy = RetryPolicy(max_attempts=30, initial_backoff_s=0.2, backoff_multiplier=1.5, max_backoff_s=2.0,
                         budget_max_tokens=30)
    async with AsyncClient(node.router_address) as plain, \
            AsyncClient(node.router_address, retry=policy, sleep=recorded_sleep) as retrying:
        in_flight = plain.generate(COLOCATED_MODEL, list(range(100, 132)), max_tokens=2000, ignore_eos=True)
        first = await in_flight.__anext__()
        assert first.token_ids
        os.kill(node.router.pid, signal.SIGKILL)
        with pytest.raises(UnavailableError):
            async for _ in in_flight:
                pass
        with pytest.raises(UnavailableError):
            await plain.complete(COLOCATED_MODEL, list(range(100, 132)), max_tokens=4, ignore_eos=True)
        done = await retrying.complete(COLOCATED_MODEL, list(range(100, 132)), max_tokens=4, ignore_eos=True,
                                       timeout_s=90)
    assert len(done.token_ids) == 4 and len(delays) >= 1
    assert node.supervisor.restarts("router") == 1 and node.supervisor.restarts("scheduler") == 1
    await wait_all_free(node)  # the lost router's streams were aborted on the workers


def _metric(address_port: int, name: str, labels: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{address_port}/metrics", timeout=5) as http:
        for line in http.read().decode().splitlines():
            if line.startswith(f"{name}{{") and labels in line:
                return float(line.rsplit(" ", 1)[1])
    return 0.0


async def test_slow_and_corrupt_kv_transfers_time_out_are_continued_and_counted(live_node):
    config = disagg_config()
    config["instances"] = [i for i in config["instances"] if i["id"] in ("p0", "d0")]
    # Transfers in order: 8 s late (past the 5 s transfer timeout), corrupt, fine; then corrupt three times.
    node = live_node(config, time_scale=1.0,
                     extra_env={"OCTOSERVE_FAULTS": "kv_transfer=slow:8,corrupt,ok,corrupt,corrupt,corrupt"})
    async with _generation(node) as stub:
        s = _stream(DISAGG_MODEL, 64, 0, 20)
        await s.run(stub, timeout_s=60)
        bounded = _stream(DISAGG_MODEL, 64, 1, 20)
        await bounded.run(stub, timeout_s=60)
    # The first token came from p0; each failed transfer into d0 was continued from there (p0 again, then d0, which
    # lives: only that hand-off failed), twice, the default bound; the third transfer was fine.
    assert (s.code, s.tokens) == (grpc.StatusCode.OK, _greedy(s)), (s.code, s.details)
    line = access_log(node, wait_for=[s])[s.request_id]
    assert (line["instances"], line["continued_causes"]) == (["p0", "d0"] * 3, ["kv_transfer", "kv_transfer"])
    # Three failed transfers: past the bound, it ends UNAVAILABLE with a hint, holding the three first tokens p0 gave.
    assert bounded.code == grpc.StatusCode.UNAVAILABLE and bounded.retry_after_ms, (bounded.code, bounded.details)
    assert "failed verification" in bounded.details and bounded.details.endswith(
        "; the request had already streamed tokens and was continued 2 time(s), the most "
        "policies.max_continuations allows: retry it"), bounded.details
    assert bounded.tokens == _greedy(bounded)[:3]
    d0_metrics = node.workers["d0"].metrics_port
    name = "octoserve_worker_kv_transfer_failures_total"
    assert _metric(d0_metrics, name, 'reason="timeout"') == 1.0
    assert _metric(d0_metrics, name, 'reason="corrupt"') == 4.0
    continuations = "octoserve_router_continuations_total"
    assert _metric(node.router.metrics_port, continuations, 'cause="kv_transfer",outcome="continued"') == 4.0
    assert _metric(node.router.metrics_port, continuations, 'cause="kv_transfer",outcome="bound"') == 1.0
    await wait_all_free(node)
    assert _expiry_warnings(node) == []  # the hand-offs were released by the router, not by a TTL

