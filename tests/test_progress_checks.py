"""The pieces of the hang and stall checks that need no node: the `engine_stall` fault's syntax, and how a process's
state reads from /proc (a stopped process is what the supervisor's hang check kills)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from octoserve.services.faults import FaultPlan
from octoserve.services.node.hang_watch import process_state


def test_engine_stall_fault_names_an_instance_and_a_step():
    assert FaultPlan.parse("engine_stall=c0@150").engine_stall == ("c0", 150)
    plan = FaultPlan.parse("kv_transfer=corrupt; engine_stall=sm-1@7")
    assert plan.engine_stall == ("sm-1", 7) and [f.kind for f in plan.kv_transfer] == ["corrupt"]
    assert FaultPlan.parse("").engine_stall is None
    for bad in ("engine_stall=c0", "engine_stall=@5", "engine_stall=c0@soon"):
        with pytest.raises(ValueError, match="engine_stall needs INSTANCE@STEPS"):
            FaultPlan.parse(bad)
    with pytest.raises(ValueError, match="known: kv_transfer, engine_stall"):
        FaultPlan.parse("disk=full")


def test_process_state_reads_stopped_running_and_gone():
    # The child says when it is up: while it still starts it may be in disk sleep ("D"), reading its imports.
    child = subprocess.Popen([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"],
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"
        deadline = time.monotonic() + 10
        while process_state(child.pid) not in ("S", "R") and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(child.pid) in ("S", "R")
        os.kill(child.pid, signal.SIGSTOP)
        while process_state(child.pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(child.pid) == "T"
        os.kill(child.pid, signal.SIGCONT)
        while process_state(child.pid) == "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert process_state(child.pid) in ("S", "R")
    finally:
        child.kill()  # this child only
        child.wait()
    assert process_state(child.pid) is None
