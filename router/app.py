"""Builds and runs the router process: placement from the scheduler, worker sessions, the Generation service.

`python -m octoserve.router [--config node.yaml] --scheduler 127.0.0.1:P [--time-scale K] [--port 50051] ...`
Startup is bounded: the router reports SERVING only after every worker of the placement confirmed its token
session and sent a load snapshot, and gives up (exit 1) after `--startup-timeout-s`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Mapping


from octoserve.router.access_log import DEFAULT_MODE, DEFAULT_SAMPLE_EVERY, MODES, AccessLog
from octoserve.router.metrics import RouterMetrics
from octoserve.router.demand_report import DemandReporter
from octoserve.router.placement_watch import PlacementFollower
from octoserve.router.pool import WorkerClient, WorkerEndpoint, WorkerPool, load_interval_ms
from octoserve.router.servicer import DEFAULT_MAX_PENDING_DELTAS, GenerationServicer, RouterSettings
from octoserve.router.watchdog import DEFAULT_HUNG_AFTER_S, HangWatchdog
from octoserve.services.cluster.service import add_headroom_service, headroom_source
from octoserve.services.core.placement import NodeConfig
from octoserve.services.core.routing import RouterPolicy, build_cost_models
from octoserve.services.core.types import Role
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
from octoserve.services import trust
from octoserve.services.rpc.hardening import add_servicer
from octoserve.services.rpc.server import ServiceSpec, setup_logging

log = logging.getLogger("octoserve.router")

GENERATION_SERVICE = gen_pb.DESCRIPTOR.services_by_name["Generation"].full_name
DEFAULT_STARTUP_TIMEOUT_S = 60.0
POLL_S = 0.05


async def placement_from_scheduler(address: str, timeout_s: float) -> dict[str, str]:
    """instance id -> worker address, once every configured instance registered (bounded by timeout_s)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    async with trust.channel(address) as channel:
        stub = s_grpc.SchedulerStub(channel)
        while True:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"the scheduler at {address} did not report a complete placement in {timeout_s:g} s")
            placement = await stub.GetPlacement(s_pb.GetPlacementRequest(), timeout=remaining, wait_for_ready=True)
            if placement.complete:
                return {p.instance_id: p.address for p in placement.instances}
            await asyncio.sleep(POLL_S)


def router_spec(
    config: NodeConfig,
    endpoints: Callable[[], Awaitable[Mapping[str, str]]],
    *,
    settings: RouterSettings = RouterSettings(),
    port: int = 0,
    metrics_port: int | None = 0,
    ready_file: str | None = None,
    grace_s: float = 10.0,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    seed: int = 0,
    host: str = "127.0.0.1",
    hung_after_s: float = DEFAULT_HUNG_AFTER_S,
    scheduler_address: str | None = None,
) -> tuple[ServiceSpec, GenerationServicer]:
    """scheduler_address: follow that scheduler's placement live (router/placement_watch.py) instead of reading
    `endpoints` once."""
    metrics = RouterMetrics(served_models=list(config.models), time_scale=settings.time_scale)
    policy = RouterPolicy(config, build_cost_models(config), random.Random(seed))
    pool = WorkerPool({})
    servicer = GenerationServicer(config, policy, pool, uuid.uuid4().hex, settings, metrics)
    servicer.connected.clear()  # calls that arrive before start() has connected the workers wait for it
    headroom = headroom_source(policy, pool.loads, lambda: not servicer.draining)
    watchdog = HangWatchdog(servicer, hung_after_s)

    def make_client(inst, address: str) -> WorkerClient:
        def on_down(instance_id: str, reason: str, cause: str) -> None:
            if pool.clients.get(instance_id) is client:  # a replaced session's end says nothing of its successor
                servicer.on_worker_down(instance_id, reason, cause)

        client = WorkerClient(WorkerEndpoint(inst.id, address, inst.role is not Role.PREFILL), servicer.session_id,
                              servicer.on_delta, on_down, policy.on_kv_events, policy.forget_instance,
                              load_interval_ms(servicer.settings.time_scale, hung_after_s))
        client.on_resumed = watchdog.resumed
        return client

    follower = None if scheduler_address is None else PlacementFollower(
        scheduler_address, config, policy, pool, servicer, make_client)
    demand = None if scheduler_address is None else DemandReporter(scheduler_address, policy)

    async def start() -> None:
        if follower is not None:
            await follower.first(startup_timeout_s)
        else:
            for instance_id, address in (await endpoints()).items():
                pool.clients[instance_id] = make_client(config.instance(instance_id), address)
        pool.start()
        await _wait_ready(pool, startup_timeout_s)
        servicer.connected.set()
        if follower is not None:
            follower.follow()
            demand.start()
        watchdog.start()

    async def close() -> None:
        await watchdog.close()
        await servicer.close()
        if follower is not None:
            await follower.close()
            await demand.close()
        await pool.close()
        await asyncio.gather(*(c.close() for c in pool.retired.values()))

    spec = ServiceSpec(
        name="router",
        host=host,
        port=port,
        metrics_port=metrics_port,
        grace_s=grace_s,
        ready_file=ready_file,
        service_names=(GENERATION_SERVICE,),
        add_servicers=lambda server: (
            add_servicer(servicer, gen_pb.DESCRIPTOR.services_by_name["Generation"], server,
                         max_message_bytes=settings.limits.max_message_bytes),
            add_headroom_service(server, headroom)),
        grpc_options=settings.limits.router_grpc_options(),
        start=start,
        drain=servicer.drain,
        close=close,
        registry=metrics.registry,
    )
    return spec, servicer


async def _wait_ready(pool: WorkerPool, timeout_s: float) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not pool.ready():
        if loop.time() > deadline:
            missing = sorted(iid for iid, c in pool.clients.items() if not c.ready())
            raise TimeoutError(f"workers not ready after {timeout_s:g} s: {', '.join(missing)}")
        await asyncio.sleep(POLL_S)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, help="node config YAML (default: the embedded placement)")
    parser.add_argument("--scheduler", required=True, help="scheduler host:port (placement source)")
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--port", type=int, default=50051)
    parser.add_argument("--host", default="127.0.0.1", help="address of the public API (0.0.0.0 in a Kubernetes pod)")
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--ready-file", default=None)
    parser.add_argument("--grace-s", type=float, default=10.0)
    parser.add_argument("--startup-timeout-s", type=float, default=DEFAULT_STARTUP_TIMEOUT_S)
    parser.add_argument("--max-pending-deltas", type=int, default=DEFAULT_MAX_PENDING_DELTAS)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--access-log", choices=MODES, default=DEFAULT_MODE,
                        help="one JSON line per request: all, errors (every failed one + 1 in --access-log-sample-every "
                             "ok ones), off")
    parser.add_argument("--access-log-sample-every", type=int, default=DEFAULT_SAMPLE_EVERY)
    parser.add_argument("--hung-after-s", type=float, default=DEFAULT_HUNG_AFTER_S,
                        help="route around a worker that sent no load report for this long (wall seconds) while its "
                             "connection stayed open (stopped, or hung)")
    parser.add_argument("--log-level", default="INFO")
    from octoserve.http_front.local import add_router_arguments

    add_router_arguments(parser)  # the OpenAI-compatible front inside this process (off unless --http-port)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="router", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging("router", args.log_level)

    async def serve() -> int:
        from octoserve.router.tenants import tenant_settings_from_dict
        from octoserve.services.config import load_node_config, load_service_sections
        from octoserve.services.rpc.limits import limits_from_dict
        from octoserve.services.rpc.server import serve_until_signal

        config = load_node_config(args.config)
        sections = load_service_sections(args.config)
        trust.configure(sections.get("tls"), "router")
        from octoserve.http_front.local import with_front_inside

        spec, servicer = router_spec(
            config,
            lambda: placement_from_scheduler(args.scheduler, args.startup_timeout_s),
            settings=RouterSettings(time_scale=args.time_scale, max_pending_deltas=args.max_pending_deltas,
                                    access_log=AccessLog(args.access_log, args.access_log_sample_every),

                                    tenants=tenant_settings_from_dict(sections.get("tenants")),
                                    limits=limits_from_dict(sections.get("limits"))),
            port=args.port, metrics_port=args.metrics_port, ready_file=args.ready_file, grace_s=args.grace_s,
            startup_timeout_s=args.startup_timeout_s, seed=args.seed, host=args.host,
            scheduler_address=args.scheduler, hung_after_s=args.hung_after_s,
        )
        return await serve_until_signal(with_front_inside(spec, servicer, args))

    import uvloop

    return uvloop.run(serve())
