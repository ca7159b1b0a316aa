"""One stop-string limit, the config's `limits.max_stop_strings`, on gRPC and HTTP alike."""

from __future__ import annotations

import aiohttp
import grpc
import pytest
from aiohttp.test_utils import TestServer

from octoserve.http_front.app import Front
from octoserve.http_front.local import LocalGeneration
from octoserve.router.app import RouterSettings
from octoserve.services.rpc.limits import Limits
from tests.service_fixtures import COLOCATED_MODEL, collect, request, start_inprocess_node


async def stop_outcomes(settings: RouterSettings | None, n: int) -> tuple:
    """(gRPC status or 'OK', gRPC message, HTTP status, HTTP error or None) for a request with n stop strings."""
    node = await start_inprocess_node(settings=settings)
    front = Front("in-process", stub=LocalGeneration(node.router_servicer))
    await front.refresh_models(timeout_s=5.0)
    server = TestServer(front.app(), host="127.0.0.1")
    await server.start_server()
    stops = [f"<stop {i}>" for i in range(n)]
    try:
        try:
            await collect(node.generation().Generate(request(stop=stops), timeout=10))
            code, details = "OK", ""
        except grpc.aio.AioRpcError as e:
            code, details = e.code().name, e.details()
        async with aiohttp.ClientSession(str(server.make_url(""))) as s:
            async with s.post("/v1/completions", json={"model": COLOCATED_MODEL, "prompt": "hello", "max_tokens": 2,
                                                       "stop": stops}) as r:
                body = await r.json()
                return code, details, r.status, body.get("error")
    finally:
        await server.close()
        await node.stop()


async def test_twenty_stop_strings_pass_both_paths_under_the_default_64():
    assert Limits().max_stop_strings == 64
    code, _, status, error = await stop_outcomes(None, 20)
    assert (code, status, error) == ("OK", 200, None)


async def test_past_the_default_both_paths_refuse_with_the_same_sentence():
    code, details, status, error = await stop_outcomes(None, 65)
    assert (code, details) == ("INVALID_ARGUMENT", "65 stop strings; send at most 64")
    assert (status, error) == (400, {"message": "65 stop strings; send at most 64", "type": "invalid_request_error",
                                     "param": "stop", "code": "invalid_argument"})


@pytest.mark.parametrize("n, refused", [(8, False), (9, True)])
async def test_the_configured_limit_holds_on_both_paths(n, refused):
    code, details, status, error = await stop_outcomes(RouterSettings(limits=Limits(max_stop_strings=8)), n)
    if refused:
        assert (code, details) == ("INVALID_ARGUMENT", "9 stop strings; send at most 8")
        assert (status, error["message"], error["param"]) == (400, "9 stop strings; send at most 8", "stop")
    else:
        assert (code, status, error) == ("OK", 200, None)
