"""The central scheduler service: worker registration, the placement the router reads, load collection, and gang
leases (pause a set of instances for a TP-wide job until released or expired).

Load collection: one WatchLoad stream per registered worker keeps `loads` current; a broken stream marks the
instance unhealthy until it reconnects. Pool balancing and model reallocation will read `loads`; they are not
here yet.
Registration is idempotent and workers repeat it every second, so a scheduler that restarted rebuilds its
registry (and its load watchers) from those heartbeats; the router keeps serving on the placement it read at
start meanwhile. A worker that registers a new address gets a new watcher.
Elastic pools (services/scheduler/elastic.py): the placement is live. `WatchPlacement` streams it after every
change, `Reconfigure` carries out a role or model change without downtime, and an optional balancer loop plans them.
Invariants: `GetPlacement.complete` only when every configured instance has registered; a lease pauses each of
its instances exactly once and resumes them exactly once (on release or at expiry).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import time
import uuid
from dataclasses import dataclass

import grpc
import prometheus_client as prom

from octoserve.services.config import config_file
from octoserve.services.core.placement import NodeConfig
from octoserve.services.core.routing import REFUSAL_REASONS
from octoserve.services.core.types import EngineLoad
from octoserve.services.rpc import convert
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc
from octoserve.services import trust
from octoserve.services.rpc.hardening import add_servicer
from octoserve.services.rpc.server import ServiceSpec, setup_logging
from octoserve.services.scheduler.gang_live import GangCollector, GangHub
from octoserve.services.scheduler import elastic
from octoserve.services.core.live_balancer import DEFAULT_WINDOW_S, DemandWindow, LiveView

log = logging.getLogger("octoserve.scheduler")

SCHEDULER_SERVICE = s_pb.DESCRIPTOR.services_by_name["Scheduler"].full_name
LOAD_INTERVAL_MS = 100  # the scheduler balances pools on a seconds scale; the router gets its own faster stream
RECONNECT_S = 0.2
WORKER_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                          ("grpc.max_reconnect_backoff_ms", 1000))
MAX_LEASE_MS = 600_000  # a gang job holds its instances at most 10 minutes per lease (renew for longer)
PAUSE_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class LeaseRecord:
    lease_id: str
    holder: str
    instance_ids: tuple[str, ...]
    expires_at_s: float


class SchedulerServicer(s_grpc.SchedulerServicer):
    def __init__(self, config: NodeConfig, time_scale: float = 1.0, elastic_section: dict | None = None,
                 placement_file: str | None = None, worker_hosts: trust.WorkerHosts = trust.WorkerHosts()) -> None:
        self.config = config
        self.worker_hosts = worker_hosts  # where a registered worker may be; the scheduler dials nothing else
        self.placement = elastic.LivePlacement(config, placement_file)  # what routers route on; changes with reconfigurations
        self.elastic = elastic.ElasticRunner(self, time_scale, **elastic.migration_settings(elastic_section))
        planned = elastic.balancer_from_section(elastic_section, config)
        window_s = getattr(planned[0], "window_s", DEFAULT_WINDOW_S) if planned else DEFAULT_WINDOW_S
        # A forward ranker replays the recent arrivals: the window keeps its history (`LiveView.arrivals`).
        self.demand = DemandWindow(window_s, getattr(planned[0], "history_s", window_s) if planned else window_s)
        self._replay = planned is not None and getattr(planned[0], "ranker", None) is not None
        self.time_scale = time_scale
        self.balancer_loop = None if planned is None else elastic.BalancerLoop(self.elastic, *planned)
        self.addresses: dict[str, str] = {}
        self.loads: dict[str, EngineLoad] = {}
        self.leases: dict[str, LeaseRecord] = {}
        self._lease_timers: dict[str, asyncio.TimerHandle] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._watchers: dict[str, asyncio.Task] = {}
        self.registry = prom.CollectorRegistry()
        self._registered = prom.Gauge("octoserve_scheduler_registered_workers", "workers registered, count",
                                      registry=self.registry)
        self._kv_usage = prom.Gauge("octoserve_scheduler_kv_usage_ratio", "KV usage per instance, ratio 0-1", ["instance"],
                                    registry=self.registry)
        self.gang = GangHub(config)  # gang groups: each member steps on its group arbiter's grants (gang_live.py)
        self.registry.register(GangCollector(self.gang))
        self._queue = prom.Gauge("octoserve_scheduler_waiting_requests", "waiting requests per instance, count",
                                 ["instance"], registry=self.registry)
        self._refusals = prom.Counter("octoserve_scheduler_refusals", "admission refusals the routers reported, by "
                                      "model and reason (the balancer's input), count", ["model", "reason"],
                                      registry=self.registry)

    # ---- registration and placement ----------------------------------------------------------------------------

    async def RegisterWorker(self, request, context):
        if request.instance_id not in self.placement.instances:
            known = ", ".join(self.placement.instances)
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"instance {request.instance_id!r} is not in the node config; known: {known}")
        try:
            self.worker_hosts.check(request.address)
        except trust.WorkerAddressError as e:  # refused before anything is resolved or dialed
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT if e.malformed else grpc.StatusCode.PERMISSION_DENIED,
                                str(e))
        if self.addresses.get(request.instance_id) == request.address:
            return s_pb.RegisterWorkerReply()  # the heartbeat of a known worker
        self.addresses[request.instance_id] = request.address
        self._registered.set(len(self.addresses))
        self._watch(request.instance_id, request.address)
        log.info("worker registered", extra={"fields": {"instance": request.instance_id, "address": request.address}})
        await self.placement.publish()
        return s_pb.RegisterWorkerReply()

    async def GetPlacement(self, request, context):
        return self.placement.snapshot(self.addresses)

    async def WatchPlacement(self, request, context):
        while True:
            seen = self.placement.version
            yield self.placement.snapshot(self.addresses)
            await self.placement.wait_change(seen)

    async def Reconfigure(self, request, context):
        try:
            r = elastic.reconfiguration_from_pb(request, self.placement.instances, self.config)
            out = await self.elastic.run(r, request.drain_timeout_ms / 1000.0 or None, drain_only=request.drain_only)
        except elastic.ReconfigError as e:
            await context.abort(e.code, str(e))
        return elastic.outcome_to_pb(out)

    async def ReportDemand(self, request, context):
        if (problem := demand_report_problem(request)) is not None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        now_s = time.monotonic() / self.time_scale
        for m in request.models:
            if m.model in self.config.models:  # others cannot be balanced: not kept
                refused = refusals_by_reason(m.refused)
                self.demand.add(now_s, m.model, m.arrivals, m.prompt_tokens, m.output_tokens, refused)
                for reason, n in refused.items():
                    self._refusals.labels(m.model, reason).inc(n)
        return s_pb.DemandReply()

    def live_view(self, now_s: float) -> LiveView:
        p = self.placement
        return LiveView(tuple(p.instances.values()),
                        {i: st is elastic.State.SERVING for i, st in p.states.items()}, dict(self.loads),
                        self.demand.demand(now_s, sorted(self.config.models)), self.demand.window_s,
                        self.elastic.migrate, self.elastic.max_migration_pause_s,
                        self.demand.arrivals(now_s, self.config.slo.ttft_ms) if self._replay else ())

    async def start_elastic(self) -> None:
        if self.balancer_loop is not None:
            self.balancer_loop.start()

    def forget_worker(self, instance_id: str) -> None:
        """A retired instance: stop watching its load; its worker is stopped by the launcher."""
        task = self._watchers.pop(instance_id, None)
        if task is not None:
            task.cancel()
        channel = self._channels.pop(instance_id, None)
        if channel is not None:
            asyncio.get_running_loop().create_task(channel.close())
        self.addresses.pop(instance_id, None)
        self.loads.pop(instance_id, None)
        self._registered.set(len(self.addresses))

    async def GetLoads(self, request, context):
        return s_pb.Loads(loads=[convert.load_to_pb(load) for _, load in sorted(self.loads.items())])

    # ---- load collection ----------------------------------------------------------------------------------------

    def _stub(self, instance_id: str) -> w_grpc.WorkerStub:
        return w_grpc.WorkerStub(self._channels[instance_id])

    def _watch(self, instance_id: str, address: str) -> None:
        old = self._watchers.pop(instance_id, None)
        if old is not None:
            old.cancel()
        channel = self._channels.pop(instance_id, None)
        if channel is not None:
            asyncio.get_running_loop().create_task(channel.close())
        self._channels[instance_id] = trust.channel(address, options=WORKER_CHANNEL_OPTIONS)
        self._watchers[instance_id] = asyncio.create_task(self._watch_loop(instance_id))

    async def _watch_loop(self, instance_id: str) -> None:
        while True:
            try:
                async for report in self._stub(instance_id).WatchLoad(w_pb.WatchLoadRequest(interval_ms=LOAD_INTERVAL_MS)):
                    load = convert.load_from_pb(report)
                    self.loads[instance_id] = load
                    self._kv_usage.labels(instance_id).set(load.kv_usage)
                    self._queue.labels(instance_id).set(load.num_waiting)
            except grpc.aio.AioRpcError:
                pass
            if instance_id in self.loads:
                self.loads[instance_id] = dataclasses.replace(self.loads[instance_id], healthy=False)
            await asyncio.sleep(RECONNECT_S)

    # ---- gang leases --------------------------------------------------------------------------------------------

    async def AcquireLease(self, request, context):
        ids = tuple(request.instance_ids)
        missing = [i for i in ids if i not in self.addresses]
        if not ids or missing:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"cannot lease {', '.join(missing) or '(no instances)'}: name registered instances")
        held = {i for lease in self.leases.values() for i in lease.instance_ids}
        if busy := sorted(held.intersection(ids)):
            await context.abort(grpc.StatusCode.ABORTED,
                                f"instances {', '.join(busy)} are already leased; retry after that lease ends")
        if request.duration_ms > MAX_LEASE_MS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"duration_ms {request.duration_ms} is over {MAX_LEASE_MS}; lease for at most that and "
                                "acquire again to extend")
        duration_s = (request.duration_ms or 1000) / 1000.0
        lease = LeaseRecord(uuid.uuid4().hex, request.holder, ids, time.monotonic() + duration_s)
        results = await asyncio.gather(*(self._stub(i).Pause(w_pb.PauseRequest(), timeout=PAUSE_TIMEOUT_S) for i in ids),
                                       return_exceptions=True)
        if failed := [i for i, r in zip(ids, results) if isinstance(r, BaseException)]:
            paused = [i for i, r in zip(ids, results) if not isinstance(r, BaseException)]
            await asyncio.gather(*(self._stub(i).Resume(w_pb.ResumeRequest(), timeout=PAUSE_TIMEOUT_S) for i in paused),
                                 return_exceptions=True)
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"instances {', '.join(failed)} did not answer Pause; nothing was leased, retry when "
                                "they are back")
        self.leases[lease.lease_id] = lease
        loop = asyncio.get_running_loop()
        self._lease_timers[lease.lease_id] = loop.call_later(
            duration_s, lambda: loop.create_task(self._end_lease(lease.lease_id)))
        return s_pb.Lease(lease_id=lease.lease_id, instance_ids=ids, expires_at_s=lease.expires_at_s)

    async def ReleaseLease(self, request, context):
        if not await self._end_lease(request.lease_id):
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no lease {request.lease_id!r}; it expired or was released")
        return s_pb.ReleaseLeaseReply()

    async def _end_lease(self, lease_id: str) -> bool:
        lease = self.leases.pop(lease_id, None)
        timer = self._lease_timers.pop(lease_id, None)
        if timer is not None:
            timer.cancel()
        if lease is None:
            return False
        await asyncio.gather(*(self._stub(i).Resume(w_pb.ResumeRequest(), timeout=10.0) for i in lease.instance_ids),
                             return_exceptions=True)
        return True

    async def GangSteps(self, request_iterator, context):
        async for grant in self.gang.steps(request_iterator, context):
            yield grant

    async def close(self) -> None:
        if self.balancer_loop is not None:
            await self.balancer_loop.close()
        await self.gang.close()
        for lease_id in list(self.leases):
            await self._end_lease(lease_id)
        for task in self._watchers.values():
            task.cancel()
        await asyncio.gather(*self._watchers.values(), return_exceptions=True)
        for channel in self._channels.values():
            await channel.close()


def demand_report_problem(report: s_pb.DemandReport) -> str | None:
    """What is wrong with a router's demand report, or None: a model's refusals are among its arrivals."""
    for m in report.models:
        refused = sum(m.refused.values())
        if refused > m.arrivals:
            return (f"model {m.model!r}: {refused} refusals reported but {m.arrivals} arrivals; send each "
                    "refused request in the arrivals too")
    return None


def refusals_by_reason(refused) -> dict[str, int]:
    """A report's refusals by reason; a reason this scheduler does not know (a newer router's) counts as "other"."""
    out: dict[str, int] = {}
    for reason, n in refused.items():
        if n:
            key = reason if reason in REFUSAL_REASONS else "other"
            out[key] = out.get(key, 0) + n
    return out


def scheduler_spec(config: NodeConfig, *, port: int = 0, metrics_port: int | None = 0,
                   ready_file: str | None = None, grace_s: float = 5.0, host: str = "127.0.0.1",
                   tls: trust.TlsFiles | None = None, time_scale: float = 1.0,
                   elastic_section: dict | None = None,
                   placement_file: str | None = None,
                   worker_hosts: trust.WorkerHosts = trust.WorkerHosts()) -> tuple[ServiceSpec, SchedulerServicer]:
    servicer = SchedulerServicer(config, time_scale, elastic_section, placement_file, worker_hosts)
    spec = ServiceSpec(
        name="scheduler", port=port, metrics_port=metrics_port, grace_s=grace_s, ready_file=ready_file,
        host=host, server_credentials=tls.server_credentials() if tls else None,
        service_names=(SCHEDULER_SERVICE,),
        add_servicers=lambda server: add_servicer(servicer, s_pb.DESCRIPTOR.services_by_name["Scheduler"], server),
        start=servicer.start_elastic, close=servicer.close, registry=servicer.registry,
    )
    return spec, servicer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scheduler", description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=config_file, default=None)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (beyond loopback: needs tls)")
    parser.add_argument("--allow-insecure", action="store_true", help="listen beyond loopback without tls anyway")
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--ready-file", default=None)
    parser.add_argument("--grace-s", type=float, default=5.0)
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="the node's dilation: modelled weight-load times and balancer periods are multiplied by it")
    parser.add_argument("--placement-file", default=None,
                        help="keep the live placement here (JSON), so a restart serves what reconfigurations made")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    setup_logging("scheduler", args.log_level)
    from octoserve.services.config import load_service_sections

    try:
        sections = load_service_sections(args.config)
        tls = trust.configure(sections.get("tls"), "scheduler")
        trust.check_bind(args.host, tls, args.allow_insecure, "scheduler")
        hosts = trust.worker_hosts(sections.get("network"), trust.worker_certificate(sections.get("tls"), tls))
    except trust.TrustError as e:
        log.error(str(e))
        return 2

    async def serve() -> int:
        from octoserve.services.config import load_node_config
        from octoserve.services.rpc.server import serve_until_signal

        spec, _ = scheduler_spec(load_node_config(args.config), port=args.port, metrics_port=args.metrics_port,
                                 ready_file=args.ready_file, grace_s=args.grace_s, host=args.host, tls=tls,
                                 time_scale=args.time_scale, elastic_section=sections.get("elastic"),
                                 placement_file=args.placement_file, worker_hosts=hosts)
        return await serve_until_signal(spec)

    import uvloop

    return uvloop.run(serve())
