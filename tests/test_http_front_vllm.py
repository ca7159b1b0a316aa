"""The HTTP front on the vllm engine with the tiny test Llama: the model's chat template and tokenizer are used
(a chat over HTTP is exactly the gRPC request for the template's token ids), text is the tokenizer's decoding of
the streamed ids, cached prompt tokens are reported, and `stop` ends the text before the stop string.
"""

from __future__ import annotations

import pytest
from vllm_fixtures import MODEL_NAME, import_vllm_or_reason, vllm_skip_reason

from octoserve.services.launcher import REPO_ROOT, start_node

_SKIP = vllm_skip_reason()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]

TINY_CONFIG = REPO_ROOT / "services" / "configs" / "tiny-vllm.yaml"
MESSAGES = [{"role": "system", "content": "Answer in one line."}, {"role": "user", "content": "What does the router do?"}]
LONG_PROMPT = "The scheduler admits a request when the KV cache has room for its prompt and reservation. " * 8


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    if (reason := import_vllm_or_reason()) is not None:
        pytest.skip(reason)
    from octoserve.services.engine.test_model import build_test_model

    return build_test_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="module")
def node(model_dir, tmp_path_factory):
    n = start_node(str(TINY_CONFIG), engine="vllm", model_path=str(model_dir),
                   run_dir=tmp_path_factory.mktemp("node"), startup_timeout_s=300.0, grace_s=10.0, http_port=0,
                   extra_env={"OCTOSERVE_VLLM_DTYPE": "float32", "HF_HUB_OFFLINE": "1"})
    yield n
    n.stop()


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
