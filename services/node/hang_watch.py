"""The supervisor's hang check: a worker process that lives but does not serve is killed, so that the supervisor's
usual exit -> restart path (services/node/supervisor.py) brings it back.

A worker is hung when, for `hung_after_s` in a row while it is up (ready, not being restarted):
- its process is stopped (state T in /proc/PID/stat: SIGSTOP, a debugger), or
- it does not answer the gRPC health check within `probe_timeout_s` (an event loop wedged in a blocking call).
  Only silence counts: an answer of any kind (NOT_SERVING while it drains, UNAVAILABLE while it stops) is the
  worker speaking, and a worker that exits is the supervisor's ordinary exit path.
It is then sent SIGKILL (its own PID only; a stopped process dies of SIGKILL without being continued) and a
"hung" event is recorded with the reason. The router routes around a silent worker on its own, sooner
(router/watchdog.py); this check is slower on purpose, so a worker that is only slow (a CPU-starved machine) is not
killed with its requests.
Runs in a daemon thread started and stopped with the supervisor.
"""

from __future__ import annotations

import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from octoserve.services import trust

DEFAULT_HUNG_AFTER_S = 6.0
PROBE_EVERY_S = 0.5
PROBE_TIMEOUT_S = 1.0


def process_state(pid: int) -> str | None:
    """The one-letter state of a process (R, S, D, T, t, Z, ...), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text[text.rindex(")") + 2]  # the command name, in parentheses, may contain spaces


class HangWatch:
    def __init__(self, supervisor, hung_after_s: float = DEFAULT_HUNG_AFTER_S, probe_every_s: float = PROBE_EVERY_S,
                 probe_timeout_s: float = PROBE_TIMEOUT_S) -> None:
        self.supervisor = supervisor
        self.hung_after_s, self.probe_every_s, self.probe_timeout_s = hung_after_s, probe_every_s, probe_timeout_s
        self._bad_since: dict[tuple[str, int], float] = {}  # (service, pid) -> first failed check in the current run
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="octoserve-hang-watch", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self.probe_every_s):
            for sp in list(getattr(self.supervisor.node, "workers", {}).values()):
                if self._stop.is_set():
                    return
                self.check(sp, time.monotonic())

    def check(self, sp, now: float) -> str | None:
        """Probes one worker; kills it when it has been failing for `hung_after_s`. Returns why it is failing now."""
        pid = sp.pid
        key = (sp.name, pid)
        if not self.supervisor.is_up(sp):
            self._bad_since.pop(key, None)
            return None
        reason = self._probe(sp, pid)
        if reason is None:
            self._bad_since.pop(key, None)
            return None
        since = self._bad_since.setdefault(key, now)
        if now - since >= self.hung_after_s:
            self._bad_since.pop(key, None)
            self.supervisor.kill_hung(sp, pid, f"{reason} for {now - since:.1f} s")
        return reason

    def _probe(self, sp, pid: int) -> str | None:
        state = process_state(pid)
        if state is None or state == "Z":
            return None  # exited: the supervisor's own path
        if state in ("T", "t"):
            return "process stopped"
        try:
            with trust.sync_channel(sp.address) as channel:
                health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=self.probe_timeout_s)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                return f"no answer to the health check in {self.probe_timeout_s:g} s"
            return None
        return None  # any answer: it is alive
