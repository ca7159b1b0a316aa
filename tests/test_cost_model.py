"""Roofline cost model: floors from hand arithmetic, exact sums of its terms, monotonicity, profiles."""

import dataclasses

import pytest
from hypothesis import given
from hypothesis import strategies as st

from octoserve.services.core.cost_model import (
    COST_PROFILES,
    DEFAULT_CONSTANTS,
    PESSIMISTIC_CONSTANTS,
    CostConstants,
    CostModel,
    cost_constants,
)
from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS, SpecError
from octoserve.services.core.types import ScheduledChunk, StepPlan

L70 = MODEL_PRESETS["llama-3-70b"]
L8 = MODEL_PRESETS["llama-3-8b"]
H100 = GPU_PRESETS["h100-sxm-80gb"]
C = DEFAULT_CONSTANTS

TP8 = CostModel(L70, H100, 8)
TP4 = CostModel(L70, H100, 4)
SMALL = CostModel(L8, H100, 1)


def test_70b_tp8_decode_never_below_weight_read_floor():
    floor_s = L70.weight_bytes_per_gpu(8) / H100.hbm_bytes_per_s  # 5.27 ms
    assert 5.26e-3 < floor_s < 5.27e-3
    assert TP8.decode_step_time_s(1, 1) > floor_s
    assert TP8.decode_step_time_s(64, 1400) > floor_s


def test_8b_prefill_never_below_flops_over_peak():
    flops = 1000 * L8.linear_flops_per_token + L8.lm_head_flops_per_token  # one sampled token
    assert SMALL.prefill_time_s(1000) > flops / H100.peak_bf16_flops  # 14.1 ms at 100 % of peak


def test_decode_step_is_the_sum_of_its_terms_by_hand():
    # 70B TP=8, batch 1, context 1,399 (1,400 KV tokens after this step's token).
    weights_s = L70.streamed_weight_bytes / 8 / (3.35e12 * 0.85)
    act_bytes = 80 * 2 * (8 * 8192 + (64 + 16) * 128 // 8 + 64 * 128 // 8 + 6 * 28672 // 8)
    memory_s = weights_s + act_bytes / (3.35e12 * 0.85)
    compute_s = (L70.linear_flops_per_token + L70.lm_head_flops_per_token) / 8 / (989e12 * 0.6)
    linear_s = memory_s + 0.9 * compute_s  # memory-bound; 90 % of the compute time is not hidden
    kv_s = 1400 * 40_960 / (3.35e12 * 0.85)  # memory-bound: 1400 pairs x 4 x 8 heads x 128 x 80 FLOPs is tiny
    allreduce_s = 160 * (20e-6 + 2 * 7 / 8 * 8192 * 2 / (450e9 * 0.8))
    layers_s = 80 * 15e-6  # small per-layer kernels
    expected = 1.0e-3 + linear_s + kv_s + allreduce_s + layers_s
    assert TP8.decode_step_time_s(1, 1399) == pytest.approx(expected, rel=1e-12)


def test_allreduce_latency_dominates_bytes_at_batch_1():
    fixed_s = 2 * 80 * C.allreduce_latency_s  # 3.2 ms per step
    bytes_s = 2 * 80 * (2 * 7 / 8 * 8192 * 2) / (H100.nvlink_bytes_per_s * C.nvlink_eff)  # 12.7 us per step
    assert fixed_s > 100 * bytes_s
    no_latency = CostModel(L70, H100, 8, dataclasses.replace(C, allreduce_latency_s=1e-12))
    delta = TP8.decode_step_time_s(1, 1000) - no_latency.decode_step_time_s(1, 1000)
    assert delta == pytest.approx(fixed_s, rel=1e-6)


def test_tp1_has_no_allreduce():
    no_latency = CostModel(L8, H100, 1, dataclasses.replace(C, allreduce_latency_s=1.0))
    assert no_latency.decode_step_time_s(8, 500) == SMALL.decode_step_time_s(8, 500)


def test_tp8_decode_faster_than_tp4():
    for batch in (1, 16, 64, 256):
        assert TP8.decode_step_time_s(batch, 1400) < TP4.decode_step_time_s(batch, 1400)


def test_monotonic_in_batch_and_context():
    for model in (TP8, TP4, SMALL):
        times = [model.decode_step_time_s(b, 1400) for b in (1, 2, 8, 32, 64, 128, 256)]
        assert times == sorted(times) and len(set(times)) == len(times)
        times = [model.decode_step_time_s(32, c) for c in (0, 100, 1000, 8000, 32000)]
        assert times == sorted(times) and len(set(times)) == len(times)
        times = [model.prefill_time_s(n) for n in (1, 64, 512, 2048, 8192)]
        assert times == sorted(times) and len(set(times)) == len(times)


@given(
    st.lists(st.tuples(st.integers(1, 4096), st.integers(0, 32768)), min_size=1, max_size=40),
    st.integers(0, 39),
    st.integers(1, 512),
    st.integers(1, 4096),
)
def test_adding_work_never_makes_a_step_faster(chunks, index, extra_new, extra_context):
    i = index % len(chunks)
    base = TP8.step_time_s(chunks)
    more_new = list(chunks)
    more_new[i] = (chunks[i][0] + extra_new, chunks[i][1])
    more_context = list(chunks)
    more_context[i] = (chunks[i][0], chunks[i][1] + extra_context)
    assert TP8.step_time_s(more_new) >= base
    assert TP8.step_time_s(more_context) >= base
    assert TP8.step_time_s(chunks + [(1, 0)]) >= base
    assert TP8.step_time_s(chunks, swap_in_blocks=1) > base


def test_empty_step_is_free_and_swap_only_step_pays_overhead():
    assert TP8.step_time_s([]) == 0.0
    assert TP8.plan_time_s(StepPlan(step_id=0, chunks=()), 16) == 0.0
    swap_s = C.swap_setup_s + 10 * 16 * 40_960 / 55e9
    assert TP8.swap_time_s(10, 16) == pytest.approx(swap_s, rel=1e-12)
    assert TP8.step_time_s([], swap_out_blocks=10) == pytest.approx(swap_s + C.step_overhead_s, rel=1e-12)
    assert TP8.swap_time_s(0, 16) == 0.0


def test_plan_time_matches_step_time_and_charges_lm_head_only_for_samplers():
    chunks = (
        ScheduledChunk("a", 512, 0, samples=False),
        ScheduledChunk("b", 1, 900, samples=True),
        ScheduledChunk("c", 1, 30, samples=True),
    )
    plan = StepPlan(step_id=3, chunks=chunks, swap_in_blocks=2)
    tuples = [(c.num_new_tokens, c.num_context_tokens) for c in chunks]
    all_sample = TP8.step_time_s(tuples, swap_in_blocks=2, block_size=16)
    planned = TP8.plan_time_s(plan, 16)
    assert planned < all_sample  # 514 tokens at TP=8 are compute-bound, so the skipped LM head shows
    sampled_all = StepPlan(step_id=3, chunks=tuple(dataclasses.replace(c, samples=True) for c in chunks),
                           swap_in_blocks=2)
    assert TP8.plan_time_s(sampled_all, 16) == all_sample


def test_prefill_of_1000_tokens_on_8b_is_compute_bound():
    compute_s = (1000 * L8.linear_flops_per_token + L8.lm_head_flops_per_token) / (989e12 * 0.6)  # 23.5 ms
    act_bytes = 32 * 2 * (8 * 4096 + (32 + 16) * 128 + 32 * 128 + 6 * 14336)
    memory_s = (L8.streamed_weight_bytes + 1000 * act_bytes) / (3.35e12 * 0.85)  # 8.5 ms
    attn_s = 32 * 128 * 32 * 4 * (1000 * 1001 // 2) / (989e12 * 0.5)
    fixed_s = 1.0e-3 + 32 * 15e-6  # step overhead and the per-layer kernels
    expected = fixed_s + compute_s + 0.9 * memory_s + attn_s
    assert SMALL.prefill_time_s(1000) == pytest.approx(expected, rel=1e-12)
    ideal = CostModel(L8, H100, 1, dataclasses.replace(C, linear_overlap_loss=0.0))
    assert ideal.prefill_time_s(1000) == pytest.approx(fixed_s + compute_s + attn_s, rel=1e-12)
    assert SMALL.prefill_tokens_per_s(1000) == pytest.approx(1000 / SMALL.prefill_time_s(1000))


def test_prefill_with_cached_context_costs_more_than_without():
    assert SMALL.prefill_time_s(512, 4096) > SMALL.prefill_time_s(512)
    assert SMALL.prefill_time_s(512, 0) == SMALL.step_time_s([(512, 0)])


def test_kv_transfer_time():
    # 70B TP=8, 1,400 tokens: each rank sends 1400 x 40,960 B over its own link.
    nvlink_s = C.kv_transfer_setup_s + 1400 * 40_960 / (450e9 * 0.8)
    assert TP8.kv_transfer_time_s(1400) == pytest.approx(nvlink_s, rel=1e-12)
    assert TP8.kv_transfer_time_s(1400, "pcie") == pytest.approx(C.kv_transfer_setup_s + 1400 * 40_960 / 55e9)
    assert TP8.kv_transfer_time_s(0) == 0.0
    with pytest.raises(ValueError, match="unknown link 'infiniband'"):
        TP8.kv_transfer_time_s(10, "infiniband")


def test_from_profile_replaces_constants_and_rejects_unknown_keys():
    slow = CostModel.from_profile(L8, H100, 1, {"step_overhead_s": 1.5e-3, "hbm_eff": 0.7})
    assert slow.constants == dataclasses.replace(C, step_overhead_s=1.5e-3, hbm_eff=0.7)
    assert slow.decode_step_time_s(1, 100) > SMALL.decode_step_time_s(1, 100)
    with pytest.raises(SpecError) as e:
        CostModel.from_profile(L8, H100, 1, {"mfu": 0.5})
    assert e.value.field == "mfu"


def test_constants_are_validated():
    with pytest.raises(SpecError) as e:
        CostConstants(linear_eff=1.2)
    assert e.value.field == "linear_eff" and "<= 1" in str(e.value)
    with pytest.raises(SpecError):
        CostConstants(step_overhead_s=0)
    with pytest.raises(SpecError):
        CostConstants(linear_overlap_loss=-0.1)
    assert CostConstants(linear_overlap_loss=0.0).linear_overlap_loss == 0.0  # the ideal roofline is allowed


def test_bad_tp_rejected():
    with pytest.raises(SpecError):
        CostModel(L70, H100, 3)


# 70B batch-1 decode at context 1,400 under the constants before the TP > 1 recalibration (allreduce 10 us, step
# overhead 0.5 ms, no per-layer term), measured on that code (8.3 ms and 14.4 ms).
TP8_B1_BEFORE_S = 0.008266263339418425
TP4_B1_BEFORE_S = 0.014414280679031954


def test_profiles_are_named_and_unknown_names_list_the_choices():
    assert list(COST_PROFILES) == ["default", "pessimistic"]
    assert cost_constants("default") is DEFAULT_CONSTANTS
    assert cost_constants("pessimistic") is PESSIMISTIC_CONSTANTS
    with pytest.raises(SpecError) as e:
        cost_constants("optimistic")
    assert str(e.value) == "cost_profile: unknown cost profile 'optimistic'; choose one of: default, pessimistic"


def test_pessimistic_70b_batch1_decode_is_at_least_1_8x_the_old_default():
    tp8 = CostModel(L70, H100, 8, PESSIMISTIC_CONSTANTS).decode_step_time_s(1, 1400)
    tp4 = CostModel(L70, H100, 4, PESSIMISTIC_CONSTANTS).decode_step_time_s(1, 1400)
    assert tp8 >= 1.8 * TP8_B1_BEFORE_S and tp8 == pytest.approx(18.97e-3, abs=0.01e-3)
    assert tp4 >= 1.8 * TP4_B1_BEFORE_S and tp4 == pytest.approx(26.44e-3, abs=0.01e-3)


def test_recalibrated_default_70b_batch1_decode():
    assert TP8.decode_step_time_s(1, 1400) == pytest.approx(11.57e-3, abs=0.01e-3)  # 1.40x the old 8.27 ms
    assert TP4.decode_step_time_s(1, 1400) == pytest.approx(17.71e-3, abs=0.01e-3)  # 1.23x the old 14.41 ms
    assert SMALL.decode_step_time_s(1, 1400) == pytest.approx(6.84e-3, abs=0.01e-3)  # 1.17x the old 5.86 ms


def test_pessimistic_is_slower_than_default_for_every_step_shape():
    for model, tp in ((L8, 1), (L70, 4), (L70, 8)):
        default, pessimistic = CostModel(model, H100, tp), CostModel(model, H100, tp, PESSIMISTIC_CONSTANTS)
        for batch in (1, 32, 256):
            assert pessimistic.decode_step_time_s(batch, 1400) > default.decode_step_time_s(batch, 1400)
        for tokens in (1000, 2700):
            assert pessimistic.prefill_time_s(tokens) > default.prefill_time_s(tokens)


def test_layer_overhead_is_paid_once_per_layer_per_nonempty_step():
    no_layer = CostModel(L70, H100, 8, dataclasses.replace(C, layer_overhead_s=1e-12))
    delta = TP8.decode_step_time_s(7, 900) - no_layer.decode_step_time_s(7, 900)
    assert delta == pytest.approx(80 * C.layer_overhead_s, rel=1e-6)
    swap_only = TP8.step_time_s([], swap_in_blocks=3) - no_layer.step_time_s([], swap_in_blocks=3)
    assert swap_only == 0.0
