"""A prompt over the router's transport message limit is invalid input: the SDK raises InvalidArgumentError after one
send (never retried), the HTTP front beside the router answers 400 invalid_request_error naming the limit; the
router's own RESOURCE_EXHAUSTED (an overload, with RetryInfo) stays an OverloadedError."""

from __future__ import annotations

import aiohttp
import grpc
import pytest
from aiohttp.test_utils import TestServer

from octoserve import AsyncClient, InvalidArgumentError, OverloadedError, RetryPolicy
from octoserve.http_front.app import Front
from octoserve.services.rpc.status import retry_trailers
from tests.service_fixtures import COLOCATED_MODEL, start_inprocess_node

PROMPT = "x" * (9 * 1000 * 1000)  # 9 MB: past the default transport limit, 2 x 4 MiB
LIMIT = 2 * 4 * 1024 * 1024


def expected_message(size: int) -> str:
    return (f"the message is {size} bytes, over the {LIMIT}-byte gRPC message size the receiving side accepts; "
            "shorten the prompt (send it as token ids, or split the work), or raise the node's "
            "limits.max_message_bytes (the router's transport accepts twice that)")


async def test_sdk_and_http_treat_a_9mb_prompt_as_invalid_input():
    node = await start_inprocess_node()
    front = Front(node.router.address)  # the front as its own process: a gRPC client of the router
    await front.refresh_models(timeout_s=5.0)
    server = TestServer(front.app(), host="127.0.0.1")
    await server.start_server()
    try:
        async with AsyncClient(node.router.address, retry=RetryPolicy()) as client:
            with pytest.raises(InvalidArgumentError) as caught:
                await client.complete(COLOCATED_MODEL, PROMPT, max_tokens=4)
        e = caught.value
        assert (e.code, e.attempts, e.field) == (grpc.StatusCode.INVALID_ARGUMENT, 1, "prompt")
        sdk_size = int(e.message.split()[3])
        assert sdk_size > len(PROMPT) and e.message == expected_message(sdk_size)
        async with aiohttp.ClientSession(str(server.make_url(""))) as s:
            async with s.post("/v1/completions", json={"model": COLOCATED_MODEL, "prompt": PROMPT,
                                                       "max_tokens": 4}) as r:
                body = await r.json()
        assert r.status == 400
        err = body["error"]
        assert (err["type"], err["code"], err["param"]) == ("invalid_request_error", "invalid_argument", "prompt")
        size = int(err["message"].split()[3])
        assert size > len(PROMPT) and err["message"] == expected_message(size)
    finally:
        await server.close()
        await front.close()
        await node.stop()


def test_only_the_transport_wording_without_a_retry_delay_counts_as_too_large():
    from octoserve.client import error_from_rpc, message_too_large

    details = f"Received message larger than max (9000017 vs. {LIMIT})"
    assert message_too_large(grpc.StatusCode.RESOURCE_EXHAUSTED, details, ()) == expected_message(9000017)
    overloaded = retry_trailers(grpc.StatusCode.RESOURCE_EXHAUSTED, details, 250)
    assert message_too_large(grpc.StatusCode.RESOURCE_EXHAUSTED, details, overloaded) is None
    assert message_too_large(grpc.StatusCode.RESOURCE_EXHAUSTED, "queue full; retry later", ()) is None
    assert message_too_large(grpc.StatusCode.INVALID_ARGUMENT, details, ()) is None

    class Rpc(grpc.RpcError):
        def __init__(self, details, trailers):
            self._d, self._t = details, trailers

        def code(self):
            return grpc.StatusCode.RESOURCE_EXHAUSTED

        def details(self):
            return self._d

        def trailing_metadata(self):
            return self._t

    assert type(error_from_rpc(Rpc(details, ()))) is InvalidArgumentError
    router_overload = error_from_rpc(Rpc("the node is full", overloaded))
    assert type(router_overload) is OverloadedError and router_overload.retry_after_ms == 250
