"""The endpoint picker (services/cluster/epp.py) driven as a gateway drives it: a real Envoy ext_proc client
(the generated `ExternalProcessorStub` of xds-protos) on 127.0.0.1 against the picker's real grpc.aio server, with
two node stand-ins serving their headroom summaries exactly as a node router does (`add_headroom_service`)."""

from __future__ import annotations

import json
import random

import grpc
import pytest

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc  # noqa: E402
from google.protobuf import struct_pb2  # noqa: E402
from grpc_health.v1 import health_pb2, health_pb2_grpc  # noqa: E402

from octoserve.services.cluster import epp  # noqa: E402
from octoserve.services.cluster.headroom import HeadroomSummary, ModelHeadroom, TierHeadroom  # noqa: E402
from octoserve.services.cluster.picker import ClusterPicker, ClusterPolicy  # noqa: E402
from octoserve.services.cluster.service import PICKER_SERVICE, PickerService, add_headroom_service  # noqa: E402
from octoserve.services.core.kv_cache import prefix_block_hashes  # noqa: E402
from octoserve.services.core.types import Priority  # noqa: E402
from octoserve.services.rpc.server import ServiceSpec, start_service  # noqa: E402
from octoserve.v1 import generate_pb2  # noqa: E402

SM = "llama-3-8b"
HOT_PROMPT = "You are a careful assistant. " * 40  # 1,160 bytes: the byte rule gives one token per byte


def _summary(wait_ms: float, *, admitting: bool = True, retry_ms: int = 0, hot=frozenset()) -> HeadroomSummary:
    tiers = tuple(TierHeadroom(t, admitting, retry_ms, wait_ms, 0.0)
                  for t in (Priority.INTERACTIVE, Priority.STANDARD, Priority.BATCH))
    return HeadroomSummary("x", True, 0.0, (ModelHeadroom(SM, tiers, 10_000.0, 1000, 2000, 16, 1.0, 4),),
                           frozenset(hot))


async def _node(state: dict):
    return await start_service(ServiceSpec(name="node", metrics_port=None, grace_s=0.5,
                                           add_servicers=lambda s: add_headroom_service(s, lambda: state["summary"])))


class Cluster:
    """Two node stand-ins and the picker with --epp on one port; endpoints are the nodes' addresses at port 8000."""

    async def __aenter__(self):
        self.a, self.b = {"summary": _summary(0.0)}, {"summary": _summary(60.0)}
        self.node_a, self.node_b = await _node(self.a), await _node(self.b)
        self.service = PickerService(ClusterPicker(ClusterPolicy(), random.Random(0)),
                                     [self.node_a.address, self.node_b.address], poll_s=3600.0,
                                     clock=lambda: 0.0)  # summaries never age here: no timing on a busy machine
        self.endpoint = {self.node_a.address: "10.0.0.1:8000", self.node_b.address: "10.0.0.2:8000"}
        resolved = []

        def resolve(node: str, port: int) -> str:
            resolved.append((node, port))
            return self.endpoint[node]

        self.resolved = resolved
        self.picker = epp.EndpointPicker(self.service, epp.RequestReader(), epp.EndpointCache(8000, resolve))

        def add(server):
            self.service.add_to_server(server)
            self.picker.add_to_server(server)

        self.front = await start_service(ServiceSpec(
            name="picker", metrics_port=None, grace_s=0.5, service_names=(PICKER_SERVICE, epp.EXT_PROC_SERVICE),
            add_servicers=add, start=self.service.start, close=self.service.close))
        self.channel = grpc.aio.insecure_channel(self.front.address)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        for s in (self.front, self.node_a, self.node_b):
            await s.shutdown()

    async def process(self, messages: list[pb.ProcessingRequest]) -> list[pb.ProcessingResponse]:
        """One request's ext_proc stream, as Envoy sends it: every message, then read every answer."""
        call = pb_grpc.ExternalProcessorStub(self.channel).Process(iter(messages), timeout=10)
        return [r async for r in call]


def _headers(path: str, content_type: str = "application/json", end: bool = False, extra=()) -> pb.ProcessingRequest:
    pairs = [(":method", "POST"), (":path", path), ("content-type", content_type), *extra]
    return pb.ProcessingRequest(request_headers=pb.HttpHeaders(
        headers=base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in pairs]),
        end_of_stream=end))


def _body_chunks(body: bytes, n: int = 3) -> list[pb.ProcessingRequest]:
    step = max(1, len(body) // n)
    chunks = [body[i:i + step] for i in range(0, len(body), step)]
    return [pb.ProcessingRequest(request_body=pb.HttpBody(body=c, end_of_stream=k == len(chunks) - 1))
            for k, c in enumerate(chunks)]


def _full_duplex(first: pb.ProcessingRequest) -> pb.ProcessingRequest:
    first.protocol_config.request_body_mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
    return first


def _destination(response: pb.ProcessingResponse, phase: str) -> tuple[str, str]:
    common = getattr(response, phase).response
    (option,) = common.header_mutation.set_headers
    assert option.header.key == "x-gateway-destination-endpoint" and common.clear_route_cache
    lb = response.dynamic_metadata.fields["envoy.lb"].struct_value.fields
    return option.header.raw_value.decode(), lb["x-gateway-destination-endpoint"].string_value


def _completion(prompt: str, **extra) -> bytes:
    return json.dumps({"model": SM, "prompt": prompt, "max_tokens": 16, **extra}).encode()


async def test_full_duplex_openai_request_gets_the_picked_node_in_header_and_metadata_and_its_body_back():
    async with Cluster() as c:
        body = _completion("Hello there, " * 30)
        responses = await c.process([_full_duplex(_headers("/v1/completions")), *_body_chunks(body)])
        # Headers answer (with the destination) only once the body is complete, then the body streamed back whole.
        assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"]
        # The pick, then its fallback (the other node also has room), as the protocol's endpoint list.
        assert _destination(responses[0], "request_headers") == ("10.0.0.1:8000,10.0.0.2:8000",) * 2
        streamed = responses[1].request_body.response.body_mutation.streamed_response
        assert streamed.body == body and streamed.end_of_stream
        assert c.resolved == [(c.node_a.address, 8000), (c.node_b.address, 8000)]
        assert c.picker.num_picked == 1


async def test_buffered_mode_answers_headers_at_once_and_decides_on_the_body():
    async with Cluster() as c:
        c.a["summary"], c.b["summary"] = _summary(90.0), _summary(0.0)
        await c.service.poll_once()
        chat = json.dumps({"model": SM, "messages": [{"role": "user", "content": "hi " * 50}]}).encode()
        responses = await c.process([_headers("/v1/chat/completions"),
                                     pb.ProcessingRequest(request_body=pb.HttpBody(body=chat, end_of_stream=True))])
        assert [r.WhichOneof("response") for r in responses] == ["request_headers", "request_body"]
        assert not responses[0].request_headers.response.HasField("header_mutation")
        assert _destination(responses[1], "request_body") == ("10.0.0.2:8000,10.0.0.1:8000",) * 2


async def test_prefix_locality_reaches_through_the_gateway():
    """A prompt whose leading blocks node b caches goes to b although a is idle: the EPP tokenizes as the front
    does (bytes for the sim engine), so its block hashes are the node's."""
    async with Cluster() as c:
        tokens = tuple(HOT_PROMPT.encode())
        c.b["summary"] = _summary(20.0, hot=prefix_block_hashes(tokens[:1024], 16, SM))
        await c.service.poll_once()
        responses = await c.process([_full_duplex(_headers("/v1/completions")),
                                     *_body_chunks(_completion(HOT_PROMPT + "What now?"))])
        assert _destination(responses[0], "request_headers")[0].split(",")[0] == "10.0.0.2:8000"
        other = await c.process([_full_duplex(_headers("/v1/completions")),
                                 *_body_chunks(_completion("Unrelated question " * 60))])
        assert _destination(other[0], "request_headers")[0].split(",")[0] == "10.0.0.1:8000"


async def test_grpc_generate_call_is_read_from_its_length_prefixed_message():
    async with Cluster() as c:
        message = generate_pb2.GenerateRequest(model=SM, token_ids=generate_pb2.TokenIds(ids=list(range(100, 900))),
                                               max_tokens=32, priority=generate_pb2.Priority.Value("BATCH"))
        raw = message.SerializeToString()
        framed = b"\x00" + len(raw).to_bytes(4, "big") + raw
        responses = await c.process([_full_duplex(_headers("/octoserve.v1.Generation/Generate", "application/grpc")),
                                     *_body_chunks(framed, 2)])
        assert _destination(responses[0], "request_headers")[0].split(",")[0] == "10.0.0.1:8000"
        assert responses[1].request_body.response.body_mutation.streamed_response.body == framed


async def test_a_node_past_the_slo_is_no_fallback():
    """Only nodes that pass the filters follow the pick: b's 400-ms queue puts the prompt past the TTFT SLO there,
    so the endpoint list is a alone."""
    async with Cluster() as c:
        c.b["summary"] = _summary(400.0, admitting=False, retry_ms=700)
        await c.service.poll_once()
        responses = await c.process([_full_duplex(_headers("/v1/completions")), *_body_chunks(_completion("w" * 600))])
        assert _destination(responses[0], "request_headers") == ("10.0.0.1:8000",) * 2


async def test_every_node_refusing_is_an_immediate_429_with_the_soonest_retry():
    async with Cluster() as c:
        c.a["summary"] = _summary(1000.0, admitting=False, retry_ms=900)
        c.b["summary"] = _summary(400.0, admitting=False, retry_ms=1300)
        await c.service.poll_once()
        responses = await c.process([_full_duplex(_headers("/v1/completions")), *_body_chunks(_completion("x" * 800))])
        assert [r.WhichOneof("response") for r in responses] == ["immediate_response"]
        refusal = responses[0].immediate_response
        assert refusal.status.code == 429
        headers = {h.header.key: h.header.raw_value.decode() for h in refusal.headers.set_headers}
        assert headers["retry-after-ms"] == "900" and headers["retry-after"] == "1"
        assert json.loads(refusal.body)["error"]["type"] == "overloaded"
        assert not refusal.HasField("grpc_status")  # an HTTP client: the status and headers say it
        # The same for a gRPC call: the gateway turns grpc_status into RESOURCE_EXHAUSTED (8) for the client.
        raw = generate_pb2.GenerateRequest(model=SM, text="y" * 800).SerializeToString()
        responses = await c.process([_full_duplex(_headers("/octoserve.v1.Generation/Generate", "application/grpc")),
                                     *_body_chunks(b"\x00" + len(raw).to_bytes(4, "big") + raw)])
        assert responses[0].immediate_response.grpc_status.status == 8
        assert c.picker.num_refused == 2 and c.picker.num_picked == 0


async def test_no_node_bad_body_and_the_gateways_subset():
    async with Cluster() as c:
        # A subset naming only b's endpoint: b is picked though a is idle.
        first = _full_duplex(_headers("/v1/completions"))
        hint = struct_pb2.Struct()
        hint.update({"x-gateway-destination-endpoint-subset": ["10.0.0.2:8000"]})
        first.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
        responses = await c.process([first, *_body_chunks(_completion("z" * 500))])
        assert _destination(responses[0], "request_headers") == ("10.0.0.2:8000",) * 2  # no fallback outside it
        # A subset of unknown endpoints: no node to pick from -> 503.
        first = _full_duplex(_headers("/v1/completions"))
        hint.update({"x-gateway-destination-endpoint-subset": ["10.9.9.9:8000"]})
        first.metadata_context.filter_metadata["envoy.lb.subset_hint"].CopyFrom(hint)
        responses = await c.process([first, *_body_chunks(_completion("z" * 500))])
        assert responses[0].immediate_response.status.code == 503
        # Bad bodies: 400 with the front's own message.
        responses = await c.process([_full_duplex(_headers("/v1/completions")), *_body_chunks(b'{"prompt": "x"}')])
        assert responses[0].immediate_response.status.code == 400
        assert "model is missing" in responses[0].immediate_response.details
        responses = await c.process([_headers("/v1/completions", end=True)])
        assert responses[0].immediate_response.status.code == 400
        # A model no node serves: 503 (unavailable), not 429 (overloaded).
        body = json.dumps({"model": "no-such-model", "prompt": "hello"}).encode()
        responses = await c.process([_full_duplex(_headers("/v1/completions")), *_body_chunks(body, 1)])
        assert responses[0].immediate_response.status.code == 503


async def test_health_reports_the_ext_proc_service():
    async with Cluster() as c:
        reply = await health_pb2_grpc.HealthStub(c.channel).Check(
            health_pb2.HealthCheckRequest(service="envoy.service.ext_proc.v3.ExternalProcessor"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_without_the_protos_the_error_says_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_envoy(name, *args, **kwargs):
        if name.startswith("envoy"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_envoy)
    with pytest.raises(epp.EppUnavailable, match="pip install xds-protos"):
        epp.require_protos()


def test_endpoint_cache_resolves_at_the_target_port_and_refreshes_after_its_ttl():
    now = [0.0]
    answers = iter(["10.0.0.7:8000", "10.0.0.8:8000"])
    calls = []

    def resolve(node, port):
        calls.append((node, port))
        return next(answers)

    cache = epp.EndpointCache(8000, resolve, ttl_s=5.0, clock=lambda: now[0])
    assert cache("octoserve-node-0.octoserve-nodes:50051") == "10.0.0.7:8000"
    now[0] = 4.0
    assert cache("octoserve-node-0.octoserve-nodes:50051") == "10.0.0.7:8000"
    now[0] = 9.5  # the pod restarted with a new IP: picked up after the TTL
    assert cache("octoserve-node-0.octoserve-nodes:50051") == "10.0.0.8:8000"
    assert calls == [("octoserve-node-0.octoserve-nodes:50051", 8000)] * 2
    assert epp.resolve_endpoint("127.0.0.1:50051", 8000) == "127.0.0.1:8000"


async def test_after_the_pick_the_response_phases_pass_through_unchanged():
    """A gateway that also sends the response (the extension's gateways do, for metrics) gets every phase answered:
    headers as they are, full-duplex body chunks streamed back byte for byte."""
    async with Cluster() as c:
        first = _full_duplex(_headers("/v1/completions"))
        first.protocol_config.response_body_mode = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
        response_headers = pb.ProcessingRequest(response_headers=pb.HttpHeaders(headers=base_pb2.HeaderMap(
            headers=[base_pb2.HeaderValue(key=":status", raw_value=b"200")])))
        chunks = [pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: {\"x\": 1}\n\n")),
                  pb.ProcessingRequest(response_body=pb.HttpBody(body=b"data: [DONE]\n\n", end_of_stream=True))]
        responses = await c.process([first, *_body_chunks(_completion("q" * 300)), response_headers, *chunks])
        assert [r.WhichOneof("response") for r in responses] == [
            "request_headers", "request_body", "response_headers", "response_body", "response_body"]
        assert not responses[2].response_headers.response.HasField("header_mutation")
        echoed = [r.response_body.response.body_mutation.streamed_response for r in responses[3:]]
        assert [(e.body, e.end_of_stream) for e in echoed] == [(b"data: {\"x\": 1}\n\n", False),
                                                               (b"data: [DONE]\n\n", True)]
