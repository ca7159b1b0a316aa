"""Baseline for the vLLM-vs-octoserve comparison: vLLM's own OpenAI server under an open-loop load, same model.

Job: start `python -m vllm.entrypoints.openai.api_server` on 127.0.0.1 with the tiny test model (built if the
folder is missing), send `--num-requests` streaming greedy completions (token-id prompts, `ignore_eos`, so every
request produces exactly `--max-tokens` tokens) at Poisson arrivals of `--rate` req/s, and report TTFT, ITL and
output throughput. The server is stopped by its PID at the end, whatever happens.

The octoserve half runs against the same model folder with octoserve's own tools:
`octoserve up --engine vllm --model DIR --config NODE.yaml` then
`octoserve bench --target 127.0.0.1:50051 --output-len-mode max-tokens --json octoserve.json`;
compare the two JSON summaries (both use `vllm bench serve` metric definitions).

Invariants: loopback only; bounded (request count, per-request timeout, server start timeout); seeded arrivals
and prompts, so two runs send the same trace.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Record:
    ttft_s: float
    itl_s: tuple[float, ...]
    num_output_tokens: int
    e2e_s: float


def start_server(model_dir: Path, port: int, args: argparse.Namespace) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", "tiny-llama", "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--enforce-eager", "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory-bytes", str(int(args.kv_cache_gib * (1 << 30))), "--scheduling-policy", "priority",
        "--max-num-seqs", str(args.max_num_seqs), "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
    ]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    log = open(Path(args.log), "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_healthy(proc: subprocess.Popen, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1.0)
    raise TimeoutError(f"vLLM server not healthy after {timeout_s:g} s")


async def one_request(session, port: int, prompt: list[int], max_tokens: int, timeout_s: float) -> Record:
    import aiohttp

    body = {"model": "tiny-llama", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    t0 = time.monotonic()
    times: list[float] = []
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=timeout) as resp:
        resp.raise_for_status()
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                times.append(time.monotonic())
    if not times:
        raise RuntimeError("stream ended without tokens")
    itl = tuple(b - a for a, b in zip(times, times[1:]))
    return Record(times[0] - t0, itl, len(times), times[-1] - t0)


async def drive(port: int, args: argparse.Namespace) -> tuple[list[Record], float]:
    import aiohttp

    rng = random.Random(args.seed)
    prompts = [[rng.randrange(3, 4000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    gaps = [rng.expovariate(args.rate) for _ in range(args.num_requests)]
    async with aiohttp.ClientSession() as session:
        t0 = time.monotonic()
        tasks, at = [], 0.0
        for prompt, gap in zip(prompts, gaps):
            at += gap
            await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
            tasks.append(asyncio.create_task(one_request(session, port, prompt, args.max_tokens, args.timeout)))
        records = await asyncio.gather(*tasks)
        return list(records), time.monotonic() - t0


def summarize(records: list[Record], wall_s: float) -> dict:
    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] * 1000.0

    ttft = [r.ttft_s for r in records]
    itl = [x for r in records for x in r.itl_s]
    out_tokens = sum(r.num_output_tokens for r in records)
    return {
        "num_requests": len(records), "wall_s": round(wall_s, 2),
        "output_tokens_per_s": round(out_tokens / wall_s, 1),
        "ttft_ms": {"mean": round(statistics.mean(ttft) * 1000, 1), "p50": round(pct(ttft, 0.5), 1),
                    "p95": round(pct(ttft, 0.95), 1)},
        "itl_ms": {"mean": round(statistics.mean(itl) * 1000, 2) if itl else 0.0,
                   "p50": round(pct(itl, 0.5), 2) if itl else 0.0, "p95": round(pct(itl, 0.95), 2) if itl else 0.0},
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("/tmp/octoserve-tiny-llama"), help="model folder")
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--rate", type=float, default=4.0, help="Poisson arrivals, requests per second")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--kv-cache-gib", type=float, default=0.25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--log", default="/tmp/bench-vllm-server.log")
    p.add_argument("--json", type=Path, default=None, help="write the summary here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not (args.model / "config.json").exists():
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from services.engine.test_model import build_test_model

        build_test_model(args.model)
    proc = start_server(args.model, args.port, args)
    try:
        wait_healthy(proc, args.port, args.start_timeout)
        records, wall_s = asyncio.run(drive(args.port, args))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    summary = {"target": "vllm-openai-server", **summarize(records, wall_s), "args": {
        k: str(v) for k, v in vars(args).items()}}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
