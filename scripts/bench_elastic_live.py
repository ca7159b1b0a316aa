"""Elastic pools on the live node: how long a role change and a model change take under load, and what the clients
saw (every request's final status). Separate processes on 127.0.0.1, sim engine, dilated by --time-scale.

    python scripts/bench_elastic_live.py [--time-scale 3] [--rounds 2] [--per-model 2]

Node: a colocated 8B on c0, c1; a disaggregated 8B on p0 (prefill), d0, d1 (decode); another 8B on y0.
Each round, under a closed-loop load of --per-model streams per model: d1 decode -> prefill -> decode (role changes,
in the worker's process), then c1 -> the other 8B and that instance back to the first 8B (model changes: drained stop,
start, modelled weight load over PCIe). Prints one line per reconfiguration (wall seconds, and modelled seconds =
wall / time scale) and the request counts per model. Run it with `nice -n 10` on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from octoserve.services.node.launcher import start_node  # noqa: E402
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb  # noqa: E402
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc  # noqa: E402
from octoserve.services.rpc.gen import worker_pb2 as w_pb  # noqa: E402
from octoserve.v1 import generate_pb2_grpc as gen_grpc  # noqa: E402
from tests.service_fixtures import COLOCATED_MODEL, DISAGG_MODEL  # noqa: E402
from tests.test_elastic_live import MAX_TOKENS, OTHER_MODEL, Load, elastic_config  # noqa: E402


async def bench(args) -> int:
    run_dir = Path(tempfile.mkdtemp(prefix="octoserve-elastic-bench-"))
    node = start_node(elastic_config(), time_scale=args.time_scale, run_dir=run_dir, startup_timeout_s=120, grace_s=3)
    rows = []
    try:
        async with grpc.aio.insecure_channel(node.router_address) as rch, \
                grpc.aio.insecure_channel(node.scheduler.address) as sch:
            scheduler = s_grpc.SchedulerStub(sch)
            load = Load(gen_grpc.GenerationStub(rch), (COLOCATED_MODEL, DISAGG_MODEL, OTHER_MODEL), args.per_model)
            load.start()
            await asyncio.sleep(2.0)

            async def reconfigure(label: str, request: s_pb.ReconfigureRequest) -> s_pb.ReconfigureReply:
                t0 = time.monotonic()
                reply = await scheduler.Reconfigure(request, timeout=300)
                rows.append((label, reply, time.monotonic() - t0))
                print(f"  {label:34s} drain {reply.drain_s:6.3f} s  switch {reply.switch_s:6.3f} s  total "
                      f"{reply.total_s:6.3f} s wall = {reply.total_s / args.time_scale:6.3f} s modelled; drained "
                      f"{reply.drained_requests} requests", flush=True)
                await asyncio.sleep(1.0)
                return reply

            on_gpu1 = "c1"  # the 8B instance on GPU 1 (a model change back gives it a new id)
            for n in range(args.rounds):
                print(f"round {n + 1}/{args.rounds}", flush=True)
                for role, name in ((w_pb.PREFILL, "prefill"), (w_pb.DECODE, "decode")):
                    await reconfigure(f"role d1 -> {name}", s_pb.ReconfigureRequest(
                        role_change=s_pb.RoleChange(instance_id="d1", role=role)))
                there = await reconfigure("model GPU 1: 8B -> other 8B", s_pb.ReconfigureRequest(
                    model_change=s_pb.ModelChange(retire=[on_gpu1], model=OTHER_MODEL, role=w_pb.COLOCATED,
                                                  tensor_parallel=1)))
                back = await reconfigure("model GPU 1: other 8B -> 8B", s_pb.ReconfigureRequest(
                    model_change=s_pb.ModelChange(retire=list(there.started), model=COLOCATED_MODEL,
                                                  role=w_pb.COLOCATED, tensor_parallel=1)))
                (on_gpu1,) = back.started
            streams = await load.finish()
    finally:
        node.stop()
    print()
    print("| reconfiguration | n | drain (wall s, median) | switch (wall s, median) | total (modelled s, median) |")
    print("|---|---|---|---|---|")
    for label in dict.fromkeys(r[0] for r in rows):
        mine = [r[1] for r in rows if r[0] == label]
        print(f"| {label} | {len(mine)} | {statistics.median(r.drain_s for r in mine):.3f} | "
              f"{statistics.median(r.switch_s for r in mine):.3f} | "
              f"{statistics.median(r.total_s for r in mine) / args.time_scale:.3f} |")
    print()
    print("| model | requests sent | final status | served in full | failed |")
    print("|---|---|---|---|---|")
    for model in (COLOCATED_MODEL, DISAGG_MODEL, OTHER_MODEL):
        mine = [s for s in streams if s.request.model == model]
        full = sum(1 for s in mine if s.code is grpc.StatusCode.OK and len(s.tokens) == MAX_TOKENS)
        final = sum(1 for s in mine if s.code is not None)
        print(f"| {model} | {len(mine)} | {final} | {full} | {final - full} |")
    lost = sum(1 for s in streams if s.code is not grpc.StatusCode.OK or len(s.tokens) != MAX_TOKENS)
    print(f"\nrequests lost or failed: {lost} of {len(streams)}")
    return 0 if lost == 0 else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-scale", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--per-model", type=int, default=2)
    return asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
