"""Live fault drill: the node as `octoserve up` runs it (default placement: a 70B at TP=4 and four 8B replicas),
24 streams on the 8B, then one 8B worker SIGKILLed (or, with `--signal stop`, SIGSTOPped: alive but silent, for the
router's hang watchdog and the supervisor's hang check to find); what the clients saw, and how fast the node noticed
and healed.

    .venv/bin/python scripts/fault_drill.py [--time-scale 10] [--streams 24] [--victim sm-0] [--probe-s 15] [--signal kill|stop]

Reported: streams finished / ended UNAVAILABLE (with a retry hint) / other; requests moved off the dead worker
(the router's access log); new 8B requests sent every 100 ms from the kill on for --probe-s: served / failed;
seconds from the kill until the router marked the worker down (its log), until the launcher had it serving again,
and until the router routed a request to it again (with `--signal stop`, also until the supervisor killed it). Wall-clock seconds on this shared 2-core machine.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

import grpc  # noqa: E402

from octoserve.services.node.launcher import start_node  # noqa: E402
from octoserve.v1 import generate_pb2 as gen_pb  # noqa: E402
from octoserve.v1 import generate_pb2_grpc as gen_grpc  # noqa: E402

MODEL = "llama-3-8b"


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.startswith("{")]


async def drill(args) -> dict:
    run_dir = Path(tempfile.mkdtemp(prefix="octoserve-drill-"))
    node = start_node(None, args.time_scale, run_dir=run_dir, startup_timeout_s=120, grace_s=5,
                      router_args=("--access-log", "all"), supervise=True)
    try:
        async with grpc.aio.insecure_channel(node.router_address) as channel:
            stub = gen_grpc.GenerationStub(channel)
            outcome: collections.Counter = collections.Counter()
            first = [asyncio.Event() for _ in range(args.streams)]

            async def stream(i: int) -> None:
                req = gen_pb.GenerateRequest(model=MODEL, token_ids=gen_pb.TokenIds(ids=[100 + (i * 13 + j) % 20000 for j in range(200)]),
                                             max_tokens=args.max_tokens, ignore_eos=True)
                n = 0
                try:
                    async for r in stub.Generate(req, timeout=600):
                        n += len(r.token_ids)
                        first[i].set()
                    outcome["finished" if n == args.max_tokens else "short"] += 1
                except grpc.aio.AioRpcError as e:
                    hint = "retry-after-ms" in dict(e.trailing_metadata() or ())
                    outcome[f"{e.code().name}{' with hint' if hint else ''}"] += 1
                finally:
                    first[i].set()

            tasks = [asyncio.create_task(stream(i)) for i in range(args.streams)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in first)), 120)
            sig = signal.SIGKILL if args.signal == "kill" else signal.SIGSTOP
            print(f"{args.streams} streams running; {sig.name} {args.victim}", flush=True)
            kill_wall = time.time()
            kill_t = time.monotonic()
            os.kill(node.workers[args.victim].pid, sig)

            probes: collections.Counter = collections.Counter()
            rejoin_s = None
            seen_ids: list[str] = []

            async def probe(k: int) -> None:  # distinct prompts: no prefix-cache affinity steers them
                req = gen_pb.GenerateRequest(model=MODEL, token_ids=gen_pb.TokenIds(ids=[5000 + k * 40 + j for j in range(32)]),
                                             max_tokens=4, ignore_eos=True)
                try:
                    rid = ""
                    async for r in stub.Generate(req, timeout=60):
                        rid = rid or r.request_id
                    probes["served"] += 1
                    seen_ids.append(rid)
                except grpc.aio.AioRpcError as e:
                    probes[e.code().name] += 1

            probe_tasks = []
            while time.monotonic() - kill_t < args.probe_s:
                probe_tasks.append(asyncio.create_task(probe(len(probe_tasks))))
                await asyncio.sleep(0.1)
            await asyncio.gather(*probe_tasks)
            await asyncio.gather(*tasks)
            node.supervisor.wait_for(f"worker:{args.victim}", "ready", timeout_s=120)
            ready = next(e for e in node.supervisor.events if e.service == f"worker:{args.victim}" and e.event == "ready")
            access = {e["request_id"]: e for e in _log(node.router.log_file) if e.get("logger") == "octoserve.router.access"}
            # First probe routed to the restarted victim: its access-log ts.
            back = [access[r]["ts"] for r in seen_ids if r in access and access[r]["instances"] == [args.victim]
                    and access[r]["ts"] > kill_wall]
            rejoin_s = (min(back) - kill_wall) if back else None
            down = [e["ts"] for e in _log(node.router.log_file)
                    if e["msg"] in ("load stream down", "worker hung: routing around it")
                    and e.get("instance") == args.victim and e["ts"] >= kill_wall]
            hung = [e.at_s - kill_t for e in node.supervisor.events
                    if e.service == f"worker:{args.victim}" and e.event == "hung"]
            moved = sum(1 for e in access.values() if e.get("rerouted"))
            return {
                "streams": dict(outcome), "moved": moved, "probes": dict(probes),
                "router_marked_down_s": (min(down) - kill_wall) if down else None,
                "supervisor_killed_hung_s": hung[0] if hung else None,
                "restarted_serving_s": ready.at_s - kill_t,
                "first_probe_on_restarted_s": rejoin_s,
            }
    finally:
        node.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--streams", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=300)
    p.add_argument("--victim", default="sm-0")
    p.add_argument("--probe-s", type=float, default=15.0)
    p.add_argument("--signal", choices=("kill", "stop"), default="kill")
    result = asyncio.run(drill(p.parse_args()))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
