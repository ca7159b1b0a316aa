"""SDK argument errors: every argument the wire cannot carry is an `InvalidArgumentError` naming the field and the
valid range or values, raised before anything is sent (no bare ValueError / KeyError / TypeError)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from octoserve import AsyncClient, Client, InvalidArgumentError, Priority
from octoserve.client import build_request

CASES = [
    # (kwargs, field, fragments of the message)
    (dict(max_tokens=-5), "max_tokens", ["max_tokens: -5 is out of range", "from 1 to 4294967295"]),
    (dict(max_tokens=0), "max_tokens", ["max_tokens: 0 is out of range", "from 1 to 4294967295"]),
    (dict(max_tokens=2**32), "max_tokens", ["from 1 to 4294967295"]),
    (dict(max_tokens=1.5), "max_tokens", ["max_tokens: 1.5 is not an integer"]),
    (dict(prompt=[5, -3, 7]), "prompt", ["token id -3 at position 1", "from 0 to 4294967295"]),
    (dict(prompt=[5, "x"]), "prompt", ["token id 'x' at position 1"]),
    (dict(prompt=b"hi"), "prompt", ["a bytes is not a prompt", "a str or a sequence of token ids"]),
    (dict(ttft_slo_ms=-1), "ttft_slo_ms", ["ttft_slo_ms: -1 is out of range", "None for the model's default"]),
    (dict(ttft_slo_ms=0), "ttft_slo_ms", ["ttft_slo_ms: 0 is out of range", "from 1 to 4294967295"]),
    (dict(priority="URGENT"), "priority", ["'URGENT' is not a tier", "INTERACTIVE, STANDARD, BATCH"]),
    (dict(priority=7), "priority", ["7 is not a tier", "INTERACTIVE, STANDARD, BATCH", "0-2"]),
    (dict(priority=True), "priority", ["True is not a tier"]),
    (dict(seed=-1), "seed", ["seed: -1 is out of range", "from 0 to 18446744073709551615"]),
    (dict(temperature="hot"), "temperature", ["'hot' is not a number"]),
    (dict(stop="\n"), "stop", ["is not a sequence of strings"]),
]


@pytest.mark.parametrize(("kwargs", "field", "fragments"), CASES, ids=[f"{c[1]}={list(c[0].values())[0]!r}"
                                                                           for c in CASES])
def test_sync_client_raises_typed_error_naming_the_field(kwargs, field, fragments):
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", "Hello")
    with Client("127.0.0.1:1") as client:  # nothing listens there: the error comes before any send
        with pytest.raises(InvalidArgumentError) as info:
            client.complete("llama-3-8b", prompt, **kwargs)
    error = info.value
    assert error.field == field
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.attempts == 0
    assert error.message.startswith(f"{field}: ")
    for fragment in fragments:
        assert fragment in error.message


def test_async_client_raises_the_same_errors():
    async def main():
        async with AsyncClient("127.0.0.1:1") as client:
            with pytest.raises(InvalidArgumentError) as info:
                await client.complete("llama-3-8b", "Hello", priority="URGENT")
            return info.value

    assert asyncio.run(main()).field == "priority"


@pytest.mark.parametrize("priority", ["interactive", "BATCH", Priority.STANDARD, 0, 2, None])
def test_valid_tiers_still_pass(priority):
    request = build_request("m", [1, 2], max_tokens=4, priority=priority, ttft_slo_ms=200, seed=0)
    assert list(request.token_ids.ids) == [1, 2]
    assert request.max_tokens == 4 and request.ttft_slo_ms == 200 and request.seed == 0
