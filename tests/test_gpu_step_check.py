"""scripts/gpu_step_check.py: the CPU smoke run measures three steps and compares each with both cost profiles, and
a saved H200 run renders to the same table the benchmarks quote."""

import json
import subprocess
import sys
from pathlib import Path

from octoserve.services.core.cost_model import COST_PROFILES, CostModel
from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_step_check  # noqa: E402


def test_prediction_leaves_out_allreduce_and_host_overhead():
    cm = CostModel(MODEL_PRESETS["llama-3-70b"], GPU_PRESETS["h200-141gb"], 4, COST_PROFILES["default"])
    full = cm.decode_step_time_s(32, 1400)
    expected = full - cm._allreduce_fixed_s - 32 * cm._allreduce_s_per_token - cm.constants.step_overhead_s
    assert gpu_step_check.gpu_time_s(cm, "decode", 32, 1400) == expected
    assert 0 < expected < full


def test_smoke_run_writes_one_row_per_step(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "scripts/gpu_step_check.py"), "--out", str(tmp_path), "--smoke"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    rows = json.loads((tmp_path / "gpu_steps.json").read_text())["rows"]
    assert [(r["kind"], r["a"], r["b"], r["mode"]) for r in rows] == [
        ("decode", 1, 64, "eager"), ("decode", 4, 64, "eager"), ("prefill", 64, 0, "eager")]
    assert all(r["measured_s"] > 0 and r["pred_pessimistic_s"] > r["pred_default_s"] > 0 for r in rows)


def test_saved_h200_run_renders(tmp_path):
    saved = ROOT / "docs/bench/h200/gpu_steps.json"
    rows = json.loads(saved.read_text())["rows"]
    assert len(rows) == 3 * (3 * 2 + 2)  # three instances x (three decode batches eager+graph, two prefills)
    table = gpu_step_check.markdown(rows)
    assert "| llama-3-70b TP=4 (one GPU's shard) | prefill 2700 | eager | 200.41 |" in table
