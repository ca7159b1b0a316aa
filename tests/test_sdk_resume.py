"""Resume: a stream cut after tokens (UNAVAILABLE) goes on from where it stopped, in the SDK and at the router.

The SDK half runs against `ScriptedGeneration` (tests/test_client.py: a real grpc.aio server on 127.0.0.1 playing
one scripted step per call), so what crosses the wire on each resume is checked exactly, and delays through an
injected sleep and a seeded rng. The router half checks `convert.resumed_spec`, the one place a `resume_from`
becomes the request the workers serve, with its exact refusals. The live half (a node under `up` whose router is
SIGKILLed mid-stream) is tests/test_resume_live.py.
"""

from __future__ import annotations

import contextlib

import grpc
import pytest

from octoserve.client import (
    AsyncClient,
    Client,
    InvalidArgumentError,
    RetryPolicy,
    UnavailableError,
    Usage,
    build_request,
)
from octoserve.services.core.errors import InvalidArgument
from octoserve.services.core.specs import MODEL_PRESETS
from octoserve.services.core.types import RequestSpec, SamplingParams
from octoserve.services.rpc import convert
from octoserve.v1 import generate_pb2 as pb
from tests.test_client import Fail, ScriptedGeneration, SleepLog, Stream, expected_delays, resp, serve


CUT = Fail(grpc.StatusCode.UNAVAILABLE, "the router went away", retry_info_ms=50,
           after_responses=(resp((11, 12), request_id="req-1"), resp((13,))))
REST = Stream((resp((14, 15), request_id="req-1"), resp((), finish=pb.LENGTH, usage=(4, 5, 0))))
SEED = 7


def policy(**kw) -> RetryPolicy:
    return RetryPolicy(**{"jitter_fraction": 0.2, **kw})


async def collect(client: AsyncClient, **kw) -> list:
    return [chunk async for chunk in client.generate("llama-3-8b", [1, 2, 3, 4], max_tokens=5, **kw)]


# --- the SDK ---------------------------------------------------------------------------------------------------


async def test_a_cut_stream_resumes_with_the_tokens_received_and_goes_on_as_one_stream():
    import random

    servicer = ScriptedGeneration([CUT, REST])
    sleep = SleepLog()
    async with serve(servicer) as target, \
            AsyncClient(target, retry=policy(), sleep=sleep, rng=random.Random(SEED)) as c:
        chunks = await collect(c, temperature=0.0, seed=3, priority="BATCH", ttft_slo_ms=900)
    assert [ch.token_ids for ch in chunks] == [(11, 12), (13,), (14, 15), ()]
    assert {ch.request_id for ch in chunks} == {"req-1"}
    assert chunks[-1].usage == Usage(4, 5, 0)  # the router's count for the whole request, passed through
    first, resumed = servicer.requests
    assert not first.HasField("resume_from") and first.request_id == ""
    # The same request, under the id the server gave it, with every token received so far.
    expected = pb.GenerateRequest()
    expected.CopyFrom(first)
    expected.request_id = "req-1"
    expected.resume_from.ids.extend([11, 12, 13])
    assert resumed == expected
    assert sleep.delays_s == expected_delays([0.05], 0.2, SEED)  # the server's hint, jittered upwards


@pytest.mark.parametrize("kw", [
    {"resume": False},
    {"temperature": 0.7},  # sampled: resumed only when asked
    {"stop": ["\n"]},  # a stop string split by the cut would be missed: resumed only when asked
])
async def test_not_resumed_by_default_where_the_resumed_stream_could_differ(kw):
    servicer = ScriptedGeneration([CUT, REST])
    async with serve(servicer) as target, AsyncClient(target, retry=policy(), sleep=SleepLog()) as c:
        seen = []
        with pytest.raises(UnavailableError) as caught:
            async for chunk in c.generate("llama-3-8b", [1, 2, 3, 4], max_tokens=5, **kw):
                seen.append(chunk.token_ids)
    assert seen == [(11, 12), (13,)] and len(servicer.requests) == 1
    assert caught.value.message == "the router went away" and caught.value.attempts == 1


async def test_not_resumed_by_default_without_a_retry_policy_but_resumed_when_asked():
    for resume, num_requests in ((None, 1), (True, 2)):
        servicer = ScriptedGeneration([CUT, REST])
        async with serve(servicer) as target, AsyncClient(target, sleep=SleepLog()) as c:
            try:
                tokens = [t for ch in await collect(c, resume=resume) for t in ch.token_ids]
            except UnavailableError:
                tokens = None
        assert len(servicer.requests) == num_requests
        assert tokens == (None if resume is None else [11, 12, 13, 14, 15])


async def test_sampled_and_stop_requests_resume_when_asked_with_their_parameters_unchanged():
    servicer = ScriptedGeneration([CUT, REST])
    async with serve(servicer) as target, AsyncClient(target, retry=policy(), sleep=SleepLog()) as c:
        await collect(c, temperature=0.7, top_p=0.9, seed=5, stop=["\n"], resume=True)
    first, resumed = servicer.requests
    assert (resumed.temperature, resumed.seed, list(resumed.stop), resumed.max_tokens) == \
        (first.temperature, first.seed, ["\n"], 5)
    assert abs(resumed.top_p - 0.9) < 1e-6 and list(resumed.resume_from.ids) == [11, 12, 13]


async def test_resumes_are_bounded_and_each_carries_every_token_so_far():
    one_more = Fail(grpc.StatusCode.UNAVAILABLE, "cut again", after_responses=(resp((21,), request_id="req-1"),))
    servicer = ScriptedGeneration([CUT, one_more])
    sleep = SleepLog()
    async with serve(servicer) as target, AsyncClient(target, retry=policy(max_resumes=2, max_attempts=1),
                                                      sleep=sleep) as c:
        seen = []
        with pytest.raises(UnavailableError) as caught:
            async for chunk in c.generate("llama-3-8b", [1, 2, 3, 4], max_tokens=9):
                seen.extend(chunk.token_ids)
    assert seen == [11, 12, 13, 21, 21] and caught.value.message == "cut again"
    assert [list(r.resume_from.ids) for r in servicer.requests] == [[], [11, 12, 13], [11, 12, 13, 21]]
    assert caught.value.attempts == 3 and len(sleep.delays_s) == 2


async def test_a_resumed_request_refused_before_its_first_token_is_retried_under_the_retry_rules():
    busy = Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy", retry_info_ms=30)
    servicer = ScriptedGeneration([CUT, busy, busy, REST])
    sleep = SleepLog()
    async with serve(servicer) as target, AsyncClient(target, retry=policy(jitter_fraction=0.0, max_attempts=3),
                                                      sleep=sleep) as c:
        chunks = await collect(c)
    assert [t for ch in chunks for t in ch.token_ids] == [11, 12, 13, 14, 15]
    assert [list(r.resume_from.ids) for r in servicer.requests[1:]] == [[11, 12, 13]] * 3
    assert sleep.delays_s == [0.05, 0.03, 0.03]  # the resume's hint, then each refusal's


@pytest.mark.parametrize("step, kw, why", [
    (CUT, {"timeout_s": 0.04}, "the 50 ms hint would outlive the 40 ms deadline"),
    (Fail(grpc.StatusCode.UNAVAILABLE, "later", retry_info_ms=20_000, after_responses=(resp((11,), request_id="r"),)),
     {}, "the server's 20 s hint is past max_backoff_s"),
    (Fail(grpc.StatusCode.INTERNAL, "broken", after_responses=(resp((11,), request_id="r"),)), {},
     "only UNAVAILABLE is resumed"),
    (Fail(grpc.StatusCode.UNAVAILABLE, "cut", after_responses=(resp((11, 12, 13, 14, 15), request_id="r"),)), {},
     "all max_tokens received: nothing left to generate"),
])
async def test_no_resume_past_the_deadline_the_hint_the_codes_or_max_tokens(step, kw, why):
    servicer = ScriptedGeneration([step, REST])
    sleep = SleepLog()
    async with serve(servicer) as target, AsyncClient(target, retry=policy(), sleep=sleep) as c:
        with pytest.raises(Exception) as caught:
            await collect(c, **kw)
    assert len(servicer.requests) == 1 and sleep.delays_s == [], why
    assert caught.value.message == step.details


async def test_a_resume_withdraws_from_the_retry_budget():
    servicer = ScriptedGeneration([CUT, REST])
    async with serve(servicer) as target, AsyncClient(target, retry=policy(budget_max_tokens=0.0),
                                                      sleep=SleepLog()) as c:
        with pytest.raises(UnavailableError):
            await collect(c)
    assert len(servicer.requests) == 1


async def test_the_blocking_client_resumes():
    import asyncio

    servicer = ScriptedGeneration([CUT, REST])
    sleep = SleepLog()

    def use(target: str):
        with Client(target, retry=policy(), sleep=sleep.sync) as c:
            return c.complete("llama-3-8b", "text prompt", max_tokens=5)

    async with serve(servicer) as target:
        done = await asyncio.to_thread(use, target)
    assert done.token_ids == (11, 12, 13, 14, 15) and done.usage == Usage(4, 5, 0) and done.request_id == "req-1"
    assert servicer.requests[1].text == "text prompt" and list(servicer.requests[1].resume_from.ids) == [11, 12, 13]
    assert len(sleep.delays_s) == 1


def test_resume_arguments_are_checked():
    with pytest.raises(ValueError, match="max_resumes and resume_wait_s must be >= 0, got -1 and 10.0"):
        RetryPolicy(max_resumes=-1)
    request = build_request("m", "hi", max_tokens=8, resume_from=[5, 6])
    assert list(request.resume_from.ids) == [5, 6]
    assert not build_request("m", "hi").HasField("resume_from")


async def test_resume_must_be_a_bool_or_none():
    async with AsyncClient("127.0.0.1:1") as c:
        with pytest.raises(InvalidArgumentError) as caught:
            await collect(c, resume="yes")
    assert caught.value.field == "resume" and caught.value.message == (
        "resume: 'yes' is not a bool; use True, False or None (resume greedy requests without stop strings when "
        "the client has a retry policy)")


# --- the router: resume_from -> the request the workers serve -----------------------------------------------

LM = MODEL_PRESETS["llama-3-8b"]  # vocab 128256


def _spec(prompt: tuple[int, ...] = (5, 6, 7), max_tokens: int = 10, sim_output_len: int | None = None):
    return RequestSpec("r1", "llama-3-8b", prompt, SamplingParams(max_tokens, 0.5, 0.9, 4, ("x",), True), 2.5,
                       sim_output_len=sim_output_len)


def _request(resume_from) -> pb.GenerateRequest:
    request = pb.GenerateRequest(model="llama-3-8b", max_tokens=10)
    if resume_from is not None:
        request.resume_from.ids.extend(resume_from)
    return request


@pytest.mark.parametrize("resume_from", [None, []])
def test_without_resume_from_the_request_is_unchanged(resume_from):
    spec = _spec()
    assert convert.resumed_spec(spec, _request(resume_from), LM) is spec


def test_resume_from_extends_the_prompt_and_takes_its_tokens_off_max_tokens():
    spec = _spec(sim_output_len=8)
    resumed = convert.resumed_spec(spec, _request([100, 101, 102]), LM)
    assert resumed.prompt_token_ids == (5, 6, 7, 100, 101, 102)
    assert resumed.sampling == SamplingParams(7, 0.5, 0.9, 4, ("x",), True)
    assert (resumed.request_id, resumed.arrival_s, resumed.sim_output_len) == ("r1", 2.5, 5)


@pytest.mark.parametrize("resume_from, message", [
    ([1] * 10, "resume_from holds 10 tokens but max_tokens is 10; max_tokens counts the whole request, resumed "
               "tokens included, so nothing is left to generate: send at most 9 resumed tokens with the original "
               "max_tokens (a stream that received max_tokens tokens has finished)"),
    ([1, 128256], "resume_from token id 128256 at position 1 is outside the vocabulary of llama-3-8b (ids "
                  "0..128255); send the token ids the stream returned"),
])
def test_resume_from_refusals_name_the_field_and_what_to_change(resume_from, message):
    with pytest.raises(InvalidArgument) as caught:
        convert.resumed_spec(_spec(), _request(resume_from), LM)
    assert (caught.value.field, caught.value.message) == ("resume_from", message)


# --- the OpenAI front: its router stream resumed the same way ------------------------------------------------


@contextlib.asynccontextmanager
async def front_on(target: str, **kw):
    """The front as a process of its own would run it (a gRPC channel to `target`), on an aiohttp test server."""
    from aiohttp.test_utils import TestClient, TestServer

    from octoserve.http_front.app import Front

    front = Front(target, **kw)
    front.set_models({"llama-3-8b": 8192})
    try:
        async with TestClient(TestServer(front.app())) as http:
            yield front, http
    finally:
        await front.close()


def _events(raw: str) -> list:
    import json

    return [e[len("data: "):] if e == "data: [DONE]" else json.loads(e[len("data: "):])
            for e in raw.split("\n\n") if e]


BODY = {"model": "llama-3-8b", "prompt": [1, 2, 3, 4], "max_tokens": 5, "temperature": 0.8}


async def test_the_fronts_stream_is_resumed_and_the_client_sees_one_stream():
    servicer = ScriptedGeneration([CUT, REST])
    async with serve(servicer) as target, front_on(target) as (front, http):
        reply = await http.post("/v1/completions", json={**BODY, "stream": True,
                                                          "stream_options": {"include_usage": True}})
        events = _events(await reply.text())
        resumed = front.metrics.resumes.labels("llama-3-8b")._value.get()
    assert reply.status == 200 and events[-1] == "[DONE]"
    # Without a tokenizer each token reads as its id (the sim engine's convention, http_front/text.py).
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "".join(f"<{t}>" for t in (11, 12, 13, 14, 15))
    assert {e["id"] for e in events[:-1]} == {"cmpl-req-1"} and events[-3]["choices"][0]["finish_reason"] == "length"
    assert events[-2]["usage"]["prompt_tokens"] == 4 and events[-2]["usage"]["completion_tokens"] == 5
    first, again = servicer.requests
    assert again.request_id == "req-1" and list(again.resume_from.ids) == [11, 12, 13]
    assert again.max_tokens == 5 and abs(again.temperature - 0.8) < 1e-6  # sampled streams are resumed too
    assert resumed == 1.0


async def test_the_front_inside_the_router_resumes_through_the_servicer_itself():
    """Inside the router (`local.LocalGeneration`, no channel): a continuation the router refused is resumed."""
    from aiohttp.test_utils import TestClient, TestServer

    from octoserve.http_front.app import Front
    from octoserve.http_front.local import LocalGeneration

    servicer = ScriptedGeneration([CUT, REST])
    front = Front("in-process", stub=LocalGeneration(servicer))
    front.set_models({"llama-3-8b": 8192})
    async with TestClient(TestServer(front.app())) as http:
        reply = await http.post("/v1/completions", json=BODY)
        body = await reply.json()
    assert reply.status == 200 and body["choices"][0]["text"] == "".join(f"<{t}>" for t in (11, 12, 13, 14, 15))
    assert [list(r.resume_from.ids) for r in servicer.requests] == [[], [11, 12, 13]]


async def test_the_fronts_whole_completion_is_resumed():
    servicer = ScriptedGeneration([CUT, REST])
    async with serve(servicer) as target, front_on(target) as (_, http):
        reply = await http.post("/v1/completions", json=BODY)
        body = await reply.json()
    assert reply.status == 200 and body["choices"][0]["text"] == "".join(f"<{t}>" for t in (11, 12, 13, 14, 15))
    assert body["usage"]["completion_tokens"] == 5 and len(servicer.requests) == 2


async def test_the_fronts_resumes_are_bounded_then_the_cut_is_an_error_event():
    cut_again = Fail(grpc.StatusCode.UNAVAILABLE, "cut again", after_responses=(resp((21,), request_id="req-1"),))
    servicer = ScriptedGeneration([CUT, cut_again])
    async with serve(servicer) as target, \
            front_on(target, resume_policy=RetryPolicy(max_resumes=1, initial_backoff_s=0.0)) as (_, http):
        reply = await http.post("/v1/completions", json={**BODY, "max_tokens": 9, "stream": True})
        events = _events(await reply.text())
    assert len(servicer.requests) == 2 and events[-1] == "[DONE]"
    assert events[-2]["error"]["message"] == "cut again" and events[-2]["error"]["code"] == "unavailable"
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "<11><12><13><21>"


BUSY = Fail(grpc.StatusCode.RESOURCE_EXHAUSTED, "no healthy instance serves it right now", retry_info_ms=10)


async def test_the_fronts_resumed_request_refused_before_its_first_token_is_sent_again():
    """A router that has just restarted may refuse the resumed request: it is sent again, as the SDK retries a
    call, without counting as another resume."""
    servicer = ScriptedGeneration([CUT, BUSY, BUSY, REST])
    resume_policy = RetryPolicy(max_resumes=1, max_attempts=3, initial_backoff_s=0.0)
    async with serve(servicer) as target, front_on(target, resume_policy=resume_policy) as (_, http):
        reply = await http.post("/v1/completions", json={**BODY, "stream": True,
                                                         "stream_options": {"include_usage": True}})
        events = _events(await reply.text())
    assert reply.status == 200 and events[-1] == "[DONE]"
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "".join(f"<{t}>" for t in (11, 12, 13, 14, 15))
    assert events[-2]["usage"]["completion_tokens"] == 5
    assert [list(r.resume_from.ids) for r in servicer.requests] == [[], [11, 12, 13], [11, 12, 13], [11, 12, 13]]
    assert {r.request_id for r in servicer.requests[1:]} == {"req-1"}


async def test_the_fronts_sends_of_a_resumed_request_are_bounded_by_max_attempts():
    servicer = ScriptedGeneration([CUT, BUSY, BUSY, REST])
    resume_policy = RetryPolicy(max_resumes=1, max_attempts=2, initial_backoff_s=0.0)
    async with serve(servicer) as target, front_on(target, resume_policy=resume_policy) as (_, http):
        reply = await http.post("/v1/completions", json={**BODY, "stream": True})
        events = _events(await reply.text())
    assert len(servicer.requests) == 3 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == "overloaded"
    assert events[-2]["error"]["message"] == "no healthy instance serves it right now"
    assert "".join(e["choices"][0]["text"] for e in events[:-2]) == "<11><12><13>"
