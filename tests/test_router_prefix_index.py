"""The router's prefix index over real gRPC: it mirrors exactly what a worker caches, and forgets the worker when its
load stream ends (a new stream reports only new events, so what the router held for it is stale; kept, it would
grow the router's memory with every worker restart and route prefixes to a worker that lost them)."""

from __future__ import annotations

import asyncio

import pytest

from octoserve.services.core.kv_cache import prefix_block_hashes
from tests.service_fixtures import COLOCATED_MODEL, collect, request, start_inprocess_node

pytestmark = pytest.mark.asyncio


async def _until(predicate, timeout_s: float = 10.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def test_index_mirrors_the_worker_cache_and_forgets_the_worker_when_its_load_stream_ends():
    node = await start_inprocess_node()
    try:
        index = node.router_servicer.policy.prefix_index
        kv = node.servicers["c0"].engine.batcher.kv
        req = request(COLOCATED_MODEL, num_prompt_tokens=64, max_tokens=4)
        await collect(node.generation().Generate(req, timeout=10))
        await node.wait_all_free()
        cached = kv.num_cached_blocks
        assert cached >= 64 // kv.block_size  # the prompt's full blocks, at least
        await _until(lambda: index.num_blocks("c0") == cached)
        hashes = prefix_block_hashes(tuple(req.token_ids.ids), kv.block_size, COLOCATED_MODEL)
        assert index.overlap_blocks(hashes) == {"c0": len(hashes)}

        await node.workers["c0"].shutdown()  # ends its WatchLoad stream
        await _until(lambda: index.num_blocks("c0") == 0)
        assert index.overlap_blocks(hashes) == {}
    finally:
        await node.stop()
