"""Time whole decoder steps of the 8B and 70B shapes on one GPU and set them beside the cost model's predictions.

Usage: python scripts/gpu_step_check.py --out DIR            (CUDA; ~40 s on an H200)
       python scripts/gpu_step_check.py --out DIR --smoke    (CPU, tiny shapes: checks the script runs)
       python scripts/gpu_step_check.py --render JSON --plot PNG   (table and plot of a saved run)

What it runs: a PyTorch decoder written from the model spec (RMSNorm, fused QKV GEMM, rotary embedding, GQA
attention through scaled_dot_product_attention over a KV cache, output GEMM, fused gate/up GEMM, SiLU-and-mul,
down GEMM, residual adds; the final norm and the LM head on the sampled rows), random BF16 weights, one GPU's
shard of a TP slice. One layer's weights and KV are allocated and run num_layers times: a layer's working set
(218 MB of 8B weights, 110-440 MB of 70B shards) is far beyond the 60 MB L2, so every pass streams from HBM as
distinct layers would. Decode steps are timed eagerly (kernel by kernel, as vLLM's enforce_eager) and replayed
from a CUDA graph (as vLLM's default decode); prefill steps eagerly.

What it leaves out, so the comparison subtracts them from the prediction: the TP all-reduces (one GPU) and the
engine's host work per step (scheduling, input preparation, sampling sync): `step_overhead_s`.

Output: a markdown table on stdout and `gpu_steps.json` in --out, with the measured times, the predictions of
both cost profiles without those two terms, and their ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from octoserve.services.core.cost_model import COST_PROFILES, CostModel
from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS, ModelSpec

CASES = (("llama-3-8b", 1), ("llama-3-70b", 4), ("llama-3-70b", 8))
DECODE = ((1, 1400), (32, 1400), (256, 1400))
PREFILL = (1000, 2700)


def gpu_time_s(cm: CostModel, kind: str, a: int, b: int) -> float:
    """The cost model's step time without the all-reduces and the host step overhead."""
    if kind == "decode":
        total, tokens = cm.decode_step_time_s(a, b), a
    else:
        total, tokens = cm.prefill_time_s(a), a
    return total - cm._allreduce_fixed_s - tokens * cm._allreduce_s_per_token - cm.constants.step_overhead_s


class Shard:
    """One GPU's shard of one decoder layer, the final norm and the LM head."""

    def __init__(self, torch, m: ModelSpec, tp: int, device: str, dtype, max_tokens: int):
        self.torch, self.m, self.tp = torch, m, tp
        self.heads, self.kv_heads = m.num_attention_heads // tp, max(1, m.num_kv_heads // tp)
        hd, h = m.head_dim, m.hidden_size

        def w(*shape):
            return torch.randn(*shape, device=device, dtype=dtype) * 0.02

        self.w_qkv = w(h, (self.heads + 2 * self.kv_heads) * hd)
        self.w_o = w(self.heads * hd, h)
        self.w_gu = w(h, 2 * m.intermediate_size // tp)
        self.w_down = w(m.intermediate_size // tp, h)
        self.w_lm = w(h, m.vocab_size // tp)
        self.norm = torch.ones(h, device=device, dtype=dtype)
        pos = torch.arange(max_tokens, device=device, dtype=torch.float32)[:, None]
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=device, dtype=torch.float32) / hd))
        ang = pos * inv[None, :]
        self.cos, self.sin = ang.cos().to(dtype), ang.sin().to(dtype)

    def rms(self, x):
        t = self.torch
        return x * t.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5).to(x.dtype) * self.norm

    def rope(self, x, positions):
        # x [..., T, hd]; rotate halves
        cos, sin = self.cos[positions], self.sin[positions]
        x1, x2 = x[..., ::2], x[..., 1::2]
        return self.torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    def mlp_and_out(self, x, a):
        t = self.torch
        x = x + a @ self.w_o
        gu = self.rms(x) @ self.w_gu
        g, u = gu.chunk(2, dim=-1)
        return x + (t.nn.functional.silu(g) * u) @ self.w_down

    def prefill(self, x):
        """x [T, h]: one prompt of T tokens from an empty context; returns the sampled token."""
        t, F = self.torch, self.torch.nn.functional
        T, hd = x.shape[0], self.m.head_dim
        positions = t.arange(T, device=x.device)
        for _ in range(self.m.num_layers):
            qkv = self.rms(x) @ self.w_qkv
            q, k, v = qkv.split((self.heads * hd, self.kv_heads * hd, self.kv_heads * hd), dim=-1)
            q = self.rope(q.view(T, self.heads, hd).transpose(0, 1), positions)
            k = self.rope(k.view(T, self.kv_heads, hd).transpose(0, 1), positions)
            v = v.view(T, self.kv_heads, hd).transpose(0, 1)
            a = F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, enable_gqa=True)
            x = self.mlp_and_out(x, a[0].transpose(0, 1).reshape(T, self.heads * hd))
        return (self.rms(x[-1:]) @ self.w_lm).argmax(-1)

    def decode(self, x, k_cache, v_cache, positions):
        """x [B, h]: one new token per sequence over k/v_cache [B, kv_heads, ctx, hd]; returns B sampled tokens."""
        t, F = self.torch, self.torch.nn.functional
        B, hd = x.shape[0], self.m.head_dim
        for _ in range(self.m.num_layers):
            qkv = self.rms(x) @ self.w_qkv
            q, k, v = qkv.split((self.heads * hd, self.kv_heads * hd, self.kv_heads * hd), dim=-1)
            q = self.rope(q.view(B, self.heads, 1, hd), positions)
            k = self.rope(k.view(B, self.kv_heads, 1, hd), positions)
            k_cache[:, :, -1:, :] = k  # the new token's KV goes into the last slot of the cache
            v_cache[:, :, -1:, :] = v.view(B, self.kv_heads, 1, hd)
            a = F.scaled_dot_product_attention(q, k_cache, v_cache, enable_gqa=True)
            x = self.mlp_and_out(x, a.reshape(B, self.heads * hd))
        return (self.rms(x) @ self.w_lm).argmax(-1)


def timer(torch, device: str, repeats: int):
    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    def time_fn(fn) -> float:
        for _ in range(3):
            fn()
        sync()
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - start)
        return statistics.median(samples)

    return time_fn


def run_case(torch, name: str, tp: int, device: str, dtype, repeats: int, decode, prefill, gpu) -> list[dict]:
    m = MODEL_PRESETS[name]
    time_fn = timer(torch, device, repeats)
    shard = Shard(torch, m, tp, device, dtype, max_tokens=max(max(prefill), max(c for _, c in decode)) + 2)
    models = {p: CostModel(m, gpu, tp, c) for p, c in COST_PROFILES.items()}
    rows = []

    def row(kind, a, b, mode, seconds):
        pred = {p: gpu_time_s(cm, kind, a, b) for p, cm in models.items()}
        rows.append({"model": name, "tp": tp, "kind": kind, "a": a, "b": b, "mode": mode, "measured_s": seconds,
                     **{f"pred_{p}_s": v for p, v in pred.items()}})
        ratios = "  ".join(f"{p} {v / seconds:.2f}x" for p, v in pred.items())
        print(f"  {name} TP={tp} {kind} {a}x{b} {mode}: {seconds * 1e3:.2f} ms  (predicted / measured: {ratios})",
              flush=True)

    with torch.inference_mode():
        for batch, ctx in decode:
            x = torch.randn(batch, m.hidden_size, device=device, dtype=dtype)
            k_cache = torch.randn(batch, shard.kv_heads, ctx + 1, m.head_dim, device=device, dtype=dtype)
            v_cache = torch.randn_like(k_cache)
            positions = torch.full((batch, 1, 1), ctx, device=device, dtype=torch.long)
            step = lambda: shard.decode(x, k_cache, v_cache, positions)  # noqa: E731
            row("decode", batch, ctx, "eager", time_fn(step))
            if device == "cuda":
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for _ in range(2):
                        step()
                torch.cuda.current_stream().wait_stream(s)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    step()
                row("decode", batch, ctx, "graph", time_fn(graph.replay))
                del graph
            del k_cache, v_cache
        for length in prefill:
            x = torch.randn(length, m.hidden_size, device=device, dtype=dtype)
            row("prefill", length, 0, "eager", time_fn(lambda: shard.prefill(x)))
    del shard
    if device == "cuda":
        torch.cuda.empty_cache()
    return rows


def markdown(rows: list[dict]) -> str:
    out = ["| instance | step | mode | measured ms | default predicts | pessimistic predicts |",
           "|---|---|---|---:|---:|---:|"]
    for r in rows:
        step = f"decode b={r['a']} ctx={r['b']}" if r["kind"] == "decode" else f"prefill {r['a']}"
        out.append(f"| {r['model']} TP={r['tp']} (one GPU's shard) | {step} | {r['mode']} | {r['measured_s'] * 1e3:.2f} "
                   f"| {r['pred_default_s'] * 1e3:.2f} ({r['pred_default_s'] / r['measured_s']:.2f}x) "
                   f"| {r['pred_pessimistic_s'] * 1e3:.2f} ({r['pred_pessimistic_s'] / r['measured_s']:.2f}x) |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path) -> None:
    """Predicted / measured per step under both profiles: 1.0 is exact, above 1 the model is conservative."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{r['model'].removeprefix('llama-3-')} TP{r['tp']} "
              + (f"dec b{r['a']} {r['mode']}" if r["kind"] == "decode" else f"pre {r['a']}") for r in rows]
    xs = range(len(rows))
    fig, ax = plt.subplots(figsize=(12, 4.5))
    for offset, profile in ((-0.2, "default"), (0.2, "pessimistic")):
        ax.bar([x + offset for x in xs], [r[f"pred_{profile}_s"] / r["measured_s"] for r in rows], 0.4, label=profile)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(list(xs), labels, rotation=70, fontsize=7)
    ax.set_ylabel("predicted / measured step time")
    ax.set_title("Cost model vs whole decoder steps on one H200 (one GPU's shard; no all-reduce, no host overhead)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", help="folder for gpu_steps.json (a measuring run)")
    parser.add_argument("--render", help="a saved gpu_steps.json: print its table instead of measuring")
    parser.add_argument("--plot", help="with --render: write the predicted/measured plot to this PNG")
    parser.add_argument("--gpu", default="h200-141gb", choices=sorted(GPU_PRESETS), help="datasheet roofline")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--smoke", action="store_true", help="CPU, float32, the 8B shape cut to 1 layer and a small MLP and vocabulary: a run check")
    args = parser.parse_args(argv)
    if args.render:
        rows = json.loads(Path(args.render).read_text())["rows"]
        print(markdown(rows))
        if args.plot:
            plot(rows, Path(args.plot))
        return 0
    if not args.out:
        parser.error("--out DIR is required for a measuring run (or --render JSON)")
    import torch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        device, dtype = "cpu", torch.float32
        import dataclasses

        MODEL_PRESETS["llama-3-8b"] = dataclasses.replace(MODEL_PRESETS["llama-3-8b"], num_layers=1, vocab_size=4096,
                                                         intermediate_size=4096)
        cases, decode, prefill, repeats = (("llama-3-8b", 1),), ((1, 64), (4, 64)), (64,), 2
        meta = {"device": "cpu (smoke)"}
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --smoke for a CPU run check", file=sys.stderr)
            return 2
        device, dtype = "cuda", torch.bfloat16
        cases, decode, prefill, repeats = CASES, DECODE, PREFILL, args.repeats
        meta = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "gpu_spec": args.gpu}
    print(f"device: {meta['device']}", flush=True)
    rows = []
    for name, tp in cases:
        rows += run_case(torch, name, tp, device, dtype, repeats, decode, prefill, GPU_PRESETS[args.gpu])
    (out / "gpu_steps.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(markdown(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
