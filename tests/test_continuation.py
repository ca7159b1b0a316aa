"""Stream continuation inside the node (router/failover.py): a request whose instance is lost after it streamed
tokens goes on, on the same client stream, from its prompt plus the tokens already streamed.

In-process nodes (the real servicers, SimEngines and router over gRPC on 127.0.0.1, in the test's event loop):
- a colocated worker stopped under streams (its server gone: the router's token session breaks): every stream
  completes with exactly the uninterrupted greedy tokens, usage reports the original prompt and all completion
  tokens, and the continuation is counted by cause and outcome and logged with its request;
- a KV transfer that fails verification on the decode worker is continued there, not failed;
- a worker drained (SIGTERM) past its grace with streams running ends their sessions cleanly: they are continued
  for the cause `drain`;
- `policies.max_continuations: 0` keeps the old rule: UNAVAILABLE with a retry hint, short of max_tokens;
- a continuation the policy refuses (no other instance serves the model) ends UNAVAILABLE with a retry hint that
  says why.
The process-level probes (SIGKILL and SIGSTOP under `octoserve up`) are in tests/test_continuation_live.py.
"""

from __future__ import annotations

import asyncio
import json
import logging

import grpc
import pytest

from octoserve.router.access_log import AccessLog
from octoserve.router.servicer import RouterSettings
from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.core.sim_executor import sim_token_id
from octoserve.services.faults import FaultPlan
from octoserve.v1 import generate_pb2 as gen_pb
from tests.fault_fixtures import Stream
from tests.service_fixtures import COLOCATED_MODEL, DISAGG_MODEL, MAX_CONTEXT, start_inprocess_node

ASYNC = pytest.mark.asyncio(loop_scope="function")

INSTANCE = {"tp": 1, "gpu_memory_utilization": 0.3}


def greedy(prompt: list[int], n: int) -> list[int]:
    """What an uninterrupted sim-engine run of `prompt` streams: its first n tokens."""
    return [sim_token_id(len(prompt), prompt[0], p) for p in range(n)]


def _prompt(n: int, salt: int) -> list[int]:
    return [1000 + (salt * 7919 + i * 31) % 30000 for i in range(n)]


def colocated_pair(**policies) -> dict:
    return {
        "gpu": "h100-sxm-80gb", "num_gpus": 8,
        "models": {COLOCATED_MODEL: {"preset": "llama-3-8b", "max_context_len": MAX_CONTEXT}},
        "instances": [
            {"id": "c0", "model": COLOCATED_MODEL, "role": "colocated", "gpu_ids": [0], **INSTANCE},
            {"id": "c1", "model": COLOCATED_MODEL, "role": "colocated", "gpu_ids": [1], **INSTANCE},
        ],
        "policies": policies,
    }


class Client(Stream):
    """One Generate call as the client saw it: tokens, the last message's usage and finish, the end status."""

    def __init__(self, stub, prompt: list[int], max_tokens: int, **kw) -> None:
        super().__init__(gen_pb.GenerateRequest(model=kw.pop("model", COLOCATED_MODEL),
                                                token_ids=gen_pb.TokenIds(ids=prompt), max_tokens=max_tokens,
                                                ignore_eos=True, **kw))
        self.stub, self.prompt, self.max_tokens = stub, prompt, max_tokens

    async def run(self) -> None:  # type: ignore[override]
        await super().run(self.stub, timeout_s=60)


def _sample(node, name: str, labels: dict) -> float:
    return node.router_servicer.metrics.registry.get_sample_value(name, labels) or 0.0


def _continued(node, cause: str, outcome: str) -> float:
    return _sample(node, "octoserve_router_continuations_total", {"cause": cause, "outcome": outcome})


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.fields: dict[str, dict] = {}

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", None)
        if fields is not None:
            self.fields[fields["request_id"]] = json.loads(json.dumps(fields))


@pytest.fixture
def access_lines():
    handler = _Lines()
    logger = logging.getLogger("octoserve.router.access")
    old_level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield handler.fields
    logger.removeHandler(handler)
    logger.setLevel(old_level)


async def _streaming(clients: list[Client], min_tokens: int) -> list[asyncio.Task]:
    tasks = [asyncio.create_task(c.run()) for c in clients]

    async def all_have_tokens() -> None:
        while not all(len(c.tokens) >= min_tokens or c.code is not None for c in clients):
            await asyncio.sleep(0.01)
    await asyncio.wait_for(all_have_tokens(), 30)
    assert all(c.code is None for c in clients), [(c.code, c.details) for c in clients]
    return tasks


@ASYNC
async def test_a_lost_colocated_worker_s_streams_continue_with_the_uninterrupted_tokens(access_lines):
    node = await start_inprocess_node(node_config_from_dict(colocated_pair()), time_scale=0.5,
                                      settings=RouterSettings(time_scale=0.5, access_log=AccessLog("all")))
    try:
        stub = node.generation()
        clients = [Client(stub, _prompt(48, i), 160) for i in range(8)]
        tasks = await _streaming(clients, 5)
        placed = {rid: st.instance_ids for rid, st in node.router_servicer.requests.items()}
        on_c0 = [c for c in clients if placed[c.request_id] == ("c0",)]
        assert on_c0 and len(on_c0) < len(clients), placed
        await node.workers["c0"].server.stop(None)  # the process is gone: its token session breaks
        await asyncio.wait_for(asyncio.gather(*tasks), 60)

        for c in clients:
            assert (c.code, c.details) == (grpc.StatusCode.OK, "")
            assert c.tokens == greedy(c.prompt, 160)
            assert (c.finish, c.usage) == (gen_pb.LENGTH, (48, 160))
        for c in clients:
            line = access_lines[c.request_id]
            assert (line["outcome"], line["tokens_out"]) == ("ok", 160)
            if c in on_c0:
                assert (line["instances"], line["continued"], line["continued_causes"]) == (["c0", "c1"], 1, ["crash"])
            else:
                assert line["instances"] == ["c1"] and "continued" not in line
        assert _continued(node, "crash", "continued") == len(on_c0)
        assert _continued(node, "crash", "bound") == _continued(node, "crash", "refused") == 0
    finally:
        await node.stop()


def _disagg_pair() -> dict:
    return {
        "gpu": "h100-sxm-80gb", "num_gpus": 8,
        "models": {DISAGG_MODEL: {"preset": "llama-3-8b", "max_context_len": MAX_CONTEXT}},
        "instances": [
            {"id": "p0", "model": DISAGG_MODEL, "role": "prefill", "gpu_ids": [0], "max_num_batched_tokens": 2048,
             **INSTANCE},
            {"id": "d0", "model": DISAGG_MODEL, "role": "decode", "gpu_ids": [1], **INSTANCE},
        ],
    }


@ASYNC
async def test_a_corrupt_kv_transfer_is_continued_not_failed(access_lines):
    node = await start_inprocess_node(node_config_from_dict(_disagg_pair()),
                                      settings=RouterSettings(access_log=AccessLog("all")))
    try:
        node.servicers["d0"].faults = FaultPlan.parse("kv_transfer=corrupt,ok")
        stub = node.generation()
        c = Client(stub, _prompt(64, 1), 40, model=DISAGG_MODEL)
        await asyncio.wait_for(c.run(), 60)
        assert (c.code, c.details) == (grpc.StatusCode.OK, "")
        assert c.tokens == greedy(c.prompt, 40)
        assert (c.finish, c.usage) == (gen_pb.LENGTH, (64, 40))
        line = access_lines[c.request_id]
        # The first token came from p0; d0 failed the transfer; the continuation (prompt + that token) ran on p0
        # and d0 again: the decode worker lives, only that hand-off failed.
        assert (line["instances"], line["continued"], line["continued_causes"]) == \
            (["p0", "d0", "p0", "d0"], 1, ["kv_transfer"])
        assert _continued(node, "kv_transfer", "continued") == 1
        await node.wait_all_free()
    finally:
        await node.stop()


@ASYNC
async def test_with_max_continuations_0_a_lost_stream_ends_unavailable_with_a_retry_hint(access_lines):
    node = await start_inprocess_node(node_config_from_dict(colocated_pair(max_continuations=0)),
                                      settings=RouterSettings(access_log=AccessLog("all")))
    try:
        stub = node.generation()
        clients = [Client(stub, _prompt(48, i), 400) for i in range(4)]
        tasks = await _streaming(clients, 3)
        placed = {rid: st.instance_ids for rid, st in node.router_servicer.requests.items()}
        on_c0 = [c for c in clients if placed[c.request_id] == ("c0",)]
        assert on_c0, placed
        await node.workers["c0"].server.stop(None)
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for c in clients:
            if c in on_c0:
                assert c.code == grpc.StatusCode.UNAVAILABLE and c.retry_after_ms == 50, (c.code, c.details)
                assert c.details.startswith("token stream from c0 failed: ")
                assert c.details.endswith("; the request had already streamed tokens and this node does not "
                                          "continue streams (policies.max_continuations is 0): retry it"), c.details
                assert 0 < len(c.tokens) < 400 and c.tokens == greedy(c.prompt, len(c.tokens))
                assert "continued" not in access_lines[c.request_id]
            else:
                assert (c.code, c.tokens) == (grpc.StatusCode.OK, greedy(c.prompt, 400))
        assert _continued(node, "crash", "bound") == len(on_c0)
        assert _continued(node, "crash", "continued") == 0
    finally:
        await node.stop()


@ASYNC
async def test_a_continuation_the_policy_refuses_ends_unavailable_with_the_refusal_and_a_hint():
    config = colocated_pair()
    config["instances"] = config["instances"][:1]  # c0 alone: nowhere to continue
    node = await start_inprocess_node(node_config_from_dict(config))
    try:
        stub = node.generation()
        c = Client(stub, _prompt(48, 3), 400)
        (task,) = await _streaming([c], 3)
        await node.workers["c0"].server.stop(None)
        await asyncio.wait_for(task, 60)
        assert c.code == grpc.StatusCode.UNAVAILABLE and c.retry_after_ms == 50, (c.code, c.details)
        assert c.details.startswith("token stream from c0 failed: ")
        assert "; the request had already streamed tokens, and continuing it on another instance was refused " \
               "(llama-3-8b is overloaded for STANDARD requests (no healthy instance serves it right now)" in c.details
        assert c.details.endswith(": retry it"), c.details
        assert 0 < len(c.tokens) < 400 and c.tokens == greedy(c.prompt, len(c.tokens))
        assert _continued(node, "crash", "refused") == 1
    finally:
        await node.stop()


@ASYNC
async def test_streams_a_drain_cannot_finish_are_continued_for_the_cause_drain(access_lines):
    node = await start_inprocess_node(node_config_from_dict(colocated_pair()), grace_s=1.0,
                                      settings=RouterSettings(access_log=AccessLog("all")))
    try:
        stub = node.generation()
        clients = [Client(stub, _prompt(48, i), 400) for i in range(6)]
        tasks = await _streaming(clients, 3)
        placed = {rid: st.instance_ids for rid, st in node.router_servicer.requests.items()}
        on_c0 = [c for c in clients if placed[c.request_id] == ("c0",)]
        assert on_c0, placed
        await node.workers["c0"].shutdown()  # SIGTERM's sequence: 1 s of grace, far less than 400 tokens take
        await asyncio.wait_for(asyncio.gather(*tasks), 60)
        for c in clients:
            assert (c.code, c.tokens, c.usage) == (grpc.StatusCode.OK, greedy(c.prompt, 400), (48, 400)), c.details
            line = access_lines[c.request_id]
            if c in on_c0:
                assert (line["instances"], line["continued_causes"]) == (["c0", "c1"], ["drain"])
        assert _continued(node, "drain", "continued") == len(on_c0)
        assert _continued(node, "crash", "continued") == 0
    finally:
        await node.stop()


def _toy_detokenize(ids) -> str:
    return "".join(f"<{i}>" for i in ids)


@pytest.mark.parametrize("before, new, expected", [
    ((1, 2), (3, 4), 0),  # "<1><2>" + "<3>": "2><3" spans the seam, completed by the first new token
    ((2,), (3, 4), 0),
    ((7, 2), (5, 3, 4), None),  # "2><5" is no stop string; "<3><4" lies wholly in the new text: the engine's own
    ((9,), (8, 2, 3), None),  # the seam's text is passed before the match could start: it is the engine's
])
def test_seam_stop_finds_only_stop_strings_that_span_the_seam(before, new, expected):
    from octoserve.services.rpc.seam_stop import SeamStop

    check = SeamStop(_toy_detokenize, before, ("2><3", "3><4"))
    assert check.feed(new) == expected


@ASYNC
async def test_stop_at_seam_ends_the_stream_at_the_completing_token_and_closes_the_engine_s():
    from octoserve.services.core.types import FinishReason, RequestOutput
    from octoserve.services.rpc.seam_stop import SeamStop, stop_at_seam

    closed = []

    async def engine_stream():
        try:
            yield RequestOutput("r", (3, 4), None, 10, 0, 2)
            yield RequestOutput("r", (5,), None, 10, 0, 3)
        finally:
            closed.append(True)

    outs = [o async for o in stop_at_seam(engine_stream(), SeamStop(_toy_detokenize, (1, 2), ("2><3",)))]
    assert [(o.new_token_ids, o.finish_reason, o.num_output_tokens) for o in outs] == [((3,), FinishReason.STOP, 1)]
    assert closed == [True]


@ASYNC
async def test_a_stop_string_across_the_seam_of_a_continued_stream_ends_it_as_an_uninterrupted_run_would(
        access_lines):
    """Disaggregated, so the seams are known: a prefill's first token t0, then the decode worker's stream; with a
    failed transfer, the continuation's prompt ends with t0 and its prefill samples t1. A stop string spanning t0|t1
    ends the stream at t1 both ways (the engines match stop strings in their own output only; the workers check
    the seam, here with a toy tokenizer on the sim engines)."""
    node = await start_inprocess_node(node_config_from_dict(_disagg_pair()),
                                      settings=RouterSettings(access_log=AccessLog("all")))
    try:
        for iid in ("p0", "d0"):
            node.servicers[iid].engine.detokenize = _toy_detokenize
        stub = node.generation()
        prompts = [_prompt(64, 5), _prompt(64, 6)]
        t = [greedy(p, 2) for p in prompts]
        plain = Client(stub, prompts[0], 40, model=DISAGG_MODEL, stop=[f"{t[0][0]}><{t[0][1]}"])
        await asyncio.wait_for(plain.run(), 60)
        node.servicers["d0"].faults = FaultPlan.parse("kv_transfer=corrupt,ok")
        continued = Client(stub, prompts[1], 40, model=DISAGG_MODEL, stop=[f"{t[1][0]}><{t[1][1]}"])
        await asyncio.wait_for(continued.run(), 60)
        for c, tokens in ((plain, t[0]), (continued, t[1])):
            assert (c.code, c.tokens, c.finish, c.usage) == (grpc.StatusCode.OK, tokens, gen_pb.STOP, (64, 2)), c.details
        assert "continued" not in access_lines[plain.request_id]
        assert access_lines[continued.request_id]["continued_causes"] == ["kv_transfer"]
        await node.wait_all_free()
    finally:
        await node.stop()
