"""Tenants at the router: API keys, token-bucket rate limits, fair sharing, and keys that never reach a log."""

from __future__ import annotations

import logging

import aiohttp
import grpc
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer

from octoserve.http_front.app import Front
from octoserve.http_front.local import LocalGeneration
from octoserve.router.servicer import RouterSettings
from octoserve.router.tenants import (
    TenantGate, TenantSettings, TenantSpec, TokenBucket, hash_key, tenant_settings_from_dict,
)
from octoserve.services.core.errors import Overloaded, Unauthenticated
from octoserve.services.core.types import Priority
from octoserve.services.rpc.status import RETRY_AFTER_MS_KEY
from octoserve.v1 import generate_pb2 as gen_pb
from tests.service_fixtures import COLOCATED_MODEL, DISAGG_MODEL, collect, request, start_inprocess_node

KEY_A, KEY_B, KEY_LIMITED = "key-a-Zx81", "key-b-Qp27", "key-limited-Lm55"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def gate(clock=None, **kw) -> TenantGate:
    tenants = (TenantSpec("a", (hash_key(KEY_A),)), TenantSpec("b", (hash_key(KEY_B),)))
    return TenantGate(TenantSettings(tenants, **kw), clock or Clock())


def test_identify_by_bearer_or_x_api_key_and_refuse_unknown_or_missing_keys():
    g = gate()
    assert g.identify([("authorization", f"Bearer {KEY_A}")]) == "a"
    assert g.identify([("x-api-key", KEY_B)]) == "b"
    with pytest.raises(Unauthenticated) as missing:
        g.identify([])
    assert "authorization: Bearer" in missing.value.message
    with pytest.raises(Unauthenticated) as unknown:
        g.identify([("authorization", "Bearer not-a-key-123")])
    assert "not-a-key-123" not in unknown.value.message
    open_gate = gate(require_api_key=False)
    assert open_gate.identify([]) == "default"
    assert TenantGate(TenantSettings()).identify([("authorization", "Bearer anything")]) == "default"


def test_config_section_keeps_only_digests_and_checks_values():
    s = tenant_settings_from_dict({"list": [{"name": "a", "key": KEY_A, "rate_rps": 5, "burst": 10},
                                            {"name": "b", "key_sha256": hash_key(KEY_B).upper(), "weight": 3}]})
    assert s.tenants[0].key_sha256 == (hash_key(KEY_A),) and KEY_A not in repr(s)
    assert s.tenants[1].key_sha256 == (hash_key(KEY_B),) and s.tenants[1].weight == 3.0
    for bad, match in (({"list": [{"name": "a"}, {"name": "a"}]}, "unique name"),
                       ({"list": [{"name": "a", "weight": 0}]}, "positive"),
                       ({"tenant": []}, "unknown key")):
        with pytest.raises(ValueError, match=match):
            tenant_settings_from_dict(bad)


def test_token_bucket_allows_its_burst_then_its_rate():
    b = TokenBucket(rate_rps=2.0, burst=3, now=0.0)
    assert [b.take(0.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take(0.0) == pytest.approx(0.5)
    assert b.take(0.5) == 0.0  # one token refilled
    assert b.take(0.5) == pytest.approx(0.5)


def test_rate_limited_tenant_gets_the_wait_as_its_retry_hint():
    clock = Clock()
    g = TenantGate(TenantSettings((TenantSpec("a", (hash_key(KEY_A),), rate_rps=10.0, burst=2),)), clock)
    g.admit("a", "m", Priority.STANDARD, "r1", 50)
    g.admit("a", "m", Priority.STANDARD, "r2", 50)
    with pytest.raises(Overloaded) as e:
        g.admit("a", "m", Priority.STANDARD, "r3", 50)
    assert e.value.retry_after_ms == 101 and "rate limit of 10 req/s" in e.value.reason
    assert g.in_flight("m") == {"a": 2}  # the refused request holds nothing


def test_a_flooding_tenant_is_held_to_its_share_and_the_other_never_is():
    clock = Clock()
    g = gate(clock)
    for i in range(20):  # tenant a alone fills the model; the policy then sheds at 20 in flight
        g.admit("a", "m", Priority.STANDARD, f"a{i}", 50)
    g.on_shed("m")  # capacity learned: 20
    for i in range(3):
        g.admit("b", "m", Priority.STANDARD, f"b{i}", 50)
    clock.now += 0.1
    with pytest.raises(Overloaded) as e:  # a holds 20 > its allowance (20 - room kept for b's peak of 3)
        g.admit("a", "m", Priority.STANDARD, "a-more", 50)
    assert "over its fair share" in e.value.reason
    for i in range(3, 12):  # b rides a burst past its half share: never refused for fairness while a holds more
        g.admit("b", "m", Priority.STANDARD, f"b{i}", 50)
    assert g.in_flight("m") == {"a": 20, "b": 12}
    for i in range(20):
        g.release(f"a{i}")
    for i in range(12):
        g.release(f"b{i}")
    assert g.in_flight("m") == {}


def test_alone_a_tenant_is_limited_by_the_admission_policy_only():
    clock = Clock()
    g = gate(clock)
    for i in range(10):
        g.admit("a", "m", Priority.STANDARD, f"a{i}", 50)
    g.on_shed("m")
    for i in range(10, 40):
        g.admit("a", "m", Priority.STANDARD, f"a{i}", 50)
    assert g.in_flight("m") == {"a": 40}


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def node():
    tenants = tenant_settings_from_dict({"list": [
        {"name": "alpha", "key": KEY_A}, {"name": "beta", "key": KEY_B},
        {"name": "limited", "key": KEY_LIMITED, "rate_rps": 0.5, "burst": 1}]})
    n = await start_inprocess_node(settings=RouterSettings(tenants=tenants))
    yield n
    await n.stop()


async def _status(stub, metadata):
    try:
        out = await collect(stub.Generate(request(max_tokens=4), metadata=metadata, timeout=10.0))
        return grpc.StatusCode.OK, "", out, ()
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details(), [], e.trailing_metadata()


@pytest.mark.asyncio(loop_scope="module")
async def test_api_keys_over_grpc_and_no_key_in_any_log(node, caplog):
    caplog.set_level(logging.DEBUG)
    stub = node.generation()
    code, _, out, _ = await _status(stub, (("authorization", f"Bearer {KEY_A}"),))
    assert code == grpc.StatusCode.OK and sum(len(r.token_ids) for r in out) == 4
    code, details, _, _ = await _status(stub, ())
    assert code == grpc.StatusCode.UNAUTHENTICATED and "API key" in details
    code, details, _, _ = await _status(stub, (("authorization", "Bearer wrong-key-Hh42"),))
    assert code == grpc.StatusCode.UNAUTHENTICATED and "wrong-key-Hh42" not in details
    code, _, _, _ = await _status(stub, (("x-api-key", KEY_LIMITED),))
    assert code == grpc.StatusCode.OK
    code, details, _, trailers = await _status(stub, (("x-api-key", KEY_LIMITED),))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "rate limit" in details
    assert int(dict(trailers)[RETRY_AFTER_MS_KEY]) > 0
    await node.wait_all_free()
    logged = caplog.text + "".join(str(getattr(r, "fields", "")) for r in caplog.records)
    for key in (KEY_A, KEY_B, KEY_LIMITED, "wrong-key-Hh42"):
        assert key not in logged
    assert node.router_servicer.tenants.in_flight(COLOCATED_MODEL) == {}


async def _list_models(stub, metadata):
    try:
        reply = await stub.ListModels(gen_pb.ListModelsRequest(), metadata=metadata, timeout=10.0)
        return grpc.StatusCode.OK, "", [m.name for m in reply.models]
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details(), []


@pytest.mark.asyncio(loop_scope="module")
async def test_list_models_checks_the_key_as_generate_does(node):
    stub = node.generation()
    assert await _list_models(stub, (("authorization", f"Bearer {KEY_A}"),)) == (grpc.StatusCode.OK, "", [COLOCATED_MODEL, DISAGG_MODEL])
    assert await _list_models(stub, (("x-api-key", KEY_B),)) == (grpc.StatusCode.OK, "", [COLOCATED_MODEL, DISAGG_MODEL])
    assert await _list_models(stub, ()) == (
        grpc.StatusCode.UNAUTHENTICATED, "this node requires an API key; send it as `authorization: Bearer <key>` metadata", [])
    assert await _list_models(stub, (("authorization", "Bearer wrong-key-Hh42"),)) == (
        grpc.StatusCode.UNAUTHENTICATED, "the API key is not known to this node; check the key your operator issued", [])


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize("where", ["inside", "beside"])
async def test_http_models_needs_the_key_and_the_front_still_starts_and_reports_healthy(node, where):
    """GET /v1/models with the client's key (401 without, as a completion); the front's own keyless refreshes
    (startup, /health) still find the router up, beside it knowing the models from the node config."""
    if where == "inside":
        front = Front("in-process", stub=LocalGeneration(node.router_servicer))
    else:
        front = Front(node.router.address)
        front.set_models({name: spec.max_context_len for name, spec in node.config.models.items()})
    await front.refresh_models(timeout_s=5.0)
    assert sorted(front.models) == [COLOCATED_MODEL, DISAGG_MODEL]
    server = TestServer(front.app(), host="127.0.0.1")
    await server.start_server()
    try:
        async with aiohttp.ClientSession(str(server.make_url(""))) as s:
            async with s.get("/health") as r:
                assert (r.status, await r.json()) == (200, {"status": "ok", "models": [COLOCATED_MODEL, DISAGG_MODEL]})
            async with s.get("/v1/models") as r:
                assert (r.status, await r.json()) == (401, {"error": {
                    "message": "this node requires an API key; send it as `authorization: Bearer <key>` metadata",
                    "type": "authentication_error", "param": None, "code": "invalid_api_key"}})
            async with s.get("/v1/models", headers={"Authorization": "Bearer wrong-key-Hh42"}) as r:
                assert r.status == 401
            async with s.get("/v1/models", headers={"Authorization": f"Bearer {KEY_A}"}) as r:
                assert r.status == 200
                assert [m["id"] for m in (await r.json())["data"]] == [COLOCATED_MODEL, DISAGG_MODEL]
    finally:
        await server.close()
        await front.close()
