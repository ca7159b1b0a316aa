"""The whole node on the vllm engine (what `octoserve up --engine vllm --model DIR` runs): scheduler, one vLLM
worker, router, as processes; `Generate` through the router returns exactly offline greedy `vllm.LLM` tokens.

Engine budget: the node's one colocated vLLM instance starts while the offline reference (a child process) runs:
two instances at most. The config is the embedded example `services/configs/tiny-vllm.yaml`.
"""

from __future__ import annotations

import asyncio

import pytest
from vllm_fixtures import (
    MAX_TOKENS,
    MODEL_NAME,
    PROMPTS,
    import_vllm_or_reason,
    read_offline_reference,
    start_offline_reference,
    vllm_skip_reason,
)

from octoserve.services.core.types import FinishReason
from octoserve.services.launcher import REPO_ROOT, start_node

_SKIP = vllm_skip_reason()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

TINY_CONFIG = REPO_ROOT / "services" / "configs" / "tiny-vllm.yaml"
NODE_PROMPTS = PROMPTS[:4]  # 200-390 tokens: one to four KV blocks each


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if (reason := import_vllm_or_reason()) is not None:
        pytest.skip(reason)
    from octoserve.services.engine.test_model import build_test_model

    return build_test_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def node_and_reference(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("reference") / "reference.json"
    reference_proc = start_offline_reference(model_dir, NODE_PROMPTS, out)
    node = None
    try:
        node = start_node(
            str(TINY_CONFIG), engine="vllm", model_path=str(model_dir), run_dir=tmp_path_factory.mktemp("node"),
            startup_timeout_s=300.0, grace_s=10.0,
            extra_env={"OCTOSERVE_VLLM_DTYPE": "float32", "HF_HUB_OFFLINE": "1"},  # as the reference runs
        )
        yield node, read_offline_reference(reference_proc, out)
    finally:
        if reference_proc.poll() is None:
            reference_proc.kill()
            reference_proc.wait()
        if node is not None:
            node.stop()


async def _complete_all(address: str, prompts) -> list:
    from octoserve.client import AsyncClient

    async with AsyncClient(address) as client:
        return await asyncio.gather(*(
            # A 10 s TTFT SLO: admission must not refuse four prompts at once on a slow, shared CPU.
            client.complete(MODEL_NAME, list(p), max_tokens=MAX_TOKENS, ignore_eos=True, ttft_slo_ms=10_000,
                            timeout_s=60.0)
            for p in prompts
        ))


def test_router_to_vllm_worker_equals_offline_greedy_and_stops_cleanly(node_and_reference):
    node, reference = node_and_reference
    assert list(node.workers) == ["tiny-0"]
    completions = asyncio.run(_complete_all(node.router_address, NODE_PROMPTS))  # concurrent: one batch
    for i, c in enumerate(completions):
        assert list(c.token_ids) == reference[i], f"prompt {i}"
        assert c.finish_reason is FinishReason.LENGTH
        assert (c.usage.prompt_tokens, c.usage.completion_tokens) == (len(NODE_PROMPTS[i]), MAX_TOKENS)
    # Again, alone: the prompt is now in vLLM's prefix cache (whole 128-token blocks), the tokens are the same.
    (again,) = asyncio.run(_complete_all(node.router_address, NODE_PROMPTS[3:4]))
    assert list(again.token_ids) == reference[3]
    assert again.usage.cached_prompt_tokens == len(NODE_PROMPTS[3]) // 128 * 128
    codes = node.stop()
    assert codes == {"router": 0, "worker:tiny-0": 0, "scheduler": 0}
