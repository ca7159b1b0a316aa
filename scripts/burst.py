"""A burst of concurrent Generate calls on one channel against a running node, and how each ended.

    .venv/bin/octoserve up --time-scale 10 --port 50051 &
    .venv/bin/python scripts/burst.py 127.0.0.1:50051 [--n 1500] [--max-tokens 400]

Each call: the 8B, a ~200-word text prompt, no deadline, no client cancel. Prints the outcome counts
(served; RESOURCE_EXHAUSTED with or without its retry hint; any other status, with or without tokens received)
and when the refusals and first tokens came (seconds from the start of the burst).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import time

import grpc

from octoserve.v1 import generate_pb2 as pb
from octoserve.v1 import generate_pb2_grpc as pbg

PROMPT = " ".join(("the scheduler admits each request against its budget and routes it to a replica " * 30).split()[:200])


async def one(stub, max_tokens: int, out: collections.Counter, t0: float, times: dict) -> None:
    got = 0
    try:
        async for r in stub.Generate(pb.GenerateRequest(model="llama-3-8b", text=PROMPT, max_tokens=max_tokens)):
            if not got:
                times["first token"].append(time.monotonic() - t0)
            got += len(r.token_ids)
        out["served"] += 1
    except grpc.aio.AioRpcError as e:
        key = e.code().name + (" after tokens" if got else "")
        if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
            times["refused"].append(time.monotonic() - t0)
            key += " with hint" if "retry-after-ms" in dict(e.trailing_metadata() or ()) else " WITHOUT hint"
        out[key] += 1


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("target")
    p.add_argument("--n", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=400)
    args = p.parse_args()
    out: collections.Counter = collections.Counter()
    times: dict[str, list[float]] = collections.defaultdict(list)
    async with grpc.aio.insecure_channel(args.target) as channel:
        stub = pbg.GenerationStub(channel)
        t0 = time.monotonic()
        await asyncio.gather(*(one(stub, args.max_tokens, out, t0, times) for _ in range(args.n)))
    print(dict(out), f"in {time.monotonic() - t0:.1f} s")
    for name, v in times.items():
        print(f"{name}: P50 {pct(v, 0.5):.2f} s, P99 {pct(v, 0.99):.2f} s, max {max(v):.2f} s")


if __name__ == "__main__":
    asyncio.run(main())
