"""Calibration: op shapes per TP shard, the roofline prediction per op, the fit on synthetic measurements, the
profile file round trip into CostModel, and the CPU command end to end on tiny shapes."""

import argparse
import json

import pytest

from octoserve.services.lab import calibrate as cal
from octoserve.services.core.cost_model import DEFAULT_CONSTANTS, CostModel
from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS, GpuSpec

H100 = GPU_PRESETS["h100-sxm-80gb"]
LM = MODEL_PRESETS["llama-3-70b"]


def test_layer_ops_shard_like_vllm():
    ops = {o.name: o for o in cal.layer_ops(LM, 4, tokens=(16,), prefill_lengths=(1024,), decode_shapes=((8, 2048),))}
    # 64 heads / 4 = 16 query heads, 8 KV heads / 4 = 2 per GPU, head dim 128; intermediate 28,672 / 4.
    assert (ops["qkv m=16"].k, ops["qkv m=16"].n) == (8192, (16 + 4) * 128)
    assert (ops["o m=16"].k, ops["o m=16"].n) == (16 * 128, 8192)
    assert (ops["gate_up m=16"].k, ops["gate_up m=16"].n) == (8192, 2 * 7168)
    assert (ops["down m=16"].k, ops["down m=16"].n) == (7168, 8192)
    attn = ops["attn decode b=8 ctx=2048"]
    assert (attn.heads, attn.kv_heads, attn.head_dim, attn.m, attn.context) == (16, 2, 128, 8, 2048)
    assert len(ops) == 6


def test_op_flops_and_bytes():
    g = cal.Op("g", "gemm", 4, 10, 20)
    assert g.flops == 2 * 4 * 10 * 20 and g.bytes == 2 * (200 + 40 + 80)
    p = cal.Op("p", "attn_prefill", 4, heads=2, kv_heads=1, head_dim=8)
    assert p.flops == 4 * 2 * 8 * 10  # 10 causal (query, key) pairs
    d = cal.Op("d", "attn_decode", 3, heads=2, kv_heads=1, head_dim=8, context=100)
    assert d.flops == 4 * 2 * 8 * 300 and d.bytes == 2 * (2 * 300 * 8 + 2 * 3 * 2 * 8)


def test_prediction_is_the_cost_model_roofline():
    gemm = cal.Op("g", "gemm", 4096, 8192, 8192)  # compute-bound
    comp = gemm.flops / (H100.peak_bf16_flops * 0.6)
    mem = gemm.bytes / (H100.hbm_bytes_per_s * 0.85)
    assert cal.predict_s(gemm, H100) == pytest.approx(comp + 0.9 * mem)
    dec = cal.Op("d", "attn_decode", 64, heads=8, kv_heads=8, head_dim=128, context=1000)
    assert cal.predict_s(dec, H100) == pytest.approx(dec.bytes / (H100.hbm_bytes_per_s * 0.85))


def test_fit_recovers_the_efficiencies_that_generated_the_measurements():
    gpu = GpuSpec("toy", 1 << 34, 100e12, 1e12, 1e11, 1e10)
    ops = cal.layer_ops(MODEL_PRESETS["llama-3-8b"], 1)
    truth = dict(linear_eff=0.7, hbm_eff=0.8, attn_eff=0.4)

    def fake_time(op):  # a device that runs exactly at those fractions of its peaks
        if op.kind == "gemm":
            return op.flops / (gpu.peak_bf16_flops * 0.7) if cal._ridge_tokens(op, gpu) else op.bytes / (1e12 * 0.8)
        if op.kind == "attn_prefill":
            return op.flops / (gpu.peak_bf16_flops * 0.4)
        return op.bytes / (1e12 * 0.8)

    ms = [cal.Measurement(op, fake_time(op), cal.predict_s(op, gpu)) for op in ops]
    assert cal.fit_profile(ms, gpu) == pytest.approx(truth)
    warnings = []
    fast = [cal.Measurement(m.op, m.measured_s / 10, m.predicted_s) for m in ms]
    assert cal.fit_profile(fast, gpu, warn=warnings.append) == {"linear_eff": 1.0, "hbm_eff": 1.0, "attn_eff": 1.0}
    assert len(warnings) == 3 and warnings[0].startswith("linear_eff: measured 7.00")


def test_step_overhead_is_what_the_gpu_work_does_not_explain():
    assert cal.fit_step_overhead_s(0.0020, 0.0012) == 0.0008
    assert cal.fit_step_overhead_s(0.0010, 0.0012) == 1e-6


def test_profile_round_trip_feeds_the_cost_model(tmp_path):
    path = cal.write_profile(tmp_path / "p.json", {"linear_eff": 0.5, "hbm_eff": 0.7}, {"device": "x"})
    assert json.loads(path.read_text())["meta"] == {"device": "x"}
    profile = cal.read_profile(path)
    slow = CostModel.from_profile(LM, H100, 8, profile)
    assert slow.constants.linear_eff == 0.5 and slow.constants.attn_eff == DEFAULT_CONSTANTS.attn_eff
    assert slow.prefill_time_s(2048) > CostModel(LM, H100, 8).prefill_time_s(2048)
    assert cal.constants_from_profile_file(path).hbm_eff == 0.7


def test_tiny_model_spec_counts_its_parameters():
    spec = cal.tiny_model_spec()
    # 4 layers x (256 x 256 q + 2 x 256 x 128 kv + 256 x 256 o + 3 x 256 x 512 mlp + 2 x 256 norms)
    # + 2 x 4096 x 256 embeddings/head + 256 final norm
    assert spec.num_params == 4 * (65536 + 65536 + 65536 + 393216 + 512) + 2 * 4096 * 256 + 256
    assert spec.head_dim == 64 and spec.dtype_bytes == 4


@pytest.mark.slow
def test_cpu_command_writes_a_profile(tmp_path, capsys):
    pytest.importorskip("torch")
    parser = argparse.ArgumentParser()
    cal.add_arguments(parser)
    out = tmp_path / "profile.json"
    assert cal.run(parser.parse_args(["--device", "cpu", "--repeats", "2", "--output", str(out)])) == 0
    text = capsys.readouterr().out
    assert "predicted us" in text and "attn decode b=16 ctx=256" in text
    assert set(cal.read_profile(out)) == {"linear_eff", "hbm_eff", "attn_eff"}


def _engine_steps(constants, model, gpu) -> list:
    """Synthetic whole-step measurements at the simulator's shapes, priced by `constants`."""
    cm = CostModel(model, gpu, 1, constants)
    shapes = [(f"decode b={b}", tuple((1, 512) for _ in range(b))) for b in (1, 4, 16, 64, 256)]
    shapes += [(f"prefill {n}", ((n, 0),)) for n in (128, 512, 1024, 2048, 4096)]
    return [cal.StepSample(name, chunks, cm.step_time_s(chunks)) for name, chunks in shapes]


def test_step_fit_recovers_the_constants_that_made_the_steps():
    from dataclasses import replace

    truth = replace(DEFAULT_CONSTANTS, linear_eff=0.45, hbm_eff=0.7, attn_eff=0.3, step_overhead_s=2.5e-3)
    model, gpu = MODEL_PRESETS["llama-3-8b"], GPU_PRESETS["h200-141gb"]
    samples = _engine_steps(truth, model, gpu)
    fitted = cal.fit_step_profile(samples, model, gpu, 1)
    assert set(fitted) == set(cal.STEP_FIT_KEYS)
    assert cal.step_fit_error(samples, model, gpu, 1, replace(DEFAULT_CONSTANTS, **fitted)) < 0.01
    assert fitted["linear_eff"] == pytest.approx(0.45, rel=0.03)
    assert fitted["hbm_eff"] == pytest.approx(0.7, rel=0.03)
    assert fitted["step_overhead_s"] == pytest.approx(2.5e-3, rel=0.05)
    # The fitted profile is what CostModel.from_profile reads.
    CostModel.from_profile(model, gpu, 1, fitted)


def test_step_fit_needs_a_sample():
    with pytest.raises(ValueError, match="at least one"):
        cal.fit_step_profile([], MODEL_PRESETS["llama-3-8b"], GPU_PRESETS["h200-141gb"], 1)
