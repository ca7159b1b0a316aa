"""The cluster tier on the wire: each node router serves its headroom summary; the picker service polls them.

Two small gRPC services whose messages are JSON (generic handlers, no generated code):
- `octoserve.cluster.v1.Headroom/Get` on every node router (`add_headroom_service`): the node's current
  `HeadroomSummary`.
- `octoserve.cluster.v1.Picker/Pick` on the picker (`PickerService`, `python -m octoserve.services.cluster`):
  request {"model", "prompt_token_ids", "priority", "max_tokens"} -> {"node": "host:port", "predicted_ttft_ms",
  "expected_cached_tokens", "fallbacks": ["host:port", ...]} (the nodes to try next, in order, if the node's own
  admission refuses: RESOURCE_EXHAUSTED with a retry delay); when every node refuses, RESOURCE_EXHAUSTED with the soonest retry delay across the
  nodes (google.rpc.RetryInfo and the `retry-after-ms` trailer, as the node routers send it).
This is lookaside load balancing: the client (or a gateway) asks the picker, then sends the request to the node;
the picker never carries tokens. Behind a gateway the picker's decision is the endpoint-picker step of the Gateway
API Inference Extension (docs/CLUSTER.md).

Staleness and node loss: the picker polls every node every `poll_s` with a `poll_timeout_s` deadline; a summary is
stamped with the picker's own receive time (no cross-machine clocks), and a node whose poll fails is forgotten at
once, so new traffic leaves a dead node within one poll interval plus the timeout.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence

import grpc

from octoserve.services.cluster.headroom import HeadroomSummary, ModelHeadroom, TierHeadroom
from octoserve.services.cluster.picker import ClusterPicker, ClusterRefuse
from octoserve.services.core.types import Priority, RequestSpec, SamplingParams
from octoserve.services.rpc.status import retry_trailers

log = logging.getLogger("octoserve.cluster")

HEADROOM_SERVICE = "octoserve.cluster.v1.Headroom"
PICKER_SERVICE = "octoserve.cluster.v1.Picker"


def _encode(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _decode(data: bytes):
    return json.loads(data.decode()) if data else {}


def summary_to_dict(s: HeadroomSummary) -> dict:
    def tier(t: TierHeadroom) -> dict:
        return {"tier": t.tier.name, "admitting": t.admitting, "retry_after_ms": t.retry_after_ms,
                "wait_ms": None if t.wait_ms == float("inf") else t.wait_ms, "correction_ms": t.correction_ms}

    return {"node_id": s.node_id, "healthy": s.healthy, "as_of_s": s.as_of_s,
            "models": [{**{f.name: getattr(m, f.name) for f in dataclasses.fields(m) if f.name != "tiers"},
                        "tiers": [tier(t) for t in m.tiers]} for m in s.models],
            "hot_prefix_hashes": sorted(s.hot_prefix_hashes)}


def summary_from_dict(d: Mapping) -> HeadroomSummary:
    def tier(t: Mapping) -> TierHeadroom:
        wait = float("inf") if t["wait_ms"] is None else float(t["wait_ms"])
        return TierHeadroom(Priority[t["tier"]], bool(t["admitting"]), int(t["retry_after_ms"]), wait,
                            float(t["correction_ms"]))

    models = tuple(ModelHeadroom(**{**{k: v for k, v in m.items() if k != "tiers"},
                                    "tiers": tuple(tier(t) for t in m["tiers"])}) for m in d["models"])
    return HeadroomSummary(d["node_id"], bool(d["healthy"]), float(d["as_of_s"]), models,
                           frozenset(int(h) for h in d["hot_prefix_hashes"]))


def add_headroom_service(server: grpc.aio.Server, summary: Callable[[], HeadroomSummary]) -> None:
    """Serve `summary()` as octoserve.cluster.v1.Headroom/Get on a node router's server."""

    async def get(request: bytes, context) -> bytes:
        return _encode(summary_to_dict(summary()))

    handler = grpc.unary_unary_rpc_method_handler(get, request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(HEADROOM_SERVICE, {"Get": handler}),))


def headroom_source(policy, loads: Callable[[], Mapping], healthy: Callable[[], bool]) -> Callable[[], HeadroomSummary]:
    """The summary function a node router serves: its policy's view of its current loads (the router's hook)."""
    from octoserve.services.cluster.headroom import HeadroomPublisher  # noqa: PLC0415

    publisher = HeadroomPublisher("node", policy)
    return lambda: publisher.summary(loads(), time.monotonic(), healthy=healthy())


async def fetch_summary(channel: grpc.aio.Channel, timeout_s: float) -> HeadroomSummary:
    call = channel.unary_unary(f"/{HEADROOM_SERVICE}/Get")
    return summary_from_dict(_decode(await call(b"", timeout=timeout_s)))


class PickerService:
    """Polls the nodes' summaries into a `ClusterPicker` and answers Pick; see the module docstring."""

    def __init__(self, picker: ClusterPicker, nodes: Sequence[str], *, poll_s: float = 0.1,
                 poll_timeout_s: float = 0.5, clock: Callable[[], float] = time.monotonic) -> None:
        self.picker = picker
        self.nodes = list(nodes)  # "host:port" of each node router; the address is the node id
        self.poll_s = poll_s
        self.poll_timeout_s = poll_timeout_s
        self.clock = clock
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._task: asyncio.Task | None = None
        self._seq = 0

    async def start(self) -> None:
        self._channels = {n: grpc.aio.insecure_channel(n) for n in self.nodes}
        await self.poll_once()
        self._task = asyncio.create_task(self._poll_loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()

    async def poll_once(self) -> None:
        results = await asyncio.gather(*(fetch_summary(c, self.poll_timeout_s) for c in self._channels.values()),
                                       return_exceptions=True)
        for node, result in zip(self._channels, results):
            if isinstance(result, BaseException):
                if node in self.picker.summaries:
                    log.warning("node unreachable; not picking it", extra={"fields": {"node": node}})
                self.picker.forget(node)
            else:
                self.picker.on_summary(dataclasses.replace(result, node_id=node, as_of_s=self.clock()))

    async def _poll_loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.poll_once()

    def add_to_server(self, server: grpc.aio.Server) -> None:
        handler = grpc.unary_unary_rpc_method_handler(self.Pick, request_deserializer=None, response_serializer=None)
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(PICKER_SERVICE, {"Pick": handler}),))

    async def Pick(self, request: bytes, context) -> bytes:
        try:
            spec = self._spec(_decode(request))
        except (KeyError, ValueError, TypeError) as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"Pick needs model, prompt_token_ids (ints), priority (a tier name): {e}")
        decision = self.picker.pick(spec, self.clock())
        if isinstance(decision, ClusterRefuse):
            code = grpc.StatusCode.RESOURCE_EXHAUSTED
            await context.abort(code, decision.reason, trailing_metadata=retry_trailers(code, decision.reason,
                                                                                       decision.retry_after_ms))
        self.picker.on_dispatched(decision.node_id, spec, decision)
        return _encode({"node": decision.node_id, "predicted_ttft_ms": decision.predicted_ttft_ms,
                        "expected_cached_tokens": decision.expected_cached_tokens,
                        "fallbacks": [p.node_id for p in decision.fallbacks]})

    def _spec(self, body: Mapping) -> RequestSpec:
        self._seq += 1
        tokens = tuple(int(t) for t in body["prompt_token_ids"])
        if not tokens:
            raise ValueError("prompt_token_ids is empty")
        return RequestSpec(f"pick-{self._seq}", str(body["model"]), tokens,
                           SamplingParams(max_tokens=int(body.get("max_tokens", 256))), 0.0,
                           Priority[str(body.get("priority", "STANDARD")).upper()])


async def pick_node(channel: grpc.aio.Channel, model: str, prompt_token_ids: Sequence[int], *,
                    priority: str = "STANDARD", max_tokens: int = 256, timeout_s: float = 2.0) -> dict:
    """Ask the picker where to send a request (the lookaside client side)."""
    call = channel.unary_unary(f"/{PICKER_SERVICE}/Pick")
    body = {"model": model, "prompt_token_ids": list(prompt_token_ids), "priority": priority, "max_tokens": max_tokens}
    return _decode(await call(_encode(body), timeout=timeout_s))
