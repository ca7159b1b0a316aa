"""Every HTTP error is OpenAI's JSON (`{"error": {"message", "type", "param", "code"}}`), `param` naming the field
at fault, whether the front or the router rejects it, for the front inside the router process and beside it."""

from __future__ import annotations

import contextlib

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from octoserve.http_front.app import Front
from octoserve.http_front.local import LocalGeneration
from tests.service_fixtures import COLOCATED_MODEL, MAX_CONTEXT, start_inprocess_node


@contextlib.asynccontextmanager
async def front_session(where: str):
    node = await start_inprocess_node()
    front = Front(node.router.address) if where == "beside" else Front(
        "in-process", stub=LocalGeneration(node.router_servicer))
    await front.refresh_models(timeout_s=5.0)
    server = TestServer(front.app(), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession(str(server.make_url(""))) as session:
            yield session
    finally:
        await server.close()
        await front.close()
        await node.stop()


async def error_of(response: aiohttp.ClientResponse) -> dict:
    assert response.content_type == "application/json", (response.status, await response.text())
    body = await response.json()
    assert set(body) == {"error"}
    assert {"message", "type", "param", "code"} <= set(body["error"])
    assert body["error"]["message"]
    return body["error"]


@pytest.mark.parametrize("where", ["inside", "beside"])
async def test_router_rejections_name_the_field(where):
    async with front_session(where) as s:
        cases = [
            ({"max_tokens": -1}, "max_tokens", "max_tokens is -1; set it to at least 1"),
            ({"max_tokens": 0}, "max_tokens", "max_tokens is 0; set it to at least 1"),
            ({"prompt": "x" * MAX_CONTEXT}, "prompt",
             f"the prompt of {MAX_CONTEXT} tokens does not fit the {MAX_CONTEXT}-token context window of "
             f"{COLOCATED_MODEL}; shorten it to at most {MAX_CONTEXT - 1} tokens"),
            ({"prompt": [1] * MAX_CONTEXT}, "prompt",
             f"the prompt of {MAX_CONTEXT} tokens does not fit the {MAX_CONTEXT}-token context window of "
             f"{COLOCATED_MODEL}; shorten it to at most {MAX_CONTEXT - 1} tokens"),
        ]
        for extra, param, message in cases:
            body = {"model": COLOCATED_MODEL, "prompt": "hello", "max_tokens": 4, **extra}
            async with s.post("/v1/completions", json=body) as r:
                assert r.status == 400
                assert await error_of(r) == {"message": message, "type": "invalid_request_error", "param": param,
                                             "code": "invalid_argument"}
        raw = f'{{"model": "{COLOCATED_MODEL}", "prompt": "hello", "max_tokens": 4, "temperature": NaN}}'
        async with s.post("/v1/completions", data=raw, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            err = await error_of(r)
            assert (err["param"], err["code"], err["type"]) == ("temperature", "invalid_argument",
                                                                "invalid_request_error")
            assert err["message"].startswith("temperature is nan; ")
        chat = {"model": COLOCATED_MODEL, "messages": [{"role": "user", "content": "x" * MAX_CONTEXT}]}
        async with s.post("/v1/chat/completions", json=chat) as r:
            assert r.status == 400
            assert (await error_of(r))["param"] == "messages"


@pytest.mark.parametrize("where", ["inside"])
async def test_unknown_paths_wrong_methods_and_bad_json_are_openai_errors(where):
    async with front_session(where) as s:
        async with s.get("/v1/nothing") as r:
            assert r.status == 404
            assert await error_of(r) == {
                "message": "no endpoint GET /v1/nothing; this node serves POST /v1/completions, "
                           "POST /v1/chat/completions, GET /v1/models, GET /health and GET /metrics",
                "type": "invalid_request_error", "param": None, "code": "unknown_url"}
        async with s.get("/v1/completions") as r:
            assert r.status == 405
            assert r.headers["Allow"] == "POST"
            assert await error_of(r) == {"message": "/v1/completions does not accept GET; use POST",
                                         "type": "invalid_request_error", "param": None,
                                         "code": "method_not_allowed"}
        async with s.post("/v1/completions", data=b"{not json", headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400
            err = await error_of(r)
            assert (err["code"], err["param"], err["type"]) == ("invalid_json", None, "invalid_request_error")
            assert err["message"].startswith("the request body is not valid JSON (")
        async with s.post("/v1/completions", json=[1, 2]) as r:
            assert r.status == 400
            assert await error_of(r) == {"message": "the request body is a JSON list, not an object; send a JSON "
                                                    "object", "type": "invalid_request_error", "param": None,
                                         "code": "invalid_json"}
