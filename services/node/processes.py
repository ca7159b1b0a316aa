"""The node's service processes: how one is started, waited for, stopped and started again.

Every service runs as the leader of its own process group, started from one long-lived thread (`_Spawner`), in
the checkout, its output appended to its log; it writes a ready file (pid and ports) once it serves. Only
processes started here are signalled, by PID (and what an exited one left in its group, by group). Used by the
launcher (`octoserve up`), the supervisor that restarts a service, the HTTP front's launch and the cluster picker.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from octoserve.services import trust

REPO_ROOT = Path(__file__).resolve().parents[2]
POLL_S = 0.05


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



def reap_leftovers(proc: subprocess.Popen) -> bool:
    """SIGKILL whatever an exited service left running. Every service starts as the leader of its own process group
    (`popen`: start_new_session), so what is still in that group is a child it started and never stopped: a
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


def stop_group(group: list[ServiceProcess], grace_s: float) -> dict[str, int]:
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


def spawn(name: str, module: str, args: list[str], run_dir: Path, env: dict[str, str]) -> ServiceProcess:
    safe = name.replace(":", "-").replace("/", "-")
    ready = run_dir / f"{safe}.ready.json"
    log = run_dir / f"{safe}.log"
    cmd = (sys.executable, "-m", module, *args, "--ready-file", str(ready))
    return ServiceProcess(name, popen(cmd, log, env), ready, log, cmd=cmd, env=env)


def popen(cmd, log: Path, env: dict[str, str]) -> subprocess.Popen:
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
    sp.proc = popen((*sp.cmd, "--port", str(sp.port), *fallback), sp.log_file, sp.env)


def wait_ready(sp: ServiceProcess, deadline: float) -> None:
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
