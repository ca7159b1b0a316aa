"""`octoserve up`: the whole node as separate processes on 127.0.0.1 — scheduler, one worker per instance, router.

Start order: scheduler -> workers (each registers with the scheduler) -> router (reads the placement from the
scheduler, opens a token session to every worker). Each process writes a ready file (pid and ports) once it
serves, so no ports are guessed; then every service must answer grpc.health.v1 SERVING, all within a bounded time.
Stop order (Ctrl-C / SIGTERM / `Node.stop()`): router first (with the HTTP front's own process, if any, at the same
moment: it drains client streams), then workers, then the scheduler; each gets SIGTERM and its grace period, then SIGKILL. Only processes this launcher started are signalled,
by PID.
Under `octoserve up` (`start_node(supervise=True)`), a `Supervisor` (services/node/supervisor.py) starts again, with
backoff and on the same port, any service that exits while the node runs (a worker killed mid-stream, the
scheduler, the router).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from octoserve.http_front.launch import http_front_args, inside_ready_file, inside_router_args, wait_http_healthy
from octoserve.services import trust
from octoserve.services.config import config_file
from octoserve.services.core.types import Role
from octoserve.services.node.processes import (
    REPO_ROOT,
    LaunchError,
    ServiceProcess,
    check_ports_free,
    spawn,
    stop_group,
    wait_healthy,
    wait_ready,
)
from octoserve.services.rpc.server import LAUNCHER_PID_ENV
from octoserve.services.node.supervisor import Supervisor

__all__ = ["REPO_ROOT", "LaunchError", "Node", "ServiceProcess", "start_node"]  # what callers of `octoserve up` use

DEFAULT_STARTUP_TIMEOUT_S = 60.0
VLLM_STARTUP_TIMEOUT_S = 300.0  # a vLLM engine starts in 20-110 s on a busy CPU machine, minutes for 70B on GPUs
DEFAULT_GRACE_S = 10.0
WORKER_MODULES = {Role.COLOCATED: "octoserve.decode_worker", Role.DECODE: "octoserve.decode_worker", Role.PREFILL: "octoserve.prefill_worker"}


@dataclass
class Node:
    """A running node. `stop()` drains and stops every process; returns name -> exit code."""

    router: ServiceProcess
    scheduler: ServiceProcess
    workers: dict[str, ServiceProcess]
    run_dir: Path
    grace_s: float = DEFAULT_GRACE_S
    exit_codes: dict[str, int] = field(default_factory=dict)
    supervisor: Supervisor | None = None
    http: ServiceProcess | None = None  # the OpenAI-compatible front (octoserve.http_front), when started
    keeper: object = None  # starts / stops workers of a model change (services/node/elastic_launch.py)

    @property
    def http_url(self) -> str | None:
        return None if self.http is None else f"http://{self.http.address}"

    @property
    def router_address(self) -> str:
        return self.router.address

    @property
    def processes(self) -> list[ServiceProcess]:
        return [*([self.http] if self.http else []), self.router, *self.workers.values(), self.scheduler]

    def stop(self) -> dict[str, int]:
        if self.supervisor is not None:
            self.supervisor.stop()  # a stopping node is not restarted
        if self.keeper is not None:
            self.keeper.stop()
        # The HTTP front's own process and the router together: both refuse new requests from the same moment
        # (503 / UNAVAILABLE) while the front's streams finish through the router, which drains until they have.
        for group in ([*([self.http] if self.http else []), self.router], list(self.workers.values()), [self.scheduler]):
            self.exit_codes.update(stop_group(group, self.grace_s))
        return self.exit_codes

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def user_path(path: str | Path | None) -> str | None:
    """A path as the caller's shell means it: `~` expanded, a relative one made absolute against the caller's working
    directory. The node's processes run in the checkout (`processes.popen`), where a relative path names something else."""
    return None if path is None else os.path.abspath(os.path.expanduser(os.fspath(path)))


def _config_path(config, run_dir: Path) -> str | None:
    """A path for the children: None (embedded default), a path, or a dict written out as YAML (its relative
    `tls.dir` made absolute against the caller's working directory first, since the file lands in the run
    directory)."""
    if config is None or isinstance(config, (str, Path)):
        return None if config is None else str(config)
    import yaml

    from octoserve.services.config import resolve_section_paths

    path = run_dir / "node.yaml"
    path.write_text(yaml.safe_dump(resolve_section_paths(dict(config), os.getcwd())))
    return str(path)


def start_node(
    config=None,
    time_scale: float = 1.0,
    *,
    engine: str = "sim",
    model_path: str | None = None,
    port: int = 0,
    run_dir: str | Path | None = None,
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S,
    grace_s: float = DEFAULT_GRACE_S,
    router_args: tuple[str, ...] = (),
    extra_env: Mapping[str, str] | None = None,
    supervise: bool = False,
    on_event=None,
    http_port: int | None = None,
    http_inside: bool = True,
    worker_args: tuple[str, ...] = (),
) -> Node:
    """Starts every process of the node and returns once all are SERVING (or stops them and raises LaunchError).

    config: None (embedded default placement), a YAML path, or a config dict. Paths (config, model_path, run_dir)
    are the caller's: relative ones are resolved against its working directory before any child starts (the
    children run in the checkout). extra_env: variables added to every child's environment (e.g.
    OCTOSERVE_VLLM_DTYPE for the vllm engine). http_port: start the OpenAI-compatible
    front on it (0: any free port; None: no front); http_inside: served by the router process (the default, measured
    faster: docs/bench/openai_front.md) or, when False, by a process of its own. supervise: restart services that
    exit (`Supervisor`; `on_event` gets its events); `octoserve up` does, harnesses that model a lost node do not.
    worker_args: extra flags for every worker (e.g. `--stall-after-s 2`).
    """
    from octoserve.router.tenants import tenant_settings_from_dict
    from octoserve.services.config import load_node_config, load_service_sections
    from octoserve.services.rpc.limits import limits_from_dict

    run_dir = Path(user_path(run_dir) if run_dir else tempfile.mkdtemp(prefix="octoserve-"))
    run_dir.mkdir(parents=True, exist_ok=True)
    if isinstance(config, (str, Path)):
        config = user_path(config)
    model_path = user_path(model_path)
    cfg_path = _config_path(config, run_dir)
    node_cfg = load_node_config(cfg_path)  # fail here, in one place, on a bad config
    sections = load_service_sections(cfg_path)
    try:  # the router reads these too; a bad one fails here, before any process starts
        limits_from_dict(sections.get("limits"))
        tenant_settings_from_dict(sections.get("tenants"))
        trust.configure(sections.get("tls"), "router")  # health checks speak the node's mTLS
        trust.worker_hosts(sections.get("network"))
    except (ValueError, trust.TrustError) as e:
        raise LaunchError(f"{cfg_path}: {e}") from None
    env = {**os.environ, **(extra_env or {}),
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
           LAUNCHER_PID_ENV: str(os.getpid())}  # each service stops when this process dies (services/rpc/server.py)
    common = ([] if cfg_path is None else ["--config", cfg_path]) + ["--grace-s", str(grace_s)]
    deadline = time.monotonic() + startup_timeout_s
    started: list[ServiceProcess] = []
    try:
        scheduler = spawn("scheduler", "octoserve.services.scheduler", [*common, "--time-scale", str(time_scale),
                           "--placement-file", str(run_dir / "placement.json")], run_dir, env)
        started.append(scheduler)
        wait_ready(scheduler, deadline)
        workers = {}
        for inst in node_cfg.instances:
            args = [*common, "--instance", inst.id, "--engine", engine, "--time-scale", str(time_scale),
                    "--scheduler", scheduler.address, *(["--model", model_path] if model_path else []), *worker_args]
            workers[inst.id] = spawn(f"worker:{inst.id}", WORKER_MODULES[inst.role], args, run_dir, env)
            started.append(workers[inst.id])
        # The router waits for a complete placement and every worker's session: give it the whole startup budget
        # (vLLM workers take 20-110 s to start on a CPU machine, past the router's own 60 s default).
        inside = http_port is not None and http_inside
        router = spawn("router", "octoserve.router", [*common, "--scheduler", scheduler.address, "--time-scale",
                                             str(time_scale), "--port", str(port),
                                             "--startup-timeout-s", str(startup_timeout_s), *router_args,
                                             *(inside_router_args(http_port, model_path, run_dir) if inside else ())],
                        run_dir, env)
        started.append(router)
        for sp in started:
            wait_ready(sp, deadline)
            wait_healthy(sp.address, deadline, internal=sp is not router)
        http = None
        if http_port is not None and inside:  # the router process serves it: the same process, its own ready file
            http = ServiceProcess("http_front", router.proc, inside_ready_file(run_dir), router.log_file)
        elif http_port is not None:  # after the router: it needs the router's port
            http = spawn("http_front", "octoserve.http_front", http_front_args(
                router.address, http_port, model_path, grace_s, startup_timeout_s, cfg_path), run_dir, env)
            started.append(http)
        if http is not None:
            wait_ready(http, deadline)
            wait_http_healthy(http.address, deadline)
    except BaseException:
        stop_group(list(reversed(started)), grace_s=1.0)
        raise
    node = Node(router, scheduler, workers, run_dir, grace_s, http=http)
    node.keeper = _placement_keeper(node, cfg_path, grace_s, engine, time_scale, model_path, env)
    if supervise:
        node.supervisor = Supervisor(node, on_event)
        node.supervisor.start()
    return node


def _placement_keeper(node: Node, cfg_path: str | None, grace_s: float, engine: str, time_scale: float,
                      model_path: str | None, env: dict[str, str]):
    """Starts the thread that starts and stops workers as model changes retire and start instances."""
    from octoserve.services.config import raw_config_with_overrides
    from octoserve.services.node.elastic_launch import PlacementKeeper
    from octoserve.services.rpc import convert

    base = raw_config_with_overrides(cfg_path, [])

    def spawn_worker(instance_id: str, role_pb: int, config_path: str) -> ServiceProcess:
        args = ["--config", config_path, "--grace-s", str(grace_s), "--instance", instance_id, "--engine", engine,
                "--time-scale", str(time_scale), "--scheduler", node.scheduler.address,
                *(["--model", model_path] if model_path else [])]
        return spawn(f"worker:{instance_id}", WORKER_MODULES[convert.ROLE_FROM_PB[role_pb]], args, node.run_dir, env)

    keeper = PlacementKeeper(node, base, spawn_worker, lambda sp: stop_group([sp], grace_s))
    keeper.start()
    return keeper


# ---- the `octoserve up` subcommand ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from octoserve.services.flags import parse_duration_s
    from octoserve.services.config import add_cost_profile_argument

    parser.add_argument("--config", type=config_file, default=None,
                        help="node config YAML (default: the embedded placement)")
    parser.add_argument("--time-scale", type=float, default=1.0,
                        help="dilate modelled time by K (sim engine; default 1: real time)")
    parser.add_argument("--engine", choices=("sim", "vllm"), default="sim",
                        help="sim (default): virtual GPUs timed by the cost model; vllm: a real model (--model)")
    parser.add_argument("--model", default=None, help="model directory (vllm engine)")
    parser.add_argument("--port", type=int, default=50051, help="router port on 127.0.0.1 (default 50051)")
    parser.add_argument("--http-port", type=int, default=8000,
                        help="OpenAI-compatible HTTP front on 127.0.0.1 (default 8000; 0: any free port)")
    parser.add_argument("--no-http", action="store_true", help="do not start the HTTP front")
    parser.add_argument("--http-process", action="store_true",
                        help="run the HTTP front as a process of its own instead of inside the router process")
    parser.add_argument("--run-dir", default=None, help="where logs and ready files go (default: a temp dir)")
    parser.add_argument("--startup-timeout-s", type=parse_duration_s, default=None,
                        help=f"how long to wait for every service to be healthy (default "
                             f"{DEFAULT_STARTUP_TIMEOUT_S:g} s, {VLLM_STARTUP_TIMEOUT_S:g} s with --engine vllm)")
    parser.add_argument("--grace-s", type=parse_duration_s, default=DEFAULT_GRACE_S,
                        help=f"how long each service drains its in-flight streams after SIGTERM (default "
                             f"{DEFAULT_GRACE_S:g} s)")
    parser.add_argument("--access-log", choices=("off", "errors", "all"), default="errors",
                        help="router access log: every request (all), failed ones + 1 in 100 ok ones (errors, the "
                             "default), off")
    add_cost_profile_argument(parser)


def run(args: argparse.Namespace) -> int:
    from octoserve.services.flags import check_positive
    from octoserve.services.config import config_source

    check_positive("--time-scale", args.time_scale, "the time scale (wall seconds per modelled second)",
                   "--time-scale 10")
    # What the user typed means what it means in their shell: the children run in the checkout.
    args.config, args.model, args.run_dir = user_path(args.config), user_path(args.model), user_path(args.run_dir)
    ports = [("--port", args.port, "stop what listens there or give the router another --port (0: any free port)")]
    if not args.no_http:
        ports.append(("--http-port", args.http_port, "stop what listens there, give the HTTP front another "
                                                      "--http-port (0: any free port), or pass --no-http"))
    check_ports_free(ports)  # before any process starts: a taken port is one line here, not a child's log
    try:
        node = start_node(config_source(args.config, args.cost_profile), args.time_scale, engine=args.engine, model_path=args.model, port=args.port,
                          run_dir=args.run_dir, startup_timeout_s=startup_timeout_s(args), grace_s=args.grace_s,
                          http_port=None if args.no_http else args.http_port, http_inside=not args.http_process,
                          router_args=("--access-log", args.access_log), supervise=True, on_event=_print_event)
    except LaunchError as e:
        print(f"octoserve up: {e}", file=sys.stderr)
        return 1
    with _recorded_signals() as received:  # before the endpoints are printed: whoever reads them may signal at once
        print(describe(node), flush=True)
        stop = _wait_for_signal_or_exit(node, received)
    codes = node.stop()
    bad = {name: code for name, code in codes.items() if code != 0}
    print(f"stopped ({stop}); exit codes: " + (", ".join(f"{n}={c}" for n, c in bad.items()) or "all 0"), flush=True)
    return 0 if not bad and stop == "signal" else 1


def startup_timeout_s(args: argparse.Namespace) -> float:
    if args.startup_timeout_s is not None:
        return args.startup_timeout_s
    return VLLM_STARTUP_TIMEOUT_S if args.engine == "vllm" else DEFAULT_STARTUP_TIMEOUT_S


def describe(node: Node) -> str:
    lines = [f"router     {node.router.address}  (octoserve.v1.Generation)  metrics :{node.router.metrics_port}",
             f"scheduler  {node.scheduler.address}  metrics :{node.scheduler.metrics_port}"]
    if node.http is not None:
        lines.insert(1, f"http       {node.http_url}  (OpenAI-compatible: /v1/completions, /v1/chat/completions, /v1/models)")
    lines += [f"worker     {sp.address}  {iid}  metrics :{sp.metrics_port}" for iid, sp in node.workers.items()]
    lines.append(f"logs       {node.run_dir}  (JSON lines)")
    return "\n".join(lines)


@contextlib.contextmanager
def _recorded_signals():
    """SIGINT/SIGTERM are appended to the yielded list instead of ending the process."""
    received: list[int] = []
    previous = {s: signal.signal(s, lambda signum, frame: received.append(signum))
                for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield received
    finally:
        for s, h in previous.items():
            signal.signal(s, h)


def _print_event(e) -> None:
    print(f"{e.service}: {e.event}" + (f" ({e.detail})" if e.detail else ""), flush=True)


def _wait_for_signal_or_exit(node: Node, received: list[int]) -> str:
    """Blocks until a signal is recorded ("signal") or until a service exits and is not restarted (its name)."""
    while not received:
        if node.supervisor is not None:
            if node.supervisor.gave_up is not None:
                return node.supervisor.gave_up
        else:
            for sp in node.processes:
                if sp.proc.poll() is not None:
                    return sp.name
        time.sleep(0.2)
    return "signal"
