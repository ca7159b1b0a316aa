"""What every octoserve service process does around its servicers: one gRPC server on 127.0.0.1 with standard
health and reflection, Prometheus metrics on an HTTP port, JSON-lines logs, and SIGTERM drain.

Lifecycle (the same for every service):
  start -> bind 127.0.0.1:port (0 = any free port) -> metrics HTTP -> health SERVING -> write the ready file
  SIGTERM/SIGINT -> health NOT_SERVING -> `drain(grace_s)` (the service refuses new work with UNAVAILABLE and
  finishes in-flight work) -> server.stop(remaining grace) -> `close()` -> exit 0.
The ready file (JSON: pid, port, metrics_port) is how a launcher learns the ports without racing for them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field

import grpc
import prometheus_client
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from octoserve.services.rpc.loop_metrics import start_task_gauge

HOST = "127.0.0.1"

# Calls the gRPC core queues for a service before its event loop accepts them (the aio server accepts one call per
# few loop cycles). Past gRPC's defaults (1,000 soft, 3,000 hard) it drops queued calls at random, and past 30 s in
# the queue it drops them too, both as a bare CANCELLED that never reaches a handler: a burst of 1,500 streams on one
# channel lost ~2 % of its calls that way. A call must reach the handler and get its typed answer (served, or
# RESOURCE_EXHAUSTED with a retry hint), so the queue holds up to MAX_QUEUED_CALLS (a few KiB each) and a queued
# call waits as long as its own deadline allows.
MAX_QUEUED_CALLS = 10_000
MAX_QUEUED_S = 24 * 3600

# Tokens are small but prompts can be long (32k ids ~ 160 KiB); keep the default 4 MiB and say so explicitly.
GRPC_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.max_receive_message_length", 16 * 1024 * 1024),
    ("grpc.max_send_message_length", 16 * 1024 * 1024),
    ("grpc.so_reuseport", 0),  # a port is owned by exactly one process
    ("grpc.server.max_pending_requests", MAX_QUEUED_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_QUEUED_CALLS),
    ("grpc.server_max_unrequested_time_in_server", MAX_QUEUED_S),
)


class JsonLineFormatter(logging.Formatter):
    """One JSON object per line: ts, level, service, msg, and any `extra={"fields": {...}}`."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(getattr(record, "fields", {}) or {})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup_logging(service: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLineFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


def log_fields(**fields) -> dict:
    """`logger.info("msg", extra=log_fields(request_id=...))`."""
    return {"fields": fields}


@dataclass
class ServiceSpec:
    """How to build one service; the callables are the service's own."""

    name: str  # e.g. "router", "worker:llama-8b-0"
    port: int = 0
    metrics_port: int | None = 0  # None: no metrics HTTP server
    grace_s: float = 10.0
    ready_file: str | None = None
    service_names: Sequence[str] = ()  # full gRPC service names for reflection and health
    add_servicers: Callable[[grpc.aio.Server], None] = lambda server: None
    start: Callable[[], Awaitable[None]] | None = None  # after bind, before SERVING
    drain: Callable[[float], Awaitable[None]] | None = None  # refuse new work, finish in-flight within the grace
    close: Callable[[], Awaitable[None]] | None = None  # after the server stopped
    on_serving: Callable[["RunningService"], Awaitable[None]] | None = None  # after SERVING, before the ready file
    registry: prometheus_client.CollectorRegistry = field(default_factory=lambda: prometheus_client.REGISTRY)
    grpc_options: Sequence[tuple[str, int]] = ()  # added to (or overriding) GRPC_OPTIONS
    host: str = HOST  # beyond loopback only with credentials (services/trust.py checks before building the spec)
    server_credentials: grpc.ServerCredentials | None = None  # mTLS; None: plaintext
    port_fallback: bool = False  # `port` taken: serve on a free port instead of failing (a restarted worker)


@dataclass
class RunningService:
    spec: ServiceSpec
    server: grpc.aio.Server
    health: health.aio.HealthServicer
    port: int
    metrics_port: int | None
    _metrics_server: object = None
    _task_gauge: asyncio.Task | None = None
    _stopped: asyncio.Event = field(default_factory=asyncio.Event)
    background: set[asyncio.Task] = field(default_factory=set)  # the service's own loops, cancelled at shutdown

    @property
    def address(self) -> str:
        return f"{self.spec.host}:{self.port}"

    @property
    def dial_address(self) -> str:
        """Where a peer on this host reaches the service: 127.0.0.1 when it listens on every address (a pod's
        services share one network namespace), else the address it listens on."""
        return f"127.0.0.1:{self.port}" if self.spec.host in ("0.0.0.0", "::", "[::]") else self.address

    async def set_serving(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", *self.spec.service_names):
            await self.health.set(name, status)

    async def shutdown(self) -> None:
        """The drain sequence; idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        log = logging.getLogger("octoserve.server")
        t0 = time.monotonic()
        log.info("draining", extra=log_fields(grace_s=self.spec.grace_s))
        await self.set_serving(False)
        if self.spec.drain is not None:
            try:
                await asyncio.wait_for(self.spec.drain(self.spec.grace_s), timeout=self.spec.grace_s)
            except TimeoutError:
                log.warning("grace period over with work in flight; cancelling it")
        remaining = max(0.0, self.spec.grace_s - (time.monotonic() - t0))
        await self.server.stop(min(remaining, 1.0))
        for task in self.background:
            task.cancel()
        if self.spec.close is not None:
            await self.spec.close()
        if self._metrics_server is not None:
            self._metrics_server.shutdown()
        if self._task_gauge is not None:
            self._task_gauge.cancel()
        log.info("stopped", extra=log_fields(drain_s=round(time.monotonic() - t0, 3)))


def _bind(server: grpc.aio.Server, spec: ServiceSpec, port: int) -> int:
    """The bound port, or 0 when `port` cannot be bound (taken by another process)."""
    address = f"{spec.host}:{port}"
    try:
        if spec.server_credentials is not None:
            return server.add_secure_port(address, spec.server_credentials)
        return server.add_insecure_port(address)
    except RuntimeError:  # grpcio reports a failed bind by raising (older versions: by returning 0)
        return 0


def _why_unbindable(host: str, port: int) -> str:
    """What the OS says to binding `host:port` now, as " (Address already in use)"; "" when it can be bound (grpc
    failed for a reason of its own). grpc's own error names no cause."""
    import socket

    host = host.strip("[]")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        return f" ({e.strerror})" if e.strerror else ""
    return ""


async def start_service(spec: ServiceSpec) -> RunningService:
    server = grpc.aio.server(options=tuple({**dict(GRPC_OPTIONS), **dict(spec.grpc_options)}.items()))
    spec.add_servicers(server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (*spec.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    port = _bind(server, spec, spec.port)
    if port == 0 and spec.port_fallback and spec.port != 0:
        port = _bind(server, spec, 0)
        logging.getLogger("octoserve.server").warning("port taken; serving on a free port instead",
                                                      extra=log_fields(wanted=spec.port, port=port))
    if port == 0:
        raise OSError(f"{spec.name}: cannot bind {spec.host}:{spec.port}{_why_unbindable(spec.host, spec.port)}; "
                      "choose a free port or 0")
    await server.start()
    metrics_server, metrics_port = None, None
    if spec.metrics_port is not None:
        metrics_server, _ = prometheus_client.start_http_server(spec.metrics_port, addr=spec.host, registry=spec.registry)
        metrics_port = metrics_server.server_port
    running = RunningService(spec, server, health_servicer, port, metrics_port, metrics_server)
    if spec.metrics_port is not None:
        running._task_gauge = start_task_gauge(spec.registry)
    if spec.start is not None:
        await spec.start()
    await running.set_serving(True)
    if spec.on_serving is not None:
        await spec.on_serving(running)
    if spec.ready_file:
        _write_ready_file(spec.ready_file, {"pid": os.getpid(), "port": port, "metrics_port": metrics_port})
    logging.getLogger("octoserve.server").info(
        "serving", extra=log_fields(address=running.address, metrics_port=metrics_port)
    )
    return running


def _write_ready_file(path: str, content: dict) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(content, f)
    os.replace(tmp, path)  # atomic: a reader never sees a half-written file


# Set by `octoserve.services.node.launcher` to its own pid: a service it started stops (drains) when the launcher dies.
LAUNCHER_PID_ENV = "OCTOSERVE_LAUNCHER_PID"


def stop_with_launcher() -> None:
    """Ask the kernel for SIGTERM when the launcher dies, even by SIGKILL, so no service outlives its node.

    Done here, in the service itself, rather than in a `preexec_fn` of the launcher's Popen: forking a process
    that runs gRPC threads and then running Python in the child is unsafe. The parent check after prctl closes
    the race with a launcher that died before it."""
    launcher_pid = os.environ.get(LAUNCHER_PID_ENV)
    if not launcher_pid or sys.platform != "linux":
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != int(launcher_pid):
        os.kill(os.getpid(), signal.SIGTERM)


async def serve_until_signal(spec: ServiceSpec) -> int:
    """Runs the service until SIGTERM/SIGINT, drains it, returns the exit code (0 on a clean drain)."""
    stop_with_launcher()
    running = await start_service(spec)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await running.shutdown()
    return 0


def run_main(spec: ServiceSpec) -> int:
    """Entry point of a service process: uvloop + `serve_until_signal`."""
    try:
        import uvloop

        return uvloop.run(serve_until_signal(spec))
    except ImportError:  # uvloop is a dependency; the fallback only keeps odd platforms working
        return asyncio.run(serve_until_signal(spec))
