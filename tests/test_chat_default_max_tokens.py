"""A chat without max_tokens: by default the rest of the context window (as vLLM does), and at most
`limits.chat_default_max_tokens` when the node config sets it, inside the router process and beside it."""

from __future__ import annotations

import aiohttp
import pytest

from octoserve.http_front import protocol
from octoserve.http_front.app import Front, add_arguments, config_limits
from octoserve.http_front.launch import http_front_args
from octoserve.http_front.local import serve_inside
from octoserve.router.app import RouterSettings
from octoserve.services.rpc.limits import Limits, limits_from_dict
from tests.service_fixtures import COLOCATED_MODEL, MAX_CONTEXT, start_inprocess_node

CHAT = {"model": COLOCATED_MODEL, "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}


def test_the_key_is_optional_and_positive():
    assert Limits().chat_default_max_tokens is None
    assert limits_from_dict({"chat_default_max_tokens": 512}).chat_default_max_tokens == 512
    assert limits_from_dict({"chat_default_max_tokens": None}) == Limits()  # YAML null: unset
    with pytest.raises(ValueError, match="limits.chat_default_max_tokens must be a positive integer, not 0"):
        limits_from_dict({"chat_default_max_tokens": 0})


def test_without_the_key_a_chat_asks_for_the_rest_of_the_window_and_with_it_the_cap():
    parsed = protocol.parse_chat(CHAT, {})
    assert parsed.max_tokens is None
    for cap, expected in ((None, None), (64, 64), (10**9, None)):
        front = Front("unused", stub=object(), chat_default_max_tokens=cap)
        front.models = {COLOCATED_MODEL: MAX_CONTEXT}
        req = front._grpc_request(parsed, chat=True)
        rest = MAX_CONTEXT - len(req.text.encode())
        assert req.max_tokens == (rest if expected is None else expected)
    assert protocol.parse_completion({"model": COLOCATED_MODEL, "prompt": "x"}, {}).max_tokens == 16


async def test_inside_the_router_the_configured_cap_ends_the_chat():
    node = await start_inprocess_node(settings=RouterSettings(limits=Limits(chat_default_max_tokens=5)))
    front, runner = await serve_inside(node.router_servicer, 0, None, None, 5.0, None)
    port = runner.addresses[0][1]
    try:
        async with aiohttp.ClientSession(f"http://127.0.0.1:{port}") as s:
            async with s.post("/v1/chat/completions", json=CHAT) as r:
                body = await r.json()
        assert r.status == 200, body
        assert (body["usage"]["completion_tokens"], body["choices"][0]["finish_reason"]) == (5, "length")
    finally:
        await runner.cleanup()
        await node.stop()


def test_the_front_as_its_own_process_reads_the_node_config(tmp_path):
    cfg = tmp_path / "node.yaml"
    cfg.write_text("limits:\n  chat_default_max_tokens: 256\n", encoding="utf-8")
    assert config_limits(str(cfg)).chat_default_max_tokens == 256
    assert config_limits(None) == Limits()
    args = http_front_args("127.0.0.1:1", 8000, None, 5.0, 60.0, "/etc/node.yaml")
    assert args[args.index("--config") + 1] == "/etc/node.yaml"
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    assert parser.parse_args(args).config == "/etc/node.yaml"
    assert "--config" not in http_front_args("127.0.0.1:1", 8000, None, 5.0, 60.0)
