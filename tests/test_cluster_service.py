"""The cluster tier on the wire (services/cluster/service.py): real grpc.aio servers on 127.0.0.1.

Node routers are stood in for by servers that serve the headroom service exactly as the router registers it
(`add_headroom_service`), over summaries from a real `RouterPolicy`; the picker is the real `PickerService`.
"""

from __future__ import annotations

import json
import random

import grpc
import pytest

from octoserve.services.cluster.headroom import HeadroomSummary, ModelHeadroom, TierHeadroom
from octoserve.services.cluster.picker import ClusterPicker, ClusterPolicy
from octoserve.services.cluster.service import (
    PICKER_SERVICE,
    PickerService,
    add_headroom_service,
    fetch_summary,
    headroom_source,
    pick_node,
    summary_from_dict,
    summary_to_dict,
)
from octoserve.services.config import load_node_config
from octoserve.services.core.routing import RouterPolicy, build_cost_models
from octoserve.services.core.types import EngineLoad, Priority, Role
from octoserve.services.rpc.server import ServiceSpec, start_service
from octoserve.services.rpc.status import retry_after_ms_from

SM = "llama-3-8b"


def _summary(wait_ms: float, admitting: bool = True, retry_ms: int = 0) -> HeadroomSummary:
    tiers = tuple(TierHeadroom(t, admitting, retry_ms, wait_ms, 0.0)
                  for t in (Priority.INTERACTIVE, Priority.STANDARD, Priority.BATCH))
    return HeadroomSummary("x", True, 0.0, (ModelHeadroom(SM, tiers, 10_000.0, 1000, 2000, 16, 1.0, 4),),
                           frozenset({7, 11}))


async def _node(state: dict) -> object:
    return await start_service(ServiceSpec(name="node", metrics_port=None, grace_s=0.5,
                                           add_servicers=lambda s: add_headroom_service(s, lambda: state["summary"])))


async def test_summary_round_trips_through_json_and_the_router_hook():
    config = load_node_config(None)
    policy = RouterPolicy(config, build_cost_models(config), random.Random(0))
    loads = {i.id: EngineLoad(i.id, i.model, Role.COLOCATED, 0, 0, 5000, 5000, 16, 0, 20_000.0, 0.01, max_num_seqs=256)
             for i in config.instances}
    source = headroom_source(policy, lambda: loads, lambda: True)
    node = await start_service(ServiceSpec(name="router-ish", metrics_port=None, grace_s=0.5,
                                           add_servicers=lambda s: add_headroom_service(s, source)))
    try:
        async with grpc.aio.insecure_channel(node.address) as channel:
            fetched = await fetch_summary(channel, 2.0)
    finally:
        await node.shutdown()
    expected = source()
    assert fetched.models == expected.models and fetched.healthy
    assert [m.model for m in fetched.models] == ["llama-3-70b", "llama-3-8b"]
    assert summary_from_dict(json.loads(json.dumps(summary_to_dict(_summary(5.0))))) == _summary(5.0)


async def test_picker_service_picks_backpressures_and_drops_a_dead_node():
    a, b = {"summary": _summary(0.0)}, {"summary": _summary(60.0)}
    node_a, node_b = await _node(a), await _node(b)
    picker = ClusterPicker(ClusterPolicy(), random.Random(0))
    # Polled by hand below; a poll deadline past a loaded machine's first connect (the default 0.5 s once dropped
    # both nodes before the first pick: "no healthy node"). A stopped node still fails its poll at once.
    service = PickerService(picker, [node_a.address, node_b.address], poll_s=3600.0, poll_timeout_s=10.0)
    front = await start_service(ServiceSpec(name="picker", metrics_port=None, grace_s=0.5,
                                            service_names=(PICKER_SERVICE,), add_servicers=service.add_to_server,
                                            start=service.start, close=service.close))
    prompt = list(range(1000, 1800))
    try:
        async with grpc.aio.insecure_channel(front.address) as channel:
            chosen = await pick_node(channel, SM, prompt)
            # b has room too (60 ms of queue): it follows as the fallback if a's own admission refuses.
            assert chosen == {"node": node_a.address, "predicted_ttft_ms": 80.0, "expected_cached_tokens": 0,
                              "fallbacks": [node_b.address]}

            a["summary"], b["summary"] = _summary(900.0, False, 700), _summary(400.0, False, 250)
            await service.poll_once()
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await pick_node(channel, SM, prompt)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert retry_after_ms_from(refused.value) == 250  # the soonest across the nodes

            a["summary"], b["summary"] = _summary(0.0), _summary(60.0)
            await node_a.shutdown()
            await service.poll_once()  # a's poll fails: forgotten at once
            assert (await pick_node(channel, SM, prompt))["node"] == node_b.address
            # Detection takes at most one poll interval plus the poll timeout: within 2 s by default.
            assert PickerService(picker, []).poll_s + PickerService(picker, []).poll_timeout_s < 2.0

            with pytest.raises(grpc.aio.AioRpcError) as bad:
                await channel.unary_unary(f"/{PICKER_SERVICE}/Pick")(b'{"model": "llama-3-8b"}', timeout=2.0)
            assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "prompt_token_ids" in bad.value.details()
    finally:
        await front.shutdown()
        await node_b.shutdown()
