"""The SDK against real grpc.aio servers on 127.0.0.1.

`ScriptedGeneration` is the server side of the public API reduced to what the SDK must react to: each call
plays the next step of a script (stream these responses, fail with this status and these retry hints, or hang).
It is the SDK's counterpart, not a mock of it: status codes, RetryInfo details, trailers, deadlines and
cancellation all cross a real HTTP/2 connection. Retry delays are checked exactly through an injected sleep
and a seeded rng, so nothing here waits for a backoff.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from dataclasses import dataclass, field

import grpc
import grpc.aio
import pytest
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2

from octoserve.client import (
    AsyncClient,
    Client,
    Completion,
    DeadlineExceededError,
    InvalidArgumentError,
    ModelInfo,
    ModelNotFoundError,
    OctoserveClientError,
    SloInfeasibleError,
    OverloadedError,
    RetryBudget,
    RetryPolicy,
    UnavailableError,
    Usage,
    assemble,
)
from octoserve.services.core.types import FinishReason, Priority
from octoserve.v1 import generate_pb2 as pb
from octoserve.v1 import generate_pb2_grpc as pb_grpc


@dataclass(frozen=True, slots=True)
class Fail:
    code: grpc.StatusCode
    details: str = "scripted failure"
    retry_info_ms: int | None = None  # google.rpc.RetryInfo in grpc-status-details-bin
    trailer_ms: str | None = None  # the retry-after-ms trailer
    after_responses: tuple[pb.GenerateResponse, ...] = ()  # streamed before failing


@dataclass(frozen=True, slots=True)
class Stream:
    responses: tuple[pb.GenerateResponse, ...]


@dataclass(frozen=True, slots=True)
class Hang:
    """Send `responses`, then wait until the client goes away."""

    responses: tuple[pb.GenerateResponse, ...] = ()


def _trailers(step: Fail) -> tuple[tuple[str, str | bytes], ...]:
    trailers: list[tuple[str, str | bytes]] = []
    if step.retry_info_ms is not None:
        info = error_details_pb2.RetryInfo(retry_delay=duration_pb2.Duration(
            seconds=step.retry_info_ms // 1000, nanos=(step.retry_info_ms % 1000) * 1_000_000))
        status = status_pb2.Status(code=step.code.value[0], message=step.details)
        status.details.add().Pack(info)
        trailers.append(("grpc-status-details-bin", status.SerializeToString()))
    if step.trailer_ms is not None:
        trailers.append(("retry-after-ms", step.trailer_ms))
    return tuple(trailers)


@dataclass
class ScriptedGeneration(pb_grpc.GenerationServicer):
    script: list  # one step per call; the last step repeats
    requests: list = field(default_factory=list)
    deadlines_s: list = field(default_factory=list)  # time remaining as each call arrived (None: no deadline)
    arrivals_s: list = field(default_factory=list)  # time.monotonic() as each call arrived
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)

    async def Generate(self, request, context):
        step = self.script[min(len(self.requests), len(self.script) - 1)]
        self.requests.append(request)
        self.deadlines_s.append(context.time_remaining())
        self.arrivals_s.append(time.monotonic())
        if isinstance(step, Stream):
            for response in step.responses:
                yield response
        elif isinstance(step, Fail):
            for response in step.after_responses:
                yield response
            await context.abort(step.code, step.details, trailing_metadata=_trailers(step))
        else:
            # A Hang ends only when the call is cancelled: while it waits, or (a client that cancels at once, on a
            # loaded machine) while the generator is still suspended at a yield, where gRPC closes it instead.
            try:
                for response in step.responses:
                    yield response
                await asyncio.Event().wait()
            finally:
                self.cancelled.set()

    async def ListModels(self, request, context):
        return pb.ListModelsResponse(models=[
            pb.Model(name="llama-3-70b", context_window=8192, state=pb.READY, num_instances=2),
            pb.Model(name="llama-3-8b", context_window=8192, state=pb.DRAINING, num_instances=4),
        ])


@contextlib.asynccontextmanager
async def serve(servicer):
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(grace=None)


def resp(ids=(), text="", request_id="", finish=pb.FINISH_REASON_UNSPECIFIED, usage=None):
    r = pb.GenerateResponse(token_ids=list(ids), text=text, request_id=request_id, finish_reason=finish)
    if usage is not None:
        r.usage.CopyFrom(pb.Usage(prompt_tokens=usage[0], completion_tokens=usage[1], cached_prompt_tokens=usage[2]))
    return r


OK_STREAM = Stream((
    resp((1, 2), "ab", request_id="req-1"),
    resp((3,), "c"),
    resp((), "", finish=pb.LENGTH, usage=(5, 3, 2)),
))
OK_COMPLETION = Completion("req-1", (1, 2, 3), "abc", FinishReason.LENGTH, Usage(5, 3, 2), 3)


class SleepLog:
    """The client's sleep: records each delay and returns at once."""

    def __init__(self) -> None:
        self.delays_s: list[float] = []

    async def __call__(self, delay_s: float) -> None:
        self.delays_s.append(delay_s)

    def sync(self, delay_s: float) -> None:
        self.delays_s.append(delay_s)


def expected_delays(base_s: list[float], jitter: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [b * (1.0 + jitter * rng.random()) for b in base_s]


# --- streaming and request fields --------------------------------------------------------------------------


async def test_stream_reassembles_chunks_and_carries_request_id():
    servicer = ScriptedGeneration([OK_STREAM])
    async with serve(servicer) as target, AsyncClient(target) as client:
        chunks = [c async for c in client.generate("llama-3-8b", [7, 8, 9], max_tokens=3)]
        completion = await client.complete("llama-3-8b", "hello", max_tokens=3)
    assert [c.token_ids for c in chunks] == [(1, 2), (3,), ()]
    assert [c.request_id for c in chunks] == ["req-1"] * 3
    assert [c.finish_reason for c in chunks] == [None, None, FinishReason.LENGTH]
    assert chunks[-1].usage == Usage(5, 3, 2) and chunks[0].usage is None
    assert completion == OK_COMPLETION
    assert list(servicer.requests[0].token_ids.ids) == [7, 8, 9]
    assert servicer.requests[1].WhichOneof("prompt") == "text" and servicer.requests[1].text == "hello"


async def test_request_fields_reach_the_server():
    servicer = ScriptedGeneration([OK_STREAM])
    async with serve(servicer) as target, AsyncClient(target) as client:
        await client.complete(
            "llama-3-70b", [], max_tokens=9, temperature=0.5, top_p=0.9, seed=42, stop=["\n"], ignore_eos=True,
            priority=Priority.INTERACTIVE, ttft_slo_ms=200, request_id="mine",
        )
        await client.complete("llama-3-70b", "x", priority="batch")
    first, second = servicer.requests
    assert first.WhichOneof("prompt") == "token_ids" and list(first.token_ids.ids) == []
    assert (first.model, first.max_tokens, first.seed, list(first.stop), first.ignore_eos) == (
        "llama-3-70b", 9, 42, ["\n"], True)
    assert first.temperature == pytest.approx(0.5) and first.top_p == pytest.approx(0.9)
    assert (first.priority, first.ttft_slo_ms, first.request_id) == (pb.INTERACTIVE, 200, "mine")
    assert (second.priority, second.HasField("seed"), second.ttft_slo_ms) == (pb.BATCH, False, 0)


async def test_list_models():
    async with serve(ScriptedGeneration([OK_STREAM])) as target, AsyncClient(target) as client:
        models = await client.list_models()
    assert models == [ModelInfo("llama-3-70b", 8192, "READY", 2), ModelInfo("llama-3-8b", 8192, "DRAINING", 4)]


# --- status -> exception ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "code, error_type",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, InvalidArgumentError),
        (grpc.StatusCode.NOT_FOUND, ModelNotFoundError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, OverloadedError),
        (grpc.StatusCode.DEADLINE_EXCEEDED, DeadlineExceededError),
        (grpc.StatusCode.UNAVAILABLE, UnavailableError),
        (grpc.StatusCode.FAILED_PRECONDITION, SloInfeasibleError),
        (grpc.StatusCode.INTERNAL, OctoserveClientError),
    ],
)
async def test_each_status_maps_to_its_error_type(code, error_type):
    async with serve(ScriptedGeneration([Fail(code, "say what to change")])) as target, AsyncClient(target) as client:
        with pytest.raises(OctoserveClientError) as caught:
            await client.complete("llama-3-8b", "hi")
    assert type(caught.value) is error_type
    assert (caught.value.code, caught.value.message, caught.value.attempts) == (code, "say what to change", 1)
    assert caught.value.retry_after_ms is None


@pytest.mark.parametrize(
    "step, retry_after_ms",
    [
        (Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_info_ms=1500), 1500.0),
        (Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, trailer_ms="250"), 250.0),
        (Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_info_ms=40, trailer_ms="999"), 40.0),  # RetryInfo wins
        (Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, trailer_ms="soon"), None),
    ],
)
async def test_overloaded_carries_the_servers_retry_delay(step, retry_after_ms):
    async with serve(ScriptedGeneration([step])) as target, AsyncClient(target) as client:
        with pytest.raises(OverloadedError) as caught:
            await client.complete("llama-3-8b", "hi")
    assert caught.value.retry_after_ms == retry_after_ms


# --- retries ------------------------------------------------------------------------------------------------


async def test_retries_honour_retryinfo_with_seeded_jitter():
    overloaded = Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_info_ms=200)
    servicer = ScriptedGeneration([overloaded, overloaded, OK_STREAM])
    sleep = SleepLog()
    policy = RetryPolicy(jitter_fraction=0.2)
    async with serve(servicer) as target, AsyncClient(target, retry=policy, rng=random.Random(7), sleep=sleep) as c:
        completion = await c.complete("llama-3-8b", "hi")
        assert c.retry_budget.tokens == 8.0
    assert completion == OK_COMPLETION
    assert len(servicer.requests) == 3
    assert sleep.delays_s == expected_delays([0.2, 0.2], 0.2, seed=7)
    assert all(d >= 0.2 for d in sleep.delays_s)  # jitter never retries earlier than the server asked


async def test_unavailable_without_hint_backs_off_exponentially_until_attempts_run_out():
    servicer = ScriptedGeneration([Fail(grpc.StatusCode.UNAVAILABLE, "draining")])
    sleep = SleepLog()
    policy = RetryPolicy(max_attempts=4, initial_backoff_s=0.1, backoff_multiplier=2.0, jitter_fraction=0.5)
    async with serve(servicer) as target, AsyncClient(target, retry=policy, rng=random.Random(3), sleep=sleep) as c:
        with pytest.raises(UnavailableError) as caught:
            await c.complete("llama-3-8b", "hi")
    assert caught.value.attempts == 4 and len(servicer.requests) == 4
    assert sleep.delays_s == expected_delays([0.1, 0.2, 0.4], 0.5, seed=3)


async def test_retry_budget_exhaustion_stops_retrying():
    servicer = ScriptedGeneration([Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, trailer_ms="10")])
    sleep = SleepLog()
    policy = RetryPolicy(max_attempts=10, budget_max_tokens=2.0, budget_ratio=0.5, jitter_fraction=0.0)
    async with serve(servicer) as target, AsyncClient(target, retry=policy, sleep=sleep) as c:
        attempts = []
        for _ in range(4):
            with pytest.raises(OverloadedError) as caught:
                await c.complete("llama-3-8b", "hi")
            attempts.append(caught.value.attempts)
    # full bucket (2) -> two retries; then each call deposits 0.5 and a retry needs a whole token
    assert attempts == [3, 1, 2, 1]
    assert len(servicer.requests) == 7
    assert sleep.delays_s == [0.01] * 3


async def test_no_retry_after_the_first_token():
    """Without resume (tests/test_sdk_resume.py), a failure after tokens is raised: never replayed."""
    servicer = ScriptedGeneration([Fail(grpc.StatusCode.UNAVAILABLE, after_responses=(resp((1,), request_id="r"),))])
    sleep = SleepLog()
    async with serve(servicer) as target, AsyncClient(target, retry=RetryPolicy(), sleep=sleep) as c:
        seen = []
        with pytest.raises(UnavailableError):
            async for chunk in c.generate("llama-3-8b", "hi", resume=False):
                seen.append(chunk.token_ids)
    assert seen == [(1,)] and len(servicer.requests) == 1 and sleep.delays_s == []


@pytest.mark.parametrize(
    "step, policy",
    [
        (Fail(grpc.StatusCode.INVALID_ARGUMENT), RetryPolicy()),  # not retryable
        (Fail(grpc.StatusCode.FAILED_PRECONDITION), RetryPolicy()),  # SLO-infeasible: waiting cannot help
        (Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_info_ms=20_000), RetryPolicy(max_backoff_s=10.0)),  # too long
        (Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_info_ms=10), RetryPolicy(max_attempts=1)),
    ],
)
async def test_not_retried(step, policy):
    servicer = ScriptedGeneration([step])
    sleep = SleepLog()
    async with serve(servicer) as target, AsyncClient(target, retry=policy, sleep=sleep) as c:
        with pytest.raises(OctoserveClientError) as caught:
            await c.complete("llama-3-8b", "hi")
    assert caught.value.attempts == 1 and len(servicer.requests) == 1 and sleep.delays_s == []


# --- deadlines and cancellation -----------------------------------------------------------------------------


# The grpc-timeout header's encoding rounds up (seen: 0.3005 s for 0.3 s, 1.0088 s for 1 s on a loaded machine).
TIMEOUT_ROUNDING_S = 0.02


def assert_server_saw_deadline(servicer, sent_at_s: float, timeout_s: float) -> None:
    """The server's deadline is the client's: at most `timeout_s` left when the call arrived (plus the encoding's
    rounding), and ending no earlier than `timeout_s` after the client was asked (the same clock: the server runs
    in this process). Neither bound depends on how long the call was in flight, so a loaded machine cannot fail it."""
    remaining_s, arrived_s = servicer.deadlines_s[0], servicer.arrivals_s[0]
    assert remaining_s <= timeout_s + TIMEOUT_ROUNDING_S, remaining_s
    assert arrived_s + remaining_s >= sent_at_s + timeout_s - 0.001, (arrived_s - sent_at_s, remaining_s)


async def test_deadline_exceeded_while_the_server_is_silent():
    servicer = ScriptedGeneration([Hang()])
    async with serve(servicer) as target, AsyncClient(target, default_timeout_s=0.3) as c:
        sent_at_s = time.monotonic()
        with pytest.raises(DeadlineExceededError) as caught:
            await c.complete("llama-3-8b", "hi")
        await asyncio.wait_for(servicer.cancelled.wait(), 5.0)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_server_saw_deadline(servicer, sent_at_s, 0.3)


async def test_no_retry_would_outlive_the_deadline():
    servicer = ScriptedGeneration([Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, retry_info_ms=2000)])
    sleep = SleepLog()
    async with serve(servicer) as target, AsyncClient(target, retry=RetryPolicy(), sleep=sleep) as c:
        sent_at_s = time.monotonic()
        with pytest.raises(OverloadedError) as caught:
            await c.complete("llama-3-8b", "hi", timeout_s=1.0)
    assert (caught.value.attempts, caught.value.retry_after_ms, sleep.delays_s) == (1, 2000.0, [])
    assert_server_saw_deadline(servicer, sent_at_s, 1.0)


async def test_closing_the_stream_early_cancels_the_call_on_the_server():
    servicer = ScriptedGeneration([Hang(responses=(resp((5,), request_id="r-9"),))])
    async with serve(servicer) as target, AsyncClient(target) as c:
        stream = c.generate("llama-3-8b", "hi")
        first = await anext(stream)
        await stream.aclose()
        await asyncio.wait_for(servicer.cancelled.wait(), 5.0)
    assert first.token_ids == (5,) and first.request_id == "r-9"


# --- the blocking client ------------------------------------------------------------------------------------


async def test_sync_client_retries_and_reassembles():
    overloaded = Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, trailer_ms="300")
    servicer = ScriptedGeneration([overloaded, OK_STREAM, Fail(grpc.StatusCode.NOT_FOUND, "unknown model 'x'")])
    sleep = SleepLog()

    def use_client(target: str):
        with Client(target, retry=RetryPolicy(jitter_fraction=0.1), rng=random.Random(11), sleep=sleep.sync) as c:
            completion = c.complete("llama-3-8b", "hi")
            with pytest.raises(ModelNotFoundError) as caught:
                list(c.generate("x", "hi"))
            return completion, caught.value, c.list_models()

    async with serve(servicer) as target:
        # the server runs on this loop, so the blocking client runs in a thread
        completion, not_found, models = await asyncio.to_thread(use_client, target)
    assert completion == OK_COMPLETION
    assert sleep.delays_s == expected_delays([0.3], 0.1, seed=11)
    assert not_found.message == "unknown model 'x'" and not_found.attempts == 1
    assert [m.name for m in models] == ["llama-3-70b", "llama-3-8b"]


# --- pure pieces --------------------------------------------------------------------------------------------


def test_retry_budget_is_a_token_bucket():
    budget = RetryBudget(ratio=0.1, max_tokens=1.0)
    assert budget.try_withdraw() and not budget.try_withdraw()
    for _ in range(9):
        budget.record_call()
    assert budget.tokens == 0.9 and not budget.try_withdraw()
    budget.record_call()
    assert budget.try_withdraw() and budget.tokens == 0.0
    for _ in range(50):
        budget.record_call()
    assert budget.tokens == 1.0  # capped


def test_backoff_is_capped_and_policy_validated():
    policy = RetryPolicy(initial_backoff_s=1.0, backoff_multiplier=3.0, max_backoff_s=5.0, jitter_fraction=0.0)
    rng = random.Random(0)
    assert [policy.delay_s(i, None, rng) for i in range(4)] == [1.0, 3.0, 5.0, 5.0]
    assert policy.delay_s(0, 7.5, rng) == 7.5
    with pytest.raises(ValueError):
        RetryPolicy(max_attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(jitter_fraction=-0.1)


async def test_unreachable_router_is_unavailable_after_the_retries():
    async with serve(ScriptedGeneration([OK_STREAM])) as target:
        pass  # the server is gone: nothing listens on `target` any more
    sleep = SleepLog()
    policy = RetryPolicy(max_attempts=3, initial_backoff_s=0.05, jitter_fraction=0.0)
    async with AsyncClient(target, retry=policy, sleep=sleep) as c:
        with pytest.raises(UnavailableError) as caught:
            await c.complete("llama-3-8b", "hi", timeout_s=10.0)
    assert caught.value.attempts == 3 and sleep.delays_s == [0.05, 0.1]


# --- against the real node (launcher: scheduler, workers and router as processes on 127.0.0.1) ------------------


@pytest.fixture(scope="module")
def node(tmp_path_factory):
    from octoserve.services.node.launcher import start_node

    running = start_node(None, 10.0, run_dir=tmp_path_factory.mktemp("node"))  # the default placement, sim engine, modelled time x10
    try:
        yield running
    finally:
        running.stop()


async def test_real_node_streams_the_sim_engines_tokens(node):
    from octoserve.services.core.sim_executor import sim_token_id

    prompt = list(range(1000, 1100))
    async with AsyncClient(node.router_address, default_timeout_s=30.0) as c:
        models = await c.list_models()
        chunks = [chunk async for chunk in c.generate("llama-3-8b", prompt, max_tokens=5)]
    assert models == [ModelInfo("llama-3-70b", 8192, "READY", 1), ModelInfo("llama-3-8b", 8192, "READY", 4)]
    completion = assemble(chunks)
    assert completion.token_ids == tuple(sim_token_id(100, 1000, i) for i in range(5))
    assert completion.finish_reason == FinishReason.LENGTH
    assert (completion.usage.prompt_tokens, completion.usage.completion_tokens) == (100, 5)
    assert completion.request_id and all(c.request_id == completion.request_id for c in chunks)


@pytest.mark.parametrize(
    "model, prompt, max_tokens, error_type",
    [
        ("llama-3-9b", [1000], 4, ModelNotFoundError),
        ("llama-3-8b", [], 4, InvalidArgumentError),
        ("llama-3-8b", [1000] * 8000, 1000, InvalidArgumentError),  # beyond the 8,192-token context
    ],
)
async def test_real_node_errors_map_to_types(node, model, prompt, max_tokens, error_type):
    async with AsyncClient(node.router_address, retry=RetryPolicy(), default_timeout_s=30.0) as c:
        with pytest.raises(OctoserveClientError) as caught:
            await c.complete(model, prompt, max_tokens=max_tokens)
    assert type(caught.value) is error_type and caught.value.attempts == 1 and caught.value.message


def test_real_node_with_the_blocking_client(node):
    with Client(node.router_address, default_timeout_s=30.0) as c:
        completion = c.complete("llama-3-70b", [1000, 1001, 1002], max_tokens=3, priority="interactive")
        with pytest.raises(ModelNotFoundError):
            c.complete("nope", "hi")
    assert len(completion.token_ids) == 3 and completion.usage.prompt_tokens == 3
