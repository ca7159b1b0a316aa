"""The process entry point shared by prefill_worker and decode_worker: one engine instance, one gRPC server.

`python -m octoserve.decode_worker --instance llama-3-8b-0 [--config node.yaml] [--engine sim] [--time-scale K]
 [--flippable] [--scheduler 127.0.0.1:P] [--port 0] [--metrics-port 0] [--ready-file F] [--grace-s 10]`
After it serves, the worker registers its address with the scheduler (when given), so the router finds it there,
and registers again every REREGISTER_S: registration is idempotent, and a scheduler that restarted (and lost its
state) learns the whole placement back from these heartbeats within about a second.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from collections.abc import Callable

import grpc  # noqa: F401  (kept for the worker's own channels)

from octoserve.services.config import config_file
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc
from octoserve.services import trust
from octoserve.services.faults import FaultPlan
from octoserve.services.rpc import role_switch
from octoserve.services.rpc.hardening import add_servicer
from octoserve.services.rpc.server import RunningService, ServiceSpec, setup_logging
from octoserve.services.rpc.stall_watch import DEFAULT_STALL_AFTER_S, watch_progress
from octoserve.services.rpc.worker_base import WorkerBase
from octoserve.services.scheduler.gang_live import attach_gang_gate

WORKER_SERVICE = w_pb.DESCRIPTOR.services_by_name["Worker"].full_name
REGISTER_TIMEOUT_S = 10.0
REREGISTER_S = 1.0
SCHEDULER_CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.min_reconnect_backoff_ms", 100),
                             ("grpc.max_reconnect_backoff_ms", 1000))


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--instance", required=True, help="instance id from the node config")
    parser.add_argument("--config", type=config_file, default=None,
                        help="node config YAML (default: the embedded placement)")
    parser.add_argument("--engine", default="sim", help="sim | vllm | module:callable")
    parser.add_argument("--model", default=None, help="model directory (vllm engine)")
    parser.add_argument("--flippable", action="store_true",
                        help="vllm engine: start its KV connector as kv_both so SetRole can change the role of the "
                             "running engine without a restart (implied when the node config's elastic section "
                             "names a balancer)")
    parser.add_argument("--time-scale", type=float, default=1.0, help="dilate modelled time by this factor")
    parser.add_argument("--scheduler", default="", help="scheduler host:port to register with")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--port-fallback", action="store_true",
                        help="when --port is taken, serve on a free port (and register that address) instead of failing")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (beyond loopback: needs tls)")
    parser.add_argument("--allow-insecure", action="store_true", help="listen beyond loopback without tls anyway")
    parser.add_argument("--metrics-port", type=int, default=0)
    parser.add_argument("--ready-file", default=None)
    parser.add_argument("--grace-s", type=float, default=10.0)
    parser.add_argument("--stall-after-s", type=float, default=DEFAULT_STALL_AFTER_S,
                        help="exit (for the supervisor to restart it) when the engine made no step for this long "
                             "with requests running; 0: never")
    parser.add_argument("--log-level", default="INFO")


async def register(scheduler: str, instance_id: str, address: str) -> None:
    """Tell the scheduler where this instance serves; retried (bounded) while the scheduler starts."""
    async with trust.channel(scheduler) as channel:
        stub = s_grpc.SchedulerStub(channel)
        request = s_pb.RegisterWorkerRequest(instance_id=instance_id, address=address, pid=os.getpid())
        await stub.RegisterWorker(request, timeout=REGISTER_TIMEOUT_S, wait_for_ready=True)


async def keep_registered(scheduler: str, instance_id: str, address: str) -> None:
    """Re-registers every REREGISTER_S for the life of the process (a restarted scheduler rebuilds from these)."""
    log = logging.getLogger("octoserve.worker")
    request = s_pb.RegisterWorkerRequest(instance_id=instance_id, address=address, pid=os.getpid())
    reachable = True
    async with trust.channel(scheduler, options=SCHEDULER_CHANNEL_OPTIONS) as channel:
        stub = s_grpc.SchedulerStub(channel)
        while True:
            await asyncio.sleep(REREGISTER_S)
            try:
                await stub.RegisterWorker(request, timeout=REREGISTER_S)
                if not reachable:
                    log.info("re-registered with the scheduler", extra={"fields": {"scheduler": scheduler}})
                reachable = True
            except grpc.aio.AioRpcError as e:
                if reachable:
                    log.warning("scheduler unreachable; registering again every second",
                                extra={"fields": {"scheduler": scheduler, "code": e.code().name}})
                reachable = False


def worker_spec(args: argparse.Namespace, make_servicer: Callable[..., WorkerBase]) -> ServiceSpec:
    from octoserve.services.config import load_node_config, load_service_sections

    tls = trust.configure(load_service_sections(args.config).get("tls"), "worker")
    trust.check_bind(args.host, tls, args.allow_insecure, f"worker {args.instance}")
    from octoserve.services.engine.factory import make_engine

    node_cfg = load_node_config(args.config)
    flippable = getattr(args, "flippable", False) or role_switch.elastic_node(args.config)
    engine = make_engine(node_cfg, args.instance, engine=args.engine, time_scale=args.time_scale, model_path=args.model,
                         flippable=flippable)
    FaultPlan.from_env().apply_to_engine(engine)  # injected faults (tests and drills); none by default
    attach_gang_gate(engine, node_cfg, args.instance, args.scheduler, args.time_scale)  # gang members step on grants
    servicer = make_servicer(engine)
    servicer.model_spec = node_cfg.models.get(engine.model)
    servicer = role_switch.RoleSwitch(servicer, role_switch.rebuilder(node_cfg, args, servicer))  # elastic pools

    async def on_serving(running: RunningService) -> None:
        running.background.add(asyncio.create_task(watch_progress(lambda: servicer.inner.engine, args.stall_after_s)))
        if args.scheduler:
            await register(args.scheduler, args.instance, running.dial_address)
            heartbeat = asyncio.create_task(keep_registered(args.scheduler, args.instance, running.dial_address))
            running.background.add(heartbeat)

    return ServiceSpec(
        name=f"worker:{args.instance}",
        port=args.port,
        port_fallback=args.port_fallback,
        host=args.host,
        server_credentials=tls.server_credentials() if tls else None,
        metrics_port=args.metrics_port,
        grace_s=args.grace_s,
        ready_file=args.ready_file,
        service_names=(WORKER_SERVICE,),
        add_servicers=lambda server: add_servicer(servicer, w_pb.DESCRIPTOR.services_by_name["Worker"], server),
        start=servicer.start,
        drain=servicer.drain,
        close=servicer.close,
        on_serving=on_serving,
        registry=servicer.metrics.registry,
    )


def worker_main(argv: list[str] | None, make_servicer: Callable[..., WorkerBase], prog: str) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging(log_name(prog, args), args.log_level)
    logging.getLogger("octoserve.worker").info("starting", extra={"fields": {"engine": args.engine}})
    return run_main_with(args, make_servicer)


def log_name(prog: str, args: argparse.Namespace) -> str:
    """What the process logs as: `colocated_worker:ID` for a colocated instance (served by the decode_worker
    module), else `prefill_worker:ID` / `decode_worker:ID`. A config that does not load keeps `prog` (the
    servicer reports the config error itself)."""
    from octoserve.services.config import load_node_config
    from octoserve.services.core.placement import PlacementError, Role

    try:
        role = load_node_config(args.config).instance(args.instance).role
    except (PlacementError, OSError, KeyError, ValueError):
        return f"{prog}:{args.instance}"
    return f"{'colocated_worker' if role is Role.COLOCATED else prog}:{args.instance}"


def run_main_with(args: argparse.Namespace, make_servicer: Callable[..., WorkerBase]) -> int:
    async def build_and_serve() -> int:
        from octoserve.services.rpc.server import serve_until_signal

        try:
            spec = worker_spec(args, make_servicer)
        except trust.TrustError as e:
            logging.getLogger("octoserve.worker").error(str(e))
            return 2
        return await serve_until_signal(spec)

    try:
        import uvloop

        return uvloop.run(build_and_serve())
    except ImportError:
        return asyncio.run(build_and_serve())


