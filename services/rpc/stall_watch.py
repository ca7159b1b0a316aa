"""A worker's own progress check: an engine that has running requests but makes no step for `stall_after_s` wall
seconds (its
step loop stuck or dead, while the process, its gRPC server and its load reports carry on) is not trusted to
recover. The worker logs it and exits with EXIT_STALLED: the router sees the connection break and fails its requests
over (those without a token move, those with tokens end UNAVAILABLE with a retry hint), and the supervisor starts a
fresh process. A process that stopped altogether is the router's and the supervisor's to find (router/watchdog.py,
services/node/hang_watch.py): this check runs on the worker's event loop and needs it turning.

Not judged: an engine with nothing running (requests only waiting, say for KV that reservations hold, are not
stepped on a healthy engine either), a paused one (a gang lease holds it), and engines that do not count their
steps as `num_steps` (the sim engine does). The engine is looked up at every check: a role change (elastic pools)
builds a new one in the same process, and the watch starts over on it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger("octoserve.worker")

DEFAULT_STALL_AFTER_S = 10.0
CHECK_EVERY_S = 0.25
EXIT_STALLED = 70  # EX_SOFTWARE


class StallWatch:
    """Tracks when the current engine last stepped while it had work; `stalled_s` is how long it has not."""

    def __init__(self, engine_of: Callable[[], object]) -> None:
        self.engine_of = engine_of
        self._engine = None
        self._steps = 0
        self._since: float | None = None  # the first check that saw work and no new step

    def stalled_s(self, now: float) -> float:
        engine = self.engine_of()
        if not hasattr(engine, "num_steps"):
            return 0.0
        steps = engine.num_steps
        load = engine.load()
        has_work = load.num_running > 0 and not load.paused
        if engine is not self._engine or steps != self._steps or not has_work:
            self._engine, self._steps, self._since = engine, steps, None
            return 0.0
        if self._since is None:
            self._since = now
        return now - self._since


def _exit_stalled() -> None:
    os._exit(EXIT_STALLED)  # a stuck engine's state is not trusted: no drain, the supervisor starts a fresh one


async def watch_progress(engine_of: Callable[[], object], stall_after_s: float,
                         on_stall: Callable[[], None] = _exit_stalled) -> None:
    """Runs for the life of the worker; calls `on_stall` once the current engine (`engine_of()`) stalled
    `stall_after_s` with work."""
    if stall_after_s <= 0:
        return
    watch = StallWatch(engine_of)
    while True:
        await asyncio.sleep(CHECK_EVERY_S)
        stalled = watch.stalled_s(time.monotonic())
        if stalled >= stall_after_s:
            engine = engine_of()
            load = engine.load()
            log.error("engine made no step with work queued; exiting so that a fresh process replaces it",
                      extra={"fields": {"stalled_s": round(stalled, 2), "steps": engine.num_steps,
                                        "running": load.num_running, "waiting": load.num_waiting,
                                        "exit_code": EXIT_STALLED}})
            for handler in logging.getLogger().handlers:
                handler.flush()
            on_stall()
            return
