"""Keeps a running node's processes up: a service that exits while the node runs is started again, with backoff, on
the port it had, so its peers (the router's worker sessions, the workers' scheduler registration, clients of the
router) reconnect to the same address without being told anything.

- Backoff: the n-th restart in a row waits RESTART_BACKOFF_S[n] (0.2 s, doubling, capped at 10 s); a service that
  stayed up STABLE_S resets its count. After MAX_RESTARTS restarts in a row without a stable period the service is
  given up on (the `octoserve up` loop then stops the node and says which one).
- Only processes the launcher started are watched and restarted; nothing else is signalled. An entry without a
  command of its own (the HTTP front served inside the router process) is not restarted itself: it follows the
  process that serves it.
- A worker that lives but does not serve (stopped, or silent to health checks) is killed by the hang check
  (services/node/hang_watch.py, a "hung" event), and restarted like any exited service.
- Every event (exit, restart, ready, gave up, hung) is kept in `events` and handed to `on_event`, so `octoserve up`
  prints it and tests read it.
Runs in a daemon thread of the launcher; `Node.stop()` stops it first, so a stopping node is not restarted.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from octoserve.services.node.hang_watch import DEFAULT_HUNG_AFTER_S, HangWatch

RESTART_BACKOFF_S = (0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0)
STABLE_S = 30.0
MAX_RESTARTS = 8
POLL_S = 0.05


@dataclass(frozen=True, slots=True)
class SupervisorEvent:
    at_s: float  # time.monotonic()
    service: str
    event: str  # "exited", "restarting", "ready", "gave_up", "hung"
    detail: str = ""


class Supervisor:
    def __init__(self, node, on_event: Callable[[SupervisorEvent], None] | None = None, *,
                 backoff_s: tuple[float, ...] = RESTART_BACKOFF_S, max_restarts: int = MAX_RESTARTS,
                 stable_s: float = STABLE_S, hung_after_s: float | None = DEFAULT_HUNG_AFTER_S) -> None:
        self.node = node
        self.backoff_s, self.max_restarts, self.stable_s = backoff_s, max_restarts, stable_s
        self.on_event = on_event
        self.events: list[SupervisorEvent] = []
        self.gave_up: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="octoserve-supervisor", daemon=True)
        self._streak: dict[str, int] = {}  # service -> restarts in a row without a stable period
        self._up_since: dict[str, float] = {}
        self._restart_at: dict[str, float] = {}  # service -> when to restart it
        self._starting: set[str] = set()  # restarted, ready file not written yet
        self._lock = threading.Lock()
        self.hang_watch = HangWatch(self, hung_after_s) if hung_after_s is not None else None

    def start(self) -> None:
        now = time.monotonic()
        for sp in self.node.processes:
            self._up_since[sp.name] = now
        self._thread.start()
        if self.hang_watch is not None:
            self.hang_watch.start()

    def stop(self) -> None:
        self._stop.set()
        if self.hang_watch is not None:
            self.hang_watch.stop()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def restarts(self, service: str) -> int:
        return sum(1 for e in self.events if e.service == service and e.event == "restarting")

    def wait_for(self, service: str, event: str, count: int = 1, timeout_s: float = 60.0) -> None:
        """Blocks until `service` had `event` `count` times (raises TimeoutError)."""
        deadline = time.monotonic() + timeout_s
        while sum(1 for e in list(self.events) if e.service == service and e.event == event) < count:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{service} did not reach {event} x{count} in {timeout_s:g} s: {self.events}")
            time.sleep(POLL_S)

    @contextlib.contextmanager
    def held(self):
        """No restart starts (and no hung worker is killed) while this is held: the supervisor waits for it. For a
        caller that must act between a service's exit and its restart (a test taking the exited worker's port)."""
        with self._lock:
            yield

    def is_up(self, sp) -> bool:
        """Started and ready, not exited nor being restarted (what the hang check may judge)."""
        with self._lock:
            return not self._stop.is_set() and sp.name not in self._starting and sp.proc.poll() is None

    def kill_hung(self, sp, pid: int, reason: str) -> None:
        """SIGKILL a hung service's process (that PID only, if it is still the service's); the exit restarts it."""
        with self._lock:
            if self._stop.is_set() or sp.pid != pid or sp.proc.poll() is not None:
                return
            self._emit(sp, "hung", f"pid {pid}: {reason}; killing it")
            sp.proc.kill()

    def _emit(self, sp, event: str, detail: str = "") -> None:
        e = SupervisorEvent(time.monotonic(), sp.name, event, detail)
        self.events.append(e)
        if self.on_event is not None:
            self.on_event(e)

    def _run(self) -> None:
        while not self._stop.wait(POLL_S):
            with self._lock:
                self.poll(time.monotonic())

    def poll(self, now: float) -> None:
        for sp in self.node.processes:
            if self._stop.is_set():
                return
            if not sp.cmd:
                continue  # served by another entry's process (the router's in-process HTTP front): it follows that one
            name = sp.name
            if name in self._starting:
                self._check_started(sp, now)
                continue
            if sp.proc.poll() is None:
                if now - self._up_since.get(name, now) >= self.stable_s:
                    self._streak[name] = 0
                continue
            if name in self._restart_at:
                if now >= self._restart_at[name]:
                    del self._restart_at[name]
                    self._restart(sp, now)
                continue
            if self.gave_up is not None:
                continue
            streak = self._streak.get(name, 0)
            self._emit(sp, "exited", f"exit code {sp.proc.returncode}")
            if streak >= self.max_restarts:
                self.gave_up = name
                self._emit(sp, "gave_up", f"{streak} restarts in a row without staying up {self.stable_s:g} s")
                continue
            self._restart_at[name] = now + self.backoff_s[min(streak, len(self.backoff_s) - 1)]

    def _restart(self, sp, now: float) -> None:
        from octoserve.services.node.processes import reap_leftovers, respawn

        old = sp.proc
        if reap_leftovers(old):  # the dead process's own children (a vLLM engine core) go with it
            self._emit(sp, "reaped", "killed what the exited process left running in its process group")
        self._streak[sp.name] = self._streak.get(sp.name, 0) + 1
        self._emit(sp, "restarting", f"port {sp.port}, restart {self._streak[sp.name]} in a row")
        respawn(sp)
        for other in self.node.processes:  # entries served by the same process follow it
            if other is not sp and other.proc is old:
                other.proc = sp.proc
        self._starting.add(sp.name)

    def _check_started(self, sp, now: float) -> None:
        if sp.ready_file.exists():
            info = json.loads(sp.ready_file.read_text())
            moved = f" (port {sp.port} was taken)" if info["port"] != sp.port else ""
            sp.port, sp.metrics_port = info["port"], info["metrics_port"]
            self._starting.discard(sp.name)
            self._up_since[sp.name] = now
            self._emit(sp, "ready", f"pid {info['pid']} port {info['port']}{moved}")
        elif sp.proc.poll() is not None:  # died while starting (its port taken, say): the usual backoff applies
            self._starting.discard(sp.name)

