"""Malformed messages on the internal APIs: the Worker service (colocated, prefill and decode roles) and the Scheduler.

The workers do not trust their caller: every RequestSpec is re-validated (model, prompt, vocabulary, sampling,
deadline), ids that name nothing are harmless, and every answer is a typed status. After the run every KV block
is free again (free-block counts) and every worker still serves. The scheduler checks addresses, instance ids and
lease durations, and a worker that does not answer a Pause is UNAVAILABLE, not INTERNAL.

`make test` runs a seeded sample; `make fuzz` 10,000 cases per API (OCTOSERVE_FUZZ_EXAMPLES).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from octoserve.services.rpc.gen import kv_pb2 as kv_pb
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc
from tests.fuzz_support import FUZZ_SETTINGS, NodeThread, assert_typed
from tests.service_fixtures import COLOCATED_MODEL, DISAGG_MODEL, MAX_CONTEXT, small_config

VOCAB = 128256
U32 = 2**32 - 1
SESSION = "fuzz-session"
TIMEOUT_S = 10.0


class Harness:
    """Stubs to every worker of the node, plus our own Attach sessions on the streaming workers (drained)."""

    def __init__(self, nt: NodeThread) -> None:
        self.nt = nt
        self.stubs = nt.run(self._open())

    async def _open(self):
        self.channels = {iid: grpc.aio.insecure_channel(r.address) for iid, r in self.nt.node.workers.items()}
        stubs = {iid: w_grpc.WorkerStub(ch) for iid, ch in self.channels.items()}
        self.sessions = []
        for iid in ("c0", "d0"):
            call = stubs[iid].Attach(w_pb.AttachRequest(session_id=SESSION))
            await call.read()  # the session confirmation
            self.sessions.append((call, asyncio.create_task(_drain(call))))
        return stubs

    async def close(self):
        for call, task in self.sessions:
            call.cancel()
            task.cancel()
        for ch in self.channels.values():
            await ch.close()


async def _drain(call) -> None:
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
    except (grpc.aio.AioRpcError, asyncio.CancelledError):
        pass


@pytest.fixture(scope="module")
def harness():
    nt = NodeThread()
    h = Harness(nt)
    yield h
    try:
        free = nt.run(nt.node.wait_all_free(timeout_s=30.0), timeout_s=40.0)  # no KV leaked
        assert all(v > 0 for v in free.values())
        for iid in nt.node.workers:  # every worker still serves
            load = nt.run(nt.node.load(iid))
            assert load.healthy and not load.paused
    finally:
        nt.run(h.close())
        nt.stop()


edge_u32 = st.one_of(st.sampled_from([0, 1, 16, MAX_CONTEXT, U32]), st.integers(0, U32))
doubles = st.one_of(st.sampled_from([0.0, -1.0, float("nan"), float("inf"), 1e300]), st.floats())


INSTANCE_MODEL = {"c0": COLOCATED_MODEL, "p0": DISAGG_MODEL, "d0": DISAGG_MODEL}  # small_config()'s instances


@st.composite
def specs(draw, model: str) -> w_pb.RequestSpec:
    """A RequestSpec valid for an instance of `model`, with up to three fields replaced by hostile values (the model
    among them: none, an unknown one, or the node's other served model)."""
    spec = w_pb.RequestSpec(
        request_id=f"fz-{draw(st.integers(0, 10**9))}",
        model=model,
        prompt_token_ids=draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=48)),
        sampling=w_pb.SamplingParams(max_tokens=draw(st.integers(1, 32)), top_p=1.0, ignore_eos=True),
        arrival_s=0.0,
        priority=draw(st.sampled_from([0, 1, 2, 3])),
    )
    for name in draw(st.lists(st.sampled_from(["request_id", "model", "prompt", "max_tokens", "temperature",
                                               "top_p", "stop", "arrival_s", "priority", "ttft_slo_ms",
                                               "sim_output_len"]), max_size=3, unique=True)):
        if name == "request_id":
            spec.request_id = draw(st.one_of(st.just(""), st.text(max_size=30)))
        elif name == "model":
            other = DISAGG_MODEL if model == COLOCATED_MODEL else COLOCATED_MODEL
            spec.model = draw(st.sampled_from(["", "nope", "x" * 3000, other]))
        elif name == "prompt":
            del spec.prompt_token_ids[:]
            spec.prompt_token_ids.extend(draw(st.one_of(
                st.lists(st.integers(0, U32), max_size=48),
                st.sampled_from([MAX_CONTEXT - 1, MAX_CONTEXT, 60_000]).map(lambda n: [7] * n))))
        elif name == "max_tokens":
            spec.sampling.max_tokens = draw(edge_u32)
        elif name == "temperature":
            spec.sampling.temperature = draw(st.floats(width=32))
        elif name == "top_p":
            spec.sampling.top_p = draw(st.floats(width=32))
        elif name == "stop":
            spec.sampling.stop.extend(draw(st.lists(st.text(max_size=5), max_size=3)))
        elif name == "arrival_s":
            spec.arrival_s = draw(doubles)
        elif name == "priority":
            spec.priority = draw(st.integers(-2**31, 2**31 - 1))
        elif name == "ttft_slo_ms":
            spec.ttft_slo_ms = draw(doubles)
        elif name == "sim_output_len":
            spec.sim_output_len = draw(edge_u32)
    return spec


handoffs = st.builds(
    kv_pb.KVHandoff, request_id=st.text(max_size=10), source_instance_id=st.sampled_from(["", "p0", "zz"]),
    num_prompt_tokens=edge_u32, first_token_id=edge_u32, num_kv_bytes=st.integers(0, 2**64 - 1),
    num_cached_prompt_tokens=edge_u32, connector_params_json=st.sampled_from(["", "{", "[]", '{"a": 1}', "\x00"]),
    finish_reason=st.sampled_from(["", "stop", "length", "bogus"]),
)

def with_spec(method: str, instances: list[str], build):
    """(method, instance, message) with the message's spec drawn for that instance's model."""
    return st.sampled_from(instances).flatmap(
        lambda iid: st.tuples(st.just(method), st.just(iid), build(specs(INSTANCE_MODEL[iid]))))


worker_calls = st.one_of(
    with_spec("Generate", ["c0", "d0", "p0"], lambda spec: st.builds(
        w_pb.WorkerGenerateRequest, session_id=st.sampled_from([SESSION, SESSION, "", "nope"]), spec=spec)),
    with_spec("Prefill", ["p0", "p0", "c0"], lambda spec: st.builds(w_pb.PrefillRequest, spec=spec)),
    with_spec("Reserve", ["d0", "d0", "c0"], lambda spec: st.builds(
        w_pb.ReserveRequest, spec=spec, ttl_ms=st.sampled_from([0, 1, 50, U32]))),
    with_spec("Decode", ["d0", "d0", "p0"], lambda spec: st.builds(
        w_pb.DecodeRequest, session_id=st.sampled_from([SESSION, "", "x"]), spec=spec, handoff=handoffs,
        source_address=st.sampled_from(["", "127.0.0.1:1", "garbage", "::::"]))),
    st.tuples(st.sampled_from(["Release", "Abort"]), st.sampled_from(["c0", "p0", "d0"]),
              st.builds(w_pb.ReleaseRequest, request_id=st.text(max_size=20))),
    st.tuples(st.just("GetLoad"), st.sampled_from(["c0", "p0", "d0"]), st.just(w_pb.GetLoadRequest())),
    st.tuples(st.just("WatchLoad"), st.sampled_from(["c0", "p0", "d0"]),
              st.builds(w_pb.WatchLoadRequest, interval_ms=edge_u32)),
    st.tuples(st.just("Attach"), st.sampled_from(["c0", "p0", "d0"]),
              st.builds(w_pb.AttachRequest, session_id=st.text(max_size=10).map(lambda s: "fz-" + s))),
    st.tuples(st.just("PauseResume"), st.sampled_from(["c0", "p0", "d0"]), st.just(None)),
    st.tuples(st.just("Raw"), st.sampled_from(["c0", "p0", "d0"]), st.tuples(
        st.sampled_from(["Generate", "Prefill", "Reserve", "Decode", "Release", "Abort", "WatchLoad", "Attach"]),
        st.binary(max_size=200))),
)


async def call_worker(stubs, channels, method: str, iid: str, msg) -> tuple[grpc.StatusCode, str]:
    stub = stubs[iid]
    try:
        if method in ("WatchLoad", "Attach"):
            call = getattr(stub, method)(msg, timeout=TIMEOUT_S)
            await call.read()  # the first report / the session confirmation, then we leave
            call.cancel()
        elif method == "PauseResume":
            await stub.Pause(w_pb.PauseRequest(), timeout=TIMEOUT_S)
            await stub.Resume(w_pb.ResumeRequest(), timeout=TIMEOUT_S)
        elif method == "Raw":
            name, data = msg
            kind = channels[iid].unary_stream if name in ("WatchLoad", "Attach") else channels[iid].unary_unary
            call = kind(f"/octoserve.v1.Worker/{name}", request_serializer=lambda b: b,
                        response_deserializer=lambda b: b)(data, timeout=TIMEOUT_S)
            if name in ("WatchLoad", "Attach"):
                await call.read()
                call.cancel()
            else:
                await call
        elif method == "Release":
            await stub.Release(msg, timeout=TIMEOUT_S)
        elif method == "Abort":
            await stub.Abort(w_pb.AbortRequest(request_id=msg.request_id), timeout=TIMEOUT_S)
        else:
            await getattr(stub, method)(msg, timeout=TIMEOUT_S)
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    finally:
        spec = getattr(msg, "spec", None)
        if spec is not None and spec.request_id:  # clean up like a router would: whatever started is freed
            await stub.Abort(w_pb.AbortRequest(request_id=spec.request_id), timeout=TIMEOUT_S)
            await stub.Release(w_pb.ReleaseRequest(request_id=spec.request_id), timeout=TIMEOUT_S)


def test_worker_api_fuzz(harness):
    """Every fuzzed call gets a typed answer, and the sample reaches both outcomes: Generate, Prefill and Reserve
    each served some specs, and some were refused as invalid (counted by this test itself, so it passes or fails the
    same run alone or in any order)."""
    seen: dict[str, set[str]] = {}

    @FUZZ_SETTINGS
    @given(case=worker_calls)
    def fuzz(case):
        method, iid, msg = case
        code, details = harness.nt.run(call_worker(harness.stubs, harness.channels, method, iid, msg), 60.0)
        seen.setdefault(method, set()).add(code.name)
        assert_typed(code, details, f"{method} on {iid}")

    fuzz()
    for method in ("Generate", "Prefill", "Reserve"):
        assert "OK" in seen.get(method, set()), seen
    assert "INVALID_ARGUMENT" in seen["Generate"] | seen["Prefill"] | seen["Reserve"], seen


def test_worker_rejects_a_spec_for_another_model(harness):
    spec = w_pb.RequestSpec(request_id="other-model", model=DISAGG_MODEL, prompt_token_ids=[1, 2, 3],
                            sampling=w_pb.SamplingParams(max_tokens=4, top_p=1.0))
    code, details = harness.nt.run(call_worker(harness.stubs, harness.channels, "Generate", "c0",
                                               w_pb.WorkerGenerateRequest(session_id=SESSION, spec=spec)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"serves {COLOCATED_MODEL}" in details


def test_watch_load_interval_is_bounded(harness):
    """A huge interval must not park the stream for days: the worker caps it."""
    from octoserve.services.rpc.worker_base import MAX_LOAD_INTERVAL_MS

    async def two_reports():
        call = harness.stubs["c0"].WatchLoad(w_pb.WatchLoadRequest(interval_ms=U32), timeout=30.0)
        loop = asyncio.get_running_loop()
        await call.read()
        t0 = loop.time()
        await call.read()
        call.cancel()
        return loop.time() - t0

    gap_s = harness.nt.run(two_reports(), 60.0)
    assert gap_s < MAX_LOAD_INTERVAL_MS / 1000.0 + 5.0


# ---- scheduler ----------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def scheduler():
    from octoserve.services.rpc.server import start_service
    from octoserve.services.scheduler.service import scheduler_spec

    nt = NodeThread.__new__(NodeThread)  # a loop thread without a node
    import threading

    nt.loop = asyncio.new_event_loop()
    nt.thread = threading.Thread(target=nt.loop.run_forever, daemon=True)
    nt.thread.start()
    spec, servicer = scheduler_spec(small_config(), metrics_port=None, grace_s=1.0)
    running = nt.run(start_service(spec))

    async def stub():
        return grpc.aio.insecure_channel(running.address)

    channel = nt.run(stub())
    yield nt, s_grpc.SchedulerStub(channel), channel, servicer
    nt.run(channel.close())
    nt.run(running.shutdown())
    nt.loop.call_soon_threadsafe(nt.loop.stop)


# Every address the scheduler may accept (and so dial) is on 127.0.0.1; the rest are refused before anything is
# resolved: malformed ones, other hosts (named and literal), and arbitrary text, which the post-condition below checks.
addresses = st.one_of(
    st.sampled_from(["", "127.0.0.1:1", "127.0.0.1:0", "127.0.0.1:99999", "garbage", "unix:/tmp/x", "127.0.0.1:", ":5",
                     "example.com:443", "10.0.0.1:50051", "[2001:db8::1]:1", "8.8.8.8:53"]),
    st.integers(1, 65535).map(lambda port: f"127.0.0.1:{port}"),
    st.text(max_size=30))
instance_ids = st.one_of(st.sampled_from(["c0", "p0", "d0", "", "nope"]), st.text(max_size=10))

scheduler_calls = st.one_of(
    st.tuples(st.just("RegisterWorker"), st.builds(s_pb.RegisterWorkerRequest, instance_id=instance_ids,
                                                   address=addresses, pid=edge_u32)),
    st.tuples(st.just("GetPlacement"), st.just(s_pb.GetPlacementRequest())),
    st.tuples(st.just("GetLoads"), st.just(s_pb.GetLoadsRequest())),
    st.tuples(st.just("AcquireLease"), st.builds(s_pb.AcquireLeaseRequest, holder=st.text(max_size=10),
                                                 instance_ids=st.lists(instance_ids, max_size=3),
                                                 duration_ms=edge_u32)),
    st.tuples(st.just("ReleaseLease"), st.builds(s_pb.ReleaseLeaseRequest, lease_id=st.text(max_size=32))),
    st.tuples(st.just("Reconfigure"), st.one_of(
        st.builds(s_pb.ReconfigureRequest, role_change=st.builds(s_pb.RoleChange, instance_id=instance_ids,
                                                                 role=st.integers(0, 5)),
                  drain_timeout_ms=st.integers(0, 2000)),
        st.builds(s_pb.ReconfigureRequest, model_change=st.builds(
            s_pb.ModelChange, retire=st.lists(instance_ids, max_size=3), model=st.text(max_size=12),
            role=st.integers(0, 5), tensor_parallel=edge_u32)),
        st.just(s_pb.ReconfigureRequest()))),
    st.tuples(st.just("ReportDemand"), st.builds(s_pb.DemandReport, models=st.lists(st.builds(
        s_pb.ModelArrivals, model=st.text(max_size=12), arrivals=edge_u32,
        refused=st.dictionaries(st.text(max_size=12), edge_u32, max_size=3)), max_size=3))),
    st.tuples(st.just("Raw"), st.tuples(st.sampled_from(["RegisterWorker", "AcquireLease", "ReleaseLease", "Reconfigure",
                                                         "ReportDemand"]),
                                        st.binary(max_size=200))),
)


async def call_scheduler(stub, channel, method, msg) -> tuple[grpc.StatusCode, str]:
    try:
        if method == "Raw":
            name, data = msg
            await channel.unary_unary(f"/octoserve.v1.Scheduler/{name}", request_serializer=lambda b: b,
                                      response_deserializer=lambda b: b)(data, timeout=TIMEOUT_S)
        else:
            reply = await getattr(stub, method)(msg, timeout=TIMEOUT_S)
            if method == "AcquireLease":
                await stub.ReleaseLease(s_pb.ReleaseLeaseRequest(lease_id=reply.lease_id), timeout=TIMEOUT_S)
        return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""


@FUZZ_SETTINGS
@given(case=scheduler_calls)
def test_scheduler_api_fuzz(scheduler, case):
    nt, stub, channel, servicer = scheduler
    method, msg = case
    code, details = nt.run(call_scheduler(stub, channel, method, msg), 60.0)
    dialed = {address.rpartition(":")[0] for address in servicer.addresses.values()}
    assert dialed <= {"127.0.0.1"}, f"the scheduler dials beyond 127.0.0.1: {dialed}"
    # UNAVAILABLE here is typed: a lease on a registered worker that does not answer its Pause.
    assert code == grpc.StatusCode.UNAVAILABLE and "did not answer" in details or \
        assert_typed(code, details, f"scheduler {method}") is None


def test_scheduler_rejects_bad_addresses_and_lease_durations(scheduler):
    nt, stub, channel, servicer = scheduler
    for address in ("garbage", "127.0.0.1:0", "127.0.0.1:99999", "unix:/tmp/x", ""):
        code, details = nt.run(call_scheduler(stub, channel, "RegisterWorker",
                                              s_pb.RegisterWorkerRequest(instance_id="c0", address=address)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "host:port" in details, (address, details)
    code, _ = nt.run(call_scheduler(stub, channel, "RegisterWorker",
                                    s_pb.RegisterWorkerRequest(instance_id="c0", address="127.0.0.1:1")))
    assert code == grpc.StatusCode.OK
    code, details = nt.run(call_scheduler(stub, channel, "AcquireLease",
                                          s_pb.AcquireLeaseRequest(instance_ids=["c0"], duration_ms=U32)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "duration_ms" in details
    code, details = nt.run(call_scheduler(stub, channel, "AcquireLease",
                                          s_pb.AcquireLeaseRequest(instance_ids=["c0"], duration_ms=100)))
    assert code == grpc.StatusCode.UNAVAILABLE and "c0" in details  # nothing listens at 127.0.0.1:1
    assert servicer.leases == {}


def test_scheduler_refuses_worker_hosts_it_does_not_allow(scheduler):
    """A registration on another host is PERMISSION_DENIED, names the host and the config key, and dials nothing."""
    nt, stub, channel, servicer = scheduler
    before = dict(servicer.addresses)
    for address, host in (("10.0.0.1:50051", "10.0.0.1"), ("example.com:443", "example.com"),
                          ("[2001:db8::1]:1", "2001:db8::1"), ("127.0.0.1.nip.io:80", "127.0.0.1.nip.io")):
        code, details = nt.run(call_scheduler(stub, channel, "RegisterWorker",
                                              s_pb.RegisterWorkerRequest(instance_id="c0", address=address)))
        assert code == grpc.StatusCode.PERMISSION_DENIED, (address, code, details)
        assert f"worker host {host!r} is not one this node dials (allowed: loopback)" in details
        assert "network.worker_hosts" in details
    assert servicer.addresses == before
