"""Spec presets, derived sizes and KV block counts, checked against hand arithmetic."""

import pytest

from octoserve.services.core.specs import (
    GIB,
    GPU_PRESETS,
    MODEL_PRESETS,
    ModelSpec,
    SpecError,
    activation_reserve_bytes,
    gpu_spec_from_dict,
    min_tp,
    model_spec_from_dict,
    num_kv_blocks,
)

L70 = MODEL_PRESETS["llama-3-70b"]
L8 = MODEL_PRESETS["llama-3-8b"]
H100 = GPU_PRESETS["h100-sxm-80gb"]


def test_kv_bytes_per_token_matches_design_table():
    assert L70.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 == 327_680  # 320 KiB
    assert L8.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2 == 131_072  # 128 KiB


def test_kv_heads_split_across_tp_then_replicate():
    assert [L70.kv_bytes_per_token_per_gpu(tp) for tp in (1, 2, 4, 8)] == [327_680, 163_840, 81_920, 40_960]
    # TP=16 > 8 KV heads: one head per GPU, replicated, so per-GPU KV stops shrinking.
    wide = ModelSpec("wide", 2, 256, 16, 2, 16, 512, 100, 1_000_000)
    assert wide.kv_heads_per_gpu(2) == 1 and wide.kv_heads_per_gpu(4) == 1
    assert wide.kv_bytes_per_token_per_gpu(4) == wide.kv_bytes_per_token_per_gpu(2) == 2 * 2 * 1 * 16 * 2


def test_weight_bytes_exact():
    assert L70.weight_bytes == 141_107_412_992
    assert L70.weight_bytes_per_gpu(8) == 17_638_426_624  # / 3.35e12 B/s = 5.27 ms, the design's decode floor
    assert L70.weight_bytes_per_gpu(4) == 35_276_853_248
    assert L8.weight_bytes_per_gpu(1) == 16_060_522_496
    odd = ModelSpec("odd", 1, 64, 2, 2, 32, 64, 10, 1001)
    assert odd.weight_bytes_per_gpu(2) == 1001  # 2002 / 2; rounding up when uneven is checked below
    assert ModelSpec("odd", 1, 64, 2, 2, 32, 64, 10, 1001, dtype_bytes=1).weight_bytes_per_gpu(2) == 501


def test_linear_flops_are_about_twice_non_embedding_params():
    # 70B: per layer q 8192^2 + kv 2*8192*1024 + o 8192^2 + mlp 3*8192*28672 = 855,638,016 params.
    assert L70.linear_params_per_layer == 855_638_016
    assert L70.linear_flops_per_token == 2 * 80 * 855_638_016
    embeddings = 2 * 128256 * 8192  # input embedding + untied LM head
    assert abs(L70.linear_flops_per_token / (2 * (L70.num_params - embeddings)) - 1) < 1e-4
    assert L70.lm_head_flops_per_token == 2 * 128256 * 8192


def test_min_tp():
    assert min_tp(L70, H100, 0.9) == 2
    assert min_tp(L8, H100, 0.9) == 1
    # H200: 141 GiB x 0.9 = 136.3 GB < 141.1 GB of weights, so one GPU is still not enough.
    assert min_tp(L70, GPU_PRESETS["h200-141gb"], 0.9) == 2
    assert min_tp(L70, GPU_PRESETS["h200-141gb"], 1.0) == 1
    with pytest.raises(SpecError) as e:
        min_tp(L70, H100, 0.1)
    assert e.value.field == "gpu_memory_utilization"


def test_num_kv_blocks_hand_computed():
    # 8B on H100, utilisation 0.9, 2,048-token budget, block 16:
    usable = int(80 * GIB * 0.9)  # 77,309,411,328
    assert usable == 77_309_411_328
    reserve = 2048 * ((8 * 4096 + 3 * 14336) * 2 + 128256 * 4)  # 2,048 x 664,576
    assert activation_reserve_bytes(L8, 1, 2048) == reserve == 1_361_051_648
    free = usable - 16_060_522_496 - reserve  # 59,887,837,184
    assert num_kv_blocks(L8, H100, 1, 0.9, 2048, 16) == free // (16 * 131_072) == 28_556


def test_num_kv_blocks_70b_tp2_leaves_about_5gb():
    blocks = num_kv_blocks(L70, H100, 2, 0.9, 2048, 16)
    assert blocks == 2006
    assert 5.2e9 < blocks * 16 * L70.kv_bytes_per_token_per_gpu(2) < 5.3e9


def test_num_kv_blocks_zero_when_weights_do_not_fit():
    assert num_kv_blocks(L70, H100, 1, 0.9, 2048, 16) == 0


def test_from_dict_preset_with_override():
    spec = model_spec_from_dict({"preset": "llama-3-70b", "max_context_len": 32768})
    assert spec.max_context_len == 32768 and spec.num_layers == 80
    assert gpu_spec_from_dict({"preset": "a100-80gb"}) == GPU_PRESETS["a100-80gb"]


def test_from_dict_full_spelling_round_trips():
    d = {
        "name": "h100-sxm-80gb",
        "memory_bytes": 80 * GIB,
        "peak_bf16_flops": 989e12,
        "hbm_bytes_per_s": 3.35e12,
        "nvlink_bytes_per_s": 450e9,
        "pcie_bytes_per_s": 55e9,
    }
    assert gpu_spec_from_dict(d) == H100


@pytest.mark.parametrize(
    ("d", "field", "fragment"),
    [
        ({"preset": "llama-3-8b", "num_layer": 3}, "num_layer", "unknown model spec field 'num_layer'"),
        ({"name": "x", "num_layers": 1}, "hidden_size", "missing 'hidden_size'"),
        ({"preset": "llama-3-8b", "hidden_size": 0}, "hidden_size", "must be > 0, got 0"),
        ({"preset": "llama-3-8b", "num_kv_heads": 3}, "num_kv_heads", "must divide num_attention_heads=32"),
        ({"preset": "llama-3-8b", "num_layers": 2.5}, "num_layers", "must be an integer"),
        ({"preset": "llama-9"}, "preset", "unknown model preset 'llama-9'"),
    ],
)
def test_model_spec_errors_name_the_field(d, field, fragment):
    with pytest.raises(SpecError) as e:
        model_spec_from_dict(d)
    assert e.value.field == field
    assert fragment in str(e.value)
    assert isinstance(e.value, ValueError)


def test_gpu_spec_error_non_positive_rate():
    with pytest.raises(SpecError) as e:
        gpu_spec_from_dict({"preset": "h100-sxm-80gb", "hbm_bytes_per_s": -1.0})
    assert e.value.field == "hbm_bytes_per_s"
    assert str(e.value) == "hbm_bytes_per_s: gpu.hbm_bytes_per_s must be > 0, got -1.0; set it to a positive number"


def test_bad_tp_rejected():
    with pytest.raises(SpecError) as e:
        L70.kv_bytes_per_token_per_gpu(3)
    assert e.value.field == "tp" and "must divide num_attention_heads=64" in str(e.value)
