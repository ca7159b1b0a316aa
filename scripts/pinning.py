"""CPU pinning helpers for the probes that hold the engine's CPU equal (scripts/ttft_pinned.py,
scripts/bench_vllm_vs_octoserve.py --pin): the engine's process tree on ENGINE_CORE, everything else on OTHER_CORE.

Pinning sets every thread's affinity (`sched_setaffinity` per task id), so threads started later inherit it;
processes started later by a pinned thread inherit it too, but pin again after start-up to catch any that reset it.
"""

from __future__ import annotations

import os
from pathlib import Path

ENGINE_CORE, OTHER_CORE = 0, 1


def tree_pids(pid: int) -> list[int]:
    """`pid` and every descendant (from /proc/PID/task/TID/children), parents first."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for t in Path(f"/proc/{p}/task").iterdir():
                todo.extend(int(k) for k in (t / "children").read_text().split())
        except (FileNotFoundError, ProcessLookupError):
            pass
    return out


def pin_tree(pid: int, core: int) -> int:
    """Every thread of `pid` and its descendants to `core`; how many threads were pinned."""
    n = 0
    for p in tree_pids(pid):
        try:
            for t in Path(f"/proc/{p}/task").iterdir():
                try:
                    os.sched_setaffinity(int(t.name), {core})
                    n += 1
                except (ProcessLookupError, PermissionError):
                    pass
        except FileNotFoundError:
            pass
    return n


def pin_self(core: int) -> int:
    """Every thread of this process to `core`; how many threads were pinned."""
    n = 0
    for t in Path("/proc/self/task").iterdir():
        try:
            os.sched_setaffinity(int(t.name), {core})
            n += 1
        except ProcessLookupError:  # a thread that ended meanwhile
            pass
    return n
