"""Worker RPCs driven directly over gRPC (real SimEngine): per-step token batches, the reserve -> prefill ->
transfer/commit -> release hand-off, reservation expiry, session close aborts, pause/resume, role errors.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
import pytest_asyncio

from octoserve.services.core.types import RequestSpec, SamplingParams
from octoserve.services.rpc import convert
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from tests.service_fixtures import COLOCATED_MODEL, DISAGG_MODEL, NUM_KV_BLOCKS, start_inprocess_node

pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def node():
    n = await start_inprocess_node()
    yield n
    await n.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def idle(node):
    yield node
    await node.wait_all_free()


def spec_pb(request_id: str, model: str = COLOCATED_MODEL, max_tokens: int = 8, num_prompt_tokens: int = 32):
    spec = RequestSpec(request_id, model, tuple(range(100, 100 + num_prompt_tokens)),
                       SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_s=time.monotonic())
    return convert.spec_to_pb(spec)


async def attach(stub, session_id: str):
    call = stub.Attach(w_pb.AttachRequest(session_id=session_id))
    stream = call.__aiter__()
    assert (await stream.__anext__()).seq == 0  # the session is confirmed before any request is submitted
    return call, stream


async def read_until_finished(stream, request_ids: set[str]) -> list[w_pb.StepBatch]:
    batches, open_ids = [], set(request_ids)
    while open_ids:
        batch = await asyncio.wait_for(stream.__anext__(), timeout=10)
        batches.append(batch)
        open_ids -= {d.request_id for d in batch.deltas if d.finish_reason}
    return batches


async def test_one_message_per_engine_step_carries_every_request_of_the_session(idle):
    stub = idle.worker("c0")
    call, stream = await attach(stub, "batching")
    ids = {f"b{i}" for i in range(3)}
    await asyncio.gather(*(stub.Generate(w_pb.WorkerGenerateRequest(session_id="batching", spec=spec_pb(i, max_tokens=20)))
                           for i in sorted(ids)))
    batches = await read_until_finished(stream, ids)
    call.cancel()
    assert [b.seq for b in batches] == list(range(1, len(batches) + 1))
    per_request = {i: [t for b in batches for d in b.deltas if d.request_id == i for t in d.token_ids] for i in ids}
    assert {i: len(t) for i, t in per_request.items()} == {i: 20 for i in ids}
    # A batch is one engine step: at most one delta per request, and each request (one token per step, no
    # preemption here) appears in consecutive batches; steps where all three ran carry all three.
    assert all(len({d.request_id for d in b.deltas}) == len(b.deltas) for b in batches)
    for i in ids:
        indices = [k for k, b in enumerate(batches) if any(d.request_id == i for d in b.deltas)]
        assert indices == list(range(indices[0], indices[0] + 20))
    assert max(len(b.deltas) for b in batches) == 3 and len(batches) < 60


async def test_handoff_reserve_prefill_decode_release(idle):
    prefill, decode = idle.worker("p0"), idle.worker("d0")
    call, stream = await attach(decode, "handoff")
    spec = spec_pb("h1", DISAGG_MODEL, max_tokens=6)
    assert (await decode.Reserve(w_pb.ReserveRequest(spec=spec, ttl_ms=5000))).reserved
    assert (await idle.load("d0")).num_free_blocks < NUM_KV_BLOCKS
    handoff = (await prefill.Prefill(w_pb.PrefillRequest(spec=spec))).handoff
    assert (handoff.request_id, handoff.num_prompt_tokens, handoff.source_instance_id) == ("h1", 32, "p0")
    assert handoff.num_kv_bytes == 32 * idle.config.models[DISAGG_MODEL].kv_bytes_per_token
    assert (await idle.load("p0")).num_free_blocks < NUM_KV_BLOCKS  # held for the hand-off
    await decode.Decode(w_pb.DecodeRequest(session_id="handoff", spec=spec, handoff=handoff))
    await prefill.Release(w_pb.ReleaseRequest(request_id="h1"))
    assert (await idle.load("p0")).num_free_blocks == NUM_KV_BLOCKS
    batches = await read_until_finished(stream, {"h1"})
    call.cancel()
    deltas = [d for b in batches for d in b.deltas]
    assert deltas[-1].num_output_tokens == 6  # the decode side counts the hand-off's first token
    assert sum(len(d.token_ids) for d in deltas) == 5


async def test_unused_reservation_expires_and_decode_is_then_refused(idle):
    decode = idle.worker("d0")
    await attach(decode, "expiry")
    spec = spec_pb("x1", DISAGG_MODEL)
    assert (await decode.Reserve(w_pb.ReserveRequest(spec=spec, ttl_ms=30))).reserved
    await idle.wait_all_free(timeout_s=5.0)
    handoff = w_pb.DecodeRequest(session_id="expiry", spec=spec).handoff
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await decode.Decode(w_pb.DecodeRequest(session_id="expiry", spec=spec, handoff=handoff))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no live reservation for x1 on d0" in info.value.details()


def worker_outcomes(node, instance_id: str) -> dict[str, float]:
    """The worker's requests-by-outcome counter (what this module's node has counted so far)."""
    registry = node.servicers[instance_id].metrics.registry
    return {s.labels["outcome"]: s.value for m in registry.collect() for s in m.samples
            if s.name == "octoserve_worker_requests_total" and s.labels["instance"] == instance_id}


async def test_closing_the_session_aborts_its_requests(idle):
    stub = idle.worker("c0")
    before = worker_outcomes(idle, "c0")
    call, stream = await attach(stub, "closing")
    await stub.Generate(w_pb.WorkerGenerateRequest(session_id="closing", spec=spec_pb("c1", max_tokens=4000)))
    first = await stream.__anext__()
    assert {d.request_id for d in first.deltas} == {"c1"}
    load = await idle.load("c0")
    assert load.num_running == 1 and load.num_free_blocks < NUM_KV_BLOCKS
    call.cancel()
    # 4,000 tokens would take ~20 s at ~5 ms a step: every block free within 5 s means the request was aborted.
    assert await idle.wait_all_free(timeout_s=5.0) == {iid: NUM_KV_BLOCKS for iid in idle.workers}
    assert idle.servicers["c0"].tasks == {}
    after = worker_outcomes(idle, "c0")
    assert {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)} == {"aborted": 1.0}


async def test_pause_keeps_requests_and_resume_finishes_them(idle):
    stub = idle.worker("c0")
    call, stream = await attach(stub, "pausing")
    await stub.Pause(w_pb.PauseRequest())
    assert (await idle.load("c0")).paused
    await stub.Generate(w_pb.WorkerGenerateRequest(session_id="pausing", spec=spec_pb("z1", max_tokens=5)))
    load = await idle.load("c0")
    assert (load.paused, load.num_waiting, load.num_running) == (True, 1, 0)
    await stub.Resume(w_pb.ResumeRequest())
    batches = await read_until_finished(stream, {"z1"})
    call.cancel()
    assert sum(len(d.token_ids) for b in batches for d in b.deltas) == 5


@pytest.mark.parametrize("instance_id, rpc, message", [
    ("p0", "Generate", "Generate is served by colocated instances; p0 is a prefill instance"),
    ("c0", "Prefill", "Prefill is served by prefill instances; c0 is a colocated instance"),
    ("c0", "Reserve", "Reserve is served by decode instances; c0 is a colocated instance"),
])
async def test_an_rpc_of_another_role_is_failed_precondition(node, instance_id, rpc, message):
    stub = node.worker(instance_id)
    request = {"Generate": w_pb.WorkerGenerateRequest, "Prefill": w_pb.PrefillRequest,
               "Reserve": w_pb.ReserveRequest}[rpc](spec=spec_pb("r"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await getattr(stub, rpc)(request)
    assert (info.value.code(), info.value.details()) == (grpc.StatusCode.FAILED_PRECONDITION, message)


async def test_generate_without_a_session_is_failed_precondition(node):
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await node.worker("c0").Generate(w_pb.WorkerGenerateRequest(session_id="nope", spec=spec_pb("n")))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert info.value.details() == "no Attach stream for session 'nope' on c0; call Attach first"
