"""The cluster tier live on one machine: N node stacks (sim engine, dilated) behind the picker service.

    python -m octoserve.services.cluster.live [--nodes 2] [--rate 6] [--duration 10] [--time-scale 20]
        [--kill-at 5] [--json F]

Starts N whole nodes (`launcher.start_node`, each on its own free ports) and the picker
(`python -m octoserve.services.cluster`) polling their routers, then replays one trace: for each request the
harness asks the picker (lookaside, `service.pick_node`) and streams it from the node it names, with the same
records as `octoserve bench` (latencies divided by the time scale). The same trace runs in the cluster simulator
(services/cluster/sim.py); `agreement.Agreement` puts both summaries side by side (goodput, TTFT P95, ITL P95,
±15 %).

`--kill-at T` instead kills node 0's router (SIGKILL, by PID) T modelled seconds into the run and reports: every
request in flight on it ends with a status (UNAVAILABLE, which the SDK treats as retryable), none without one; and
the recovery time, in real seconds from the kill to the last pick that still named node 0 (every later pick goes
to the live node).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

from octoserve.client import AsyncClient
from octoserve.services import launcher
from octoserve.services.agreement import Agreement, cap_outputs
from octoserve.services.cluster.service import pick_node
from octoserve.services.loadgen import BenchOptions, _send
from octoserve.services.metrics import SloSpec, summarize
from octoserve.services.rpc.status import retry_after_ms_from
from octoserve.services.workload import PROFILES, TraceRequest, generate_trace, scaled


@dataclass
class LiveCluster:
    nodes: list[launcher.Node]
    picker: launcher.ServiceProcess

    @property
    def picker_address(self) -> str:
        return self.picker.address

    def stop(self) -> None:
        launcher._stop_group([self.picker], 2.0)
        for node in self.nodes:
            node.stop()


def start_cluster(num_nodes: int, time_scale: float, *, config=None, startup_timeout_s: float = 180.0) -> LiveCluster:
    nodes: list[launcher.Node] = []
    try:
        for _ in range(num_nodes):
            nodes.append(launcher.start_node(config, time_scale, startup_timeout_s=startup_timeout_s, grace_s=3.0))
        run_dir = Path(tempfile.mkdtemp(prefix="octoserve-picker-"))
        env = {**os.environ, launcher.LAUNCHER_PID_ENV: str(os.getpid()),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(launcher.REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        args = ["--nodes", ",".join(n.router_address for n in nodes), "--port", "0", "--poll-s", "0.1"]
        if isinstance(config, (str, Path)):
            args += ["--config", str(config)]
        picker = launcher._spawn("picker", "octoserve.services.cluster", args, run_dir, env)
        deadline = time.monotonic() + 60.0
        launcher._wait_ready(picker, deadline)
        launcher.wait_healthy(picker.address, deadline)
    except BaseException:
        for node in nodes:
            node.stop()
        raise
    return LiveCluster(nodes, picker)


@dataclass(frozen=True, slots=True)
class Pick:
    request_id: str
    node: str | None  # None: the picker refused
    sent_s: float  # real seconds from the start


async def replay(cluster: LiveCluster, trace: Sequence[TraceRequest], time_scale: float, *, drain_timeout_s: float,
                 kill_at_s: float | None = None):
    """Every request via the picker to its node; returns (records in trace order, picks, kill time or None)."""
    options = BenchOptions(time_scale=time_scale, drain_timeout_s=drain_timeout_s)
    clients = {n.router_address: AsyncClient(n.router_address) for n in cluster.nodes}
    records: list = [None] * len(trace)
    picks: list[Pick] = []
    tasks = []
    killed_s: list[float] = []
    loop = asyncio.get_running_loop()
    t0 = time.monotonic()

    async def one(index: int, req: TraceRequest) -> None:
        sent = time.monotonic() - t0
        try:
            chosen = await pick_node(picker_channel, req.model, req.prompt_token_ids, priority=req.priority.name,
                                     max_tokens=req.max_tokens)
        except grpc.aio.AioRpcError as e:
            picks.append(Pick(req.request_id, None, sent))
            records[index] = req.record(arrival_s=sent / time_scale, refused=True, retry_after_ms=retry_after_ms_from(e),
                                        error="" if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else e.code().name)
            return
        picks.append(Pick(req.request_id, chosen["node"], sent))
        await _send(clients[chosen["node"]], req, t0, options, records, index)

    async with grpc.aio.insecure_channel(cluster.picker_address) as picker_channel:
        for i, req in enumerate(trace):
            send_at = t0 + req.arrival_s * time_scale
            if kill_at_s is not None and not killed_s and send_at >= t0 + kill_at_s * time_scale:
                while (delay := t0 + kill_at_s * time_scale - time.monotonic()) > 0:
                    await asyncio.sleep(delay)
                os.kill(cluster.nodes[0].router.pid, signal.SIGKILL)  # the process this harness started, by PID
                killed_s.append(time.monotonic() - t0)
            while (delay := send_at - time.monotonic()) > 0:
                await asyncio.sleep(delay)
            tasks.append(loop.create_task(one(i, req)))
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=drain_timeout_s)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
    await asyncio.gather(*(c.close() for c in clients.values()))
    return records, picks, (killed_s[0] if killed_s else None)


def recovery_s(picks: Sequence[Pick], dead: str, killed_s: float) -> float | None:
    """Real seconds from the kill to the last pick that still named the dead node (0 if none did after it); None if
    picks to it never stopped. Real, not modelled: the picker notices a dead node on the wall clock."""
    after = sorted((p for p in picks if p.sent_s >= killed_s), key=lambda p: p.sent_s)
    to_dead = [p for p in after if p.node == dead]
    if to_dead and to_dead[-1] is after[-1]:
        return None
    return to_dead[-1].sent_s - killed_s if to_dead else 0.0


def main(argv: list[str] | None = None) -> int:
    from octoserve.services.cluster.sim import ClusterSimulator
    from octoserve.services.config import load_node_config

    parser = argparse.ArgumentParser(prog="python -m octoserve.services.cluster.live", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rate", type=float, default=6.0, help="modelled req/s for the whole cluster")
    parser.add_argument("--duration", type=float, default=10.0, help="modelled seconds of arrivals")
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--max-output", type=int, default=64, help="cap on true output lengths (wall time)")
    parser.add_argument("--kill-at", type=float, default=None, help="modelled s: kill node 0's router then")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    profile = scaled(PROFILES["seed-000"], rate_rps=args.rate, duration_s=args.duration)
    trace = cap_outputs(generate_trace(profile, 0), args.max_output)
    slo = profile.slo
    config = load_node_config(None)
    virtual = ClusterSimulator(config, args.nodes).run(trace)
    print(f"[live] simulated: goodput {virtual.summary.overall.goodput_rps:.2f} req/s; starting {args.nodes} nodes",
          file=sys.stderr, flush=True)
    cluster = start_cluster(args.nodes, args.time_scale)
    try:
        print("[live] nodes and picker up; replaying", file=sys.stderr, flush=True)
        records, picks, killed_s = asyncio.run(replay(cluster, trace, args.time_scale,
                                                      drain_timeout_s=60.0 + args.max_output * 0.05 * args.time_scale,
                                                      kill_at_s=args.kill_at))
    finally:
        cluster.stop()
    out: dict = {}
    if killed_s is None:
        agreement = Agreement(summarize(records, slo, args.duration, warmup_s=virtual.summary.window.start_s),
                              virtual.summary)
        print(agreement.table())
        out = {"differences": agreement.relative_differences(), "within": agreement.within()}
        print(f"agreement within ±15 %: {'yes' if agreement.within() else 'NO'}")
    else:
        dead = cluster.nodes[0].router_address
        node_of = {p.request_id: p.node for p in picks}
        on_dead = [r for r in records if r is not None and node_of.get(r.request_id) == dead]
        no_status = sum(1 for r in records if r is None)
        errors = sorted({r.error.split(":")[0] for r in on_dead if r.error})
        rec = recovery_s(picks, dead, killed_s)
        print(f"killed {dead} at {killed_s / args.time_scale:.2f} modelled s; requests to it: {len(on_dead)}, "
              f"statuses of the failed ones: {errors}; requests without a status: {no_status}; "
              f"recovery (last pick to the dead node after the kill): {rec} s (real time)")
        out = {"killed_at_s": killed_s / args.time_scale, "recovery_s": rec, "no_status": no_status, "errors": errors}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
