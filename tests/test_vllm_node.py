"""The whole node on the vllm engine (what `octoserve up --engine vllm --model DIR` runs): scheduler, one vLLM
worker, router and the HTTP front, as processes.

- `Generate` through the router returns exactly offline greedy `vllm.LLM` tokens, and the node stops cleanly;
- the HTTP front uses the tiny test Llama's chat template and tokenizer (a chat over HTTP is exactly the gRPC
  request for the template's token ids), text is the tokenizer's decoding of the streamed ids, cached prompt tokens
  are reported, and `stop` ends the text before the stop string.

Engine budget: one node for the module's tests (its one colocated vLLM instance starts while the session's offline
reference, a child process, runs if test_vllm_engine has not run it already: two instances at most). The config is
the embedded example `services/configs/tiny-vllm.yaml`.
"""

from __future__ import annotations

import asyncio

import pytest
from vllm_fixtures import MAX_TOKENS, MODEL_NAME, PROMPTS, vllm_skip_reason

from octoserve.services.core.types import FinishReason
from octoserve.services.node.launcher import REPO_ROOT, start_node

_SKIP = vllm_skip_reason()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

TINY_CONFIG = REPO_ROOT / "services" / "configs" / "tiny-vllm.yaml"
NODE_PROMPTS = PROMPTS[:4]  # 200-390 tokens: one to four KV blocks each
MESSAGES = [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "What does the router do?"}]
LONG_PROMPT = "The scheduler admits a request when the KV cache has room for its prompt and reservation. " * 8


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir  # the session's (tests/conftest.py): the shared offline reference is of this model


@pytest.fixture(scope="module")
def node_and_reference(model_dir, offline_reference, tmp_path_factory):
    """The module's one node (HTTP front included: a vLLM start-up is the slow part, the tests share it) and the
    session's offline reference: already read when test_vllm_engine ran first, else its child process runs while
    the node starts; the test that needs it reads it."""
    offline_reference.start()
    node = None
    try:
        node = start_node(
            str(TINY_CONFIG), engine="vllm", model_path=str(model_dir), run_dir=tmp_path_factory.mktemp("node"),
            startup_timeout_s=300.0, grace_s=10.0, http_port=0,
            extra_env={"OCTOSERVE_VLLM_DTYPE": "float32", "HF_HUB_OFFLINE": "1"},  # as the reference runs
        )
        yield node, offline_reference
    finally:
        offline_reference.stop()  # if still unread: never beside the next module's engines
        if node is not None:
            node.stop()


@pytest.fixture(scope="module")
def node(node_and_reference):
    return node_and_reference[0]


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def grpc_ids(node, prompt_ids, max_tokens: int) -> list[int]:
    from octoserve.client import Client

    with Client(node.router_address) as c:
        return list(c.complete(MODEL_NAME, list(prompt_ids), max_tokens=max_tokens, ignore_eos=True,
                               ttft_slo_ms=10_000, timeout_s=60.0).token_ids)


def test_chat_renders_the_models_template_and_decodes_with_its_tokenizer(node, model_dir, tokenizer):
    import openai

    from octoserve.http_front.text import TextCodec

    codec = TextCodec.from_model_dir(model_dir)
    rendered = codec.render_chat(MESSAGES)
    assert rendered == ("<|bos|><|system|>\nAnswer in one line.<|end|>\n<|user|>\nWhat does the router do?<|end|>\n"
                        "<|assistant|>\n")
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False).ids
    expected = tokenizer.decode(grpc_ids(node, prompt_ids, 12))
    with openai.OpenAI(base_url=node.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        r = c.chat.completions.create(model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True, "ttft_slo_ms": 10_000})
        assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 12
        assert r.choices[0].message.content == expected
        streamed = "".join(ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
            model=MODEL_NAME, messages=MESSAGES, max_tokens=12, temperature=0, stream=True,
            extra_body={"ignore_eos": True, "ttft_slo_ms": 10_000}) if ch.choices)
        assert streamed == expected


def test_completion_reports_cached_tokens_and_honours_stop(node, tokenizer):
    import openai

    prompt_ids = tokenizer.encode(LONG_PROMPT).ids  # with BOS, as the front encodes a completion prompt
    assert len(prompt_ids) > 128
    full = tokenizer.decode(grpc_ids(node, prompt_ids, 16))  # also puts the prompt's blocks in the prefix cache
    with openai.OpenAI(base_url=node.http_url + "/v1", api_key="unused", max_retries=0, timeout=60) as c:
        r = c.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=16, temperature=0,
                                 extra_body={"ignore_eos": True, "ttft_slo_ms": 10_000})
        assert r.choices[0].text == full
        assert r.usage.prompt_tokens == len(prompt_ids)
        assert r.usage.prompt_tokens_details.cached_tokens == len(prompt_ids) // 128 * 128
        stop = full[len(full) // 2:len(full) // 2 + 3]
        stopped = c.completions.create(model=MODEL_NAME, prompt=LONG_PROMPT, max_tokens=16, temperature=0,
                                       stop=[stop], extra_body={"ttft_slo_ms": 10_000})
        assert stopped.choices[0].finish_reason == "stop"
        assert stopped.choices[0].text == full[:full.index(stop)]


async def _complete_all(address: str, prompts) -> list:
    from octoserve.client import AsyncClient

    async with AsyncClient(address) as client:
        return await asyncio.gather(*(
            # A 10 s TTFT SLO: admission must not refuse four prompts at once on a slow, shared CPU.
            client.complete(MODEL_NAME, list(p), max_tokens=MAX_TOKENS, ignore_eos=True, ttft_slo_ms=10_000,
                            timeout_s=60.0)
            for p in prompts
        ))


# Last in the file: it stops the node (a clean exit of every process is part of what it checks). What the HTTP tests
# ran before it changes neither a greedy output nor the cached count (the first batch caches the prompt's blocks).
def test_router_to_vllm_worker_equals_offline_greedy_and_stops_cleanly(node_and_reference):
    node, offline_reference = node_and_reference
    reference = offline_reference.tokens()[:len(NODE_PROMPTS)]
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
    assert codes == {"http_front": 0, "router": 0, "worker:tiny-0": 0, "scheduler": 0}
