"""top_p = 0: proto3 cannot tell it from unset, so gRPC reads 0 as 1.0 (documented); the SDK and the HTTP front, which
can see an explicit 0, refuse it naming top_p, as the router refuses 1.5."""

from __future__ import annotations

import aiohttp
import pytest
from aiohttp.test_utils import TestServer

from octoserve import InvalidArgumentError
from octoserve.client import build_request
from octoserve.http_front.app import Front
from octoserve.http_front.local import LocalGeneration
from tests.service_fixtures import COLOCATED_MODEL, collect, request, start_inprocess_node


def test_sdk_refuses_an_explicit_zero_before_sending():
    with pytest.raises(InvalidArgumentError) as caught:
        build_request(COLOCATED_MODEL, [1, 2, 3], top_p=0)
    assert caught.value.field == "top_p" and caught.value.attempts == 0
    assert str(caught.value).startswith("top_p: 0 is out of range (on the wire 0 means unset, i.e. 1.0); use a "
                                        "number in (0, 1], or temperature=0 for greedy decoding")
    assert build_request(COLOCATED_MODEL, [1, 2, 3], top_p=0.5).top_p == 0.5


async def test_http_refuses_zero_and_above_one_and_grpc_reads_zero_as_unset():
    node = await start_inprocess_node()
    front = Front("in-process", stub=LocalGeneration(node.router_servicer))
    await front.refresh_models(timeout_s=5.0)
    server = TestServer(front.app(), host="127.0.0.1")
    await server.start_server()
    try:
        # gRPC: 0 is the wire's unset, served with top_p 1.0
        out = await collect(node.generation().Generate(request(max_tokens=2, top_p=0.0), timeout=10))
        assert out[-1].usage.completion_tokens == 2
        async with aiohttp.ClientSession(str(server.make_url(""))) as s:
            body = {"model": COLOCATED_MODEL, "prompt": "hello", "max_tokens": 2}
            async with s.post("/v1/completions", json={**body, "top_p": 0}) as r:
                assert (r.status, await r.json()) == (400, {"error": {
                    "message": "top_p is 0; set it in (0, 1] (1 disables nucleus sampling; for greedy decoding set "
                               "temperature to 0)",
                    "type": "invalid_request_error", "param": "top_p", "code": "invalid_argument"}})
            async with s.post("/v1/chat/completions", json={"model": COLOCATED_MODEL, "max_tokens": 2, "top_p": 0.0,
                                                            "messages": [{"role": "user", "content": "hi"}]}) as r:
                assert r.status == 400 and (await r.json())["error"]["param"] == "top_p"
            async with s.post("/v1/completions", json={**body, "top_p": 1.5}) as r:
                assert (r.status, (await r.json())["error"]["param"]) == (400, "top_p")
            async with s.post("/v1/completions", json={**body, "top_p": 0.5}) as r:
                assert r.status == 200
    finally:
        await server.close()
        await node.stop()
