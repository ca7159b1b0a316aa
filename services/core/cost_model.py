"""Roofline step-time model: the sim engine's clock, and the planner's and router's time estimates.

Job: given a batch of chunks `(num_new_tokens, num_context_tokens)` on one model instance (TP GPUs), return how
long the step takes on the GPU it models. Per step:

    overhead + layers x layer_overhead + linear + attention + all-reduce + swap
    linear     = max(compute, memory) + linear_overlap_loss x min(compute, memory), where
                 compute = linear FLOPs / (peak x linear_eff),
                 memory  = (streamed weight bytes + activation bytes) / (HBM x hbm_eff)
    attention  = max(attention FLOPs / (peak x attn_eff), KV bytes read / (HBM x hbm_eff))
    all-reduce = 2 per layer when TP > 1, each allreduce_latency_s + 2 (TP-1)/TP x tokens x hidden x 2 B / link
    swap       = swap_setup_s + blocks x block_size x KV bytes per token per GPU / PCIe

Invariants:
- Pure arithmetic on precomputed per-instance rates; no clock, no per-chunk objects. Safe to call ~1e5 times a
  simulated minute.
- Monotonic: more tokens, more context, more sampled tokens or more swapped blocks never make a step faster.
- An empty step (no chunks, no swaps) takes 0 s; any other step pays `step_overhead_s` once.
- Every constant is in `CostConstants`, with its source in a comment and in docs/COST_MODEL.md.
- Named constant sets live in `COST_PROFILES` ("default", "pessimistic"); a node config picks one by name
  (`cost_profile`), so every CostModel built from that config prices steps with the same constants.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from octoserve.services.core.specs import GpuSpec, ModelSpec, SpecError
from octoserve.services.core.types import StepPlan

LINKS = ("nvlink", "pcie")


@dataclass(frozen=True, slots=True)
class CostConstants:
    """Achieved fractions of datasheet peaks and fixed latencies. Defaults are for vLLM-class engines on Hopper."""

    # Large BF16 GEMMs reach 60-75 % of dense peak in cuBLAS on H100; a whole prefill step (norms, RoPE, sampling
    # glue between GEMMs) lands nearer 50-60 %. 0.6 sits in that band (Sarathi-Serve and Vidur profile similar).
    linear_eff: float = 0.6
    # FlashAttention-2 forward reaches ~35 % of H100 peak, FlashAttention-3 ~75 % (740 TFLOP/s BF16, Shah et al.
    # 2024). vLLM mixes both; 0.5 is the midpoint.
    attn_eff: float = 0.5
    # Decode GEMV and paged-attention KV reads stream HBM at 80-90 % of the datasheet rate (memory-bound kernels on
    # H100; Databricks' "MBU" study and the DistServe/Splitwise decode analyses put achieved MBU in that range).
    hbm_eff: float = 0.85
    # NCCL/custom all-reduce bus bandwidth as a fraction of the per-direction NVLink rate for step-sized messages.
    nvlink_eff: float = 0.8
    # Fixed cost of one small (batch-sized) all-reduce on an 8-GPU NVLink node. Vidur's H100 DGX profile
    # (microsoft/vidur data/profiling/network/h100_dgx/all_reduce.csv, NCCL) measures 10-18 KB all-reduces at
    # 18-21 us minimum / 23-29 us median over 8 ranks and 26-38 us over 4; CUDA-graph custom all-reduce sits at
    # or under the NCCL minimum. 20 us is that minimum (was 10 us, which put TP=8 batch-1 decode at half Vidur's).
    allreduce_latency_s: float = 20e-6
    # Fixed time per layer per step that no roofline term sees: the small kernels between GEMMs (two RMSNorms,
    # RoPE, SiLU-and-mul, residual add) and the floor of GEMVs on thin TP shards. Vidur's H100 per-op profile
    # of the Llama-2-70B layer shape (= Llama-3-70B's) exceeds the HBM roofline at 1 token by 19-30 us a layer
    # at TP 1-8 (33 us for the 7B shape), measured op by op without CUDA graphs or fusions; vLLM fuses add+norm
    # and SiLU-mul and replays a CUDA graph, so half of that, 15 us, is the default.
    layer_overhead_s: float = 15e-6
    # Per-step host time not hidden behind the GPU: scheduling, input preparation, graph launch, sampling sync.
    # vLLM's CI latency test (buildkite vllm/performance-benchmark build 9515: H200, batch 8, 32 in / 128 out)
    # ran 8B TP1 in 833 ms and 70B TP4 in 2,078 ms; 0.5 ms here (and no layer term) predicted 0.68-0.70 of
    # that, 1.0 ms with the layer term 0.83-0.90. Not fitted: the rest is detokenisation and engine glue.
    step_overhead_s: float = 1.0e-3
    # Fixed cost of one prefill->decode KV hand-off: descriptor exchange and the first transfer's launch
    # (NIXL / NCCL send-recv), independent of size.
    kv_transfer_setup_s: float = 100e-6
    # Fixed cost of one swap-in or swap-out batch (cudaMemcpyAsync launches and a stream sync).
    swap_setup_s: float = 50e-6
    # Fraction of the smaller of (GEMM compute time, weight streaming time) that is NOT hidden behind the larger.
    # 0 is the ideal roofline max(); 1 is no overlap at all. Near the ridge (~100-300 tokens a step) real GEMMs
    # reach neither peak: the ideal roofline predicts 0.59x the published TensorRT-LLM A100 batch-1 first-token
    # latency of 128-token prompts for both Llama-2-7B and -70B; 0.9 brings both to ~1.0 (a 2-point fit, see
    # docs/COST_MODEL.md). Far from the ridge the smaller term is small, so this hardly matters there.
    linear_overlap_loss: float = 0.9

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise SpecError(f.name, f"cost constant {f.name} must be a number >= 0, got {value!r}")
            if value == 0 and f.name != "linear_overlap_loss":
                raise SpecError(f.name, f"cost constant {f.name} must be > 0, got 0")
            if (f.name.endswith("_eff") or f.name == "linear_overlap_loss") and value > 1:
                raise SpecError(f.name, f"{f.name} is a fraction and must be <= 1, got {value}")


DEFAULT_CONSTANTS = CostConstants()

# The pessimistic end of each constant's published range, for asking which conclusions survive the uncertainty
# (docs/COST_MODEL.md, "Profiles"). Each value sits at or past the slow end of its cited range; the doubled setup
# costs and nvlink_eff are assumptions, and hardly move a step.
PESSIMISTIC_CONSTANTS = CostConstants(
    linear_eff=0.5,  # whole prefill steps, not single GEMMs: the bottom of the 50-60 % band
    attn_eff=0.35,  # FlashAttention-2 on H100 (FA3 paper), no FA3 kernels
    hbm_eff=0.7,  # Vidur's H100 TP=8 GEMVs of the 70B layer stream at ~0.73 of datasheet HBM; below that
    nvlink_eff=0.6,  # NCCL ring bus bandwidth without NVLS / custom all-reduce
    allreduce_latency_s=38e-6,  # Vidur H100 DGX NCCL median for 10-18 KB over 4 ranks (the slowest size class)
    layer_overhead_s=30e-6,  # Vidur's unfused, graph-less per-layer excess at TP 4 and 8 (19-33 us range)
    step_overhead_s=3e-3,  # Vidur's vLLM-0.2-era CPU profile: schedule + prepare + sample + process outputs
    kv_transfer_setup_s=200e-6,  # assumption: twice the default
    swap_setup_s=100e-6,  # assumption: twice the default
    linear_overlap_loss=1.0,  # no overlap of GEMM compute with weight streaming near the ridge
)

# Named constant sets a node config may choose by `cost_profile`.
COST_PROFILES: Mapping[str, CostConstants] = {"default": DEFAULT_CONSTANTS, "pessimistic": PESSIMISTIC_CONSTANTS}


def cost_constants(profile: str) -> CostConstants:
    """The constants of a named profile; SpecError naming the choices for any other name."""
    if profile not in COST_PROFILES:
        raise SpecError(
            "cost_profile", f"unknown cost profile {profile!r}; choose one of: {', '.join(COST_PROFILES)}"
        )
    return COST_PROFILES[profile]


class CostModel:
    """Step times of one model instance (`tp` GPUs of type `gpu`) under `constants`."""

    __slots__ = (
        "model",
        "gpu",
        "tp",
        "constants",
        "_linear_s_per_token",
        "_lm_head_s_per_sample",
        "_weights_s",
        "_activation_s_per_token",
        "_attn_s_per_pair",
        "_kv_read_s_per_token",
        "_allreduce_fixed_s",
        "_layer_fixed_s",
        "_allreduce_s_per_token",
        "_kv_bytes_per_token_per_gpu",
        "_swap_s_per_token",
        "_overlap_loss",
    )

    def __init__(self, model: ModelSpec, gpu: GpuSpec, tp: int, constants: CostConstants = DEFAULT_CONSTANTS):
        model.check_tp(tp)
        self.model, self.gpu, self.tp, self.constants = model, gpu, tp, constants
        c = constants
        flops_per_s = gpu.peak_bf16_flops * c.linear_eff
        hbm_per_s = gpu.hbm_bytes_per_s * c.hbm_eff
        self._linear_s_per_token = model.linear_flops_per_token / tp / flops_per_s
        self._lm_head_s_per_sample = model.lm_head_flops_per_token / tp / flops_per_s
        self._weights_s = model.streamed_weight_bytes / tp / hbm_per_s
        self._activation_s_per_token = _activation_bytes_per_token_per_gpu(model, tp) / hbm_per_s
        # QK^T and AV: 2 GEMMs x 2 FLOPs per multiply-add x head_dim, for each (query, key) pair, each local head.
        heads_per_gpu = model.num_attention_heads // tp
        attn_flops_per_pair = 4 * heads_per_gpu * model.head_dim * model.num_layers
        self._attn_s_per_pair = attn_flops_per_pair / (gpu.peak_bf16_flops * c.attn_eff)
        self._kv_bytes_per_token_per_gpu = model.kv_bytes_per_token_per_gpu(tp)
        self._kv_read_s_per_token = self._kv_bytes_per_token_per_gpu / hbm_per_s
        self._allreduce_fixed_s, self._allreduce_s_per_token = _allreduce_rates(model, gpu, tp, c)
        self._layer_fixed_s = model.num_layers * c.layer_overhead_s
        self._swap_s_per_token = self._kv_bytes_per_token_per_gpu / gpu.pcie_bytes_per_s
        self._overlap_loss = c.linear_overlap_loss

    @classmethod
    def from_profile(cls, model: ModelSpec, gpu: GpuSpec, tp: int, profile: Mapping[str, Any]) -> CostModel:
        """A model whose constants come from a measured profile.

        `profile` maps `CostConstants` field names to measured values, e.g.
        {"linear_eff": 0.55, "attn_eff": 0.4, "hbm_eff": 0.8, "step_overhead_s": 0.0012}; fields it omits keep
        their defaults, unknown keys raise SpecError."""
        known = {f.name for f in dataclasses.fields(CostConstants)}
        for key in profile:
            if key not in known:
                raise SpecError(key, f"unknown cost profile key {key!r}; use one of {sorted(known)}")
        return cls(model, gpu, tp, dataclasses.replace(DEFAULT_CONSTANTS, **dict(profile)))

    def _time_s(
        self, num_tokens: int, num_pairs: float, num_kv_tokens: float, num_samples: int, swap_tokens: int
    ) -> float:
        """The step time from batch totals: tokens computed, (query, key) pairs, KV tokens read, sampled tokens,
        and tokens' worth of KV copied over PCIe."""
        total = 0.0
        if num_tokens:
            compute_s = num_tokens * self._linear_s_per_token + num_samples * self._lm_head_s_per_sample
            memory_s = self._weights_s + num_tokens * self._activation_s_per_token
            if compute_s > memory_s:
                total += compute_s + self._overlap_loss * memory_s
            else:
                total += memory_s + self._overlap_loss * compute_s
            total += max(num_pairs * self._attn_s_per_pair, num_kv_tokens * self._kv_read_s_per_token)
            total += self._allreduce_fixed_s + num_tokens * self._allreduce_s_per_token
            total += self._layer_fixed_s
        if swap_tokens:
            total += self.constants.swap_setup_s + swap_tokens * self._swap_s_per_token
        if total:
            total += self.constants.step_overhead_s
        return total

    def step_time_s(
        self,
        chunks: Sequence[tuple[int, int]],
        swap_in_blocks: int = 0,
        swap_out_blocks: int = 0,
        block_size: int = 16,
    ) -> float:
        """Every chunk is taken to sample one token (the LM head is ~1.5 % of a token's FLOPs on 70B, so a prefill
        chunk that does not sample is over-charged by that much); `plan_time_s` uses each chunk's `samples`."""
        num_tokens = num_pairs = num_kv_tokens = 0
        for new, context in chunks:
            num_tokens += new
            # Causal attention: new token i (0-based) sees the context plus new tokens 0..i.
            num_pairs += new * context + new * (new + 1) // 2
            num_kv_tokens += context + new
        swap_tokens = (swap_in_blocks + swap_out_blocks) * block_size
        return self._time_s(num_tokens, num_pairs, num_kv_tokens, len(chunks), swap_tokens)

    def plan_time_s(self, plan: StepPlan, block_size: int) -> float:
        num_tokens = num_pairs = num_kv_tokens = num_samples = 0
        for chunk in plan.chunks:
            new, context = chunk.num_new_tokens, chunk.num_context_tokens
            num_tokens += new
            num_pairs += new * context + new * (new + 1) // 2
            num_kv_tokens += context + new
            num_samples += chunk.samples
        swap_tokens = (plan.swap_in_blocks + plan.swap_out_blocks) * block_size
        return self._time_s(num_tokens, num_pairs, num_kv_tokens, num_samples, swap_tokens)

    def chunks_time_s(
        self,
        num_new: Sequence[int],
        contexts: Sequence[int],
        num_samples: int,
        swap_blocks: int = 0,
        block_size: int = 16,
        num_steady: int = 0,
        steady_tokens: int = 0,
    ) -> float:
        """`plan_time_s` of a step given as parallel columns (`Batcher.schedule_compact`): chunk i computes
        `num_new[i]` tokens on top of `contexts[i]`; `num_samples` chunks sample. Plus `num_steady` one-token
        decode chunks (not counted in `num_samples`) whose lengths (context + 1) sum to `steady_tokens`: each is
        context + 1 pairs and as many KV tokens. The same integer totals as `plan_time_s`, so the same float."""
        num_tokens = sum(num_new)
        num_pairs = steady_tokens
        for new, context in zip(num_new, contexts):
            num_pairs += new * context + new * (new + 1) // 2
        num_kv_tokens = sum(contexts) + num_tokens + steady_tokens
        return self._time_s(num_tokens + num_steady, num_pairs, num_kv_tokens, num_samples + num_steady,
                            swap_blocks * block_size)

    def attn_s_per_pair(self) -> float:
        """Attention compute time of one (new token, context token) pair, at the attention kernels' efficiency."""
        return self._attn_s_per_pair

    def prefill_time_s(self, num_tokens: int, num_context_tokens: int = 0) -> float:
        """One chunk of `num_tokens` new tokens on top of `num_context_tokens` cached ones, alone in its step."""
        pairs = num_tokens * num_context_tokens + num_tokens * (num_tokens + 1) // 2
        return self._time_s(num_tokens, pairs, num_context_tokens + num_tokens, 1 if num_tokens else 0, 0)

    def decode_step_time_s(self, batch_size: int, context_len: float) -> float:
        """`batch_size` sequences, each with `context_len` tokens already in KV, each computing one token (an average
        context may be fractional: services/core/migration.py)."""
        per_seq_kv = context_len + 1
        return self._time_s(batch_size, batch_size * per_seq_kv, batch_size * per_seq_kv, batch_size, 0)

    def prefill_tokens_per_s(self, chunk_tokens: int) -> float:
        """Prompt tokens per second when prefilling back-to-back chunks of `chunk_tokens` from an empty context."""
        if chunk_tokens <= 0:
            raise ValueError(f"chunk_tokens must be > 0, got {chunk_tokens}")
        return chunk_tokens / self.prefill_time_s(chunk_tokens)

    def kv_transfer_time_s(self, num_tokens: int, link: str = "nvlink") -> float:
        """Time to move `num_tokens` of KV between two instances of this model at the same TP: each rank sends its
        own shard over its own link in parallel, so the per-GPU shard size sets the time."""
        if link == "nvlink":
            bytes_per_s = self.gpu.nvlink_bytes_per_s * self.constants.nvlink_eff
        elif link == "pcie":
            bytes_per_s = self.gpu.pcie_bytes_per_s
        else:
            raise ValueError(f"unknown link {link!r}; use one of {LINKS}")
        if num_tokens <= 0:
            return 0.0
        return self.constants.kv_transfer_setup_s + num_tokens * self._kv_bytes_per_token_per_gpu / bytes_per_s

    def swap_time_s(self, num_blocks: int, block_size: int) -> float:
        """Copy `num_blocks` KV blocks between GPU and host over PCIe (either direction), step overhead excluded."""
        if num_blocks <= 0:
            return 0.0
        return self.constants.swap_setup_s + num_blocks * block_size * self._swap_s_per_token


def _activation_bytes_per_token_per_gpu(model: ModelSpec, tp: int) -> int:
    """HBM traffic of one token's activations per layer, read and written once per kernel: q/k/v out, o in,
    gate_up out, SiLU-and-mul in and out, down in (all /TP), and 8 hidden-sized reads/writes (GEMM inputs and
    outputs on the residual stream, two RMSNorms, two residual adds)."""
    h, hd = model.hidden_size, model.head_dim
    qkv_out = (model.num_attention_heads + 2 * model.num_kv_heads) * hd // tp
    o_in = model.num_attention_heads * hd // tp
    mlp = 6 * model.intermediate_size // tp  # gate_up out 2I, act in 2I + out I, down in I
    return model.num_layers * model.dtype_bytes * (8 * h + qkv_out + o_in + mlp)


def _allreduce_rates(model: ModelSpec, gpu: GpuSpec, tp: int, c: CostConstants) -> tuple[float, float]:
    """(fixed seconds per step, seconds per token per step) of the two all-reduces per layer under TP."""
    if tp == 1:
        return 0.0, 0.0
    num_allreduces = 2 * model.num_layers  # after attention's o_proj and after the MLP's down_proj
    ring_bytes_per_token = 2 * (tp - 1) / tp * model.hidden_size * model.dtype_bytes
    per_token_s = ring_bytes_per_token / (gpu.nvlink_bytes_per_s * c.nvlink_eff)
    return num_allreduces * c.allreduce_latency_s, num_allreduces * per_token_s
