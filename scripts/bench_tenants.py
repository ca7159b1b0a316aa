"""Two tenants on the live node: does one tenant's 10x flood take the other's share?

    python scripts/bench_tenants.py [--phase-s 60] [--time-scale 10] [--out docs/bench/tenants.png]

One 8B colocated instance (sim engine, its own process) behind the router, two tenants of equal weight with their
own API keys. Phases, each `--phase-s` wall seconds of open-loop Poisson traffic (fixed 256-token prompts, 64
output tokens):
  1. saturation: the flood tenant alone far over capacity -> the node's goodput G (req/s within the TTFT SLO);
  2. solo: the steady tenant alone at its share, G/2 -> its solo goodput;
  3. flood: the steady tenant at G/2 while the flood tenant sends 10x its share (5 G) -> the steady tenant's goodput;
  4. the same as 3 on a node without tenants configured (no fair sharing), for comparison.
Goodput counts requests whose first token came within the TTFT SLO (modelled time), per modelled second, after
the first 20 % of the phase (warm-up). Target: phase 3 / phase 2 >= 0.9.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

import grpc

from octoserve.services.node.launcher import start_node
from octoserve.services.rpc.convert import SIM_OUTPUT_LEN_KEY
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc

MODEL = "llama-3-8b"
KEYS = {"steady": "steady-key-0123456789", "flood": "flood-key-9876543210"}
PROMPT_LEN, OUTPUT_LEN = 256, 64


def node_config(with_tenants: bool) -> dict:
    cfg = {"gpu": "h100-sxm-80gb", "num_gpus": 8, "models": {MODEL: MODEL},
           "instances": [{"id": "sm-0", "model": MODEL, "role": "colocated", "tp": 1, "gpu_ids": [0]}]}
    if with_tenants:
        cfg["tenants"] = {"list": [{"name": name, "key": key, "weight": 1} for name, key in KEYS.items()]}
    return cfg


async def one(stub, tenant: str, prompt: list[int], t0: float, slo_ms: float, time_scale: float,
              stats: dict) -> None:
    req = gen_pb.GenerateRequest(model=MODEL, token_ids=gen_pb.TokenIds(ids=prompt), max_tokens=OUTPUT_LEN,
                                 ignore_eos=True)
    metadata = (("authorization", f"Bearer {KEYS[tenant]}"), (SIM_OUTPUT_LEN_KEY, str(OUTPUT_LEN)))
    sent = time.monotonic()
    first = None
    try:
        async for resp in stub.Generate(req, metadata=metadata, timeout=120.0):
            if first is None and resp.token_ids:
                first = time.monotonic()
        outcome = "ok" if first is not None and (first - sent) / time_scale * 1000.0 <= slo_ms else "late"
    except grpc.aio.AioRpcError as e:
        outcome = e.code().name
        if "fair share" in (e.details() or ""):
            outcome = "fair_share_refusal"
    stats.setdefault(tenant, []).append((sent - t0, outcome))


async def drive(address: str, rates: dict[str, float], phase_s: float, time_scale: float, slo_ms: float,
                seed: int) -> dict:
    """Open-loop Poisson traffic per tenant (rates in modelled req/s); returns per-tenant (t, outcome) lists."""
    stats: dict[str, list] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = gen_grpc.GenerationStub(channel)
        t0 = time.monotonic()
        tasks = []

        async def arrivals(tenant: str, rate_wall: float) -> None:
            rng = random.Random(f"{seed}-{tenant}")  # per tenant: the steady tenant's arrivals are the same every phase
            t = 0.0
            while True:
                t += rng.expovariate(rate_wall)
                if t > phase_s:
                    return
                await asyncio.sleep(max(0.0, t - (time.monotonic() - t0)))
                prompt = [rng.randrange(1, 128000) for _ in range(PROMPT_LEN)]
                tasks.append(asyncio.create_task(one(stub, tenant, prompt, t0, slo_ms, time_scale, stats)))

        await asyncio.gather(*(arrivals(t, r / time_scale) for t, r in rates.items() if r > 0))
        await asyncio.gather(*tasks)
    return stats


def goodput(stats: dict, tenant: str, phase_s: float, time_scale: float) -> float:
    """Requests within the SLO per modelled second, arrivals after the first 20 % of the phase."""
    start = 0.2 * phase_s
    ok = sum(1 for t, o in stats.get(tenant, []) if t >= start and o == "ok")
    return ok / ((phase_s - start) / time_scale)


def outcome_counts(stats: dict, tenant: str) -> dict[str, int]:
    counts: dict[str, int] = {}
    for _, o in stats.get(tenant, []):
        counts[o] = counts.get(o, 0) + 1
    return counts


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase-s", type=float, default=60.0, help="wall seconds per phase")
    p.add_argument("--time-scale", type=float, default=10.0)
    p.add_argument("--probe-rps", type=float, default=400.0, help="modelled req/s of the saturation phase")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/bench/tenants.png")
    args = p.parse_args(argv)
    from octoserve.services.config import load_node_config  # noqa: F401 (fail early on a broken install)

    slo_ms = 250.0  # the standard tier's TTFT SLO in the default config
    results = {}
    node = start_node(node_config(True), args.time_scale)
    try:
        def phase(name: str, rates: dict[str, float], address: str) -> dict:
            print(f"phase {name}: {', '.join(f'{t} {r:.1f} req/s' for t, r in rates.items())} (modelled), "
                  f"{args.phase_s:g} s ...", file=sys.stderr, flush=True)
            stats = asyncio.run(drive(address, rates, args.phase_s, args.time_scale, slo_ms, args.seed))
            results[name] = {t: {"rate_rps": r, "goodput_rps": round(goodput(stats, t, args.phase_s, args.time_scale), 2),
                                 "outcomes": outcome_counts(stats, t)} for t, r in rates.items()}
            print(f"  {json.dumps(results[name])}", file=sys.stderr, flush=True)
            return stats

        phase("saturation", {"flood": args.probe_rps}, node.router_address)
        capacity = results["saturation"]["flood"]["goodput_rps"]
        share = capacity / 2
        phase("solo", {"steady": share}, node.router_address)
        phase("flood", {"steady": share, "flood": 10 * share}, node.router_address)
    finally:
        node.stop()
    plain = start_node(node_config(False), args.time_scale)
    try:
        phase("flood without tenants", {"steady": share, "flood": 10 * share}, plain.router_address)
    finally:
        plain.stop()
    solo = results["solo"]["steady"]["goodput_rps"]
    kept = results["flood"]["steady"]["goodput_rps"] / solo if solo else 0.0
    kept_plain = results["flood without tenants"]["steady"]["goodput_rps"] / solo if solo else 0.0
    summary = {"capacity_goodput_rps": capacity, "steady_share_rps": share, "kept_with_fair_share": round(kept, 3),
               "kept_without_tenants": round(kept_plain, 3), "phases": results}
    print(json.dumps(summary, indent=2))
    _plot(results, Path(args.out))
    return 0 if kept >= 0.9 else 1


def _plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["solo", "flood", "flood without tenants"]
    steady = [results[n]["steady"]["goodput_rps"] for n in names]
    flood = [results[n].get("flood", {}).get("goodput_rps", 0.0) for n in names]
    fig, ax = plt.subplots(figsize=(7, 4))
    x = range(len(names))
    ax.bar([i - 0.2 for i in x], steady, width=0.4, label="steady tenant (at its share)")
    ax.bar([i + 0.2 for i in x], flood, width=0.4, label="flood tenant (10x its share)")
    ax.set_xticks(list(x), ["steady alone", "both, fair sharing", "both, no tenants"])
    ax.set_ylabel("goodput (req/s within TTFT SLO, modelled)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
