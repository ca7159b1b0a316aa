"""Gang members whose engine can only be paused and resumed: an arbiter step is a *slice* of engine iterations.

vLLM's AsyncLLM runs its own step loop; octoserve cannot hand it one iteration at a time. It can stop the loop at
an iteration boundary and start it again, keeping every request and its KV (`pause_generation(mode="keep")` /
`resume_generation()`, the engine's `pause()` / `resume()`). `EngineSliceMember` turns that into the gang protocol
of `GangDriver`: told to start with a cap, it resumes its engine and pauses it again after `min(slice_s, cap)`
less `stop_margin_s` (the pause lands at the end of the iteration then running, so a slice overruns its planned
length by up to one iteration), or as soon as it has no request left.

Requests go through the member (`generate`), which counts the ones in flight: that count is the member's `has_work`
(the engine's own stats stop while it is paused) and every arrival or completion wakes the driver.

Invariants: the engine is paused whenever the member is not inside a slice (`park()` before the driver starts);
each slice is recorded as a (resume called, pause returned) window on the monotonic clock, the clock vLLM's engine
core stamps its step outputs with, so a test can check every step of the engine against the windows.
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from octoserve.services.core.gang import MemberView
from octoserve.services.core.types import RequestOutput, RequestSpec
from octoserve.services.engine.base import Engine

_WINDOWS_KEPT = 100_000


@dataclass
class SliceStats:
    num_slices: int = 0
    num_overruns: int = 0  # slices that ran longer than the arbiter's cap
    max_overrun_s: float = 0.0
    pause_s: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))  # pause() times
    resume_s: collections.deque = field(default_factory=lambda: collections.deque(maxlen=4096))  # resume() times


class EngineSliceMember:
    def __init__(self, member_id: str, engine: Engine, *, slice_s: float, min_slice_s: float,
                 stop_margin_s: float = 0.0, time_scale: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0 < min_slice_s <= slice_s:
            raise ValueError(f"need 0 < min_slice_s <= slice_s, got {min_slice_s} and {slice_s}")
        self.member_id = member_id
        self.engine = engine
        self.slice_s = slice_s
        self.min_slice_s = min_slice_s
        self.stop_margin_s = stop_margin_s
        self.time_scale = time_scale
        self.stats = SliceStats()
        self.windows: collections.deque[tuple[float, float]] = collections.deque(maxlen=_WINDOWS_KEPT)
        self.on_change: Callable[[], None] = lambda: None  # set to the driver's wake
        self._clock = clock
        self._num_active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._slice: asyncio.Task | None = None

    @property
    def num_active(self) -> int:
        return self._num_active

    async def park(self) -> None:
        """Pause the engine before the driver starts: from now on it steps only inside slices."""
        await self.engine.pause()

    async def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        self._num_active += 1
        self._idle.clear()
        self.on_change()
        try:
            async for out in self.engine.generate(spec):
                yield out
        finally:
            self._num_active -= 1
            if self._num_active == 0:
                self._idle.set()
            self.on_change()

    # ---- the gang protocol -------------------------------------------------------------------------------------

    def view(self) -> MemberView:
        return MemberView(self.member_id, self._num_active > 0, self.min_slice_s)

    def notify(self, shared: bool, tail_lent: bool = False) -> None:
        """Nothing to do: a vLLM engine's load report does not model shared steps."""

    async def start(self, cap_s: float, shared: bool = False) -> float | None:
        if self._num_active == 0:
            return None
        length_s = max(self.min_slice_s, min(self.slice_s, cap_s) - self.stop_margin_s)
        began = self._clock()
        await self.engine.resume()
        self.stats.resume_s.append(self._clock() - began)
        self._slice = asyncio.create_task(self._run_slice(began, length_s, cap_s))
        return length_s

    async def wait_end(self) -> None:
        assert self._slice is not None, "wait_end without start"
        task, self._slice = self._slice, None
        await task

    async def _run_slice(self, began: float, length_s: float, cap_s: float) -> None:
        remaining = began + length_s * self.time_scale - self._clock()
        if remaining > 0:
            try:
                await asyncio.wait_for(self._idle.wait(), remaining)  # out of work: end the slice early
            except TimeoutError:
                pass
        stop = self._clock()
        await self.engine.pause()
        ended = self._clock()
        self.stats.pause_s.append(ended - stop)
        self.windows.append((began, ended))
        self.stats.num_slices += 1
        overrun_s = (ended - began) / self.time_scale - cap_s
        if overrun_s > 0:
            self.stats.num_overruns += 1
            self.stats.max_overrun_s = max(self.stats.max_overrun_s, overrun_s)


class LocalGang:
    """One gang group of local pause/resume engines (e.g. two vLLM engines on one host) under the arbiter.

    `start()` parks every engine and runs the driver; from then on an engine steps only inside the slices the
    arbiter gives it. `stop()` stops the driver (letting a running slice end) and resumes every engine, which then
    runs freely again. Requests go through the members' `generate`.
    """

    def __init__(self, policy, lm: EngineSliceMember, sms: list[EngineSliceMember]) -> None:
        from octoserve.services.core.gang import GangArbiter
        from octoserve.services.scheduler.gang_driver import GangDriver

        self.lm = lm
        self.sms = list(sms)
        self.arbiter = GangArbiter(policy, lm.member_id, [s.member_id for s in self.sms])
        self.driver = GangDriver(self.arbiter, lm, self.sms, time_scale=lm.time_scale)
        for member in self.members:
            member.on_change = self.driver.wake
        self._task: asyncio.Task | None = None

    @property
    def members(self) -> list[EngineSliceMember]:
        return [self.lm, *self.sms]

    def member(self, member_id: str) -> EngineSliceMember:
        return next(m for m in self.members if m.member_id == member_id)

    async def start(self) -> None:
        await asyncio.gather(*(m.park() for m in self.members))
        self._task = asyncio.create_task(self.driver.run(), name="gang-driver")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        for member in self.members:
            member.on_change = lambda: None
        await asyncio.gather(*(m.engine.resume() for m in self.members))
