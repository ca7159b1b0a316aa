"""top_p = 0: `top_p` is an optional field on the wire, so the router tells an explicit 0 from unset and refuses it
naming top_p, as it refuses 1.5; unset is 1.0. The SDK and the HTTP front refuse 0 before sending."""

from __future__ import annotations

import aiohttp
import grpc
import pytest
from aiohttp.test_utils import TestServer

from octoserve import InvalidArgumentError
from octoserve.client import build_request
from octoserve.http_front.app import Front
from octoserve.http_front.local import LocalGeneration
from octoserve.http_front.protocol import field_from_trailers
from octoserve.services.rpc import convert
from tests.service_fixtures import COLOCATED_MODEL, collect, request, start_inprocess_node


def test_sdk_refuses_an_explicit_zero_before_sending():
    with pytest.raises(InvalidArgumentError) as caught:
        build_request(COLOCATED_MODEL, [1, 2, 3], top_p=0)
    assert caught.value.field == "top_p" and caught.value.attempts == 0
    assert str(caught.value).startswith("top_p: 0 is out of range; use a number in (0, 1] (1 disables nucleus "
                                        "sampling), or temperature=0 for greedy decoding")
    assert build_request(COLOCATED_MODEL, [1, 2, 3], top_p=0.5).top_p == 0.5


async def test_http_and_raw_grpc_refuse_an_explicit_zero_and_serve_unset_as_one():
    node = await start_inprocess_node()
    front = Front("in-process", stub=LocalGeneration(node.router_servicer))
    await front.refresh_models(timeout_s=5.0)
    server = TestServer(front.app(), host="127.0.0.1")
    await server.start_server()
    try:
        # raw gRPC: an explicit 0 is on the wire (optional field) and refused naming top_p, as 1.5 is
        for bad in (0.0, 1.5):
            explicit = request(max_tokens=2, top_p=bad)
            assert explicit.HasField("top_p") and explicit.SerializeToString() != request(max_tokens=2).SerializeToString()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await collect(node.generation().Generate(explicit, timeout=10))
            assert (refused.value.code(), refused.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT, f"top_p is {bad}; set it in (0, 1] (1 disables nucleus sampling)")
            assert field_from_trailers(refused.value.trailing_metadata()) == "top_p"
        # unset (absent on the wire) is 1.0: served
        unset = request(max_tokens=2)
        assert not unset.HasField("top_p")
        out = await collect(node.generation().Generate(unset, timeout=10))
        assert out[-1].usage.completion_tokens == 2
        assert convert.spec_from_public(unset, "r", 0.0).sampling.top_p == 1.0
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
