"""The gang arbiter's adapter loop on the real clock: who runs next on a gang group's GPUs, live.

`GangDriver` runs the protocol of `octoserve.services.core.gang` (decide -> start -> started / nothing_to_run ->
finished -> decide) over *members*: anything that can run one arbiter step when told, within a cap, and say when
it ended. The same loop drives
- local engines that can only be paused and resumed (vLLM's `pause_generation(mode="keep")`): one arbiter step is
  a *slice*, several engine iterations between a resume and the pause that ends them (`EngineSliceMember`,
  services/scheduler/lease_members.py);
- remote sim-engine workers that step when granted, one iteration per grant (services/scheduler/gang_live.py).

Clock: the arbiter sees virtual seconds since the driver was built, `(loop.time() - start) / time_scale`
(K-dilated sim engines run K times slower than modelled; the vLLM engines run with K = 1), so its held-time
accounting starts at zero as in the simulator. Members report deadlines on the absolute scale, `loop.time() / K`
(the sim engine's batcher clock); the driver shifts them onto its own.

Control-loop latency, measured per decision: from the moment a member's step ended (its `wait_end` returned) to
the moment the next step the arbiter then started was running (its `start` returned). It is real time that the
GPUs are idle between two arbiter steps and that the simulator does not have; leases are coarse enough when it is
small against a step (reported in `DriverStats`, in virtual milliseconds).

Invariants: the arbiter is the only one that starts member steps; a member is started only when the arbiter says
so and is reported finished exactly once per start; a member that planned nothing is reported `nothing_to_run`
and not offered again until something changes: work arrives (`wake`) or any member's step ends, when the arbiter's
caps move (the simulator's adapter, services/sim/gang_sim.py, offers it again at the same events).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from octoserve.services.core.gang import GangArbiter, MemberView

_LATENCY_SAMPLES = 4096  # the most recent control-loop latencies kept for the percentiles


class GangMember(Protocol):
    member_id: str

    def view(self) -> MemberView:
        """Its state at this boundary (work, step floor, earliest deadline), in virtual seconds."""

    async def start(self, cap_s: float, shared: bool = False) -> float | None:
        """Begin one arbiter step that ends within `cap_s` (virtual s); its planned length, or None if it has
        nothing to run. `shared`: the member is shared (core/gang.py: it reports shared rates)."""

    def notify(self, shared: bool, tail_lent: bool = False) -> None:
        """The arbiter's notice: the member's sharing, or whether the other side lends it its ITL tail, changed (it
        may be idle); nothing to answer."""

    async def wait_end(self) -> None:
        """Return when the started step has ended (the member is idle at an iteration boundary)."""


@dataclass
class DriverStats:
    num_decisions: int = 0
    num_blocked: int = 0  # members told to start that had nothing to run
    latencies_s: collections.deque = field(default_factory=lambda: collections.deque(maxlen=_LATENCY_SAMPLES))

    def latency_ms(self, q: float) -> float:
        """A quantile of the control-loop latency, in the arbiter's (virtual) milliseconds."""
        if not self.latencies_s:
            return 0.0
        ordered = sorted(self.latencies_s)
        return 1e3 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


class GangDriver:
    def __init__(self, arbiter: GangArbiter, lm: GangMember, sms: Sequence[GangMember], *,
                 time_scale: float = 1.0) -> None:
        if {lm.member_id, *(s.member_id for s in sms)} != {arbiter.lm_id, *arbiter.sm_ids}:
            raise ValueError("the driver's members must be exactly the arbiter's LM and SMs")
        self.arbiter = arbiter
        self.time_scale = time_scale
        self.stats = DriverStats()
        self._members = {m.member_id: m for m in (lm, *sms)}
        self._lm = lm
        self._sms = list(sms)
        self._wake = asyncio.Event()
        self._running: dict[str, asyncio.Task] = {}  # member id -> its wait_end task
        self._blocked: set[str] = set()
        self._ended_at: float | None = None  # loop time of the step end that led to the pending decision
        self._origin_s = asyncio.get_running_loop().time() / time_scale

    def now(self) -> float:
        return asyncio.get_running_loop().time() / self.time_scale - self._origin_s

    def wake(self) -> None:
        """Work arrived or changed somewhere in the group: decide again."""
        self._blocked.clear()
        self._wake.set()

    def _view(self, member: GangMember) -> MemberView:
        v = member.view()
        deadline_s = None if v.deadline_s is None else v.deadline_s - self._origin_s
        return MemberView(v.member_id, v.has_work and member.member_id not in self._blocked, v.min_step_s, deadline_s,
                          v.due_prefill_s, v.lends_tail)

    async def run(self) -> None:
        """The loop, until cancelled; a cancelled driver lets running steps end and reports them."""
        try:
            while True:
                await self._decide_and_start()
                await self._wait_for_change()
        finally:
            for member_id, task in list(self._running.items()):
                with contextlib.suppress(Exception, asyncio.CancelledError):
                    await task
                self.arbiter.finished(member_id, self.now())
            self._running.clear()

    async def _decide_and_start(self) -> None:
        while True:
            now = self.now()
            d = self.arbiter.decide(now, self._view(self._lm), [self._view(s) for s in self._sms])
            self.stats.num_decisions += 1
            told = dict.fromkeys(m for m, _ in (*d.notices, *d.lend_notices))  # in order, once each
            for member_id in told:
                self._members[member_id].notify(self.arbiter.shared(member_id), self.arbiter.tail_lent(member_id))
            starts = ([(self._lm, d.lm_cap_s)] if d.run_lm else []) + [(self._members[i], c) for i, c in d.sm_starts]
            if not starts:
                self._ended_at = None  # what follows waits on the arbiter (a barrier, no work), not on the loop
                return
            steps = await asyncio.gather(*(m.start(cap, self.arbiter.shared(m.member_id)) for m, cap in starts))
            if self._ended_at is not None:
                self.stats.latencies_s.append((asyncio.get_running_loop().time() - self._ended_at) / self.time_scale)
                self._ended_at = None
            blocked = False
            for (member, cap), step_s in zip(starts, steps):
                if step_s is None:
                    self.arbiter.nothing_to_run(member.member_id)
                    self._blocked.add(member.member_id)
                    self.stats.num_blocked += 1
                    blocked = True
                else:
                    self.arbiter.started(member.member_id, now, step_s, cap)
                    self._running[member.member_id] = asyncio.create_task(self._timed_end(member))
            if not blocked:
                return

    async def _timed_end(self, member: GangMember) -> float:
        await member.wait_end()
        return asyncio.get_running_loop().time()

    async def _wait_for_change(self) -> None:
        self._wake.clear()
        waiter = asyncio.create_task(self._wake.wait())
        try:
            await asyncio.wait([waiter, *self._running.values()], return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
        for member_id, task in list(self._running.items()):
            if task.done():
                del self._running[member_id]
                ended_at = task.result()  # a member that failed its step stops the driver loudly
                self.arbiter.finished(member_id, ended_at / self.time_scale - self._origin_s)
                self._blocked.clear()  # a step end changes the caps: a member that planned nothing may fit now
                self._ended_at = ended_at if self._ended_at is None else min(self._ended_at, ended_at)
