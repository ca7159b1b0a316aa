"""What the router adds to an isolated request's first token, on the sim engine, with the CPU held equal.

  .venv/bin/python scripts/router_hop.py [--n 40] [--runs 3]

Starts `services/configs/tiny-vllm.yaml` on the sim engine (no vLLM: the engine's own time is the cost model's, so
what differs between the paths is octoserve's), the worker's process tree on core 0, the router, the scheduler and
this client on core 1 (scripts/pinning.py). Then, `--runs` times, rounds of two isolated requests in turn: straight
to the worker's gRPC API (Attach + Generate, as scripts/ttft_layers.py sends them) and through the router with the
SDK; fresh random 256-token prompts, 16 tokens, 0.1 s apart (`--gap-s`), the first three rounds dropped. Prints each
path's P50 and the router's added P50. Run it on two builds (a checkout of each) to compare them.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from pinning import ENGINE_CORE, OTHER_CORE, pin_self, pin_tree  # noqa: E402

GAP_S = 0.1  # default seconds between requests
DROPPED_ROUNDS = 3


async def one_run(node, n: int, seed: int, gap_s: float = GAP_S) -> tuple[list[float], list[float]]:
    from ttft_layers import DirectWorker, prompts, router_ttft_s

    from octoserve.client import AsyncClient

    direct = DirectWorker(node.workers["tiny-0"].address)
    await direct.start()
    client = AsyncClient(node.router_address)
    worker_t, router_t = [], []
    try:
        for i, p in enumerate(prompts(seed, 2 * (n + DROPPED_ROUNDS))):
            if i % 2 == 0:
                t = await direct.ttft_s(p)
            else:
                t = await router_ttft_s(client, p)
            if i >= 2 * DROPPED_ROUNDS:
                (worker_t if i % 2 == 0 else router_t).append(t)
            await asyncio.sleep(gap_s)
    finally:
        await direct.close()
        await client.close()
    return worker_t, router_t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=40, help="requests a path in each run")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--gap-s", type=float, default=GAP_S, help="seconds between requests (the caches cool with it)")
    args = ap.parse_args()
    from ttft_layers import CONFIG

    from octoserve.services.node.launcher import start_node

    node = start_node(str(CONFIG), engine="sim", run_dir=tempfile.mkdtemp(prefix="octoserve-router-hop-"))
    try:
        pin_tree(node.workers["tiny-0"].proc.pid, ENGINE_CORE)
        for service in (node.router, node.scheduler):
            pin_tree(service.proc.pid, OTHER_CORE)
        pin_self(OTHER_CORE)
        for run in range(1, args.runs + 1):
            # New prompts each run: no prefix hits.
            worker_t, router_t = asyncio.run(one_run(node, args.n, seed=100 + run, gap_s=args.gap_s))
            w, r = statistics.median(worker_t) * 1e3, statistics.median(router_t) * 1e3
            print(f"run {run}: worker direct P50 {w:.2f} ms, through the router P50 {r:.2f} ms, router adds "
                  f"{r - w:+.2f} ms (n={len(worker_t)} a path)", flush=True)
    finally:
        node.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
