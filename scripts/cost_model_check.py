"""Print the cost model's key predictions and compare them with published measurements.

Usage: python scripts/cost_model_check.py   (output is pasted into docs/COST_MODEL.md)

The published points are the TensorRT-LLM performance tables for A100 80 GB in FP16 (same tensor-core rate and
bytes per weight as BF16), docs/source/performance.md in NVIDIA/TensorRT-LLM: batch-1 first-token latency (v0.5)
and peak throughput (v0.6.1). They use Llama-2 shapes, built here from the Llama-3 presets by overriding fields.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.core.cost_model import CostModel  # noqa: E402
from services.core.specs import GPU_PRESETS, MODEL_PRESETS, model_spec_from_dict  # noqa: E402

LLAMA2_7B = model_spec_from_dict(
    {
        "preset": "llama-3-8b",
        "name": "llama-2-7b",
        "num_kv_heads": 32,
        "intermediate_size": 11008,
        "vocab_size": 32000,
        "num_params": 6_738_415_616,
        "max_context_len": 4096,
    }
)
LLAMA2_70B = model_spec_from_dict(
    {"preset": "llama-3-70b", "name": "llama-2-70b", "vocab_size": 32000, "num_params": 68_976_648_192,
     "max_context_len": 4096}
)


def predictions() -> list[tuple[str, float]]:
    h100 = GPU_PRESETS["h100-sxm-80gb"]
    l70, l8 = MODEL_PRESETS["llama-3-70b"], MODEL_PRESETS["llama-3-8b"]
    tp8, tp4, small = CostModel(l70, h100, 8), CostModel(l70, h100, 4), CostModel(l8, h100, 1)
    return [
        ("70B TP=8 decode step, batch 1, context 1,400 (ms)", tp8.decode_step_time_s(1, 1400) * 1e3),
        ("70B TP=8 decode step, batch 64, context 1,400 (ms)", tp8.decode_step_time_s(64, 1400) * 1e3),
        ("70B TP=4 decode step, batch 1, context 1,400 (ms)", tp4.decode_step_time_s(1, 1400) * 1e3),
        ("70B TP=4 decode step, batch 64, context 1,400 (ms)", tp4.decode_step_time_s(64, 1400) * 1e3),
        ("8B decode step, batch 1, context 1,400 (ms)", small.decode_step_time_s(1, 1400) * 1e3),
        ("8B decode step, batch 64, context 1,400 (ms)", small.decode_step_time_s(64, 1400) * 1e3),
        ("8B prefill of 1,000 tokens (ms)", small.prefill_time_s(1000) * 1e3),
        ("8B prefill throughput at 2,048-token chunks (tok/s)", small.prefill_tokens_per_s(2048)),
        ("70B TP=8 prefill of 1,000 tokens (ms)", tp8.prefill_time_s(1000) * 1e3),
        ("70B TP=4 prefill of 1,000 tokens (ms)", tp4.prefill_time_s(1000) * 1e3),
        ("70B TP=8 KV hand-off of 1,400 tokens over NVLink (ms)", tp8.kv_transfer_time_s(1400) * 1e3),
    ]


def comparisons() -> list[tuple[str, float, float]]:
    """(what, published ms, predicted ms)."""
    a100 = GPU_PRESETS["a100-80gb"]
    small = CostModel(LLAMA2_7B, a100, 1)
    large = CostModel(LLAMA2_70B, a100, 4)
    # Peak-throughput row: batch 60, 128 in / 2,048 out, 1,928 output tok/s -> one decode step = 60 / 1,928 s,
    # at a mean context of 128 + 2,048 / 2 = 1,152 tokens (the 60 prompts' prefill is <1 % of the run).
    return [
        ("Llama-2-7B A100 TTFT, batch 1, 128-token prompt", 16.0, small.prefill_time_s(128) * 1e3),
        ("Llama-2-7B A100 TTFT, batch 1, 2,048-token prompt", 133.0, small.prefill_time_s(2048) * 1e3),
        ("Llama-2-70B 4xA100 TTFT, batch 1, 128-token prompt", 47.0, large.prefill_time_s(128) * 1e3),
        ("Llama-2-70B 4xA100 TTFT, batch 1, 2,048-token prompt", 377.0, large.prefill_time_s(2048) * 1e3),
        ("Llama-2-7B A100 decode step, batch 60, ~1,152 context", 60 / 1928 * 1e3,
         small.decode_step_time_s(60, 1152) * 1e3),
    ]


def main() -> int:
    print("Predictions (H100 SXM 80 GB, default CostConstants)")
    print("| quantity | predicted |")
    print("|---|---:|")
    for what, value in predictions():
        print(f"| {what} | {value:,.2f} |")
    print()
    print("Against published measurements (TensorRT-LLM, A100 80 GB FP16)")
    print("| measurement | published (ms) | predicted (ms) | predicted / published |")
    print("|---|---:|---:|---:|")
    for what, published, predicted in comparisons():
        print(f"| {what} | {published:,.1f} | {predicted:,.1f} | {predicted / published:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
