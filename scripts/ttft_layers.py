"""Isolated-request TTFT of the tiny vLLM model, layer by layer (where does octoserve's extra TTFT go?).

  .venv/bin/python scripts/ttft_layers.py [--n 20] [--phase engine|node|both]

engine phase (one process, one vLLM instance): (1) AsyncLLM.generate directly, (2) VllmEngine.generate, alternated.
node phase (start_node tiny-vllm.yaml, engine=vllm): (3) the worker's gRPC API called the way the router calls it
(one Attach session, Generate with the session id; first token on the session), (4) through the router (client
stream), alternated. Every request: a fresh random 256-token prompt (no prefix-cache hit), 16 tokens, greedy,
ignore_eos, one at a time with a 0.5 s gap (the isolated probe of bench_vllm_vs_octoserve.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL_DIR = Path("/tmp/octoserve-tiny-llama")
MODEL_NAME = "tiny-llama"
CONFIG = REPO_ROOT / "services" / "configs" / "tiny-vllm.yaml"
PROMPT_LEN, OUT_LEN, GAP_S = 256, 16, 0.5


def prompts(seed: int, n: int) -> list[tuple[int, ...]]:
    rng = random.Random(seed)
    return [tuple(rng.randrange(3, 4000) for _ in range(PROMPT_LEN)) for _ in range(n)]


def summary(name: str, xs: list[float]) -> str:
    ms = sorted(x * 1000 for x in xs)
    p95 = ms[min(len(ms) - 1, int(0.95 * len(ms)))]
    return f"{name:<34} n={len(ms):3d}  P50 {statistics.median(ms):6.1f} ms  mean {statistics.mean(ms):6.1f}  " \
           f"min {ms[0]:6.1f}  P95 {p95:6.1f}"


async def engine_phase(n: int) -> None:
    from octoserve.services.core.types import RequestSpec, SamplingParams
    from octoserve.services.engine.vllm_engine import VllmEngine, _tokens, vllm_priority, vllm_sampling_params
    from octoserve.services.core.types import Role

    eng = VllmEngine("probe-0", MODEL_NAME, str(MODEL_DIR), Role.COLOCATED, max_model_len=1024, max_num_seqs=16,
                     max_num_batched_tokens=1024, enable_prefix_caching=True, kv_cache_space_gib=1.0, dtype="float32")
    await eng.start()
    try:
        raw, adapter = [], []
        for i, p in enumerate(prompts(1, 2 * n + 4)):
            spec = RequestSpec(request_id=f"r{i}", model=MODEL_NAME, prompt_token_ids=p,
                               sampling=SamplingParams(max_tokens=OUT_LEN, ignore_eos=True), arrival_s=time.monotonic())
            t0 = time.perf_counter()
            first = None
            if i % 2 == 0:
                params = vllm_sampling_params(spec.sampling)
                async for out in eng._llm.generate(_tokens(p), params, spec.request_id,
                                                   priority=vllm_priority(spec, 1000.0)):
                    if first is None and out.outputs[0].token_ids:
                        first = time.perf_counter() - t0
                (raw if i >= 4 else []).append(first)
            else:
                async for out in eng.generate(spec):
                    if first is None and out.new_token_ids:
                        first = time.perf_counter() - t0
                (adapter if i >= 4 else []).append(first)
            await asyncio.sleep(GAP_S)
        print(summary("(1) AsyncLLM.generate in-process", raw))
        print(summary("(2) VllmEngine.generate in-process", adapter))
    finally:
        await eng.stop()


class DirectWorker:
    def __init__(self, address: str) -> None:
        import grpc
        from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc

        self.channel = grpc.aio.insecure_channel(address)
        self.stub = w_grpc.WorkerStub(self.channel)
        self.session_id = uuid.uuid4().hex
        self.first: dict[str, float] = {}
        self.done: dict[str, asyncio.Event] = {}
        self.attached = asyncio.Event()
        self.task = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self._attach())
        await asyncio.wait_for(self.attached.wait(), 10.0)

    async def _attach(self) -> None:
        from octoserve.services.rpc.gen import worker_pb2 as w_pb

        async for batch in self.stub.Attach(w_pb.AttachRequest(session_id=self.session_id)):
            now = time.monotonic()
            if batch.seq == 0:
                self.attached.set()
            for d in batch.deltas:
                if d.token_ids and d.request_id not in self.first:
                    self.first[d.request_id] = now
                if d.finish_reason and d.request_id in self.done:
                    self.done[d.request_id].set()

    async def ttft_s(self, prompt) -> float:
        from octoserve.client import build_request
        from octoserve.services.rpc import convert
        from octoserve.services.rpc.gen import worker_pb2 as w_pb

        rid = uuid.uuid4().hex
        public = build_request(MODEL_NAME, list(prompt), max_tokens=OUT_LEN, ignore_eos=True)
        self.done[rid] = asyncio.Event()
        t0 = time.monotonic()
        spec = convert.spec_from_public(public, rid, time.monotonic())
        await self.stub.Generate(w_pb.WorkerGenerateRequest(session_id=self.session_id, spec=convert.spec_to_pb(spec)),
                                 timeout=30.0)
        await asyncio.wait_for(self.done[rid].wait(), 30.0)
        del self.done[rid]
        if os.environ.get("TTFT_LAYERS_STAGE_LOG"):  # client-side stamps, to line up with a worker-side probe
            os.makedirs(os.path.dirname(os.path.abspath(os.environ["TTFT_LAYERS_STAGE_LOG"])), exist_ok=True)
            with open(os.environ["TTFT_LAYERS_STAGE_LOG"], "a") as f:
                f.write(f"{rid} send {t0:.6f}\n{rid} client_first {self.first[rid]:.6f}\n")
        return self.first.pop(rid) - t0

    async def close(self) -> None:
        self.task.cancel()
        await self.channel.close()


async def router_ttft_s(client, prompt) -> float | None:
    """One isolated request through the router with the SDK (`client`: an AsyncClient): seconds from the call to
    the first chunk with tokens, None if none came; the stream is read to its end."""
    t0, first = time.perf_counter(), None
    async for chunk in client.generate(MODEL_NAME, list(prompt), max_tokens=OUT_LEN, ignore_eos=True, timeout_s=30.0):
        if first is None and chunk.token_ids:
            first = time.perf_counter() - t0
    return first


async def node_ttfts(node, n: int) -> tuple[list[float], list[float]]:
    """TTFTs (s) of `n` requests sent straight to the worker's gRPC API and `n` through the router, alternately
    (the first two of each kind dropped)."""
    from octoserve.client import AsyncClient

    direct = DirectWorker(node.workers["tiny-0"].address)
    await direct.start()
    client = AsyncClient(node.router_address)
    worker_t, router_t = [], []
    try:
        for i, p in enumerate(prompts(2, 2 * n + 4)):
            if i % 2 == 0:
                t = await direct.ttft_s(p)
                (worker_t if i >= 4 else []).append(t)
            else:
                first = await router_ttft_s(client, p)
                (router_t if i >= 4 else []).append(first)
            await asyncio.sleep(GAP_S)
    finally:
        await direct.close()
        await client.close()
    return worker_t, router_t


async def node_probe(node, n: int) -> None:
    worker_t, router_t = await node_ttfts(node, n)
    print(summary("(3) worker gRPC (Attach+Generate)", worker_t))
    print(summary("(4) router (client stream)", router_t))


def _cpu_s(pid: int) -> float:
    """CPU seconds of a process and its descendants (vLLM's engine core and model worker are children)."""
    total = 0.0
    pids = [pid]
    while pids:
        p = pids.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
            for t in Path(f"/proc/{p}/task").iterdir():
                kids = (t / "children").read_text().split()
                pids.extend(int(k) for k in kids)
        except (FileNotFoundError, ProcessLookupError):
            pass
    return total


def _affinity(pid: int) -> str:
    """Allowed CPUs of a process and its descendants' threads (vLLM pins its OpenMP threads)."""
    out, pids = [], [pid]
    while pids:
        p = pids.pop()
        try:
            allowed = {(t / "status").read_text().split("Cpus_allowed_list:")[1].split()[0]
                       for t in Path(f"/proc/{p}/task").iterdir()}
            out.append(f"{p}:{'/'.join(sorted(allowed))}")
            for t in Path(f"/proc/{p}/task").iterdir():
                pids.extend(int(k) for k in (t / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError, IndexError):
            pass
    return " ".join(out)


def idle_cpu(node, window_s: float = 10.0) -> None:
    """CPU the idle node burns (load reports, polling): wake-ups that compete with the engine on 2 cores."""
    procs = {"router": node.router, "scheduler": node.scheduler, **{f"worker {k}": v for k, v in node.workers.items()}}
    for k, v in procs.items():
        print(f"cpus allowed {k:<16} {_affinity(v.proc.pid)}", flush=True)
    before = {k: _cpu_s(v.proc.pid) for k, v in procs.items()}
    time.sleep(window_s)
    for k, v in procs.items():
        print(f"idle CPU {k:<16} {(_cpu_s(v.proc.pid) - before[k]) / window_s * 100:5.1f} % of a core", flush=True)


def node_phase(n: int) -> None:
    from octoserve.services.node.launcher import start_node

    node = start_node(str(CONFIG), engine="vllm", model_path=str(MODEL_DIR),
                      run_dir=tempfile.mkdtemp(prefix="ttft-layers-"), startup_timeout_s=300,
                      extra_env={"OCTOSERVE_VLLM_DTYPE": "float32", "HF_HUB_OFFLINE": "1",
                                 "VLLM_CPU_KVCACHE_SPACE": "1"})
    try:
        idle_cpu(node)
        asyncio.run(node_probe(node, n))
    finally:
        node.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=20)
    ap.add_argument("--phase", choices=("engine", "node", "both"), default="both")
    args = ap.parse_args()
    if not MODEL_DIR.exists():
        from octoserve.services.engine.test_model import build_test_model
        build_test_model(MODEL_DIR)
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    if args.phase in ("engine", "both"):
        asyncio.run(engine_phase(args.n))
    if args.phase in ("node", "both"):
        node_phase(args.n)
    print(f"load average {os.getloadavg()[0]:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
