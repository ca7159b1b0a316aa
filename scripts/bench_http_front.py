"""HTTP front overhead: added TTFT of the OpenAI-compatible front over the gRPC path, and streamed tokens per
front CPU-second, measured the way scripts/bench_router.py measures the router.

    .venv/bin/python scripts/bench_http_front.py [--mode inside|beside] [--requests 200] [--levels 1,32,128]

What it runs: `start_node` with `scripts/bench_router_node.yaml` (scheduler, one 8B colocated worker, router) plus
the HTTP front (inside the router process, or with --mode beside its own process) on 127.0.0.1, sim engine.
1. TTFT: N sequential requests alternating (a) the SDK through the router (gRPC, the path bench_router.py calls
   "through the router") and (b) a streaming POST /v1/completions through the front, read as raw SSE with aiohttp
   (a lean client, so the figure is the front's, not a client library's). Same 32-token prompt, 4 output tokens.
   The difference of the P50s is the front's added TTFT.
2. Capacity: for each level C, a separate load process holds C concurrent SSE streams through the front (each
   `--max-tokens` tokens, replaced at once when done) while this process sends the same alternating probes;
   tokens are counted by the load process, CPU of the front and the router from /proc over the same window.
Nothing asserts a time; the figures are printed side by side and, with --out, written as markdown.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from bench_router import MODEL, NODE_YAML, PROBE_MAX_TOKENS, PROMPT, cpu_s, pct  # noqa: E402

from octoserve.client import AsyncClient  # noqa: E402
from octoserve.services.node.launcher import start_node  # noqa: E402

TARGET_ADDED_P50_MS = 2.0


def body(max_tokens: int) -> bytes:
    return json.dumps({"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "stream": True,
                       "ignore_eos": True}).encode()


async def grpc_ttft_s(client: AsyncClient) -> float:
    t0 = time.perf_counter()
    first = None
    async for chunk in client.generate(MODEL, PROMPT, max_tokens=PROBE_MAX_TOKENS, ignore_eos=True, timeout_s=30.0):
        if first is None and chunk.token_ids:
            first = time.perf_counter()
    return first - t0


async def http_ttft_s(session, url: str) -> float:
    t0 = time.perf_counter()
    first = None
    async with session.post(url, data=body(PROBE_MAX_TOKENS), headers={"Content-Type": "application/json"}) as r:
        async for line in r.content:
            if first is None and line.startswith(b"data: {"):
                first = time.perf_counter()
    return first - t0


async def probe_pairs(client, session, url, n: int, deadline: float | None = None, gap_s: float = 0.0):
    g, h = [], []
    for i in range(n):
        if deadline is not None and time.perf_counter() > deadline:
            break
        if i % 2 == 0:
            g.append(await grpc_ttft_s(client))
            h.append(await http_ttft_s(session, url))
        else:
            h.append(await http_ttft_s(session, url))
            g.append(await grpc_ttft_s(client))
        if gap_s:
            await asyncio.sleep(gap_s)
    return g, h


# ---- the load process ------------------------------------------------------------------------------------------


async def load_main(args) -> dict:
    import aiohttp

    t0 = time.perf_counter()
    start, end = t0 + args.warmup_s, t0 + args.warmup_s + args.duration_s
    counts = {"tokens": 0, "events": 0, "errors": 0}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        async def stream() -> None:
            while time.perf_counter() < end:
                try:
                    async with session.post(args.url, data=body(args.max_tokens),
                                            headers={"Content-Type": "application/json"}) as r:
                        async for line in r.content:
                            now = time.perf_counter()
                            if line.startswith(b"data: {") and start <= now <= end:
                                counts["events"] += 1
                                counts["tokens"] += line.count(b"<")  # sim engine text: one <id> per token
                            if now > end:
                                break
                except Exception:  # counted: an error is a figure, not a crash of the bench
                    counts["errors"] += 1
                    await asyncio.sleep(0.01)

        print(json.dumps({"started": True}), flush=True)
        await asyncio.gather(*(stream() for _ in range(args.concurrency)))
    return {**counts, "duration_s": args.duration_s}


def spawn_load(url: str, concurrency: int, args) -> subprocess.Popen:
    cmd = [sys.executable, __file__, "--load-child", "--url", url, "--concurrency", str(concurrency),
           "--max-tokens", str(args.max_tokens), "--warmup-s", str(args.warmup_s), "--duration-s", str(args.level_s)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, cwd=REPO_ROOT)


def finish_child(proc: subprocess.Popen, timeout_s: float) -> dict:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()  # this child only, by its PID
        proc.communicate()
        raise RuntimeError("the load process did not finish in time")
    return json.loads(out.strip().splitlines()[-1])


async def run_level(node, client, session, url, c: int, args) -> dict:
    loop = asyncio.get_running_loop()
    proc = spawn_load(url, c, args)
    await loop.run_in_executor(None, proc.stdout.readline)
    await asyncio.sleep(args.warmup_s)
    pids = {"front": node.http.pid, "router": node.router.pid, "load": proc.pid}
    cpu0 = {k: cpu_s(p) for k, p in pids.items()}
    t0 = time.perf_counter()
    g, h = await probe_pairs(client, session, url, 10_000, deadline=t0 + args.level_s - 0.2, gap_s=0.02)
    elapsed = time.perf_counter() - t0
    cpu = {k: (cpu_s(p) - cpu0[k]) / elapsed for k, p in pids.items()}
    result = await loop.run_in_executor(None, finish_child, proc, args.level_s + 60.0)
    tps = result["tokens"] / result["duration_s"]
    return {"streams": c, "tokens_per_s": tps, "events_per_s": result["events"] / result["duration_s"],
            "front_cpu": cpu["front"], "router_cpu": cpu["router"], "load_cpu": cpu["load"],
            "tokens_per_front_cpu_s": tps / cpu["front"] if cpu["front"] else float("nan"),
            "tokens_per_router_cpu_s": tps / cpu["router"] if cpu["router"] else float("nan"),
            "grpc_p50_ms": pct(g, 50) * 1e3, "http_p50_ms": pct(h, 50) * 1e3, "probes": len(g),
            "errors": result["errors"]}


async def bench(args) -> dict:
    import aiohttp

    run_dir = Path(tempfile.mkdtemp(prefix="octoserve-bench-http-"))
    node = start_node(str(NODE_YAML), args.time_scale, run_dir=run_dir, startup_timeout_s=60.0, grace_s=5.0,
                      http_port=0, http_inside=args.mode == "inside")
    try:
        url = node.http_url + "/v1/completions"
        client = AsyncClient(node.router_address)
        async with aiohttp.ClientSession() as session:
            await probe_pairs(client, session, url, 20)  # warm both paths
            g, h = await probe_pairs(client, session, url, args.requests)
            ttft = {"n": len(g), "grpc_p50_ms": pct(g, 50) * 1e3, "http_p50_ms": pct(h, 50) * 1e3,
                    "grpc_p99_ms": pct(g, 99) * 1e3, "http_p99_ms": pct(h, 99) * 1e3}
            ttft["added_p50_ms"] = ttft["http_p50_ms"] - ttft["grpc_p50_ms"]
            ttft["added_p99_ms"] = ttft["http_p99_ms"] - ttft["grpc_p99_ms"]
            print(f"idle TTFT: gRPC P50 {ttft['grpc_p50_ms']:.3f} ms, HTTP P50 {ttft['http_p50_ms']:.3f} ms, "
                  f"added {ttft['added_p50_ms']:.3f} ms (P99 added {ttft['added_p99_ms']:.3f})", flush=True)
            levels = []
            for c in args.levels:
                lv = await run_level(node, client, session, url, c, args)
                levels.append(lv)
                print(f"  {c:4d} streams: {lv['tokens_per_s']:9,.0f} tok/s  front CPU {lv['front_cpu']:.2f} "
                      f"({lv['tokens_per_front_cpu_s']:,.0f} tok per front CPU-s)  router CPU {lv['router_cpu']:.2f}  "
                      f"added P50 {lv['http_p50_ms'] - lv['grpc_p50_ms']:.2f} ms  errors {lv['errors']}", flush=True)
        await client.close()
    finally:
        codes = node.stop()
    print(f"node exit codes: {codes}")
    return {"ttft": ttft, "levels": levels}


def table(result: dict) -> str:
    t = result["ttft"]
    lines = [
        "| path | TTFT P50 ms | TTFT P99 ms | n |", "|---|---:|---:|---:|",
        f"| gRPC through the router (SDK) | {t['grpc_p50_ms']:.3f} | {t['grpc_p99_ms']:.3f} | {t['n']} |",
        f"| HTTP through the front (SSE) | {t['http_p50_ms']:.3f} | {t['http_p99_ms']:.3f} | {t['n']} |",
        f"| **added by the front** | **{t['added_p50_ms']:.3f}** | **{t['added_p99_ms']:.3f}** | |", "",
        "| streams | tokens/s | SSE events/s | front CPU (cores) | tokens per front CPU-s | router CPU | "
        "tokens per router CPU-s | probe P50 gRPC / HTTP ms | errors |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for lv in result["levels"]:
        lines.append(f"| {lv['streams']} | {lv['tokens_per_s']:,.0f} | {lv['events_per_s']:,.0f} | "
                     f"{lv['front_cpu']:.2f} | {lv['tokens_per_front_cpu_s']:,.0f} | {lv['router_cpu']:.2f} | "
                     f"{lv['tokens_per_router_cpu_s']:,.0f} | {lv['grpc_p50_ms']:.2f} / {lv['http_p50_ms']:.2f} | "
                     f"{lv['errors']} |")
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--time-scale", type=float, default=0.25)
    p.add_argument("--requests", type=int, default=200, help="sequential TTFT requests per path")
    p.add_argument("--levels", type=lambda s: [int(x) for x in s.split(",")], default=[1, 32, 128])
    p.add_argument("--level-s", type=float, default=6.0)
    p.add_argument("--warmup-s", type=float, default=1.5)
    p.add_argument("--max-tokens", type=int, default=1000)
    p.add_argument("--json", default=None)
    p.add_argument("--mode", choices=("inside", "beside"), default="inside",
                   help="the front inside the router process (the default; front and router CPU are then the same "
                        "process) or beside it as a process of its own")
    p.add_argument("--load-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--url", default="", help=argparse.SUPPRESS)
    p.add_argument("--concurrency", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--duration-s", type=float, default=5.0, help=argparse.SUPPRESS)
    args = p.parse_args()
    import uvloop

    if args.load_child:
        print(json.dumps(uvloop.run(load_main(args))), flush=True)
        return 0
    result = uvloop.run(bench(args))
    print("\n" + table(result))
    print(f"\nmachine: {os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
