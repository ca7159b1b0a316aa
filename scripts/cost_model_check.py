"""Print the cost model's key predictions and compare them with published measurements.

Usage: python scripts/cost_model_check.py   (output is pasted into docs/COST_MODEL.md)

Every figure is printed under both cost profiles ("default" and "pessimistic"). The published points:
- TensorRT-LLM performance tables for A100 80 GB in FP16 (same tensor-core rate and bytes per weight as BF16),
  docs/source/performance.md in NVIDIA/TensorRT-LLM: batch-1 first-token latency (v0.5) and peak throughput (v0.6.1);
- vLLM's CI latency test on H200 (buildkite vllm/performance-benchmark build 9515): batch 8, 32 in / 128 out;
- Vidur's H100 per-op profile of the Llama-2-70B and -7B layers at 1 token (microsoft/vidur,
  data/profiling/compute/h100/meta-llama/*/mlp.csv, medians of the nine per-layer ops summed).
Llama-2 shapes are built here from the Llama-3 presets by overriding fields.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from octoserve.services.core.cost_model import COST_PROFILES, CostConstants, CostModel  # noqa: E402
from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS, model_spec_from_dict  # noqa: E402

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


def predictions(c: CostConstants) -> list[tuple[str, float]]:
    h100 = GPU_PRESETS["h100-sxm-80gb"]
    l70, l8 = MODEL_PRESETS["llama-3-70b"], MODEL_PRESETS["llama-3-8b"]
    tp8, tp4, small = CostModel(l70, h100, 8, c), CostModel(l70, h100, 4, c), CostModel(l8, h100, 1, c)
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


def step_table(c: CostConstants) -> list[tuple[str, list[float]]]:
    """Decode at batch 1 / 32 / 256 (context 1,400) and prefill of 1,000 / 2,700 tokens, ms, per instance shape."""
    h100 = GPU_PRESETS["h100-sxm-80gb"]
    l70, l8 = MODEL_PRESETS["llama-3-70b"], MODEL_PRESETS["llama-3-8b"]
    rows = []
    for name, model, tp in (("8B TP=1", l8, 1), ("70B TP=4", l70, 4), ("70B TP=8", l70, 8)):
        cost = CostModel(model, h100, tp, c)
        decode = [cost.decode_step_time_s(b, 1400) * 1e3 for b in (1, 32, 256)]
        rows.append((name, decode + [cost.prefill_time_s(n) * 1e3 for n in (1000, 2700)]))
    return rows


def comparisons(c: CostConstants) -> list[tuple[str, float, float]]:
    """(what, published ms, predicted ms)."""
    a100, h100, h200 = GPU_PRESETS["a100-80gb"], GPU_PRESETS["h100-sxm-80gb"], GPU_PRESETS["h200-141gb"]
    small = CostModel(LLAMA2_7B, a100, 1, c)
    large = CostModel(LLAMA2_70B, a100, 4, c)
    rows = [
        ("Llama-2-7B A100 TTFT, batch 1, 128-token prompt", 16.0, small.prefill_time_s(128) * 1e3),
        ("Llama-2-7B A100 TTFT, batch 1, 2,048-token prompt", 133.0, small.prefill_time_s(2048) * 1e3),
        ("Llama-2-70B 4xA100 TTFT, batch 1, 128-token prompt", 47.0, large.prefill_time_s(128) * 1e3),
        ("Llama-2-70B 4xA100 TTFT, batch 1, 2,048-token prompt", 377.0, large.prefill_time_s(2048) * 1e3),
        # Peak-throughput row: batch 60, 128 in / 2,048 out, 1,928 output tok/s -> one decode step = 60 / 1,928 s,
        # at a mean context of 128 + 2,048 / 2 = 1,152 tokens (the 60 prompts' prefill is <1 % of the run).
        ("Llama-2-7B A100 decode step, batch 60, ~1,152 context", 60 / 1928 * 1e3,
         small.decode_step_time_s(60, 1152) * 1e3),
    ]
    # vLLM CI latency test: one step prefilling 8 x 32 tokens, then 127 decode steps of batch 8.
    for what, model, tp, published in (("Llama-3.1-8B H200 TP=1", MODEL_PRESETS["llama-3-8b"], 1, 833.421),
                                       ("Llama-3-70B H200 TP=4", MODEL_PRESETS["llama-3-70b"], 4, 2077.53)):
        cost = CostModel(model, h200, tp, c)
        e2e_s = cost.step_time_s([(32, 0)] * 8) + sum(cost.decode_step_time_s(8, 32 + i) for i in range(127))
        rows.append((f"{what} vLLM latency, batch 8, 32 in / 128 out (end to end)", published, e2e_s * 1e3))
    # Vidur per-op medians at 1 token, summed over the nine ops of a layer, times the layer count. The model's
    # counterpart: the layer weights streamed at hbm_eff plus layer_overhead_s (activations are ~0 at 1 token).
    for what, model, tp, vidur_layer_ms in (("Llama-2-70B layers, TP=8", LLAMA2_70B, 8, 0.1045),
                                            ("Llama-2-70B layers, TP=4", LLAMA2_70B, 4, 0.1790),
                                            ("Llama-2-70B layers, TP=1", LLAMA2_70B, 1, 0.6250),
                                            ("Llama-2-7B layers, TP=1", LLAMA2_7B, 1, 0.1750)):
        layer_s = model.linear_params_per_layer * model.dtype_bytes / tp / (h100.hbm_bytes_per_s * c.hbm_eff)
        rows.append((f"{what}, 1 token, H100 (Vidur, sum of per-op kernels)", model.num_layers * vidur_layer_ms,
                     model.num_layers * (layer_s + c.layer_overhead_s) * 1e3))
    return rows


def main() -> int:
    names = list(COST_PROFILES)
    print("Predictions (H100 SXM 80 GB)")
    print("| quantity | " + " | ".join(names) + " |")
    print("|---|" + "---:|" * len(names))
    columns = [predictions(COST_PROFILES[n]) for n in names]
    for i, (what, _) in enumerate(columns[0]):
        print(f"| {what} | " + " | ".join(f"{col[i][1]:,.2f}" for col in columns) + " |")
    print()
    print("Step times (ms, H100 SXM; decode at context 1,400)")
    print("| profile | instance | decode b=1 | b=32 | b=256 | prefill 1,000 | prefill 2,700 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for n in names:
        for inst, values in step_table(COST_PROFILES[n]):
            print(f"| {n} | {inst} | " + " | ".join(f"{v:,.2f}" for v in values) + " |")
    print()
    print("Against published measurements")
    print("| measurement | published (ms) | " + " | ".join(f"{n} (ms) | {n} / published" for n in names) + " |")
    print("|---|---:|" + "---:|---:|" * len(names))
    columns = [comparisons(COST_PROFILES[n]) for n in names]
    for i, (what, published, _) in enumerate(columns[0]):
        cells = " | ".join(f"{col[i][2]:,.1f} | {col[i][2] / published:.2f}" for col in columns)
        print(f"| {what} | {published:,.1f} | {cells} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
