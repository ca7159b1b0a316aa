"""The load snapshot on the wire: every EngineLoad field reaches the router, so the live router admits on the same
view the simulator's router has.

The decode-slot limit (`max_num_seqs`) and the recent mean completion length (`mean_output_tokens`) feed the
router's slot-wait prediction (`admission.slot_wait_s`). Dropped on the wire they read as 0, "no limit", and the
live router admitted requests to an instance whose only slot was taken, while the simulator refused them.
"""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from octoserve.services.core.types import EngineLoad, Role
from octoserve.services.rpc import convert
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from tests.service_fixtures import COLOCATED_MODEL, collect, request, small_config_dict, start_inprocess_node
from octoserve.services.core.placement import node_config_from_dict


def _every_field_set() -> EngineLoad:
    """An EngineLoad with no field at its default, so a field lost on the wire shows."""
    return EngineLoad(
        instance_id="lm-0", model="llama-3-70b", role=Role.DECODE, num_running=3, num_waiting=4,
        num_total_blocks=1000, num_free_blocks=250, block_size=32, queued_prefill_tokens=4096,
        prefill_tokens_per_s=12345.5, decode_step_time_s=0.0264, healthy=False, paused=True, max_num_seqs=7,
        mean_output_tokens=96.5, num_reserved=2, long_prefill_tokens_per_s=23456.5,
        busy_until_s=77.25, long_step_wait_s=0.375, long_burst_tokens=4096.0, long_sustained_tokens_per_s=1234.5,
    )


def test_load_report_round_trip_keeps_every_engine_load_field():
    load = _every_field_set()
    defaults = EngineLoad("", "", Role.COLOCATED, 0, 0, 0, 0, 0, 0, 0.0, 0.0)
    assert all(getattr(load, f.name) != getattr(defaults, f.name) for f in dataclasses.fields(EngineLoad))
    assert convert.load_from_pb(convert.load_to_pb(load)) == load
    wire = set(w_pb.LoadReport.DESCRIPTOR.fields_by_name)
    assert {f.name for f in dataclasses.fields(EngineLoad)} <= wire


def _one_slot_config():
    """The small node with its colocated 8B held to one decode slot (slo_sizing off: the configured batch holds)."""
    raw = small_config_dict()
    raw["instances"][0]["max_num_seqs"] = 1
    raw["policies"] = {"slo_sizing": False, "slack_chunking": False}
    return node_config_from_dict(raw)


async def _wait_for(predicate, what: str, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.01)


@pytest.mark.asyncio
async def test_live_router_refuses_while_the_only_decode_slot_is_taken():
    node = await start_inprocess_node(_one_slot_config())
    try:
        pool = node.router_servicer.pool
        await _wait_for(lambda: "c0" in pool.loads(), "the first snapshot of c0")
        assert pool.loads()["c0"].max_num_seqs == 1
        assert pool.loads()["c0"].mean_output_tokens > 0  # the predictor's prior before any request finished
        stub = node.generation()
        # The first request holds the slot for 400 decode steps (~3 s on the 8B).
        first = asyncio.create_task(collect(stub.Generate(request(max_tokens=400))))
        await _wait_for(lambda: pool.loads()["c0"].num_running == 1, "the first request to run")
        load = pool.loads()["c0"]
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await collect(stub.Generate(request(max_tokens=8)))
        assert refused.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "predicted TTFT" in refused.value.details()
        # The hint covers the wait for the slot: one whole sequence's decode (the predictor's mean length x the
        # decode step), less the 250 ms SLO the request is allowed; 0.9: the step estimate moves between snapshots.
        slot_wait_ms = 1000 * load.mean_output_tokens * load.decode_step_time_s
        hint = int(dict(refused.value.trailing_metadata() or ()).get("retry-after-ms", 0))
        assert hint >= 0.9 * slot_wait_ms - 250 > 1000
        first.cancel()
        await node.wait_all_free()
        await _wait_for(lambda: pool.loads()["c0"].num_running == 0, "the router to see the slot free")
        # With the slot free again the same request is admitted and served.
        responses = await collect(stub.Generate(request(max_tokens=8)))
        assert sum(len(r.token_ids) for r in responses) == 8
    finally:
        await node.stop()
