"""`octoserve up`: the whole node as separate processes on 127.0.0.1 — scheduler, one worker per instance, router.

Start order: scheduler -> workers (each registers with the scheduler) -> router (reads the placement from the
scheduler, opens a token session to every worker). Each process writes a ready file (pid and ports) once it
serves, so no ports are guessed; then every service must answer grpc.health.v1 SERVING, all within a bounded time.
Stop order (Ctrl-C / SIGTERM / `Node.stop()`): router first (with the HTTP front's own process, if any, at the same
moment: it drains client streams), then workers, then the scheduler; each gets SIGTERM and its grace period, then SIGKILL. Only processes this launcher started are signalled,
by PID.
Under `octoserve up` (`start_node(supervise=True)`), a `Supervisor` (services/supervisor.py) starts again, with
backoff and on the same port, any service that exits while the node runs (a worker killed mid-stream, the
scheduler, the router).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from octoserve.http_front.launch import http_front_args, inside_ready_file, inside_router_args, wait_http_healthy
from octoserve.services import trust
from octoserve.services.core.types import Role
from octoserve.services.rpc.server import LAUNCHER_PID_ENV
from octoserve.services.supervisor import Supervisor

REPO_ROOT = Path(__file__).resolve().parents[1]
POLL_S = 0.05
DEFAULT_STARTUP_TIMEOUT_S = 60.0
VLLM_STARTUP_TIMEOUT_S = 300.0  # a vLLM engine starts in 20-110 s on a busy CPU machine, minutes for 70B on GPUs
DEFAULT_GRACE_S = 10.0
WORKER_MODULES = {Role.COLOCATED: "octoserve.decode_worker", Role.DECODE: "octoserve.decode_worker", Role.PREFILL: "octoserve.prefill_worker"}


class LaunchError(RuntimeError):
    """A service did not come up; the message names it and points at its log."""


@dataclass
class ServiceProcess:
    name: str
    proc: subprocess.Popen
    ready_file: Path
    log_file: Path
    port: int = 0
    metrics_port: int | None = None
    cmd: tuple[str, ...] = ()  # how it was started: a restart runs it again with --port pinned
    env: dict[str, str] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.proc.pid


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
    keeper: object = None  # starts / stops workers of a model change (services/elastic_launch.py)

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
            self.exit_codes.update(_stop_group(group, self.grace_s))
        return self.exit_codes

    def __enter__(self) -> Node:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def reap_leftovers(proc: subprocess.Popen) -> bool:
    """SIGKILL whatever an exited service left running. Every service starts as the leader of its own process group
    (`_popen`: start_new_session), so what is still in that group is a child it started and never stopped: a
    SIGKILLed vLLM worker leaves its engine core running, holding its memory (and on a GPU the device's), which a
    restarted worker would then share with. The group's number is not reused while any member lives, so this signals
    nothing else. True when something was left."""
    if proc.poll() is None:
        raise ValueError(f"process {proc.pid} is still running: stop it before reaping its group")
    if not group_members(proc.pid):
        return False
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:  # they exited meanwhile
        return False
    return True


def group_members(pgid: int) -> list[int]:
    """The live processes of process group `pgid` (zombies left out: they hold nothing but a process table slot)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it exited while we read
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(stat.parent.name))
    return members


def _stop_group(group: list[ServiceProcess], grace_s: float) -> dict[str, int]:
    """SIGTERM to every process of the group at once (one signal per process: the front inside the router is the
    router's process), then each one's exit code by name, SIGKILL past its grace."""
    signalled: set[int] = set()
    for sp in group:
        if sp.proc.poll() is None and id(sp.proc) not in signalled:
            signalled.add(id(sp.proc))
            sp.proc.send_signal(signal.SIGTERM)
    codes = {}
    for sp in group:
        try:
            codes[sp.name] = sp.proc.wait(timeout=grace_s + 5.0)
        except subprocess.TimeoutExpired:
            sp.proc.kill()  # this process only, by its PID
            codes[sp.name] = sp.proc.wait()
        reap_leftovers(sp.proc)
    return codes


def _spawn(name: str, module: str, args: list[str], run_dir: Path, env: dict[str, str]) -> ServiceProcess:
    safe = name.replace(":", "-").replace("/", "-")
    ready = run_dir / f"{safe}.ready.json"
    log = run_dir / f"{safe}.log"
    cmd = (sys.executable, "-m", module, *args, "--ready-file", str(ready))
    return ServiceProcess(name, _popen(cmd, log, env), ready, log, cmd=cmd, env=env)


def _popen(cmd, log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "ab") as log_f:
        return _SPAWNER.popen(cmd, cwd=REPO_ROOT, env=env, stdout=log_f, stderr=subprocess.STDOUT,
                              start_new_session=True)  # Ctrl-C in a terminal reaches the launcher only


class _Spawner:
    """Starts every service process from one thread that lives as long as this process.

    A service asks the kernel for SIGTERM when its launcher dies (PR_SET_PDEATHSIG, `stop_with_launcher` in
    services/rpc/server.py), and Linux sends it when the *thread* that started the process ends, not the process. A
    worker started from the placement keeper's thread (a model change) or the supervisor's (a restart) got SIGTERM
    when `Node.stop()` ended that thread: ahead of the ordered stop (router first), and when it landed as the worker
    was already exiting from the launcher's own SIGTERM, the worker died of it (exit -15)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def popen(self, cmd, **kwargs) -> subprocess.Popen:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="octoserve-spawner", daemon=True)
                self._thread.start()
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((cmd, kwargs, done))
        return done.result()

    def _run(self) -> None:
        while True:  # a daemon thread: it ends with the process, so PR_SET_PDEATHSIG fires with the process only
            cmd, kwargs, done = self._jobs.get()
            try:
                done.set_result(subprocess.Popen(cmd, **kwargs))
            except BaseException as e:  # noqa: BLE001 (handed to the caller)
                done.set_exception(e)


_SPAWNER = _Spawner()


def respawn(sp: ServiceProcess) -> None:
    """Starts an exited service again on the port it had (its peers reconnect there); its ready file is rewritten.
    A worker whose port was taken meanwhile serves on a free one and registers that address with the scheduler,
    whose placement the router follows (router/placement_watch.py); the supervisor reads the new port from the ready file."""
    sp.ready_file.unlink(missing_ok=True)
    fallback = ("--port-fallback",) if sp.name.startswith("worker:") else ()
    sp.proc = _popen((*sp.cmd, "--port", str(sp.port), *fallback), sp.log_file, sp.env)


def _wait_ready(sp: ServiceProcess, deadline: float) -> None:
    while not sp.ready_file.exists():
        if sp.proc.poll() is not None:
            cause = cause_in_log(sp.log_file)
            raise LaunchError(f"{sp.name} exited with code {sp.proc.returncode} while starting"
                              + (f": {cause}" if cause else "") + f"; see {sp.log_file}")
        if time.monotonic() > deadline:
            raise LaunchError(f"{sp.name} did not become ready in time; see {sp.log_file}")
        time.sleep(POLL_S)
    info = json.loads(sp.ready_file.read_text())
    sp.port, sp.metrics_port = info["port"], info["metrics_port"]


def cause_in_log(log_file: Path, tail_bytes: int = 65536) -> str | None:
    """Why a service stopped, as its log says it: the last exception line of a traceback (`OSError: ...`), or the
    message of the last error-level JSON line, whichever comes last; None when the log says neither."""
    import re

    try:
        with open(log_file, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            lines = f.read().decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    exception = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Failure)(: .*)?$")
    for line in reversed(lines):
        line = line.strip()
        if line.startswith("{"):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and str(entry.get("level", "")).lower() in ("error", "critical"):
                return str(entry.get("msg", line))
        elif exception.match(line):
            return line
    return None


def check_ports_free(ports: list[tuple[str, int, str]]) -> None:
    """Each (flag, port, how to change it) can be listened on at 127.0.0.1 now (0: any free port, not checked), and
    no two flags name the same port: else `UsageError` naming the flag and the port, before anything starts. (The
    service binds it a moment later: the check cannot hold it, but a port in use is the usual case.)"""
    import errno
    import socket

    from octoserve.services.usage import UsageError

    held: dict[int, str] = {}
    sockets = []
    try:
        for flag, port, change in ports:
            if not 0 <= port <= 65535:
                raise UsageError(f"{flag} {port}: not a port number; give one in 1-65535 (0: any free port)")
            if port == 0:
                continue
            if port in held:
                raise UsageError(f"{flag} {port}: {held[port]} is {port} too; give them different ports")
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sockets.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the services bind: TIME_WAIT is no conflict
            try:
                s.bind(("127.0.0.1", port))
            except OSError as e:
                why = "is already in use" if e.errno == errno.EADDRINUSE else f"cannot be listened on ({e.strerror})"
                raise UsageError(f"{flag} {port}: 127.0.0.1:{port} {why}; {change}") from None
            held[port] = flag
    finally:
        for s in sockets:
            s.close()


def wait_healthy(address: str, deadline: float, service: str = "", internal: bool = True) -> None:
    """Polls grpc.health.v1 Check until SERVING or the deadline (raises LaunchError); `internal`: the node's mTLS,
    when configured (the router's public port is plaintext)."""
    with (trust.sync_channel(address) if internal else grpc.insecure_channel(address)) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise LaunchError(f"{address} is not SERVING after the startup timeout")
            time.sleep(POLL_S)


def user_path(path: str | Path | None) -> str | None:
    """A path as the caller's shell means it: `~` expanded, a relative one made absolute against the caller's working
    directory. The node's processes run in the checkout (`_popen`), where a relative path names something else."""
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
        scheduler = _spawn("scheduler", "octoserve.services.scheduler", [*common, "--time-scale", str(time_scale),
                           "--placement-file", str(run_dir / "placement.json")], run_dir, env)
        started.append(scheduler)
        _wait_ready(scheduler, deadline)
        workers = {}
        for inst in node_cfg.instances:
            args = [*common, "--instance", inst.id, "--engine", engine, "--time-scale", str(time_scale),
                    "--scheduler", scheduler.address, *(["--model", model_path] if model_path else []), *worker_args]
            workers[inst.id] = _spawn(f"worker:{inst.id}", WORKER_MODULES[inst.role], args, run_dir, env)
            started.append(workers[inst.id])
        # The router waits for a complete placement and every worker's session: give it the whole startup budget
        # (vLLM workers take 20-110 s to start on a CPU machine, past the router's own 60 s default).
        inside = http_port is not None and http_inside
        router = _spawn("router", "octoserve.router", [*common, "--scheduler", scheduler.address, "--time-scale",
                                             str(time_scale), "--port", str(port),
                                             "--startup-timeout-s", str(startup_timeout_s), *router_args,
                                             *(inside_router_args(http_port, model_path, run_dir) if inside else ())],
                        run_dir, env)
        started.append(router)
        for sp in started:
            _wait_ready(sp, deadline)
            wait_healthy(sp.address, deadline, internal=sp is not router)
        http = None
        if http_port is not None and inside:  # the router process serves it: the same process, its own ready file
            http = ServiceProcess("http_front", router.proc, inside_ready_file(run_dir), router.log_file)
        elif http_port is not None:  # after the router: it needs the router's port
            http = _spawn("http_front", "octoserve.http_front", http_front_args(
                router.address, http_port, model_path, grace_s, startup_timeout_s, cfg_path), run_dir, env)
            started.append(http)
        if http is not None:
            _wait_ready(http, deadline)
            wait_http_healthy(http.address, deadline)
    except BaseException:
        _stop_group(list(reversed(started)), grace_s=1.0)
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
    import yaml

    from octoserve.services.config import default_config_text
    from octoserve.services.elastic_launch import PlacementKeeper
    from octoserve.services.rpc import convert

    base = yaml.safe_load(default_config_text() if cfg_path is None else Path(cfg_path).read_text())

    def spawn_worker(instance_id: str, role_pb: int, config_path: str) -> ServiceProcess:
        args = ["--config", config_path, "--grace-s", str(grace_s), "--instance", instance_id, "--engine", engine,
                "--time-scale", str(time_scale), "--scheduler", node.scheduler.address,
                *(["--model", model_path] if model_path else [])]
        return _spawn(f"worker:{instance_id}", WORKER_MODULES[convert.ROLE_FROM_PB[role_pb]], args, node.run_dir, env)

    keeper = PlacementKeeper(node, base, spawn_worker, lambda sp: _stop_group([sp], grace_s))
    keeper.start()
    return keeper


# ---- the `octoserve up` subcommand ----------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from octoserve.services.flags import parse_duration_s
    from octoserve.services.sim.cli_simulate import add_cost_profile_argument

    parser.add_argument("--config", default=None, help="node config YAML (default: the embedded placement)")
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
    from octoserve.services.sim.cli_simulate import config_source

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
