"""Live migration vs drain on the live node: the same model changes under the same load, once draining only and once
migrating running decodes by KV hand-off, side by side in one run. Separate processes on 127.0.0.1, sim engine,
dilated by --time-scale; figures in modelled seconds (wall / time scale).

    python scripts/bench_migration_live.py [--time-scale 4] [--rounds 2] [--streams 4] [--max-tokens 400]

Node: the 8B on c0, c1 and another 8B on y0. Under a closed loop of --streams long requests to the 8B and two to
the other, each round moves GPU 1 to the other 8B and back (model changes), first with `drain_only` and then with
migration. Per reconfiguration: the drain (DRAINING until the retired instance is idle), the switch, requests
migrated; per request: whether every token is exactly what an unmigrated run produces, and the largest gap between
two tokens it saw (for migrated requests: the hand-off's stall) against the median inter-token gap of the run.
Run it with `nice -n 10` on a shared machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from octoserve.services.core.sim_executor import sim_token_id  # noqa: E402
from octoserve.services.node.launcher import start_node  # noqa: E402
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb  # noqa: E402
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc  # noqa: E402
from octoserve.services.rpc.gen import worker_pb2 as w_pb  # noqa: E402
from octoserve.v1 import generate_pb2 as gen_pb  # noqa: E402
from octoserve.v1 import generate_pb2_grpc as gen_grpc  # noqa: E402
from tests.fault_fixtures import load, prompt  # noqa: E402
from tests.service_fixtures import COLOCATED_MODEL  # noqa: E402
from tests.test_migration import OTHER_MODEL, _migrate_config  # noqa: E402


class Timed:
    """One Generate call: its tokens, the wall time each response came, and its final status."""

    def __init__(self, request: gen_pb.GenerateRequest) -> None:
        self.request = request
        self.tokens: list[int] = []
        self.times: list[tuple[float, int]] = []
        self.request_id = ""
        self.code: grpc.StatusCode | None = None

    async def run(self, stub) -> None:
        try:
            async for r in stub.Generate(self.request, timeout=300):
                self.request_id = self.request_id or r.request_id
                if r.token_ids:
                    self.times.append((time.monotonic(), len(r.token_ids)))
                self.tokens.extend(r.token_ids)
            self.code = grpc.StatusCode.OK
        except grpc.aio.AioRpcError as e:
            self.code = e.code()

    def exact(self) -> bool:
        ids = list(self.request.token_ids.ids)
        return self.tokens == [sim_token_id(len(ids), ids[0], p) for p in range(self.request.max_tokens)]

    def gaps(self) -> list[float]:
        """Wall seconds between consecutive responses, per token they carried."""
        return [(t1 - t0) / n for (t0, _), (t1, n) in zip(self.times, self.times[1:])]


async def bench(args) -> int:
    run_dir = Path(tempfile.mkdtemp(prefix="octoserve-migration-bench-"))
    node = start_node(_migrate_config(), time_scale=args.time_scale, run_dir=run_dir, startup_timeout_s=120,
                      grace_s=3, router_args=("--access-log", "all"))
    rows, streams, salt = [], [], [0]
    print(f"node logs: {run_dir}", flush=True)
    stop = asyncio.Event()
    try:
        async with grpc.aio.insecure_channel(node.router_address) as rch, \
                grpc.aio.insecure_channel(node.scheduler.address) as sch:
            router, scheduler = gen_grpc.GenerationStub(rch), s_grpc.SchedulerStub(sch)

            async def client(model: str) -> None:
                while not stop.is_set():
                    salt[0] += 1
                    s = Timed(gen_pb.GenerateRequest(model=model, token_ids=prompt(48, salt[0]),
                                                     max_tokens=args.max_tokens, ignore_eos=True))
                    streams.append(s)
                    await s.run(router)

            tasks = [asyncio.create_task(client(COLOCATED_MODEL)) for _ in range(args.streams)]
            tasks += [asyncio.create_task(client(OTHER_MODEL)) for _ in range(args.streams)]

            async def busy(instance_id: str, address_of) -> None:
                deadline = time.monotonic() + 60
                while (await load(address_of())).num_running < 2 and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.5 * args.time_scale)  # well into their decodes

            placement = {}

            async def refresh() -> None:
                p = await scheduler.GetPlacement(s_pb.GetPlacementRequest(), timeout=5)
                placement.clear()
                placement.update({i.instance_id: i.address for i in p.instances})

            on_gpu1 = "c1"
            for n in range(args.rounds):
                for mode in ("drain", "migrate"):
                    for model in (OTHER_MODEL, COLOCATED_MODEL):
                        await refresh()
                        await busy(on_gpu1, lambda: placement[on_gpu1])
                        t0 = time.monotonic()
                        reply = await scheduler.Reconfigure(s_pb.ReconfigureRequest(
                            model_change=s_pb.ModelChange(retire=[on_gpu1], model=model, role=w_pb.COLOCATED,
                                                          tensor_parallel=1),
                            drain_only=mode == "drain", reason=f"bench: {mode}"), timeout=600)
                        label = f"{'8B -> other' if model == OTHER_MODEL else 'other -> 8B'}"
                        rows.append((mode, label, reply, t0, on_gpu1))
                        print(f"  round {n + 1} {mode:7s} {label:12s} drain {reply.drain_s / args.time_scale:7.3f} s "
                              f"switch {reply.switch_s / args.time_scale:6.3f} s (modelled); in flight "
                              f"{reply.drained_requests}, migrated {reply.migrated_requests}", flush=True)
                        (on_gpu1,) = reply.started
            stop.set()
            await asyncio.gather(*tasks)
    finally:
        node.stop()
    log, handed_at = {}, {}
    for line in node.router.log_file.read_text().splitlines():
        if line.startswith("{"):
            e = json.loads(line)
            if e.get("logger") == "octoserve.router.access":
                log[e["request_id"]] = e
            elif e.get("msg") == "request migrated":
                handed_at[e["request_id"]] = e["tokens"]  # the first token the target produced has this index
    k = args.time_scale
    migrated = [s for s in streams if len(log.get(s.request_id, {}).get("instances", [])) > 1]
    others = [s for s in streams if s not in migrated]
    all_gaps = [g for s in streams for g in s.gaps()]
    median_itl_ms = statistics.median(all_gaps) / k * 1000 if all_gaps else float("nan")
    print()
    print("| mode | reconfiguration | n | drain (modelled s, median) | switch (modelled s, median) | "
          "total (modelled s, median) | in flight at drain start | migrated |")
    print("|---|---|---|---|---|---|---|---|")
    for mode in ("drain", "migrate"):
        for label in dict.fromkeys(r[1] for r in rows):
            mine = [r[2] for r in rows if r[0] == mode and r[1] == label]
            if not mine:
                continue
            print(f"| {mode} | {label} | {len(mine)} | {statistics.median(r.drain_s for r in mine) / k:.3f} | "
                  f"{statistics.median(r.switch_s for r in mine) / k:.3f} | "
                  f"{statistics.median(r.total_s for r in mine) / k:.3f} | {sum(r.drained_requests for r in mine)} | "
                  f"{sum(r.migrated_requests for r in mine)} |")
    print()
    at_handoff = [g for s in migrated if (g := handoff_gap_s(s, handed_at.get(s.request_id))) is not None]
    between = [t1 - t0 for s in streams for (t0, _), (t1, _) in zip(s.times, s.times[1:])]
    print(f"median gap between two responses of a stream: {statistics.median(between) / k * 1000:.2f} ms; "
          f"per token: {median_itl_ms:.2f} ms (modelled)")
    if at_handoff:
        ms = sorted(g / k * 1000 for g in at_handoff)
        print(f"gap at the hand-off (last token from the source -> first from the target), {len(ms)} migrated "
              f"requests: median {statistics.median(ms):.2f} ms, max {ms[-1]:.2f} ms (modelled)")
    max_gap_other = [max(s.gaps()) / k * 1000 for s in others if s.gaps()]
    if max_gap_other:
        print(f"largest per-token gap of each request not migrated: median {statistics.median(max_gap_other):.2f} ms, "
              f"max {max(max_gap_other):.2f} ms ({len(max_gap_other)} requests)")
    if args.plot:
        plot(args.plot, rows, streams, log, k)
        print(f"plot: {args.plot}")
    final = [s for s in streams if s.code is not None]
    lost = sum(1 for s in final if s.code is not grpc.StatusCode.OK or not s.exact())
    print(f"requests: {len(final)} with a final status of {len(streams)} sent; migrated {len(migrated)}; "
          f"not OK or tokens not exact: {lost}")
    return 0 if lost == 0 and len(final) == len(streams) else 1


def handoff_gap_s(s: Timed, first_on_target: int | None) -> float | None:
    """Wall seconds between the response that carried the source's last token and the one with the target's first."""
    if first_on_target is None:
        return None
    seen = 0
    for i, (t, n) in enumerate(s.times):
        if seen <= first_on_target < seen + n:
            return t - s.times[i - 1][0] if i else None
        seen += n
    return None


def plot(path: str, rows, streams: list[Timed], log: dict, k: float) -> None:
    """Tokens received over time by the requests running on the retired instance, for the first reconfiguration of
    each mode; vertical lines at the drain's end and the switch's end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, mode in zip(axes, ("drain", "migrate")):
        mode_label, label, reply, t0, retired = next(r for r in rows if r[0] == mode)
        for s in streams:
            if not s.times or retired not in log.get(s.request_id, {}).get("instances", []):
                continue
            if not s.times[0][0] < t0 < s.times[-1][0]:
                continue
            xs, ys, n = [], [], 0
            for t, m in s.times:
                n += m
                xs.append((t - t0) / k)
                ys.append(n)
            ax.plot(xs, ys, drawstyle="steps-post", lw=1)
        ax.axvline(reply.drain_s / k, color="k", ls="--", lw=0.8, label="drain ends")
        ax.axvline((reply.drain_s + reply.switch_s) / k, color="r", ls=":", lw=0.8, label="new instance serves")
        ax.set_title(f"{mode}: {label}, {reply.migrated_requests} of {reply.drained_requests} migrated")
        ax.set_xlabel("modelled s since the reconfiguration started")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("tokens received")
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-scale", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--streams", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--plot", default="docs/bench/migration_live.png", help="PNG of the token timelines ('' for none)")
    return asyncio.run(bench(parser.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
