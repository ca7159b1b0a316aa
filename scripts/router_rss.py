"""Router memory probe: rounds of soak traffic against the live node, the router's RSS measured at idle after each.

    python scripts/router_rss.py [--rounds 5] [--round-s 40] [--env MALLOC_ARENA_MAX=2 ...] [--time-scale 10]

Each round sends the soak's traffic (the seed-000 mix at 10x SLO capacity, outputs capped, 10 % client cancels,
one burst) for `--round-s` wall seconds, waits until every stream ended, then records the router's RSS (and the
anonymous-memory share of it, from /proc/PID/smaps_rollup) with nothing in flight. Memory measured in steady load
includes the requests in flight; measured at idle, anything that rises round after round is retained. `--env` adds
variables to every service's environment, to compare allocator settings one at a time.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.util
import json
import sys
import time
from pathlib import Path

from octoserve.services.node.launcher import start_node

_SOAK = Path(__file__).with_name("soak.py")


def _soak_module():
    spec = importlib.util.spec_from_file_location("octoserve_soak", _SOAK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def memory_mib(pid: int) -> dict[str, float]:
    out = {}
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("Rss", "Anonymous"):
                out[key.lower()] = round(int(rest.split()[0]) / 1024.0, 1)
    return out


async def main_async(args) -> int:
    soak = _soak_module()
    sargs = soak.parse_args(["--time-scale", str(args.time_scale), "--seed", str(args.seed)])
    sargs.burst_every_s = args.round_s / 2  # one burst per round, mid-round
    env = dict(kv.split("=", 1) for kv in args.env)
    total_s = args.rounds * args.round_s
    rate = sargs.capacity_rps * sargs.overload
    profile = soak.scaled(soak.PROFILES["seed-000"], rate_rps=rate, duration_s=total_s / args.time_scale + 1.0)
    trace = soak.cap_outputs(soak.generate_trace(profile, args.seed), sargs.max_output)
    pool = soak.cap_outputs(soak.generate_trace(soak.scaled(profile, duration_s=20.0), args.seed + 1), sargs.max_output)
    node = await asyncio.to_thread(start_node, args.config, args.time_scale, extra_env=env)
    rows = []
    try:
        pid = node.router.pid
        rows.append({"round": 0, "requests": 0, **memory_mib(pid)})
        print(f"env {env or '{}'}; router pid {pid}; idle at start: {rows[-1]}", file=sys.stderr, flush=True)
        sent = 0
        for r in range(1, args.rounds + 1):
            t0 = time.monotonic()
            traffic = soak.Traffic(sargs, node.router_address, t0)
            start_s = (r - 1) * args.round_s
            chunk = [dataclasses.replace(req, arrival_s=req.arrival_s - start_s / args.time_scale) for req in trace if start_s <= req.arrival_s * args.time_scale < start_s + args.round_s]
            await traffic.run(chunk, pool, args.round_s)
            await traffic.drain(timeout_s=sargs.max_output * 0.1 * args.time_scale + 60.0)
            await asyncio.sleep(2.0)  # the router's cleanup RPCs land
            sent += len(traffic.outcomes)
            rows.append({"round": r, "requests": sent, **memory_mib(pid)})
            print(f"round {r}: {rows[-1]}", file=sys.stderr, flush=True)
        await asyncio.sleep(args.hold_s)
    finally:
        await asyncio.to_thread(node.stop)
    growth = rows[-1]["rss"] - rows[1]["rss"]
    per_1k = growth / max(1, rows[-1]["requests"] - rows[1]["requests"]) * 1000.0
    print(json.dumps({"env": env, "rows": rows, "rss_growth_after_round_1_mib": round(growth, 1),
                      "mib_per_1000_requests": round(per_1k, 2)}))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--round-s", type=float, default=40.0, help="wall seconds of traffic per round")
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--config", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--hold-s", type=float, default=0.0, help="keep the idle node up this long before stopping it")
    p.add_argument("--env", action="append", default=[], metavar="KEY=VALUE", help="added to every service's env")
    return asyncio.run(main_async(p.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
