"""Hostile and malformed input on the public API (octoserve.v1.Generation), hypothesis-driven, against a real node.

Every field at and past its limits (negative, zero, NaN, infinite, huge, empty, unknown enum values), token ids
outside the vocabulary, stop lists of thousands of strings, raw bytes that are not a valid message (invalid UTF-8
included), messages at and over the size limit, and thousands of streams on one connection. Every case must get a
typed status with a message saying what to change (never INTERNAL/UNKNOWN), the router and workers must keep
serving, and every KV block must be free afterwards.

`make test` runs a seeded sample (OCTOSERVE_FUZZ_EXAMPLES unset: 150 per test); `make fuzz` runs 10,000.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from octoserve.router.metrics import UNSERVED_LABEL
from octoserve.services.rpc.limits import TRANSPORT_SLACK, Limits
from octoserve.services.rpc.server import GRPC_OPTIONS
from octoserve.v1 import generate_pb2 as gen_pb
from tests.fuzz_support import FUZZ_SETTINGS, NodeThread, assert_typed
from tests.service_fixtures import COLOCATED_MODEL, DISAGG_MODEL, MAX_CONTEXT, request

VOCAB = 128256  # llama-3-8b
U32 = 2**32 - 1
GENERATE = "/octoserve.v1.Generation/Generate"
CASE_TIMEOUT_S = 10.0


@pytest.fixture(scope="module")
def node():
    from octoserve.router.servicer import RouterSettings

    n = NodeThread(settings=RouterSettings(time_scale=0.2))
    yield n
    try:
        free = n.run(n.node.wait_all_free(timeout_s=30.0), timeout_s=40.0)
        assert all(v > 0 for v in free.values())
        assert n.node.router_servicer.requests == {}
        models = {s.labels["model"] for m in n.node.router_servicer.metrics.registry.collect() for s in m.samples
                  if "model" in s.labels}  # hostile model names must not grow the metrics registry
        assert models <= {COLOCATED_MODEL, DISAGG_MODEL, UNSERVED_LABEL}, sorted(models)[:5]
    finally:
        n.stop()


edge_u32 = st.one_of(st.sampled_from([0, 1, 2, 16, MAX_CONTEXT - 40, MAX_CONTEXT, 2**31, U32]), st.integers(0, U32))
floats32 = st.one_of(st.sampled_from([0.0, -0.0, 1.0, -1.0, float("nan"), float("inf"), -float("inf"), 1e-45, 3.4e38]),
                     st.floats(width=32))
token_id = st.one_of(st.integers(0, VOCAB - 1), st.sampled_from([VOCAB - 1, VOCAB, U32]), st.integers(0, U32))


HOSTILE_FIELDS = ("model", "prompt", "max_tokens", "temperature", "top_p", "seed", "stop", "priority", "ttft_slo_ms",
                  "request_id")


@st.composite
def generate_requests(draw) -> gen_pb.GenerateRequest:
    """A valid request with zero to three fields replaced by hostile values (so both sides of every check are hit)."""
    req = gen_pb.GenerateRequest(
        model=draw(st.sampled_from([COLOCATED_MODEL, DISAGG_MODEL])),
        max_tokens=draw(st.integers(1, 64)),
        temperature=draw(st.sampled_from([0.0, 0.7, 1.0])),
        ignore_eos=draw(st.booleans()),
        priority=draw(st.sampled_from([0, 1, 2, 3])),
    )
    top_p = draw(st.sampled_from([None, 0.9, 1.0]))  # None: unset (1.0); an explicit 0 is a hostile value
    if top_p is not None:
        req.top_p = top_p
    if draw(st.booleans()):
        req.text = draw(st.text(min_size=1, max_size=200))
    else:
        req.token_ids.ids.extend(draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=64)))
    for name in draw(st.lists(st.sampled_from(HOSTILE_FIELDS), max_size=3, unique=True)):
        _hostile(draw, req, name)
    return req


def _hostile(draw, req: gen_pb.GenerateRequest, name: str) -> None:
    if name == "model":
        req.model = draw(st.sampled_from(["", "no-such-model", "m" * 5000, COLOCATED_MODEL + "\x00", "LLAMA-3-8B"]))
    elif name == "prompt":
        kind = draw(st.sampled_from(["text", "ids", "none", "empty_ids", "long_ids"]))
        req.ClearField("text")
        req.ClearField("token_ids")
        if kind == "text":
            req.text = draw(st.text(max_size=300))
        elif kind == "ids":
            req.token_ids.ids.extend(draw(st.lists(token_id, max_size=64)))
        elif kind == "empty_ids":
            req.token_ids.SetInParent()
        elif kind == "long_ids":
            req.token_ids.ids.extend([100] * draw(st.sampled_from([MAX_CONTEXT - 2, MAX_CONTEXT - 1, MAX_CONTEXT,
                                                                    MAX_CONTEXT + 1, 200_000])))
    elif name == "max_tokens":
        req.max_tokens = draw(edge_u32)
    elif name == "temperature":
        req.temperature = draw(floats32)
    elif name == "top_p":
        req.top_p = draw(floats32)
    elif name == "seed":
        req.seed = draw(st.sampled_from([0, 2**64 - 1]) | st.integers(0, 2**64 - 1))
    elif name == "stop":
        req.stop.extend(draw(st.one_of(
            st.lists(st.text(max_size=12), max_size=6),
            st.sampled_from([64, 65, 5000]).map(lambda n: [f"s{i}" for i in range(n)]),
            st.sampled_from([1024, 1025, 100_000]).map(lambda n: ["x" * n]),
        )))
    elif name == "priority":
        req.priority = draw(st.integers(-2**31, 2**31 - 1))
    elif name == "ttft_slo_ms":
        req.ttft_slo_ms = draw(edge_u32)
    elif name == "request_id":
        req.request_id = draw(st.one_of(st.just(""), st.text(max_size=24), st.sampled_from(["r" * 256, "r" * 257])))


async def run_case(channel: grpc.aio.Channel, payload, serialize,
                   timeout_s: float = CASE_TIMEOUT_S) -> tuple[grpc.StatusCode, str]:
    """One Generate call; reads at most two messages, then cancels (a served request counts as OK). A call the node
    does not answer within `timeout_s` ends DEADLINE_EXCEEDED, which `assert_typed` refuses: a hang is a failure."""
    call = channel.unary_stream(GENERATE, request_serializer=serialize,
                                response_deserializer=gen_pb.GenerateResponse.FromString)(payload, timeout=timeout_s)
    n = 0
    try:
        async for _ in call:
            n += 1
            if n == 2:
                call.cancel()
                return grpc.StatusCode.OK, ""
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details() or ""
    return await call.code(), await call.details() or ""


def _channel(node):
    if not hasattr(node, "fuzz_channel"):
        node.fuzz_channel = node.run(_open(node.node.router.address))
    return node.fuzz_channel


async def _open(address):
    return grpc.aio.insecure_channel(address, options=(("grpc.max_send_message_length", 64 * 1024 * 1024),))


def test_generate_fields_fuzz(node):
    """Every fuzzed request gets a typed answer, and the sample reaches served and refused cases alike (the status
    codes it produced are counted by this test itself, so it passes or fails the same run alone or in any order)."""
    seen: dict[str, int] = {}

    @FUZZ_SETTINGS
    @given(req=generate_requests())
    def fuzz(req):
        code, details = node.run(run_case(_channel(node), req, gen_pb.GenerateRequest.SerializeToString), 60.0)
        seen[code.name] = seen.get(code.name, 0) + 1
        assert_typed(code, details, f"{req.model[:40]!r} {req.WhichOneof('prompt')} max_tokens={req.max_tokens}")

    fuzz()
    assert {"OK", "INVALID_ARGUMENT", "NOT_FOUND"} <= set(seen), seen


@st.composite
def raw_messages(draw) -> bytes:
    """Random bytes, or a valid request with bytes flipped, cut or inserted."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=400))
    valid = gen_pb.GenerateRequest(model=COLOCATED_MODEL, text=draw(st.text(min_size=1, max_size=40)), max_tokens=4)
    base = bytearray(valid.SerializeToString())
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "cut", "insert"]))
        i = draw(st.integers(0, max(0, len(base) - 1)))
        if op == "flip" and base:
            base[i] = draw(st.integers(0, 255))
        elif op == "cut":
            del base[i:]
        else:
            base[i:i] = draw(st.binary(min_size=1, max_size=8))
    return bytes(base)


@FUZZ_SETTINGS
@given(data=raw_messages())
def test_generate_raw_bytes_fuzz(node, data):
    code, details = node.run(run_case(_channel(node), data, lambda b: b), 60.0)
    assert_typed(code, details, f"raw {data[:24]!r}")


def _field(number: int, payload: bytes) -> bytes:
    """One length-delimited protobuf field (for payloads the Python API refuses to build)."""
    return bytes([number << 3 | 2]) + _varint(len(payload)) + payload


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


@pytest.mark.parametrize("field,bad", [(2, b"hello \xff\xfe world"), (1, b"llama\xc3"), (12, b"\xed\xa0\x80")])
def test_invalid_utf8_is_invalid_argument(node, field, bad):
    payload = _field(1, COLOCATED_MODEL.encode()) * (field != 1) + _field(field, bad)
    code, details = node.run(run_case(_channel(node), payload, lambda b: b))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "UTF-8" in details and "GenerateRequest" in details


def test_message_size_at_and_over_the_limit(node):
    limit = Limits().max_message_bytes
    overhead = len(gen_pb.GenerateRequest(model=COLOCATED_MODEL, text="x" * 10, max_tokens=4).SerializeToString()) - 10
    at_limit = gen_pb.GenerateRequest(model=COLOCATED_MODEL, text="x" * (limit - overhead - 4), max_tokens=4)
    assert len(at_limit.SerializeToString()) <= limit
    code, details = node.run(run_case(_channel(node), at_limit, gen_pb.GenerateRequest.SerializeToString))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "context window" in details  # decoded, then validated
    over = gen_pb.GenerateRequest(model=COLOCATED_MODEL, text="x" * (limit + 1), max_tokens=4)
    code, details = node.run(run_case(_channel(node), over, gen_pb.GenerateRequest.SerializeToString))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and f"limit of {limit}" in details
    far_over = gen_pb.GenerateRequest(model=COLOCATED_MODEL, text="x" * (TRANSPORT_SLACK * limit + 1))
    code, details = node.run(run_case(_channel(node), far_over, gen_pb.GenerateRequest.SerializeToString))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "larger than max" in details  # the transport's own check


def test_limits_each_have_a_typed_error(node):
    cases = {
        "stop": request(stop=[f"s{i}" for i in range(Limits().max_stop_strings + 1)]),
        "stop ": request(stop=["x" * (Limits().max_stop_chars + 1)]),
        "priority": request(priority=7),
        "request_id": request(request_id="r" * (Limits().max_request_id_chars + 1)),
        "temperature": request(temperature=float("inf")),
        "prompt": gen_pb.GenerateRequest(model=COLOCATED_MODEL, max_tokens=4),
        "prompt ": request(num_prompt_tokens=MAX_CONTEXT),
    }
    for name, req in cases.items():
        code, details = node.run(run_case(_channel(node), req, gen_pb.GenerateRequest.SerializeToString))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
        assert_typed(code, details, name)
    at_limits = request(stop=["x" * Limits().max_stop_chars] * Limits().max_stop_strings,
                        request_id="r" * Limits().max_request_id_chars)
    code, details = node.run(run_case(_channel(node), at_limits, gen_pb.GenerateRequest.SerializeToString))
    assert code == grpc.StatusCode.OK, details


async def _many_streams(address: str, n: int) -> dict[str, int]:
    async with grpc.aio.insecure_channel(address) as channel:  # one channel: one HTTP/2 connection
        results = await asyncio.gather(*(run_case(channel, request(max_tokens=4, num_prompt_tokens=16 + i % 50),
                                                  gen_pb.GenerateRequest.SerializeToString, timeout_s=240.0)
                                         for i in range(n)))
    counts: dict[str, int] = {}
    for code, details in results:
        assert_typed(code, details, "one of many streams")
        counts[code.name] = counts.get(code.name, 0) + 1
    return counts


@pytest.mark.slow
def test_thousands_of_streams_on_one_connection(node):
    # Every one gets an answer (served or refused): none is dropped as a bare CANCELLED, which gRPC does to calls
    # queued past its default limits (services/rpc/server.py raises them for every service).
    assert dict(GRPC_OPTIONS)["grpc.server.max_pending_requests"] >= 2000
    counts = node.run(_many_streams(node.node.router.address, 2000), timeout_s=300.0)
    assert sum(counts.values()) == 2000
    assert set(counts) <= {"OK", "RESOURCE_EXHAUSTED"}, counts
    assert counts.get("OK", 0) > 0
