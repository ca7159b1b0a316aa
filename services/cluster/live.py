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
import dataclasses
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
from octoserve.services.node import launcher, processes
from octoserve.services.lab.agreement import Agreement, cap_outputs
from octoserve.services.cluster.service import pick_node
from octoserve.services.loadgen import BenchOptions, send_request
from octoserve.services.metrics import summarize
from octoserve.services.rpc.server import LAUNCHER_PID_ENV
from octoserve.services.rpc.status import retry_after_ms_from
from octoserve.services.workload import PROFILES, TraceRequest, generate_trace, scaled


@dataclass
class LiveCluster:
    nodes: list[launcher.Node]
    picker: processes.ServiceProcess

    @property
    def picker_address(self) -> str:
        return self.picker.address

    def stop(self) -> None:
        processes.stop_group([self.picker], 2.0)
        for node in self.nodes:
            node.stop()


def start_cluster(num_nodes: int, time_scale: float, *, config=None, startup_timeout_s: float = 180.0) -> LiveCluster:
    nodes: list[launcher.Node] = []
    try:
        for _ in range(num_nodes):
            nodes.append(launcher.start_node(config, time_scale, startup_timeout_s=startup_timeout_s, grace_s=3.0))
        run_dir = Path(tempfile.mkdtemp(prefix="octoserve-picker-"))
        env = {**os.environ, LAUNCHER_PID_ENV: str(os.getpid()),
               "PYTHONPATH": os.pathsep.join(filter(None, [str(processes.REPO_ROOT), os.environ.get("PYTHONPATH")]))}
        args = ["--nodes", ",".join(n.router_address for n in nodes), "--port", "0", "--poll-s", "0.1"]
        if isinstance(config, (str, Path)):
            args += ["--config", str(config)]
        picker = processes.spawn("picker", "octoserve.services.cluster", args, run_dir, env)
        deadline = time.monotonic() + 60.0
        processes.wait_ready(picker, deadline)
        processes.wait_healthy(picker.address, deadline)
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
        offers = [chosen["node"], *chosen.get("fallbacks", ())]
        first_arrival_s, retries = None, []
        for k, node in enumerate(offers):
            await send_request(clients[node], req, t0, options, records, index)
            record = records[index]
            first_arrival_s = record.arrival_s if first_arrival_s is None else first_arrival_s
            if not record.refused or record.retry_after_ms is None or k == len(offers) - 1:
                break
            retries.append(record.retry_after_ms)  # the node's admission refused: its next-best fallback
        if k > 0:  # latencies from the first try; a refusal after every try carries the soonest delay
            fields = {"arrival_s": first_arrival_s}
            if record.refused and record.retry_after_ms is not None:
                fields["retry_after_ms"] = min([*retries, record.retry_after_ms])
            records[index] = dataclasses.replace(record, **fields)

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


@dataclass(frozen=True, slots=True)
class KillReport:
    dead: str  # the killed router's address
    killed_at_s: float  # real seconds from the start of the replay
    num_to_dead: int  # requests the picker sent to the dead node (before and after the kill)
    statuses_on_dead: tuple[str, ...]  # distinct error statuses of those that did not complete
    num_without_status: int  # requests with no record at all: must be 0
    recovery_s: float | None  # real seconds from the kill to the last pick naming the dead node
    num_after_kill_completed: int  # requests sent after the kill that completed (on the live node)
    num_cut_off: int = 0  # on the dead node, sent before the kill, not finished when it died
    records: tuple = ()


def _trace(rate: float, duration_s: float, max_output: int) -> list[TraceRequest]:
    return cap_outputs(generate_trace(scaled(PROFILES["seed-000"], rate_rps=rate, duration_s=duration_s), 0), max_output)


def _drain_s(max_output: int, time_scale: float) -> float:
    return 60.0 + max_output * 0.05 * time_scale


def run_agreement(num_nodes: int, rate: float, duration_s: float, time_scale: float, max_output: int) -> Agreement:
    """The same trace through the cluster simulator and through live nodes behind the picker."""
    from octoserve.services.cluster.sim import ClusterSimulator
    from octoserve.services.config import load_node_config

    trace = _trace(rate, duration_s, max_output)
    slo = PROFILES["seed-000"].slo
    virtual = ClusterSimulator(load_node_config(None), num_nodes).run(trace)
    cluster = start_cluster(num_nodes, time_scale)
    try:
        records, _, _ = asyncio.run(replay(cluster, trace, time_scale, drain_timeout_s=_drain_s(max_output, time_scale)))
    finally:
        cluster.stop()
    return Agreement(summarize(records, slo, duration_s, warmup_s=virtual.summary.window.start_s), virtual.summary)


def run_kill(num_nodes: int, rate: float, duration_s: float, time_scale: float, max_output: int,
             kill_at_s: float) -> KillReport:
    """Replay through the picker and SIGKILL node 0's router `kill_at_s` modelled seconds in."""
    trace = _trace(rate, duration_s, max_output)
    cluster = start_cluster(num_nodes, time_scale)
    try:
        records, picks, killed_s = asyncio.run(replay(cluster, trace, time_scale, kill_at_s=kill_at_s,
                                                      drain_timeout_s=_drain_s(max_output, time_scale)))
    finally:
        cluster.stop()
    dead = cluster.nodes[0].router_address
    node_of = {p.request_id: p.node for p in picks}
    sent_at = {p.request_id: p.sent_s for p in picks}
    on_dead = [r for r in records if r is not None and node_of.get(r.request_id) == dead]
    after = [r for r in records if r is not None and sent_at.get(r.request_id, 0.0) > killed_s]
    return KillReport(
        dead=dead, killed_at_s=killed_s, num_to_dead=len(on_dead),
        statuses_on_dead=tuple(sorted({r.error.split(":")[0] for r in on_dead if r.error})),
        num_without_status=sum(1 for r in records if r is None),
        recovery_s=recovery_s(picks, dead, killed_s),
        num_after_kill_completed=sum(1 for r in after if r.completed),
        num_cut_off=sum(1 for r in on_dead if sent_at[r.request_id] <= killed_s
                        and (r.finish_s is None or r.finish_s * time_scale > killed_s)),
        records=tuple(records),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m octoserve.services.cluster.live", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=2)
    parser.add_argument("--rate", type=float, default=6.0, help="modelled req/s for the whole cluster")
    parser.add_argument("--duration", type=float, default=10.0, help="modelled seconds of arrivals")
    parser.add_argument("--time-scale", type=float, default=20.0)
    parser.add_argument("--max-output", type=int, default=64, help="cap on true output lengths (wall time)")
    parser.add_argument("--kill-at", type=float, default=None, help="modelled s: kill node 0's router then")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    print(f"[live] {args.nodes} nodes at {args.rate:g} req/s for {args.duration:g} modelled s, time scale "
          f"{args.time_scale:g}; starting", file=sys.stderr, flush=True)
    if args.kill_at is None:
        agreement = run_agreement(args.nodes, args.rate, args.duration, args.time_scale, args.max_output)
        print(agreement.table())
        print(f"agreement within ±15 %: {'yes' if agreement.within() else 'NO'}")
        out = {"differences": agreement.relative_differences(), "within": agreement.within()}
    else:
        k = run_kill(args.nodes, args.rate, args.duration, args.time_scale, args.max_output, args.kill_at)
        print(f"killed {k.dead} at {k.killed_at_s:.2f} s (real); requests sent to it: {k.num_to_dead}, statuses of "
              f"those that did not complete: {list(k.statuses_on_dead)}; requests without a status: "
              f"{k.num_without_status}; last pick to the dead node {k.recovery_s} s after the kill (real time); "
              f"completed after the kill: {k.num_after_kill_completed}; cut off by the kill: {k.num_cut_off}")
        out = {"killed_at_s": k.killed_at_s, "recovery_s": k.recovery_s, "num_without_status": k.num_without_status,
               "statuses_on_dead": list(k.statuses_on_dead), "num_to_dead": k.num_to_dead,
               "num_after_kill_completed": k.num_after_kill_completed, "num_cut_off": k.num_cut_off}
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
