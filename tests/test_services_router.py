"""Router + workers over real gRPC on 127.0.0.1 with the real SimEngine: streaming, errors, cancellation, drain.

One in-process node per module (workers, router; time_scale 1, so an 8B decode step is ~5 ms of real time).
Every test leaves the node idle: tests that start work wait until every worker reports all KV blocks free.
"""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest
import pytest_asyncio
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from grpc_status import rpc_status

from octoserve.router.servicer import RouterSettings
from octoserve.v1 import generate_pb2 as gen_pb
from tests.service_fixtures import (
    COLOCATED_MODEL, DISAGG_MODEL, MAX_CONTEXT, NUM_KV_BLOCKS, collect, request, start_inprocess_node,
)

pytestmark = pytest.mark.asyncio(loop_scope="module")

SLOW_READER_OPTIONS = (("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0))  # tiny flow window


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def node():
    n = await start_inprocess_node(settings=RouterSettings(max_pending_deltas=4))
    yield n
    await n.stop()


@pytest_asyncio.fixture(loop_scope="module")
async def idle(node):
    yield node
    await node.wait_all_free()


def tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def outcomes(node, model: str = COLOCATED_MODEL) -> dict[str, float]:
    """The router's finished-request counter for `model`, by outcome (what this module's node has counted so far)."""
    registry = node.router_servicer.metrics.registry
    return {s.labels["outcome"]: s.value for m in registry.collect() for s in m.samples
            if s.name == "octoserve_router_requests_total" and s.labels["model"] == model}


def counted(node, name: str, labels: dict[str, str]) -> float:
    return node.router_servicer.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("model", [COLOCATED_MODEL, DISAGG_MODEL])
async def test_streams_exactly_max_tokens_and_finishes_with_length(idle, model):
    responses = await collect(idle.generation().Generate(request(model, max_tokens=12), timeout=10))
    assert len(tokens(responses)) == 12
    assert all(len(r.token_ids) >= 1 for r in responses)
    assert responses[0].request_id != "" and all(r.request_id == "" for r in responses[1:])
    assert [r.finish_reason for r in responses[:-1]] == [gen_pb.FINISH_REASON_UNSPECIFIED] * (len(responses) - 1)
    assert responses[-1].finish_reason == gen_pb.LENGTH
    assert (responses[-1].usage.prompt_tokens, responses[-1].usage.completion_tokens) == (32, 12)


async def test_disaggregated_output_equals_colocated_output(idle):
    stub = idle.generation()
    colocated = await collect(stub.Generate(request(COLOCATED_MODEL, max_tokens=16), timeout=10))
    disaggregated = await collect(stub.Generate(request(DISAGG_MODEL, max_tokens=16), timeout=10))
    assert tokens(disaggregated) == tokens(colocated)


async def test_disaggregated_request_of_one_token_finishes_at_the_prefill(idle):
    responses = await collect(idle.generation().Generate(request(DISAGG_MODEL, max_tokens=1), timeout=10))
    assert len(tokens(responses)) == 1 and responses[-1].finish_reason == gen_pb.LENGTH


@pytest.mark.parametrize("model", [COLOCATED_MODEL, DISAGG_MODEL])
async def test_sim_output_length_hint_stops_the_simulated_model_with_stop(idle, model):
    from octoserve.services.rpc.convert import SIM_OUTPUT_LEN_KEY

    req = request(model, max_tokens=40, ignore_eos=False)
    call = idle.generation().Generate(req, timeout=10, metadata=((SIM_OUTPUT_LEN_KEY, "7"),))
    responses = await collect(call)
    assert len(tokens(responses)) == 7 and tokens(responses)[-1] == 2  # the 7th token is EOS
    assert responses[-1].finish_reason == gen_pb.STOP


async def test_client_request_id_is_echoed(idle):
    responses = await collect(idle.generation().Generate(request(request_id="mine-1"), timeout=10))
    assert responses[0].request_id == "mine-1"


async def _error(call) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await collect(call)
    return info.value


async def test_empty_prompt_is_invalid_argument(node):
    err = await _error(node.generation().Generate(request(num_prompt_tokens=0), timeout=5))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert err.details() == "the prompt is empty; send at least one prompt token"


async def test_over_long_prompt_is_invalid_argument_saying_the_limit(node):
    err = await _error(node.generation().Generate(request(num_prompt_tokens=MAX_CONTEXT), timeout=5))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"shorten it to at most {MAX_CONTEXT - 1} tokens" in err.details()


async def test_max_tokens_beyond_the_window_is_invalid_argument(node):
    err = await _error(node.generation().Generate(request(max_tokens=MAX_CONTEXT), timeout=5))
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"lower max_tokens to at most {MAX_CONTEXT - 32}" in err.details()


async def test_unknown_model_is_not_found_listing_the_served_models(node):
    err = await _error(node.generation().Generate(request("gpt-5"), timeout=5))
    assert err.code() == grpc.StatusCode.NOT_FOUND
    assert err.details() == f"unknown model 'gpt-5'; this node serves: {COLOCATED_MODEL}, {DISAGG_MODEL}"


async def test_shed_request_is_resource_exhausted_with_retry_info_and_trailer(node):
    # 12,000 prompt tokens need 750 blocks; every instance has 703: admission sheds it before any GPU work. BATCH, so
    # its 10 s SLO leaves room for its prefill (as STANDARD it would be refused as SLO-infeasible first).
    err = await _error(node.generation().Generate(
        request(num_prompt_tokens=12_000, max_tokens=4, priority=gen_pb.BATCH), timeout=5))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "no instance has KV headroom" in err.details() and "retry after" in err.details()
    status = rpc_status.from_call(err)
    info = error_details_pb2.RetryInfo()
    assert status.details[0].Unpack(info)
    trailer = dict(err.trailing_metadata())["retry-after-ms"]
    assert int(trailer) == info.retry_delay.ToMilliseconds() >= node.config.policies.min_retry_after_ms
    assert (await node.load("c0")).num_free_blocks == NUM_KV_BLOCKS


async def test_prompt_slower_than_its_slo_even_idle_is_failed_precondition_with_the_numbers(node):
    # 9,000 tokens of 8B prefill take ~285 ms on an idle H100 by the cost model, over the 250 ms STANDARD SLO.
    err = await _error(node.generation().Generate(request(num_prompt_tokens=9_000, max_tokens=4), timeout=5))
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert err.details().startswith("the 9000-token prompt alone takes ")
    assert "over its 250 ms STANDARD TTFT SLO; shorten it to at most " in err.details()
    assert dict(err.trailing_metadata() or ()).get("retry-after-ms") is None  # retrying cannot help
    assert (await node.load("c0")).num_free_blocks == NUM_KV_BLOCKS
    # The same length with a 1 s SLO of its own is served (other tokens: later tests must not find it cached).
    own_slo = request(num_prompt_tokens=9_000, max_tokens=4, ttft_slo_ms=1000)
    own_slo.token_ids.ids[:] = [20_000 + i for i in range(9_000)]
    responses = [r async for r in node.generation().Generate(own_slo, timeout=30)]
    assert sum(len(r.token_ids) for r in responses) == 4
    # Leave the node as found: wait (bounded) until the router's load view has the KV back.
    for _ in range(100):
        if node.router_servicer.pool.loads()["c0"].num_free_blocks == NUM_KV_BLOCKS:
            break
        await asyncio.sleep(0.02)
    assert node.router_servicer.pool.loads()["c0"].num_free_blocks == NUM_KV_BLOCKS


async def test_deadline_shorter_than_predicted_ttft_is_refused_as_deadline_exceeded(node):
    # BATCH: an 11,000-token prompt (~390 ms of prefill by the cost model) is within its SLO, but not within a 300 ms
    # deadline. The router's refusal must reach the client before that deadline passes on the client's side: 300 ms
    # leaves a loaded machine room for it (a 50 ms deadline once lost that race to the client's own expiry).
    call = node.generation().Generate(request(num_prompt_tokens=11_000, max_tokens=4, priority=gen_pb.BATCH), timeout=0.3)
    err = await _error(call)
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    found = re.fullmatch(r"the first token is predicted in (\d+) ms but the deadline is in (\d+) ms; "
                         r"raise the deadline or retry later", err.details())
    assert found, err.details()
    predicted_ms, deadline_ms = int(found[1]), int(found[2])
    assert deadline_ms <= 300 < predicted_ms, err.details()


async def test_deadline_mid_stream_is_deadline_exceeded_and_frees_kv(idle):
    before = outcomes(idle)
    call = idle.generation().Generate(request(max_tokens=4000), timeout=0.3)
    received = 0
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in call:
            received += len(response.token_ids)
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    # Mid-stream: tokens flowed (5 ms decode steps: dozens in 0.3 s), then the deadline ended the stream early.
    assert 0 < received < 4000
    # The node saw the deadline too: the request is aborted on its worker (every KV block free again), the router
    # forgets it, and counts it once, as a stream that ended without finishing (not ok, not an error of its own).
    assert await idle.wait_all_free() == {iid: NUM_KV_BLOCKS for iid in idle.workers}
    assert idle.router_servicer.requests == {}
    after = outcomes(idle)
    assert {k: after[k] - before.get(k, 0.0) for k in after if after[k] != before.get(k, 0.0)} == {"cancelled": 1.0}


async def _read_some_then_cancel(node, model: str, busy_ids: tuple[str, ...]) -> None:
    call = node.generation().Generate(request(model, max_tokens=4000), timeout=30)
    stream = call.__aiter__()
    for _ in range(3):
        await stream.__anext__()
    loads = {iid: await node.load(iid) for iid in busy_ids}
    assert all(load.num_free_blocks < NUM_KV_BLOCKS for load in loads.values()), loads
    call.cancel()
    assert await node.wait_all_free() == {iid: NUM_KV_BLOCKS for iid in node.workers}


async def test_cancelled_colocated_stream_frees_kv_on_the_worker(node):
    await _read_some_then_cancel(node, COLOCATED_MODEL, ("c0",))


async def test_cancelled_disaggregated_stream_frees_kv_on_every_worker(node):
    await _read_some_then_cancel(node, DISAGG_MODEL, ("d0",))


async def test_client_that_stops_reading_is_cut_off_without_stalling_its_worker(node):
    call = node.generation(options=SLOW_READER_OPTIONS).Generate(request(max_tokens=4000), timeout=30)
    stream = call.__aiter__()
    await stream.__anext__()
    # Not reading: the router's 4-message bound fills, the request is aborted on the worker.
    assert await node.wait_all_free() == {iid: NUM_KV_BLOCKS for iid in node.workers}
    received = 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for response in stream:
            received += len(response.token_ids)
    assert info.value.code() == grpc.StatusCode.ABORTED
    assert "fell more than 4 token messages behind" in info.value.details()
    assert received < 4000


async def test_list_models(node):
    reply = await node.generation().ListModels(gen_pb.ListModelsRequest(), timeout=5)
    assert [(m.name, m.context_window, m.state, m.num_instances) for m in reply.models] == [
        (COLOCATED_MODEL, MAX_CONTEXT, gen_pb.READY, 1),
        (DISAGG_MODEL, MAX_CONTEXT, gen_pb.READY, 2),
    ]


async def test_health_and_reflection(node):
    channel = node.channel()
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", "octoserve.v1.Generation"):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    replies = [r async for r in reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))]
    names = {s.name for s in replies[0].list_services_response.service}
    assert names == {"octoserve.v1.Generation", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"}


async def test_router_metrics_count_ttft_and_outcomes(idle):
    # The module's node has counted earlier tests' requests: one more request moves each counter by exactly one.
    ttft = {"model": COLOCATED_MODEL}
    ttft_before, outcomes_before = counted(idle, "octoserve_router_ttft_seconds_count", ttft), outcomes(idle)
    await collect(idle.generation().Generate(request(max_tokens=3), timeout=10))
    assert counted(idle, "octoserve_router_ttft_seconds_count", ttft) - ttft_before == 1.0
    after = outcomes(idle)
    assert {k: after[k] - outcomes_before.get(k, 0.0) for k in after if after[k] != outcomes_before.get(k, 0.0)} == {
        "ok": 1.0}


@pytest_asyncio.fixture(loop_scope="module")
async def own_node():
    """A node of this test's own: draining its router must not end the module's node for the tests after it."""
    n = await start_inprocess_node(settings=RouterSettings(max_pending_deltas=4))
    yield n
    await n.stop()


async def test_draining_router_refuses_new_requests_and_finishes_in_flight_ones(own_node):
    node = own_node
    call = node.generation().Generate(request(max_tokens=60), timeout=30)
    stream = call.__aiter__()
    first = await stream.__anext__()
    shutdown = asyncio.create_task(node.router.shutdown())
    for _ in range(200):  # bounded: the drain flag is set within a few loop iterations
        if node.router_servicer.draining:
            break
        await asyncio.sleep(0.005)
    err = await _error(node.generation().Generate(request(max_tokens=4), timeout=5))
    assert err.code() == grpc.StatusCode.UNAVAILABLE
    assert "draining" in err.details()
    rest = [r async for r in stream]
    assert len(first.token_ids) + len(tokens(rest)) == 60 and rest[-1].finish_reason == gen_pb.LENGTH
    await shutdown
