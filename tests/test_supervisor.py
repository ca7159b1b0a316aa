"""The supervisor (services/node/supervisor.py) with real child processes: a service that keeps exiting is restarted
with the backoff in order and on its port, then given up on; one that comes up (writes its ready file) is reported
ready with its new pid; a stopped supervisor restarts nothing."""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass

from octoserve.services.node.processes import ServiceProcess, group_members, popen
from octoserve.services.node.supervisor import Supervisor


@dataclass
class _Node:
    processes: list[ServiceProcess]


def _service(tmp_path, name: str, code: str) -> ServiceProcess:
    cmd = (sys.executable, "-c", code)
    log = tmp_path / f"{name}.log"
    sp = ServiceProcess(name, popen(cmd, log, None), tmp_path / f"{name}.ready.json", log, port=4321, cmd=cmd)
    return sp


def _run_until_given_up(sup: Supervisor, timeout_s: float = 30.0) -> None:
    sup.start()
    try:
        deadline = time.monotonic() + timeout_s
        while sup.gave_up is None and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        sup.stop()


def test_a_crash_looping_service_is_restarted_with_backoff_then_given_up(tmp_path):
    sp = _service(tmp_path, "worker:x", "import sys; sys.exit(3)")
    sup = Supervisor(_Node([sp]), backoff_s=(0.05, 0.1), max_restarts=3, stable_s=60)
    _run_until_given_up(sup)
    assert sup.gave_up == "worker:x"
    kinds = [e.event for e in sup.events]
    assert kinds == ["exited", "restarting"] * 3 + ["exited", "gave_up"]
    assert [e.detail for e in sup.events if e.event == "exited"] == ["exit code 3"] * 4
    assert sup.restarts("worker:x") == 3
    assert sp.proc.args[-3:] == ("--port", "4321", "--port-fallback")  # on the port it had (a free one if taken)
    gaps = [b.at_s - a.at_s for a, b in zip(sup.events, sup.events[1:]) if (a.event, b.event) == ("exited", "restarting")]
    # Never sooner than the backoff slot (a lower bound: a busy machine can only make it later).
    assert [g >= b for g, b in zip(gaps, (0.05, 0.1, 0.1))] == [True, True, True]


def test_a_restarted_service_is_reported_ready_and_a_stopped_supervisor_restarts_nothing(tmp_path):
    ready = tmp_path / "router.ready.json"
    # Exits at once the first time; the restart (which gets --port) writes its ready file and stays up.
    code = (f"import json, os, sys, time\n"
            f"if '--port' not in sys.argv: sys.exit(1)\n"
            f"open({str(ready)!r}, 'w').write(json.dumps({{'pid': os.getpid(), 'port': 4321, 'metrics_port': 9}}))\n"
            f"time.sleep(60)\n")
    sp = _service(tmp_path, "router", code)
    sup = Supervisor(_Node([sp]), backoff_s=(0.05,))
    sup.start()
    try:
        sup.wait_for("router", "ready", timeout_s=30)
        assert [e.event for e in sup.events] == ["exited", "restarting", "ready"]
        assert json.loads(ready.read_text())["pid"] == sp.proc.pid and sp.metrics_port == 9
        sup.stop()
        assert not sup._thread.is_alive()  # its poll loop has ended: nothing polls on its own any more
        events, restarted = list(sup.events), sp.proc
        restarted.kill()  # the child this test started, by its PID
        restarted.wait()
        # Even polled by hand, now and past every backoff slot, a stopped supervisor neither records the exit nor
        # restarts the service.
        sup.poll(time.monotonic())
        sup.poll(time.monotonic() + 3600.0)
        assert sup.events == events and sp.proc is restarted and sup.restarts("router") == 1
    finally:
        sup.stop()
        if sp.proc.poll() is None:
            sp.proc.kill()
            sp.proc.wait()


# A service that starts a child and dies without stopping it (as a SIGKILLed vLLM worker leaves its engine core).
ORPHANING = ("import subprocess, sys; "
             "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             "open(sys.argv[1], 'a').write(f'{child.pid}\\n'); sys.exit(9)")


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def _wait_gone(pid: int, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _alive(pid)


def test_reap_leftovers_kills_what_an_exited_service_left_in_its_process_group(tmp_path):
    from octoserve.services.node.processes import reap_leftovers

    pid_file = tmp_path / "child.pid"
    proc = popen((sys.executable, "-c", ORPHANING, str(pid_file)), tmp_path / "svc.log", None)
    assert proc.wait(timeout=30) == 9
    child = int(pid_file.read_text())
    assert _alive(child) and group_members(proc.pid) == [child]  # outlived its parent, in its process group
    assert reap_leftovers(proc) is True
    assert _wait_gone(child)
    assert reap_leftovers(proc) is False  # nothing left the second time


def test_reap_leftovers_refuses_a_running_process(tmp_path):
    import pytest

    from octoserve.services.node.processes import reap_leftovers

    proc = popen((sys.executable, "-c", "import time; time.sleep(30)"), tmp_path / "svc.log", None)
    try:
        with pytest.raises(ValueError, match=f"process {proc.pid} is still running: stop it before reaping its group"):
            reap_leftovers(proc)
    finally:
        proc.kill()
        proc.wait()


def test_the_supervisor_kills_a_dead_services_leftovers_before_restarting_it(tmp_path):
    from octoserve.services.node.processes import reap_leftovers

    pid_file = tmp_path / "child.pid"
    cmd = (sys.executable, "-c", ORPHANING, str(pid_file))
    sp = ServiceProcess("worker:x", popen(cmd, tmp_path / "x.log", None), tmp_path / "x.ready.json",
                        tmp_path / "x.log", port=4321, cmd=cmd)
    sup = Supervisor(_Node([sp]), backoff_s=(0.05,), max_restarts=1, stable_s=60)
    _run_until_given_up(sup)
    kinds = [e.event for e in sup.events]
    assert kinds == ["exited", "reaped", "restarting", "exited", "gave_up"]
    first, second = (int(line) for line in pid_file.read_text().split())
    assert _wait_gone(first)  # reaped before the restart
    assert _alive(second) and reap_leftovers(sp.proc)  # given up on: the node's stop reaps the last one's group
    assert _wait_gone(second)
