"""The CPU-pinning helpers of scripts/bench_vllm_vs_octoserve.py --pin (scripts/pinning.py) on a real child process:
every thread of its tree lands on the core asked for. No vLLM start."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "scripts"))

from pinning import pin_tree, tree_pids  # noqa: E402

CHILD = ("import time,threading; [threading.Thread(target=time.sleep,args=(30,),daemon=True).start() "
         "for _ in range(3)]; time.sleep(30)")


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="pinning to one core of several needs two cores")
@pytest.mark.skipif(0 not in os.sched_getaffinity(0), reason="core 0 is not allowed to this process")
def test_pin_tree_pins_every_thread_of_a_child():
    proc = subprocess.Popen([sys.executable, "-c", CHILD])
    try:
        task_dir = Path(f"/proc/{proc.pid}/task")
        deadline = time.monotonic() + 10.0
        while len(list(task_dir.iterdir())) < 4:  # the main thread and its three sleepers
            assert proc.poll() is None and time.monotonic() < deadline, "child did not start its threads"
            time.sleep(0.02)
        assert tree_pids(proc.pid) == [proc.pid]
        assert pin_tree(proc.pid, 0) >= 4
        tids = [int(t.name) for t in task_dir.iterdir()]
        assert len(tids) >= 4
        assert {tid: os.sched_getaffinity(tid) for tid in tids} == {tid: {0} for tid in tids}
    finally:
        proc.kill()  # this child only, by its PID
        proc.wait()
