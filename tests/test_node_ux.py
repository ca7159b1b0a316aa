"""What a new user sees from a live node (real gRPC on 127.0.0.1, sim engine): text prompts counted one token a
byte with empty response text, bounded metric labels, and `bench` refusing a workload the node does not serve."""

from __future__ import annotations

import argparse
import asyncio

import pytest
import pytest_asyncio

from octoserve import AsyncClient, ModelNotFoundError
from octoserve.router.metrics import UNSERVED_LABEL
from octoserve.services.loadgen import build_trace, served_models
from octoserve.services.usage import UsageError
from tests.service_fixtures import COLOCATED_MODEL, DISAGG_MODEL, start_inprocess_node


pytestmark = pytest.mark.asyncio(loop_scope="module")


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def node():
    n = await start_inprocess_node()
    yield n
    await n.stop()


async def test_sim_engine_counts_a_text_prompt_one_token_a_byte_and_returns_empty_text(node):
    text = "héllo wörld"  # 11 characters, 13 UTF-8 bytes
    async with AsyncClient(node.router.address) as client:
        done = await client.complete(COLOCATED_MODEL, text, max_tokens=3, ignore_eos=True)
    assert done.usage.prompt_tokens == len(text.encode("utf-8")) == 13
    assert len(done.token_ids) == 3 and done.text == ""


async def test_router_metrics_never_label_an_unserved_model(node):
    async with AsyncClient(node.router.address) as client:
        for name in ("gpt-4", "", "gpt-4o"):
            with pytest.raises(ModelNotFoundError):
                await client.complete(name, [1, 2, 3], max_tokens=2)
        await client.complete(COLOCATED_MODEL, [1, 2, 3], max_tokens=2, ignore_eos=True)
    registry = node.router_servicer.metrics.registry
    models = {s.labels["model"] for fam in registry.collect() for s in fam.samples if "model" in s.labels}
    assert models == {COLOCATED_MODEL, UNSERVED_LABEL}
    assert registry.get_sample_value("octoserve_router_refusals_total",
                                     {"model": UNSERVED_LABEL, "error": "UnknownModel"}) == 3


async def test_bench_refuses_a_workload_the_target_does_not_serve_before_sending(node):
    target = node.router.address
    served = await asyncio.to_thread(served_models, target)
    assert sorted(served) == sorted([COLOCATED_MODEL, DISAGG_MODEL])
    args = argparse.Namespace(profile="seed-000", workload=None, trace=None, only_served=False, rate=10.0,
                              duration=1.0, burstiness=None, seed=0, max_requests=None)
    with pytest.raises(UsageError) as info:
        build_trace(args, served)
    assert str(info.value) == (
        "workload seed-000 asks for llama-3-70b, which the node does not serve (it serves llama-3-8b, "
        "llama-3-8b-pd); serve them in the config, give a workload with only served models (--workload / "
        "--trace), or pass --only-served to drop their requests")
