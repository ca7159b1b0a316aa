"""The SDK's tenant key: `api_key=` on Client and AsyncClient goes out on every call, list_models included, as the
`authorization: Bearer <key>` metadata the router's tenant gate reads; a missing or unknown key raises the typed
UnauthenticatedError after one send."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest

import octoserve
from octoserve import AsyncClient, Client, RetryPolicy
from octoserve.router.app import RouterSettings
from octoserve.router.tenants import tenant_settings_from_dict
from octoserve.v1 import generate_pb2 as pb
from octoserve.v1 import generate_pb2_grpc as pb_grpc
from tests.service_fixtures import COLOCATED_MODEL, start_inprocess_node

TENANTS = {"require_api_key": True, "list": [{"name": "team-a", "key": "k-a"}]}


async def test_the_key_authenticates_and_a_missing_or_wrong_one_is_unauthenticated():
    node = await start_inprocess_node(settings=RouterSettings(tenants=tenant_settings_from_dict(TENANTS)))
    try:
        async with AsyncClient(node.router.address, retry=RetryPolicy(), api_key="k-a") as client:
            done = await client.complete(COLOCATED_MODEL, [1, 2, 3], max_tokens=2, ignore_eos=True)
            assert done.usage.completion_tokens == 2
        for key in (None, "wrong"):
            async with AsyncClient(node.router.address, retry=RetryPolicy(), api_key=key) as client:
                with pytest.raises(octoserve.UnauthenticatedError) as caught:
                    await client.complete(COLOCATED_MODEL, [1, 2, 3], max_tokens=2)
            e = caught.value
            assert (e.code, e.attempts) == (grpc.StatusCode.UNAUTHENTICATED, 1)
            assert isinstance(e, octoserve.OctoserveClientError)
    finally:
        await node.stop()


class Recorder(pb_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple[tuple[str, str], ...]]] = []

    async def ListModels(self, request, context):
        self.seen.append(("ListModels", tuple((m.key, m.value) for m in context.invocation_metadata())))
        return pb.ListModelsResponse(models=[pb.Model(name="m", context_window=8)])

    async def Generate(self, request, context):
        self.seen.append(("Generate", tuple((m.key, m.value) for m in context.invocation_metadata())))
        yield pb.GenerateResponse(token_ids=[1], finish_reason=pb.LENGTH)


def keys_of(metadata) -> list[tuple[str, str]]:
    return [(k, v) for k, v in metadata if k in ("authorization", "x-api-key")]


async def test_every_call_carries_the_key_list_models_included():
    recorder = Recorder()
    server = grpc.aio.server()
    pb_grpc.add_GenerationServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with AsyncClient(f"127.0.0.1:{port}", api_key="k-a") as client:
            await client.list_models()
            await client.complete("m", [1], max_tokens=1)
            await client.list_models(metadata=[("x-api-key", "per-call")])
        assert [(name, keys_of(md)) for name, md in recorder.seen] == [
            ("ListModels", [("authorization", "Bearer k-a")]),
            ("Generate", [("authorization", "Bearer k-a")]),
            ("ListModels", [("x-api-key", "per-call")]),
        ]
    finally:
        await server.stop(None)


class SyncRecorder(pb_grpc.GenerationServicer):
    def __init__(self) -> None:
        self.seen: list[tuple[str, tuple[tuple[str, str], ...]]] = []

    def ListModels(self, request, context):
        self.seen.append(("ListModels", tuple(context.invocation_metadata())))
        return pb.ListModelsResponse(models=[pb.Model(name="m", context_window=8)])

    def Generate(self, request, context):
        self.seen.append(("Generate", tuple(context.invocation_metadata())))
        yield pb.GenerateResponse(token_ids=[1], finish_reason=pb.LENGTH)


def test_blocking_client_sends_the_key_on_every_call_and_refuses_a_malformed_one():
    from concurrent.futures import ThreadPoolExecutor

    recorder = SyncRecorder()
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_GenerationServicer_to_server(recorder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with Client(f"127.0.0.1:{port}", api_key="k-a") as client:
            assert [m.name for m in client.list_models()] == ["m"]
            client.complete("m", [1], max_tokens=1)
        assert [(name, keys_of(md)) for name, md in recorder.seen] == [
            ("ListModels", [("authorization", "Bearer k-a")]),
            ("Generate", [("authorization", "Bearer k-a")]),
        ]
    finally:
        server.stop(None)
    for bad in ("", " k", "k\n", 7):
        with pytest.raises(ValueError):
            Client("127.0.0.1:1", api_key=bad)
