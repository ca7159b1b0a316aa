"""A router SIGKILLed mid-stream under `up`'s supervisor (sim engine, every process on 127.0.0.1): streams that resume
go on from where they stopped on the restarted router and complete, token for token what an uninterrupted greedy
run gives, with usage for the whole request; a stream that does not resume ends UNAVAILABLE, as before.

Clients on one node, all mid-stream when the router dies:
- SDK streams with `resume=True` (token-id prompts and a text prompt) and one with the default `resume=None` under a
  retry policy (greedy, no stop strings: resumed by default);
- one SDK stream with `resume=False`;
- one SSE stream through the OpenAI front running as a process of its own (`up --http-process`), whose gRPC
  stream to the router is cut the same way.
A worker SIGKILLed mid-stream on a node that may not continue a request itself (`max_continuations: 0`): the router
ends the lost worker's streams UNAVAILABLE with a retry hint, and the SDK (resumed by default: greedy, a retry
policy) and the OpenAI front inside the router resume them on the surviving replica, with the same guarantees.
Nothing here asserts a duration; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal

import aiohttp
import grpc
import pytest

from octoserve.client import AsyncClient, RetryPolicy, UnavailableError
from octoserve.services.core.sim_executor import sim_token_id
from octoserve.services.node.launcher import start_node
from octoserve.types import FinishReason
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from tests.fault_fixtures import prompt, router_log, two_replica_config, until, wait_all_free
from tests.service_fixtures import COLOCATED_MODEL

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="function")]

MAX_TOKENS = 400  # long enough that every stream is still decoding when the router dies (~10 ms a token)
POLICY = RetryPolicy(max_resumes=2, resume_wait_s=60.0, max_attempts=10, max_backoff_s=2.0)


def greedy_tokens(prompt_ids) -> list[int]:
    """What an uninterrupted greedy run of the sim model streams (ignore_eos: all MAX_TOKENS of them)."""
    return [sim_token_id(len(prompt_ids), prompt_ids[0], p) for p in range(MAX_TOKENS)]


class SdkStream:
    def __init__(self, prompt_, resume: bool | None) -> None:
        self.prompt, self.resume = prompt_, resume
        self.tokens: list[int] = []
        self.chunks = []
        self.error: Exception | None = None

    async def run(self, client: AsyncClient) -> None:
        try:
            async for chunk in client.generate(COLOCATED_MODEL, self.prompt, max_tokens=MAX_TOKENS, ignore_eos=True,
                                               resume=self.resume, timeout_s=120.0):
                self.chunks.append(chunk)
                self.tokens.extend(chunk.token_ids)
        except UnavailableError as e:
            self.error = e


class SseStream:
    """A streamed /v1/completions through the front: the text of its events, its usage, its error if any."""

    def __init__(self, prompt_ids: list[int]) -> None:
        self.prompt = prompt_ids
        self.text: list[str] = []
        self.usage: dict | None = None
        self.finish: str | None = None
        self.error: dict | None = None

    async def run(self, url: str) -> None:
        body = {"model": COLOCATED_MODEL, "prompt": self.prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.post(f"{url}/v1/completions", json=body) as reply:
                assert reply.status == 200, await reply.text()
                async for line in reply.content:
                    line = line.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[len("data: "):])
                    if "error" in event:
                        self.error = event["error"]
                    elif event.get("usage"):
                        self.usage = event["usage"]
                    else:
                        self.text.append(event["choices"][0]["text"])
                        self.finish = event["choices"][0]["finish_reason"] or self.finish

    @property
    def num_text_events(self) -> int:
        return sum(1 for t in self.text if t)


@pytest.fixture
def node(tmp_path):
    n = start_node(two_replica_config(), time_scale=1.0, run_dir=tmp_path, startup_timeout_s=90, grace_s=3,
                   supervise=True, http_port=0, http_inside=False)
    yield n
    n.stop()


async def test_streams_resume_across_a_router_killed_mid_stream(node):
    text_prompt = "resume me across a router restart, please"
    resumed = [SdkStream(prompt(48, salt).ids, True) for salt in range(3)]
    resumed.append(SdkStream(text_prompt, True))
    by_default = SdkStream(prompt(40, 7).ids, None)
    not_resumed = SdkStream(prompt(40, 8).ids, False)
    sse = SseStream(list(prompt(36, 9).ids))
    sdk_streams = [*resumed, by_default, not_resumed]

    async with AsyncClient(node.router_address, retry=POLICY) as client:
        tasks = [asyncio.create_task(s.run(client)) for s in sdk_streams]
        tasks.append(asyncio.create_task(sse.run(node.http_url)))
        await until(lambda: all(s.tokens for s in sdk_streams) and sse.num_text_events > 0, 60,
                    "every stream has tokens")
        os.kill(node.router.pid, signal.SIGKILL)
        # Every stream was cut mid-way: none had all its tokens when the router died.
        cut_at = {id(s): len(s.tokens) for s in sdk_streams}
        assert all(n < MAX_TOKENS for n in cut_at.values()), cut_at
        assert sse.finish is None
        await asyncio.wait_for(asyncio.gather(*tasks), 180)

    # Resumed: complete, exactly the uninterrupted greedy tokens, under one request id, usage for the whole request.
    for s in [*resumed, by_default]:
        prompt_ids = list(s.prompt.encode()) if isinstance(s.prompt, str) else list(s.prompt)
        assert s.error is None, s.error
        assert s.tokens == greedy_tokens(prompt_ids)
        assert len({c.request_id for c in s.chunks}) == 1
        last = s.chunks[-1]
        assert last.finish_reason == FinishReason.LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(prompt_ids), MAX_TOKENS)
    # Not resumed: UNAVAILABLE after the tokens it had, as before.
    assert isinstance(not_resumed.error, UnavailableError)
    assert 0 < len(not_resumed.tokens) < MAX_TOKENS
    assert not_resumed.tokens == greedy_tokens(not_resumed.prompt)[:len(not_resumed.tokens)]
    # The front's SSE stream: resumed too; each token reads as <id> without a tokenizer.
    assert sse.error is None, sse.error
    assert "".join(sse.text) == "".join(f"<{t}>" for t in greedy_tokens(sse.prompt))
    assert sse.finish == "length"
    assert (sse.usage["prompt_tokens"], sse.usage["completion_tokens"]) == (len(sse.prompt), MAX_TOKENS)
    with open(node.http.log_file) as log:
        assert sum(1 for line in log if "resuming a cut stream" in line) == 1

    assert node.supervisor.restarts("router") == 1
    await wait_all_free(node)  # the lost router's streams were aborted, the resumed ones finished


async def test_the_router_refuses_a_resume_with_nothing_left_to_generate(node):
    request = gen_pb.GenerateRequest(model=COLOCATED_MODEL, token_ids=prompt(16, 1), max_tokens=4)
    request.resume_from.ids.extend([1001, 1002, 1003, 1004])
    async with grpc.aio.insecure_channel(node.router_address) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in gen_grpc.GenerationStub(channel).Generate(request, timeout=30):
                pass
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (
        "resume_from holds 4 tokens but max_tokens is 4; max_tokens counts the whole request, resumed tokens "
        "included, so nothing is left to generate: send at most 3 resumed tokens with the original max_tokens (a "
        "stream that received max_tokens tokens has finished)")


@pytest.fixture
def no_continuation_node(tmp_path):
    config = {**two_replica_config(), "policies": {"max_continuations": 0}}
    for instance in config["instances"]:
        instance["gpu_memory_utilization"] = 0.5  # room for every stream on the surviving replica
    n = start_node(config, time_scale=1.0, run_dir=tmp_path, startup_timeout_s=90, grace_s=3, supervise=True,
                   http_port=0, router_args=("--access-log", "all"))
    yield n
    n.stop()


async def test_streams_refused_a_continuation_by_the_router_resume_on_the_surviving_replica(no_continuation_node):
    node = no_continuation_node
    sdk_streams = [SdkStream(prompt(48, 20 + salt).ids, None) for salt in range(6)]
    sse_streams = [SseStream(list(prompt(40, 30 + salt).ids)) for salt in range(4)]
    async with AsyncClient(node.router_address, retry=POLICY) as client:
        tasks = [asyncio.create_task(s.run(client)) for s in sdk_streams]
        tasks += [asyncio.create_task(s.run(node.http_url)) for s in sse_streams]
        await until(lambda: all(s.tokens for s in sdk_streams) and all(s.num_text_events for s in sse_streams), 60,
                    "every stream has tokens")
        os.kill(node.workers["c0"].pid, signal.SIGKILL)
        assert all(len(s.tokens) < MAX_TOKENS for s in sdk_streams) and all(s.finish is None for s in sse_streams)
        await asyncio.wait_for(asyncio.gather(*tasks), 180)

    for s in sdk_streams:
        assert s.error is None, s.error
        assert s.tokens == greedy_tokens(s.prompt)
        assert (s.chunks[-1].usage.prompt_tokens, s.chunks[-1].usage.completion_tokens) == (len(s.prompt), MAX_TOKENS)
    for s in sse_streams:
        assert s.error is None, s.error
        assert "".join(s.text) == "".join(f"<{t}>" for t in greedy_tokens(s.prompt))
        assert (s.usage["prompt_tokens"], s.usage["completion_tokens"]) == (len(s.prompt), MAX_TOKENS)
    # The router's account: a stream cut on c0 has a failed line there (UNAVAILABLE, no continuation allowed) and
    # an ok line on c1 under the same request id, for the tokens after the cut. The router writes a line as its
    # stream ends, which a loaded machine may put after the client read the last token: read once each request
    # has its ok line (bounded).
    def access_lines() -> dict[str, list[dict]]:
        out: dict[str, list[dict]] = {}
        for entry in router_log(node):
            if entry.get("logger") == "octoserve.router.access":
                out.setdefault(entry["request_id"], []).append(entry)
        return out

    streams = len(sdk_streams) + len(sse_streams)
    await until(lambda: (len(got := access_lines()) == streams
                         and all(any(e["outcome"] == "ok" for e in l) for l in got.values())),
                30, "an ok access-log line for every stream")
    lines = access_lines()
    cut = {rid: l for rid, l in lines.items() if len(l) == 2}
    assert cut, "no stream was on c0"
    for first, second in cut.values():
        assert (first["instances"], first["code"], second["instances"], second["outcome"]) == \
            (["c0"], "UNAVAILABLE", ["c1"], "ok")
        assert first["tokens_out"] + second["tokens_out"] == MAX_TOKENS
        assert "resumed_tokens" not in first and second["resumed_tokens"] == first["tokens_out"]
    assert all(len(l) == 1 and l[0]["instances"] == ["c1"] for rid, l in lines.items() if rid not in cut)
    assert len(lines) == len(sdk_streams) + len(sse_streams)
    sdk_cut = {s.chunks[0].request_id for s in sdk_streams} & cut.keys()
    num_sse_cut = len(cut) - len(sdk_cut)
    assert sdk_cut, "no SDK stream was on c0"
    # The front resumed each of its streams that were on c0, once (how many were is the router's choice: 0-4).
    assert _front_resumes(node.http_url) == num_sse_cut
    await wait_all_free(node)


def _front_resumes(url: str) -> float:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=5) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("octoserve_http_resumed_streams_total{"):
                return float(line.rsplit(" ", 1)[1])
    return 0.0
