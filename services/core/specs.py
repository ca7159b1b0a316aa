"""Model and GPU specs, and the memory arithmetic derived from them (weights, KV per token, KV block count).

Job: give every other module one source of truth for "how big is this model on this GPU at this TP".

Invariants:
- Specs are frozen, slotted and validated at construction: every size is a positive int, every rate a positive
  number. A bad value raises `SpecError` naming the field and what to change, whichever way the spec was built.
- Bytes are bytes, not GB: `memory_bytes` of a GPU preset is the marketed capacity read as GiB (80 GiB =
  85,899,345,920 B), which is within 0.5 % of what `nvidia-smi` reports for the H100 SXM (81,559 MiB) and H200
  (143,771 MiB) and exact for the A100 80 GB (81,920 MiB). `gpu_memory_utilization` is applied to that number,
  as vLLM applies it to the device total.
- Tensor parallelism splits attention heads, MLP columns and the vocabulary evenly; a TP degree must divide the
  query heads, and either divide the KV heads or be a multiple of them. When TP > num_kv_heads, each GPU keeps
  one whole KV head and KV heads are replicated TP / num_kv_heads times (Llama-3 at TP=16 would hold 2 copies).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

TP_CANDIDATES = (1, 2, 4, 8)

GIB = 1024**3

# Activation reserve for one step of `max_num_batched_tokens` tokens, per GPU (see `activation_reserve_bytes`).
# Hidden-sized BF16 buffers live at the peak of a layer: residual stream, normed input, attention output, the
# all-reduce output, plus as many again for allocator slack and cuBLAS/attention workspaces.
ACTIVATION_HIDDEN_BUFFERS = 8
# Intermediate-sized buffers at the MLP peak: fused gate_up output (2 x I/TP) and the SiLU-and-mul output (I/TP).
ACTIVATION_INTERMEDIATE_BUFFERS = 3
# Logits are materialised in FP32 over the full vocabulary (gathered across TP ranks) for each token that samples;
# reserve for every token of the budget, because a decode-only step of that many sequences samples them all.
LOGITS_BYTES_PER_VOCAB_ENTRY = 4


# Local weight storage: sequential read of one local disk with a cold page cache, as measured on the H200 machine
# (scripts/gpu_load_check.py, BENCHMARKS.md "Cost model against a real GPU (H200)": 2.07 GB/s; 5.9 GB/s from the page
# cache). A datacenter PCIe Gen4 NVMe drive is rated at ~7 GB/s, so this is the slow end. Used for the weight-load
# time of an instance started from disk (services/core/elastic_capacity.py, weight_load_s).
LOCAL_DISK_READ_BYTES_PER_S = 2.07e9
# GPUs per PCIe switch uplink on an 8-GPU HGX board: a TP group that loads all its shards at once shares each uplink
# between two GPUs, so each sees half the pinned host->GPU rate (same BENCHMARKS section).
GPUS_PER_PCIE_UPLINK = 2


class SpecError(ValueError):
    """A model or GPU spec (or a TP / memory setting derived from one) is invalid. `field` names the culprit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


def _check_positive_int(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(name, f"{owner}.{name} must be an integer, got {value!r}; set it to a positive integer")
    if value <= 0:
        raise SpecError(name, f"{owner}.{name} must be > 0, got {value}; set it to a positive integer")


def _check_positive_number(owner: str, name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SpecError(name, f"{owner}.{name} must be a number, got {value!r}; set it to a positive number")
    if not value > 0:  # also rejects NaN
        raise SpecError(name, f"{owner}.{name} must be > 0, got {value}; set it to a positive number")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Shape of a dense Llama-style decoder (GQA attention, SwiGLU MLP, untied LM head)."""

    name: str
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    num_params: int  # all parameters, embeddings and LM head included
    dtype_bytes: int = 2  # BF16 weights and KV cache
    max_context_len: int = 8192  # prompt + output tokens one sequence may hold

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SpecError("name", "model.name must be a non-empty string")
        for f in dataclasses.fields(self):
            if f.name != "name":
                _check_positive_int("model", f.name, getattr(self, f.name))
        if self.num_attention_heads % self.num_kv_heads:
            raise SpecError(
                "num_kv_heads",
                f"model.num_kv_heads={self.num_kv_heads} must divide num_attention_heads={self.num_attention_heads}",
            )

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers and all KV heads (70B: 327,680 B = 320 KiB)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes

    def check_tp(self, tp: int) -> None:
        """Raise SpecError unless `tp` splits this model's heads evenly (the rule vLLM applies)."""
        if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
            raise SpecError("tp", f"tensor parallel size must be a positive integer, got {tp!r}")
        if self.num_attention_heads % tp:
            raise SpecError(
                "tp", f"tp={tp} must divide num_attention_heads={self.num_attention_heads} of {self.name}"
            )
        if self.num_kv_heads % tp and tp % self.num_kv_heads:
            raise SpecError(
                "tp", f"tp={tp} must divide num_kv_heads={self.num_kv_heads} of {self.name} or be a multiple of it"
            )

    def kv_heads_per_gpu(self, tp: int) -> int:
        """KV heads each GPU stores; at least 1, because past TP = num_kv_heads heads are replicated, not split."""
        self.check_tp(tp)
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token_per_gpu(self, tp: int) -> int:
        return 2 * self.num_layers * self.kv_heads_per_gpu(tp) * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    def weight_bytes_per_gpu(self, tp: int) -> int:
        """Weights each GPU holds: everything is split TP ways (embedding and LM head vocab-parallel).

        The replicated RMSNorm weights (161 K params on 70B) are ignored: under 1 MB per GPU."""
        self.check_tp(tp)
        return -(-self.weight_bytes // tp)

    @property
    def linear_params_per_layer(self) -> int:
        """Parameters of the q/k/v/o projections and the gate/up/down MLP of one layer."""
        q_dim = self.num_attention_heads * self.head_dim
        kv_dim = self.num_kv_heads * self.head_dim
        attn = self.hidden_size * (q_dim + 2 * kv_dim) + q_dim * self.hidden_size
        mlp = 3 * self.hidden_size * self.intermediate_size
        return attn + mlp

    @property
    def linear_flops_per_token(self) -> int:
        """2 FLOPs per multiply-add over every layer's linear weights: about 2 x non-embedding params.

        Excludes the LM head (see `lm_head_flops_per_token`), which only runs for tokens that sample."""
        return 2 * self.num_layers * self.linear_params_per_layer

    @property
    def lm_head_flops_per_token(self) -> int:
        return 2 * self.vocab_size * self.hidden_size

    @property
    def streamed_weight_bytes(self) -> int:
        """Weights a forward pass reads in full: all layers plus the LM head. The input embedding is only
        gathered row by row, so it is not streamed."""
        layer_params = self.num_layers * self.linear_params_per_layer
        return (layer_params + self.vocab_size * self.hidden_size) * self.dtype_bytes


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """One accelerator: capacity and datasheet peak rates (achieved fractions live in the cost model)."""

    name: str
    memory_bytes: int
    peak_bf16_flops: float  # dense, no sparsity
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float  # per direction, per GPU
    pcie_bytes_per_s: float  # effective host<->device copy rate per direction, not the raw link rate

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise SpecError("name", "gpu.name must be a non-empty string")
        _check_positive_int("gpu", "memory_bytes", self.memory_bytes)
        for name in ("peak_bf16_flops", "hbm_bytes_per_s", "nvlink_bytes_per_s", "pcie_bytes_per_s"):
            _check_positive_number("gpu", name, getattr(self, name))


# Shapes from the published Llama-3 config.json files; num_params is the exact parameter count of the checkpoint.
MODEL_PRESETS: dict[str, ModelSpec] = {
    "llama-3-70b": ModelSpec(
        name="llama-3-70b",
        num_layers=80,
        hidden_size=8192,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=28672,
        vocab_size=128256,
        num_params=70_553_706_496,
    ),
    "llama-3-8b": ModelSpec(
        name="llama-3-8b",
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
        num_params=8_030_261_248,
    ),
    # Seed 003's large model: a ~180B dense Llama-style shape (no published checkpoint; the Llama-3 layout scaled
    # to 96 layers x 12,288 hidden, 8 KV heads, 40,960 MLP). 179.5 B params, 359.0 GB of BF16 weights: 44.9 GB a
    # GPU at TP=8, 89.8 GB at TP=4 (over an 80 GB GPU), so it needs all eight GPUs. KV: 96 x 8 x 128 x 2 x 2 B =
    # 384 KiB a token (48 KiB a GPU at TP=8). num_params counts every linear weight, both embeddings and the norms.
    "dense-180b": ModelSpec(
        name="dense-180b",
        num_layers=96,
        hidden_size=12288,
        num_attention_heads=96,
        num_kv_heads=8,
        head_dim=128,
        intermediate_size=40960,
        vocab_size=128256,
        num_params=179_516_485_632,
    ),
}

# Datasheet figures (NVIDIA H100 / H200 / A100 datasheets; see docs/COST_MODEL.md for the citations).
GPU_PRESETS: dict[str, GpuSpec] = {
    "h100-sxm-80gb": GpuSpec(
        name="h100-sxm-80gb",
        memory_bytes=80 * GIB,
        peak_bf16_flops=989e12,
        hbm_bytes_per_s=3.35e12,
        nvlink_bytes_per_s=450e9,  # NVLink 4: 900 GB/s bidirectional
        pcie_bytes_per_s=55e9,  # PCIe Gen5 x16: 64 GB/s raw per direction, ~55 GB/s achieved by pinned copies
    ),
    "h200-141gb": GpuSpec(
        name="h200-141gb",
        memory_bytes=141 * GIB,
        peak_bf16_flops=989e12,
        hbm_bytes_per_s=4.8e12,
        nvlink_bytes_per_s=450e9,
        pcie_bytes_per_s=55e9,  # measured: 55.3 GB/s pinned host->GPU (scripts/gpu_load_check.py, BENCHMARKS.md)
    ),
    "a100-80gb": GpuSpec(
        name="a100-80gb",
        memory_bytes=80 * GIB,
        peak_bf16_flops=312e12,
        hbm_bytes_per_s=2.039e12,
        nvlink_bytes_per_s=300e9,  # NVLink 3: 600 GB/s bidirectional
        pcie_bytes_per_s=25e9,  # PCIe Gen4 x16: 32 GB/s raw per direction
    ),
}


def _spec_from_dict(cls: type, kind: str, presets: Mapping[str, Any], d: Mapping[str, Any]) -> Any:
    """Build `cls` from a dict; an optional "preset" key starts from a preset and the other keys override it."""
    if not isinstance(d, Mapping):
        raise SpecError(kind, f"{kind} spec must be a mapping of field names to values, got {type(d).__name__}")
    known = [f.name for f in dataclasses.fields(cls)]
    values: dict[str, Any] = {}
    if "preset" in d:
        preset = d["preset"]
        if preset not in presets:
            raise SpecError("preset", f"unknown {kind} preset {preset!r}; use one of {sorted(presets)}")
        values = {name: getattr(presets[preset], name) for name in known}
    for key, value in d.items():
        if key == "preset":
            continue
        if key not in known:
            raise SpecError(key, f"unknown {kind} spec field {key!r}; remove it or use one of {known}")
        values[key] = value
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
    for name in required:
        if name not in values:
            raise SpecError(name, f"{kind} spec is missing {name!r}; add it, or start from a \"preset\"")
    return cls(**values)


def model_spec_from_dict(d: Mapping[str, Any]) -> ModelSpec:
    """E.g. {"preset": "llama-3-70b", "max_context_len": 32768} or every ModelSpec field spelled out."""
    return _spec_from_dict(ModelSpec, "model", MODEL_PRESETS, d)


def gpu_spec_from_dict(d: Mapping[str, Any]) -> GpuSpec:
    return _spec_from_dict(GpuSpec, "gpu", GPU_PRESETS, d)


def _check_utilization(gpu_memory_utilization: float) -> None:
    u = gpu_memory_utilization
    if isinstance(u, bool) or not isinstance(u, (int, float)) or not 0 < u <= 1:
        raise SpecError("gpu_memory_utilization", f"must be in (0, 1], got {u!r}; vLLM's default is 0.9")


def usable_bytes_per_gpu(gpu: GpuSpec, gpu_memory_utilization: float) -> int:
    _check_utilization(gpu_memory_utilization)
    return int(gpu.memory_bytes * gpu_memory_utilization)


def min_tp(model: ModelSpec, gpu: GpuSpec, gpu_memory_utilization: float) -> int:
    """Smallest TP in 1, 2, 4, 8 whose weight shard leaves room for the KV of one max-length sequence.

    Activations are not subtracted here (they depend on the step token budget; `num_kv_blocks` does). The answer
    is a floor, not a recommendation: 70B on H100 at 0.9 gives TP=2, which leaves 77.3 - 70.6 = 6.8 GB per GPU,
    ~5 GB once a 2,048-token step's activations are reserved: about 32k tokens of KV, a few sequences. Serve it
    at TP=4 or TP=8."""
    usable = usable_bytes_per_gpu(gpu, gpu_memory_utilization)
    for tp in TP_CANDIDATES:
        try:
            model.check_tp(tp)
        except SpecError:
            continue
        one_sequence = model.max_context_len * model.kv_bytes_per_token_per_gpu(tp)
        if usable - model.weight_bytes_per_gpu(tp) >= one_sequence:
            return tp
    raise SpecError(
        "gpu_memory_utilization",
        f"{model.name} does not fit on up to {TP_CANDIDATES[-1]} x {gpu.name} at utilisation "
        f"{gpu_memory_utilization}; use a larger GPU, raise the utilisation or lower max_context_len",
    )


def activation_reserve_bytes(model: ModelSpec, tp: int, max_num_batched_tokens: int) -> int:
    """Peak transient memory per GPU of one step with `max_num_batched_tokens` tokens:

    tokens x dtype x (ACTIVATION_HIDDEN_BUFFERS x hidden + ACTIVATION_INTERMEDIATE_BUFFERS x intermediate / TP)
    + tokens x vocab x 4 B of FP32 logits. 8B at 8,192 tokens: 1.24 GB + 4.2 GB."""
    _check_positive_int("engine", "max_num_batched_tokens", max_num_batched_tokens)
    model.check_tp(tp)
    per_token_buffers = (
        ACTIVATION_HIDDEN_BUFFERS * model.hidden_size
        + ACTIVATION_INTERMEDIATE_BUFFERS * model.intermediate_size // tp
    ) * model.dtype_bytes
    logits = model.vocab_size * LOGITS_BYTES_PER_VOCAB_ENTRY
    return max_num_batched_tokens * (per_token_buffers + logits)


def num_kv_blocks(
    model: ModelSpec,
    gpu: GpuSpec,
    tp: int,
    gpu_memory_utilization: float,
    max_num_batched_tokens: int,
    block_size: int,
) -> int:
    """KV blocks each GPU of the instance holds (the same count on every rank; a block covers `block_size` tokens).

    = floor((memory x utilisation - weights / TP - activation reserve) / (block_size x KV bytes per token per GPU)),
    and 0 when nothing is left."""
    _check_positive_int("engine", "block_size", block_size)
    free = (
        usable_bytes_per_gpu(gpu, gpu_memory_utilization)
        - model.weight_bytes_per_gpu(tp)
        - activation_reserve_bytes(model, tp, max_num_batched_tokens)
    )
    block_bytes = block_size * model.kv_bytes_per_token_per_gpu(tp)
    return max(0, free // block_bytes)
