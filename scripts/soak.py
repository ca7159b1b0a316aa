"""Soak test of the live node: hours-scale overload with cancels, bursts and worker kills; nothing may grow or be lost.

    python scripts/soak.py [--minutes 30] [--time-scale 10] [--capacity-rps 3.8] [--overload 10] [--out docs/bench/soak]

Starts the whole node (`start_node`: scheduler, one sim-engine worker process per instance, router, all on
127.0.0.1) and drives it open-loop with the seed-000 mix at `overload` x the SLO capacity (modelled req/s), plus:
- random client cancels (a fraction of requests is cancelled at a random moment of its stream),
- bursts (`--burst-size` requests at once every `--burst-every-s`),
- a worker SIGKILL every `--kill-every-s` (a random worker). The launcher's supervisor restarts it when the
  launcher supervises its services (`--restart launcher`, and `--restart auto`, the default: the node is started with
  its supervisor, as `octoserve up` does); `--restart soak`: the script restarts it on the same port itself;
  `--restart none` kills nothing.
Every `--sample-s` it records, per service: RSS (from /proc), live asyncio tasks (`octoserve_asyncio_tasks`), the
router's in-flight requests, the client's open streams, KV blocks in use per worker (GetLoad), and per-minute SLO
attainment; at the end it writes PNG plots, samples.csv and summary.json under `--out`.

Pass:
- every request ends with a status: a finished stream, or a gRPC status code (RESOURCE_EXHAUSTED with a retry hint,
  UNAVAILABLE after a kill, our own cancel, ...). A stream that ends OK without a finish reason, or that is still
  open at the client's deadline, is LOST;
- no series grows without bound: the mean of the last third of the run is within `--growth-tolerance` (plus a
  small absolute slack) of the mean of the middle third;
- once the load stops, the node returns to idle: no request in flight at the router, every KV block free.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from octoserve.services.lab.agreement import cap_outputs
from octoserve.services.node.launcher import Node, start_node
from octoserve.services.node.processes import wait_healthy
from octoserve.services.rpc.convert import PRIORITY_TO_PB, SIM_OUTPUT_LEN_KEY
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc
from octoserve.services.rpc.status import RETRY_AFTER_MS_KEY
from octoserve.services.workload import PROFILES, TraceRequest, generate_trace, scaled
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc

# Octoserve's measured SLO capacity on the seed-000 mix (BENCHMARKS.md, policy comparison, default profile).
DEFAULT_CAPACITY_RPS = 3.8
REQUEST_TIMEOUT_S = 600.0  # the client's deadline: a stream still open then counts as LOST
RSS_SLACK_MIB = 24.0
TASK_SLACK = 64.0


@dataclass
class Outcome:
    arrival_s: float
    model: str
    ttft_slo_ms: float
    status: str = "PENDING"  # OK (finished), a gRPC code name, CANCELLED_BY_CLIENT, LOST
    ttft_s: float | None = None
    tokens: int = 0
    retry_hint: bool = False
    detail: str = ""


@dataclass
class Samples:
    t_s: list[float] = field(default_factory=list)
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    def add(self, group: str, name: str, t: float, value: float) -> None:
        self.series.setdefault(f"{group}/{name}", []).append((t, value))

    def group(self, group: str) -> dict[str, list[tuple[float, float]]]:
        return {k.split("/", 1)[1]: v for k, v in self.series.items() if k.startswith(group + "/")}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--minutes", type=float, default=30.0, help="wall-clock length of the traffic phase")
    p.add_argument("--time-scale", type=float, default=10.0, help="wall seconds per modelled second")
    p.add_argument("--config", default=None, help="node config YAML (default: the embedded placement)")
    p.add_argument("--capacity-rps", type=float, default=DEFAULT_CAPACITY_RPS, help="SLO capacity, modelled req/s")
    p.add_argument("--overload", type=float, default=10.0, help="traffic = overload x capacity")
    p.add_argument("--max-output", type=int, default=128, help="cap on true output lengths")
    p.add_argument("--cancel-frac", type=float, default=0.1, help="fraction of requests the client cancels")
    p.add_argument("--burst-every-s", type=float, default=60.0)
    p.add_argument("--burst-size", type=int, default=200)
    p.add_argument("--kill-every-s", type=float, default=180.0)
    p.add_argument("--restart", choices=("auto", "soak", "launcher", "none"), default="auto",
                   help="who restarts a killed worker; auto: the launcher when it supervises its services, else soak")
    p.add_argument("--sample-s", type=float, default=5.0)
    p.add_argument("--channels", type=int, default=4)
    p.add_argument("--growth-tolerance", type=float, default=0.15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="docs/bench/soak")
    p.add_argument("--run-dir", default=None, help="service logs (default: a temp dir)")
    return p.parse_args(argv)


# ---- traffic ------------------------------------------------------------------------------------------------------


async def one_request(stub, req: TraceRequest, t0: float, out: Outcome, cancel_after_s: float | None,
                      rid: str) -> None:
    msg = gen_pb.GenerateRequest(model=req.model, token_ids=gen_pb.TokenIds(ids=req.prompt_token_ids),
                                 max_tokens=req.max_tokens, priority=PRIORITY_TO_PB[req.priority],
                                 ttft_slo_ms=round(req.ttft_slo_ms), request_id=rid)
    call = stub.Generate(msg, metadata=((SIM_OUTPUT_LEN_KEY, str(req.output_len)),), timeout=REQUEST_TIMEOUT_S)
    canceller = None
    if cancel_after_s is not None:
        canceller = asyncio.get_running_loop().call_later(cancel_after_s, call.cancel)
    finished = False
    try:
        async for resp in call:
            if out.ttft_s is None and resp.token_ids:
                out.ttft_s = time.monotonic() - t0 - out.arrival_s
            out.tokens += len(resp.token_ids)
            if resp.finish_reason:
                finished = True
        code = await call.code()
    except asyncio.CancelledError:
        out.status = "CANCELLED_BY_CLIENT" if call.cancelled() else "LOST"
        if not call.cancelled():
            raise
        return
    except grpc.aio.AioRpcError as e:
        code = e.code()
        out.detail = e.details() or ""
    finally:
        if canceller is not None:
            canceller.cancel()
    if call.cancelled() and cancel_after_s is not None:
        out.status = "CANCELLED_BY_CLIENT"
    elif code == grpc.StatusCode.OK:
        out.status = "OK" if finished else "LOST"
    elif code == grpc.StatusCode.DEADLINE_EXCEEDED:
        out.status = "LOST"  # still open at the client's (generous) deadline: a hang
    else:
        out.status = code.name
        if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            trailers = await call.trailing_metadata()
            out.retry_hint = any(k == RETRY_AFTER_MS_KEY for k, _ in (trailers or ()))


class Traffic:
    def __init__(self, args, address: str, t0: float) -> None:
        self.args = args
        self.t0 = t0
        self.rng = random.Random(args.seed)
        self.channels = [grpc.aio.insecure_channel(address, options=(("grpc.use_local_subchannel_pool", 1),))
                         for _ in range(args.channels)]
        self.stubs = [gen_grpc.GenerationStub(c) for c in self.channels]
        self.outcomes: list[Outcome] = []
        self.tasks: set[asyncio.Task] = set()
        self._n = 0

    def send(self, req: TraceRequest) -> None:
        now = time.monotonic() - self.t0
        out = Outcome(now, req.model, req.ttft_slo_ms)
        self.outcomes.append(out)
        cancel = None
        if self.rng.random() < self.args.cancel_frac:
            cancel = self.rng.uniform(0.0, 2.0 * self.args.time_scale)  # up to 2 modelled seconds in
        self._n += 1
        stub = self.stubs[self._n % len(self.stubs)]
        task = asyncio.create_task(one_request(stub, req, self.t0, out, cancel, f"soak-{self._n}"))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def run(self, trace: list[TraceRequest], pool: list[TraceRequest], stop_s: float) -> None:
        scale = self.args.time_scale
        next_burst = self.args.burst_every_s
        for req in trace:
            at = req.arrival_s * scale
            if at > stop_s:
                break
            while next_burst <= at:  # bursts interleave with the trace on the wall clock
                await self._sleep_until(next_burst)
                for _ in range(self.args.burst_size):
                    self.send(self.rng.choice(pool))
                next_burst += self.args.burst_every_s
            await self._sleep_until(at)
            self.send(req)

    async def _sleep_until(self, at_s: float) -> None:
        delay = at_s - (time.monotonic() - self.t0)
        if delay > 0:
            await asyncio.sleep(delay)

    async def drain(self, timeout_s: float) -> None:
        if self.tasks:
            await asyncio.wait(list(self.tasks), timeout=timeout_s)
        for task in list(self.tasks):
            task.cancel()
        for c in self.channels:
            await c.close()


# ---- faults -------------------------------------------------------------------------------------------------------


def restart_worker(node: Node, iid: str, deadline_s: float = 60.0) -> None:
    """Start a killed worker again with the same command on the same port, so the router's channel reconnects."""
    sp = node.workers[iid]
    sp.proc.wait()
    sp.ready_file.unlink(missing_ok=True)
    cmd = [*sp.proc.args, "--port", str(sp.port)]
    env = {**os.environ, "OCTOSERVE_LAUNCHER_PID": str(os.getpid())}
    with open(sp.log_file, "ab") as log_f:
        sp.proc = subprocess.Popen(cmd, cwd=Path(__file__).resolve().parents[1], env=env, stdout=log_f,
                                   stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + deadline_s
    while not sp.ready_file.exists():
        if sp.proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"worker {iid} did not restart; see {sp.log_file}")
        time.sleep(0.05)
    sp.metrics_port = json.loads(sp.ready_file.read_text())["metrics_port"]
    wait_healthy(sp.address, deadline)


async def kill_loop(node: Node, args, rng: random.Random, t0: float, stop_s: float, kills: list) -> None:
    if args.restart == "none":
        return
    while True:
        await asyncio.sleep(args.kill_every_s)
        if time.monotonic() - t0 > stop_s:
            return
        iid = rng.choice(sorted(node.workers))
        sp = node.workers[iid]
        os.kill(sp.pid, signal.SIGKILL)  # this worker's own PID only
        t_kill = time.monotonic() - t0
        if args.restart == "soak":
            await asyncio.to_thread(restart_worker, node, iid)
        else:
            await asyncio.to_thread(_wait_relaunched, node, iid, sp.pid)
        kills.append({"t_s": round(t_kill, 1), "instance": iid, "back_after_s": round(time.monotonic() - t0 - t_kill, 2)})
        print(f"[{t_kill:7.0f} s] killed {iid}; serving again after {kills[-1]['back_after_s']} s", file=sys.stderr,
              flush=True)


def _wait_relaunched(node: Node, iid: str, old_pid: int, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    sp = node.workers[iid]
    while (sp.pid == old_pid or not sp.ready_file.exists()) and time.monotonic() < deadline:
        time.sleep(0.2)
    sp.metrics_port = json.loads(sp.ready_file.read_text())["metrics_port"]
    wait_healthy(sp.address, deadline)


# ---- sampling -----------------------------------------------------------------------------------------------------


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return float("nan")


def scrape(port: int | None, names: tuple[str, ...]) -> dict[str, float]:
    if not port:
        return {}
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2.0).read().decode()
    except OSError:
        return {}
    found = {}
    for line in text.splitlines():
        for name in names:
            if line.startswith(name + " ") or line.startswith(name + "{"):
                found[name] = found.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return found


async def kv_in_use(node: Node) -> dict[str, float]:
    used = {}
    for iid, sp in node.workers.items():
        try:
            async with grpc.aio.insecure_channel(sp.address) as ch:
                load = await w_grpc.WorkerStub(ch).GetLoad(w_pb.GetLoadRequest(), timeout=2.0)
            used[iid] = float(load.num_total_blocks - load.num_free_blocks)
        except grpc.aio.AioRpcError:
            used[iid] = float("nan")  # down (just killed)
    return used


async def sample(node: Node, traffic: Traffic, samples: Samples, t0: float) -> None:
    t = round(time.monotonic() - t0, 1)
    samples.t_s.append(t)
    for sp in node.processes:
        samples.add("rss_mib", sp.name, t, rss_mib(sp.pid))
        m = await asyncio.to_thread(scrape, sp.metrics_port, ("octoserve_asyncio_tasks", "octoserve_router_in_flight_requests",
                                                              "octoserve_router_hung_workers_total"))
        samples.add("asyncio_tasks", sp.name, t, m.get("octoserve_asyncio_tasks", float("nan")))
        if sp is node.router:
            samples.add("streams", "router in flight", t, m.get("octoserve_router_in_flight_requests", float("nan")))
            samples.add("router", "workers declared hung", t, m.get("octoserve_router_hung_workers_total", 0.0))
    samples.add("streams", "client open", t, float(len(traffic.tasks)))
    samples.add("asyncio_tasks", "soak client", t, float(len(asyncio.all_tasks())))
    for iid, used in (await kv_in_use(node)).items():
        samples.add("kv_blocks_in_use", iid, t, used)


async def sample_loop(node, traffic, samples, t0, every_s: float) -> None:
    while True:
        await sample(node, traffic, samples, t0)
        await asyncio.sleep(every_s)


# ---- verdicts -----------------------------------------------------------------------------------------------------


def growth(points: list[tuple[float, float]], tolerance: float, slack: float) -> dict:
    """Mean of the middle third vs the last third (NaN samples, e.g. a worker just killed, skipped), and the
    least-squares slope of the last third per minute (reported: a series can pass the means and still climb)."""
    pts = [(t, v) for t, v in points if v == v]
    n = len(pts)
    if n < 6:
        return {"middle": None, "last": None, "last_third_slope_per_min": None, "bounded": True}
    vals = [v for _, v in pts]
    mid, last = statistics.fmean(vals[n // 3: 2 * n // 3]), statistics.fmean(vals[2 * n // 3:])
    tail = pts[2 * n // 3:]
    slope = statistics.linear_regression([t for t, _ in tail], [v for _, v in tail]).slope * 60.0
    return {"middle": round(mid, 2), "last": round(last, 2), "last_third_slope_per_min": round(slope, 3),
            "bounded": last <= mid * (1 + tolerance) + slack}


def attainment_per_minute(outcomes: list[Outcome], time_scale: float) -> dict[str, list[tuple[float, float]]]:
    bins: dict[int, list[Outcome]] = {}
    for o in outcomes:
        bins.setdefault(int(o.arrival_s // 60), []).append(o)
    admitted, offered = [], []
    for minute, group in sorted(bins.items()):
        ok = [o for o in group if o.status == "OK" and o.ttft_s is not None and
              o.ttft_s / time_scale * 1000.0 <= o.ttft_slo_ms]
        served = [o for o in group if o.status == "OK"]
        t = minute * 60.0 + 30.0
        admitted.append((t, len(ok) / len(served) if served else float("nan")))
        offered.append((t, len(ok) / len(group)))
    return {"of served (TTFT within SLO)": admitted, "of all sent": offered}


async def main_async(args) -> int:
    from octoserve.services.plots import plot_timeseries

    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    stop_s = args.minutes * 60.0
    rate = args.capacity_rps * args.overload
    profile = scaled(PROFILES["seed-000"], rate_rps=rate, duration_s=stop_s / args.time_scale + 1.0)
    trace = cap_outputs(generate_trace(profile, args.seed), args.max_output)
    pool = cap_outputs(generate_trace(scaled(profile, duration_s=20.0), args.seed + 1), args.max_output)
    print(f"starting the node (time scale {args.time_scale:g}x); {len(trace)} trace requests at {rate:g} req/s "
          f"modelled ({rate / args.time_scale:.2f}/s wall) + {args.burst_size} every {args.burst_every_s:g} s, "
          f"{args.minutes:g} min", file=sys.stderr, flush=True)
    node = await asyncio.to_thread(start_node, args.config, args.time_scale, run_dir=args.run_dir,
                                   supervise=args.restart in ("auto", "launcher"))
    if args.restart == "auto":
        args.restart = "launcher" if getattr(node, "supervisor", None) is not None else "soak"
    rng = random.Random(args.seed + 2)
    t0 = time.monotonic()
    traffic = Traffic(args, node.router_address, t0)
    samples, kills = Samples(), []
    sampler = asyncio.create_task(sample_loop(node, traffic, samples, t0, args.sample_s))
    killer = asyncio.create_task(kill_loop(node, args, rng, t0, stop_s, kills))
    reporter = asyncio.create_task(_report_loop(traffic, t0))
    try:
        await traffic.run(trace, pool, stop_s)
        await asyncio.sleep(max(0.0, stop_s - (time.monotonic() - t0)))
        killer.cancel()
        await traffic.drain(timeout_s=args.max_output * 0.1 * args.time_scale + 60.0)
        await asyncio.sleep(2.0)  # let the workers' TTLs and the router's cleanup RPCs land
        await sample(node, traffic, samples, t0)  # the idle sample after the load
    finally:
        for task in (sampler, killer, reporter):
            task.cancel()
        codes = await asyncio.to_thread(node.stop)

    statuses: dict[str, int] = {}
    for o in traffic.outcomes:
        statuses[o.status] = statuses.get(o.status, 0) + 1
    refused = [o for o in traffic.outcomes if o.status == "RESOURCE_EXHAUSTED"]
    examples: dict[str, list[str]] = {}
    for o in traffic.outcomes:
        if o.detail and len(examples.setdefault(o.status, [])) < 3 and o.detail not in examples[o.status]:
            examples[o.status].append(o.detail)
    idle = {k: v[-1][1] for k, v in samples.group("kv_blocks_in_use").items()}
    router_idle = samples.group("streams")["router in flight"][-1][1]
    growths = {}
    for group, slack in (("rss_mib", RSS_SLACK_MIB), ("asyncio_tasks", TASK_SLACK)):
        for name, pts in samples.group(group).items():
            growths[f"{group}/{name}"] = growth(pts[:-1], args.growth_tolerance, slack)
    lost = statuses.get("LOST", 0) + statuses.get("PENDING", 0)
    verdict = {
        "lost": lost,
        "refusals_without_hint": sum(1 for o in refused if not o.retry_hint),
        "unbounded": sorted(k for k, g in growths.items() if not g["bounded"]),
        "kv_in_use_at_idle": idle,
        "router_in_flight_at_idle": router_idle,
        # the router's hang watchdog (a restarted router counts from 0 again); every kill here is a SIGKILL, so a
        # declaration would be a worker the router found silent under load
        "router_hung_declarations": max((v for _, v in samples.group("router").get("workers declared hung", [])),
                                        default=0.0),
    }
    passed = (lost == 0 and not verdict["unbounded"] and verdict["refusals_without_hint"] == 0
              and all(v == 0 for v in idle.values()) and router_idle == 0)
    summary = {"args": {k: v for k, v in vars(args).items() if k != "run_dir"},  # no machine paths in results
               "requests": len(traffic.outcomes), "statuses": statuses, "examples": examples, "kills": kills,
               "growth": growths, "verdict": verdict, "passed": passed, "exit_codes": codes,
               "supervisor_events": [{"t_s": round(e.at_s - t0, 1), "service": e.service, "event": e.event,
                                      "detail": e.detail} for e in (node.supervisor.events if node.supervisor else ())]}
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    _write_csv(out_dir / "samples.csv", samples)
    for group, ylabel in (("rss_mib", "RSS (MiB)"), ("asyncio_tasks", "asyncio tasks"),
                          ("streams", "open streams"), ("kv_blocks_in_use", "KV blocks in use")):
        plot_timeseries(samples.group(group), out_dir / f"{group}.png", ylabel)
    plot_timeseries(attainment_per_minute(traffic.outcomes, args.time_scale), out_dir / "attainment.png",
                    "TTFT SLO attainment per minute")
    print(json.dumps({k: summary[k] for k in ("requests", "statuses", "examples", "kills", "verdict", "passed")}, indent=2,
                     default=str))
    return 0 if passed else 1


async def _report_loop(traffic: Traffic, t0: float) -> None:
    while True:
        await asyncio.sleep(60.0)
        counts: dict[str, int] = {}
        for o in traffic.outcomes:
            counts[o.status] = counts.get(o.status, 0) + 1
        print(f"[{time.monotonic() - t0:7.0f} s] sent {len(traffic.outcomes)}, open {len(traffic.tasks)}: {counts}",
              file=sys.stderr, flush=True)


def _write_csv(path: Path, samples: Samples) -> None:
    names = sorted(samples.series)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["t_s", *names])
        for i, t in enumerate(samples.t_s):
            w.writerow([t, *(samples.series[n][i][1] if i < len(samples.series[n]) else "" for n in names)])


def main(argv=None) -> int:
    return asyncio.run(main_async(parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
