"""The OpenAI-compatible HTTP front, driven by the official `openai` package against a real node (scheduler,
workers, router and front as separate processes on 127.0.0.1 free ports, sim engine), plus table tests of the
pure translation (http_front/protocol.py) and of the incremental detokenizer.

Every error path is checked as the exception the `openai` package raises, with the same message the gRPC API gives
for the same request.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.request

import grpc
import openai
import pytest

from octoserve.http_front import protocol
from octoserve.http_front.protocol import ApiError
from octoserve.http_front.text import DEFAULT_CHAT_TEMPLATE, Detokenizer, TextCodec
from octoserve.services.node.launcher import start_node
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from tests.service_fixtures import COLOCATED_MODEL, DISAGG_MODEL, MAX_CONTEXT, request, small_config_dict

TOKENS = [100 + i for i in range(32)]  # the prompt `tests.service_fixtures.request` sends


# ---- pure translation --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"prompt": "x"}, "model", "model is missing; name one of the models GET /v1/models lists"),
        ({"model": "m"}, "prompt", "prompt is missing or not a string or a list of token ids; send one of those"),
        ({"model": "m", "prompt": ["a", "b"]}, "prompt", "prompt is a batch of 2 prompts; send one prompt per request"),
        ({"model": "m", "prompt": [5, -1]}, "prompt",
         "prompt token id -1 at position 1 is negative; token ids are >= 0"),
        ({"model": "m", "prompt": "x", "max_tokens": -5}, "max_tokens", "max_tokens is -5; set it to at least 1"),
        ({"model": "m", "prompt": "x", "max_tokens": "5"}, "max_tokens",
         "max_tokens is '5', not an integer; send a whole number"),
        ({"model": "m", "prompt": "x", "temperature": "hot"}, "temperature", "temperature is 'hot', not a number; send a number"),
        ({"model": "m", "prompt": "x", "n": 2}, "n",
         "n is 2; this node returns one choice per request: set n to 1 or leave it unset"),
        ({"model": "m", "prompt": "x", "logprobs": 3}, "logprobs",
         "logprobs are not available from this node (its public API streams token ids and text only); leave "
         "logprobs unset"),
        ({"model": "m", "prompt": "x", "priority": "URGENT"}, "priority",
         "priority is 'URGENT'; use one of INTERACTIVE, STANDARD, BATCH"),
        ({"model": "m", "prompt": "x", "ttft_slo_ms": -1}, "ttft_slo_ms",
         "ttft_slo_ms is -1; set a positive deadline or leave it unset"),
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options",
         "stream_options is only allowed with stream: true"),
        ({"model": "m", "prompt": "x", "stop": [1]}, "stop", "stop is not a string or a list of strings"),
    ],
)
def test_bad_completion_bodies_are_400_naming_the_field(body, param, message):
    with pytest.raises(ApiError) as caught:
        protocol.parse_completion(body, {})
    assert (caught.value.status, caught.value.param, caught.value.message) == (400, param, message)
    assert caught.value.body()["error"] == {"message": message, "type": "invalid_request_error", "param": param,
                                            "code": "invalid_argument"}


def test_chat_body_with_tiers_in_headers_and_body():
    body = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}],
            "priority": "batch", "ttft_slo_ms": 900, "max_completion_tokens": 7, "stop": "\n", "seed": 3}
    parsed = protocol.parse_chat(body, {protocol.PRIORITY_HEADER: "interactive", protocol.TIMEOUT_HEADER: "2500"})
    assert (parsed.messages, parsed.priority, parsed.ttft_slo_ms, parsed.timeout_s, parsed.max_tokens,
            parsed.stop, parsed.seed, parsed.temperature) == (
        ({"role": "user", "content": "ab"},), "INTERACTIVE", 900, 2.5, 7, ("\n",), 3, 1.0)


@pytest.mark.parametrize(
    "code, retry_after_ms, status, headers, err_type, err_code",
    [
        (grpc.StatusCode.INVALID_ARGUMENT, None, 400, {}, "invalid_request_error", "invalid_argument"),
        (grpc.StatusCode.FAILED_PRECONDITION, None, 400, {}, "invalid_request_error", "slo_infeasible"),
        (grpc.StatusCode.NOT_FOUND, None, 404, {}, "invalid_request_error", "model_not_found"),
        (grpc.StatusCode.UNAUTHENTICATED, None, 401, {}, "authentication_error", "invalid_api_key"),
        (grpc.StatusCode.PERMISSION_DENIED, None, 403, {}, "permission_error", "permission_denied"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 1200, 429, {"Retry-After": "2", "retry-after-ms": "1200"},
         "overloaded_error", "overloaded"),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 40, 429, {"Retry-After": "1", "retry-after-ms": "40"},
         "overloaded_error", "overloaded"),
        (grpc.StatusCode.UNAVAILABLE, None, 503, {}, "unavailable_error", "unavailable"),
        (grpc.StatusCode.DEADLINE_EXCEEDED, None, 504, {}, "timeout_error", "deadline_exceeded"),
        (grpc.StatusCode.CANCELLED, None, 499, {}, "cancelled_error", "cancelled"),
        (grpc.StatusCode.INTERNAL, None, 500, {}, "internal_error", "internal"),
    ],
)
def test_router_statuses_map_to_http(code, retry_after_ms, status, headers, err_type, err_code):
    e = protocol.error_for_status(code, "the message", retry_after_ms)
    assert (e.status, e.headers, e.body()["error"]["type"], e.body()["error"]["code"], e.body()["error"]["message"],
            e.body()["error"]["param"]) == (status, headers, err_type, err_code, "the message", None)
    if retry_after_ms is not None:
        assert e.body()["error"]["retry_after_ms"] == retry_after_ms


def test_default_chat_template_renders_roles_and_the_generation_prompt():
    text = TextCodec().render_chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text == "<|system|>\nBe brief.<|end|>\n<|user|>\nHi<|end|>\n<|assistant|>\n"
    assert TextCodec().chat_template == DEFAULT_CHAT_TEMPLATE


def test_detokenizer_never_splits_a_character_and_adds_up_to_the_whole():
    tokenizers = pytest.importorskip("tokenizers")
    from octoserve.services.engine.test_model import build_tokenizer

    tok: tokenizers.Tokenizer = build_tokenizer(4096)
    text = "Prefill computes the prompt; décodage — 漢字 ok ✓ 3.14"
    ids = tok.encode(text, add_special_tokens=False).ids
    detok = Detokenizer(tok)
    pieces = [detok.push([i]) for i in ids] + [detok.flush()]
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)


def test_without_a_tokenizer_each_token_reads_as_its_id():
    detok = Detokenizer(None)
    assert (detok.push([1000, 1001]), detok.push([7]), detok.flush()) == ("<1000><1001>", "<7>", "")


# ---- a live node, the official client --------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["beside", "inside"])
def node(request, tmp_path_factory):
    """The front as its own process (the default) and inside the router process: every test runs on both."""
    n = start_node(small_config_dict(), time_scale=1.0, run_dir=tmp_path_factory.mktemp("http-node"),
                   startup_timeout_s=60, grace_s=5, http_port=0, http_inside=request.param == "inside")
    yield n
    n.stop()


@pytest.fixture
def client(node):
    with openai.OpenAI(base_url=node.http_url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
        yield c


def grpc_error(node, req: gen_pb.GenerateRequest) -> grpc.RpcError:
    with grpc.insecure_channel(node.router_address) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            list(gen_grpc.GenerationStub(channel).Generate(req, timeout=10))
    return caught.value



@pytest.mark.slow
def test_models_lists_the_served_models_with_their_windows(client):
    models = client.models.list()
    assert [(m.id, m.owned_by, m.max_model_len) for m in models.data] == [
        (COLOCATED_MODEL, "octoserve", MAX_CONTEXT), (DISAGG_MODEL, "octoserve", MAX_CONTEXT)]


@pytest.mark.slow
@pytest.mark.parametrize("model", [COLOCATED_MODEL, DISAGG_MODEL])
def test_completion_returns_every_token_and_the_usage(client, model):
    # A prompt no other test sends (one per model): the first run finds nothing cached; the same prompt again finds
    # its first 16-token KV block cached (the block holding the last prompt token is always computed).
    prompt = [31_000 + 100 * (model == DISAGG_MODEL) + i for i in range(32)]
    first = client.completions.create(model=model, prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True})
    again = client.completions.create(model=model, prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True})
    for r in (first, again):
        choice = r.choices[0]
        assert choice.finish_reason == "length" and choice.text.count("<") == 6
        assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (32, 6, 38)
        assert r.id.startswith("cmpl-")
    assert first.id != again.id
    assert (first.usage.prompt_tokens_details.cached_tokens, again.usage.prompt_tokens_details.cached_tokens) == (0, 16)


@pytest.mark.slow
def test_streamed_completion_equals_the_grpc_stream_and_ends_with_usage(client, node):
    with grpc.insecure_channel(node.router_address) as channel:
        grpc_ids = [i for r in gen_grpc.GenerationStub(channel).Generate(request(max_tokens=9), timeout=10)
                    for i in r.token_ids]
    chunks = list(client.completions.create(model=COLOCATED_MODEL, prompt=TOKENS, max_tokens=9, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == "".join(f"<{i}>" for i in grpc_ids)  # the sim engine's tokens are deterministic
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 9
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.slow
def test_chat_uses_the_template_and_streams_role_then_content(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = TextCodec().render_chat(messages)
    r = client.chat.completions.create(model=COLOCATED_MODEL, messages=messages, max_tokens=5,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content.count("<") == 5
    assert r.usage.prompt_tokens == len(rendered.encode())  # without a tokenizer: one token per UTF-8 byte
    stream = list(client.chat.completions.create(model=COLOCATED_MODEL, messages=messages, max_tokens=5,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert stream[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in stream) == r.choices[0].message.content
    assert stream[-1].choices[0].finish_reason == "length"


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="function")
async def test_async_client_streams_concurrent_requests(node):
    async with openai.AsyncOpenAI(base_url=node.http_url + "/v1", api_key="unused", max_retries=0) as c:
        async def one(n: int) -> tuple[int, str]:
            stream = await c.chat.completions.create(
                model=DISAGG_MODEL, messages=[{"role": "user", "content": f"request {n}"}], max_tokens=n,
                stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            content, usage = "", None
            async for chunk in stream:
                if chunk.choices:
                    content += chunk.choices[0].delta.content or ""
                usage = chunk.usage or usage
            return usage.completion_tokens, content

        results = await asyncio.gather(*(one(n) for n in (3, 5, 8)))
        assert [(n, text.count("<")) for n, text in results] == [(3, 3), (5, 5), (8, 8)]
        r = await c.completions.create(model=COLOCATED_MODEL, prompt="The scheduler", max_tokens=4,
                                       extra_body={"ignore_eos": True})
        assert r.usage.prompt_tokens == len("The scheduler") and r.usage.completion_tokens == 4


@pytest.mark.slow
def test_invalid_input_is_bad_request_with_the_grpc_message(client, node):
    err = grpc_error(node, request(max_tokens=MAX_CONTEXT))
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=COLOCATED_MODEL, prompt=TOKENS, max_tokens=MAX_CONTEXT)
    assert (caught.value.status_code, caught.value.type, caught.value.code) == (
        400, "invalid_request_error", "invalid_argument")
    assert caught.value.body["message"] == err.details()
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=COLOCATED_MODEL, prompt=TOKENS, max_tokens=4, temperature=-1)
    assert caught.value.body["message"] == grpc_error(node, request(temperature=-1)).details()
    assert (caught.value.type, caught.value.code, caught.value.param) == (
        "invalid_request_error", "invalid_argument", "temperature")


@pytest.mark.slow
def test_unknown_model_is_not_found_with_the_grpc_message(client, node):
    err = grpc_error(node, request("gpt-5"))
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-5", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert caught.value.body["message"] == err.details()
    assert (caught.value.status_code, caught.value.type, caught.value.code) == (
        404, "invalid_request_error", "model_not_found")


@pytest.mark.slow
def test_overload_is_rate_limit_with_retry_after(client, node):
    # 12,000 prompt tokens need 750 KV blocks; every instance has 703: shed at admission (see test_services_router).
    big = [100 + i % 3000 for i in range(12_000)]
    err = grpc_error(node, gen_pb.GenerateRequest(model=COLOCATED_MODEL, token_ids=gen_pb.TokenIds(ids=big),
                                                  max_tokens=4, priority=gen_pb.BATCH))
    grpc_retry_ms = int(dict(err.trailing_metadata())["retry-after-ms"])
    with pytest.raises(openai.RateLimitError) as caught:
        client.completions.create(model=COLOCATED_MODEL, prompt=big, max_tokens=4,
                                  extra_headers={"X-Octoserve-Priority": "BATCH"})
    e = caught.value
    retry_ms = int(e.response.headers["retry-after-ms"])
    assert (e.status_code, e.type, e.code) == (429, "overloaded_error", "overloaded")
    assert "no instance has KV headroom" in e.message
    assert retry_ms == e.body["retry_after_ms"] >= node_min_retry_ms(node)
    assert int(e.response.headers["Retry-After"]) == max(1, -(-retry_ms // 1000))
    assert abs(retry_ms - grpc_retry_ms) <= grpc_retry_ms  # the same order: one computed a moment later


def node_min_retry_ms(node) -> int:
    from octoserve.services.core.placement import node_config_from_dict

    return node_config_from_dict(small_config_dict()).policies.min_retry_after_ms


@pytest.mark.slow
def test_slo_infeasible_prompt_is_bad_request_saying_what_to_change(client, node):
    big = [100 + i % 3000 for i in range(9_000)]
    err = grpc_error(node, gen_pb.GenerateRequest(model=COLOCATED_MODEL, token_ids=gen_pb.TokenIds(ids=big),
                                                  max_tokens=4))
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=COLOCATED_MODEL, prompt=big, max_tokens=4)
    assert (caught.value.status_code, caught.value.type, caught.value.code) == (
        400, "invalid_request_error", "slo_infeasible")
    assert caught.value.body["message"] == err.details()


@pytest.mark.slow
def test_call_deadline_is_504(client):
    with pytest.raises(openai.InternalServerError) as caught:
        client.completions.create(model=COLOCATED_MODEL, prompt=TOKENS, max_tokens=4000,
                                  extra_headers={"X-Octoserve-Timeout-Ms": "1"})
    assert (caught.value.status_code, caught.value.type, caught.value.code) == (504, "timeout_error", "deadline_exceeded")


@pytest.mark.slow
def test_health_and_metrics(node, client):
    client.completions.create(model=COLOCATED_MODEL, prompt=TOKENS, max_tokens=3, extra_body={"ignore_eos": True})
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="not-served", prompt=TOKENS, max_tokens=3)
    with urllib.request.urlopen(node.http_url + "/health", timeout=5) as r:
        assert r.status == 200 and json.loads(r.read())["models"] == [COLOCATED_MODEL, DISAGG_MODEL]
    with urllib.request.urlopen(node.http_url + "/metrics", timeout=5) as r:
        text = r.read().decode()
    assert 'octoserve_http_requests_total{code="200",endpoint="/v1/completions"}' in text
    assert 'octoserve_http_requests_total{code="404",endpoint="/v1/completions"}' in text
    assert f'octoserve_http_streamed_tokens_total{{model="{COLOCATED_MODEL}"}}' in text
    assert 'model="not-served"' not in text  # model labels are bounded to the served models


def wait_until_draining(url: str, timeout_s: float = 10.0) -> None:
    import time
    import urllib.error

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=2).close()
        except urllib.error.HTTPError as e:
            if e.code == 503 and json.loads(e.read())["error"]["code"] == "draining":
                return
        time.sleep(0.01)
    raise AssertionError("the front did not start draining after SIGTERM")


@pytest.mark.slow
@pytest.mark.parametrize("inside", [False, True])
def test_draining_front_refuses_with_503_and_finishes_the_stream_in_flight(tmp_path, inside):
    node = start_node(small_config_dict(), time_scale=1.0, run_dir=tmp_path, startup_timeout_s=60, grace_s=10,
                      http_port=0, http_inside=inside)
    try:
        with openai.OpenAI(base_url=node.http_url + "/v1", api_key="unused", max_retries=0, timeout=30) as c:
            stream = c.completions.create(model=DISAGG_MODEL, prompt=TOKENS, max_tokens=300, stream=True,
                                          stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            chunks = iter(stream)
            first = next(chunks)
            os.kill(node.http.pid, signal.SIGTERM)
            wait_until_draining(node.http_url)  # the signal is delivered asynchronously
            with pytest.raises(openai.InternalServerError) as caught:
                c.completions.create(model=COLOCATED_MODEL, prompt=TOKENS, max_tokens=3)
            assert (caught.value.status_code, caught.value.type, caught.value.code) == (
                503, "unavailable_error", "draining")
            rest = list(chunks)
        assert rest[-1].usage.completion_tokens == 300
        assert sum(c.choices[0].text.count("<") for c in [first, *rest] if c.choices) == 300
        assert node.http.proc.wait(timeout=15) == 0
    finally:
        node.stop()


@pytest.mark.parametrize(
    "stops, pieces, expected",
    [
        ((), ["ab", "c"], "abc"),
        (("\n\n",), ["Hello\n", "\nWorld"], "Hello"),
        (("END",), ["xE", "N", "Dyz"], "x"),
        (("END", "x"), ["abcE", "Nx"], "abcEN"),
        (("zz",), ["abz", "q"], "abzq"),
    ],
)
def test_stop_trimmer_cuts_before_the_first_stop_string_whatever_the_pieces(stops, pieces, expected):
    from octoserve.http_front.text import StopTrimmer

    trim = StopTrimmer(stops)
    out = [trim.push(p) for p in pieces] + [trim.finish()]
    assert "".join(out) == expected


@pytest.mark.slow
def test_a_client_that_disconnects_mid_stream_frees_its_request(node, client):
    import time

    stream = client.completions.create(model=COLOCATED_MODEL, prompt=TOKENS, max_tokens=2000, stream=True,
                                       extra_body={"ignore_eos": True})
    next(iter(stream))
    assert router_in_flight(node) == 1
    stream.close()
    deadline = time.monotonic() + 10
    while router_in_flight(node) != 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert router_in_flight(node) == 0


def router_in_flight(node) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{node.router.metrics_port}/metrics", timeout=5) as r:
        line = next(l for l in r.read().decode().splitlines() if l.startswith("octoserve_router_in_flight_requests "))
    return float(line.split()[1])


@pytest.mark.slow
@pytest.mark.parametrize("inside", [False, True])
def test_tenant_keys_reach_the_router_and_a_bad_key_is_authentication_error(tmp_path, inside):
    config = {**small_config_dict(), "tenants": {"require_api_key": True, "list": [{"name": "team-a", "key": "k-a"}]}}
    node = start_node(config, time_scale=1.0, run_dir=tmp_path, startup_timeout_s=60, grace_s=5, http_port=0,
                      http_inside=inside)
    try:
        with openai.OpenAI(base_url=node.http_url + "/v1", api_key="k-a", max_retries=0, timeout=30) as c:
            r = c.completions.create(model=COLOCATED_MODEL, prompt=TOKENS, max_tokens=3, extra_body={"ignore_eos": True})
            assert r.usage.completion_tokens == 3
        with openai.OpenAI(base_url=node.http_url + "/v1", api_key="wrong", max_retries=0, timeout=30) as c:
            with pytest.raises(openai.AuthenticationError) as caught:
                c.completions.create(model=COLOCATED_MODEL, prompt=TOKENS, max_tokens=3)
        assert (caught.value.status_code, caught.value.type, caught.value.code) == (
            401, "authentication_error", "invalid_api_key")
    finally:
        node.stop()
