"""Helpers of the live fault tests: node configs with spare replicas, a stream recorder, the router's access log,
and worker loads read over the workers' own RPCs."""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from dataclasses import dataclass, field

import grpc

from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc
from octoserve.v1 import generate_pb2 as gen_pb
from tests.service_fixtures import COLOCATED_MODEL, DISAGG_MODEL, MAX_CONTEXT

INSTANCE = {"tp": 1, "gpu_memory_utilization": 0.22}


def two_replica_config(gpu_memory_utilization: float = INSTANCE["gpu_memory_utilization"]) -> dict:
    """One 8B served by two colocated replicas (c0, c1)."""
    inst = {**INSTANCE, "gpu_memory_utilization": gpu_memory_utilization}
    return {
        "gpu": "h100-sxm-80gb", "num_gpus": 8,
        "models": {COLOCATED_MODEL: {"preset": "llama-3-8b", "max_context_len": MAX_CONTEXT}},
        "instances": [
            {"id": "c0", "model": COLOCATED_MODEL, "role": "colocated", "gpu_ids": [0], **inst},
            {"id": "c1", "model": COLOCATED_MODEL, "role": "colocated", "gpu_ids": [1], **inst},
        ],
    }


def disagg_config() -> dict:
    """One disaggregated 8B: prefill p0, p1 and decode d0, d1."""
    return {
        "gpu": "h100-sxm-80gb", "num_gpus": 8,
        "models": {DISAGG_MODEL: {"preset": "llama-3-8b", "max_context_len": MAX_CONTEXT}},
        "instances": [
            {"id": "p0", "model": DISAGG_MODEL, "role": "prefill", "gpu_ids": [0], "max_num_batched_tokens": 2048, **INSTANCE},
            {"id": "p1", "model": DISAGG_MODEL, "role": "prefill", "gpu_ids": [1], "max_num_batched_tokens": 2048,
             **INSTANCE},
            {"id": "d0", "model": DISAGG_MODEL, "role": "decode", "gpu_ids": [2], **INSTANCE},
            {"id": "d1", "model": DISAGG_MODEL, "role": "decode", "gpu_ids": [3], **INSTANCE},
        ],
    }


def prompt(n: int, salt: int) -> gen_pb.TokenIds:
    """A token prompt of n ids, distinct per salt (no shared prefix between requests)."""
    return gen_pb.TokenIds(ids=[1000 + (salt * 7919 + i * 31) % 30000 for i in range(n)])


@dataclass
class Stream:
    """One Generate call as the client saw it."""

    request: gen_pb.GenerateRequest
    tokens: list[int] = field(default_factory=list)
    request_id: str = ""
    code: grpc.StatusCode | None = None  # None while running, OK when finished
    details: str = ""
    retry_after_ms: int | None = None
    first_token: asyncio.Event = field(default_factory=asyncio.Event)
    usage: tuple[int, int] | None = None  # (prompt, completion) tokens of the last message, once finished
    finish: int | None = None  # the last message's finish reason

    async def run(self, stub, timeout_s: float = 120.0) -> None:
        try:
            async for response in stub.Generate(self.request, timeout=timeout_s):
                self.request_id = self.request_id or response.request_id
                self.tokens.extend(response.token_ids)
                if response.finish_reason:
                    self.finish = response.finish_reason
                    self.usage = (response.usage.prompt_tokens, response.usage.completion_tokens)
                if self.tokens:
                    self.first_token.set()
            self.code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            self.code, self.details = e.code(), e.details() or ""
            trailers = dict(e.trailing_metadata() or ())
            if "retry-after-ms" in trailers:
                self.retry_after_ms = int(trailers["retry-after-ms"])
        finally:
            self.first_token.set()  # also on failure: nobody waits forever


def access_log(node, wait_for=(), timeout_s: float = 30.0) -> dict[str, dict]:
    """request_id -> the router's access-log line. `wait_for`: request ids (or Streams) whose lines must be there;
    the file is read again (bounded) until they are, since a client can see its stream end before the router's
    line for it reaches the log file."""
    want = {w.request_id if isinstance(w, Stream) else w for w in wait_for}
    deadline = time.monotonic() + timeout_s
    while True:
        lines = {}
        for line in node.router.log_file.read_text().splitlines():
            if line.startswith("{") and line.endswith("}"):
                entry = json.loads(line)
                if entry.get("logger") == "octoserve.router.access":
                    lines[entry["request_id"]] = entry
        missing = want - lines.keys()
        if not missing:
            return lines
        if time.monotonic() > deadline:
            raise AssertionError(f"no access-log line within {timeout_s} s for {sorted(missing)}")
        time.sleep(0.05)


def router_log(node) -> list[dict]:
    return [json.loads(line) for line in node.router.log_file.read_text().splitlines() if line.startswith("{")]


async def load(address: str) -> w_pb.LoadReport:
    async with grpc.aio.insecure_channel(address) as channel:
        return await w_grpc.WorkerStub(channel).GetLoad(w_pb.GetLoadRequest(), timeout=5.0)


async def wait_all_free(node, timeout_s: float = 30.0) -> dict[str, w_pb.LoadReport]:
    """Every worker's KV blocks all free and nothing queued (bounded)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while True:
        loads = {iid: await load(sp.address) for iid, sp in node.workers.items()}
        if all(l.num_free_blocks == l.num_total_blocks and l.num_running == 0 and l.num_waiting == 0
               for l in loads.values()):
            return loads
        if loop.time() > deadline:
            raise AssertionError(f"KV not freed within {timeout_s} s: {loads}")
        await asyncio.sleep(0.1)


async def _holds(predicate) -> bool:
    result = predicate()
    return await result if inspect.isawaitable(result) else result


async def until(predicate, timeout_s: float, what: str) -> None:
    """Polls `predicate` (plain or async) every 50 ms; AssertionError naming `what` past `timeout_s`."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not await _holds(predicate):
        if loop.time() > deadline:
            raise AssertionError(f"not within {timeout_s} s: {what}")
        await asyncio.sleep(0.05)
