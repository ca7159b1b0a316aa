"""Gang leases on the live node: the scheduler runs each gang group's arbiter over its members' workers, step by step.

The simulator's gang adapter (services/sim/gang_sim.py) starts every member step itself, with the arbiter's cap.
Live, the steps run in the workers' processes, so each member's step loop asks before every step:

    worker (GangGate, in the sim engine's step loop)        scheduler (GangHub: one GangDriver per group)
    BOUNDARY(view)  ------------------------------------->  view updated, driver woken
                    <-------------------------------------  GangGrant(cap_s)        (the arbiter started it)
    sets its load report's sharing  <---------------------  GangGrant(notice, shared) (its sharing changed)
    schedule(now, step_cap_s=cap); STARTED(step_s) ------>  arbiter.started(...)
    ... the step runs (modelled time x K) ...
    ENDED(view after the step) -------------------------->  arbiter.finished(...); decide again

A member granted a cap its next step cannot fit (e.g. a prefill chunk longer than the cap) answers NOTHING and keeps
its work; until new work arrives it still listens for grants, since the arbiter offers it again (a longer cap)
after the next step end anywhere in the group, as the simulator's adapter does.

A view is what the simulator's adapter reads from the batcher: work (waiting, running or pending outputs), the step
floor, and the earliest deadline (`Batcher.earliest_deadline_s`), in modelled seconds on the worker's loop clock
divided by K, which is the scheduler's clock divided by K too (one host; both read CLOCK_MONOTONIC).

Control-loop latency: one gRPC round trip per arbiter step (ENDED -> grant -> STARTED), measured by the driver and
exported as `octoserve_gang_control_latency_ms`; with K-dilated sim engines it is divided by K like every modelled
time, and it is what the live node spends that the simulator does not.

Invariants: a gang member's engine starts no step without a grant (the gate is attached before the engine starts
and the stream is opened on its first boundary); a grant is answered by exactly one STARTED or NOTHING; a member
whose stream ends (worker gone) counts as idle until it reconnects, so the group never waits on it; a worker whose
stream breaks (scheduler restarting) waits for no grant it cannot get: it rejoins and asks again.
"""

from __future__ import annotations

import asyncio
import collections
import logging
from collections.abc import AsyncIterator

import grpc

from octoserve.services.core.gang import GangArbiter, MemberView
from octoserve.services.core.placement import GangGroup, NodeConfig
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
from octoserve.services.scheduler.gang_driver import GangDriver

log = logging.getLogger("octoserve.scheduler.gang")

Event = s_pb.GangReport.Event
REJOIN_S = 0.2  # pause before a member reopens a broken stream (the scheduler restarting)


def _view_pb(batcher, itl_s: float, now: float, due_horizon_s: float, lending: bool, prefill_share: float) -> dict:
    """The member's view (`MemberView`) on the wire; `now`: the batcher's clock (modelled seconds)."""
    deadline = batcher.earliest_deadline_s(itl_s, prefill_share)
    has_work = bool(batcher.has_work or batcher.has_pending_outputs)
    return dict(has_work=has_work, min_step_s=batcher.step_floor_s(),
                has_deadline=deadline is not None, deadline_s=deadline if deadline is not None else 0.0,
                due_prefill_s=batcher.due_prefill_s(now, due_horizon_s) if has_work else 0.0,
                lends_tail=lending and batcher.lends_tail())


# ---- worker side -------------------------------------------------------------------------------------------------


class GangGate:
    """A member worker's side of the protocol: the sim engine's step loop calls `turn` before every step."""

    def __init__(self, instance_id: str, scheduler: str, *, itl_s: float, time_scale: float,
                 due_horizon_s: float = 1.0, lending: bool = False, prefill_share: float = 1.0) -> None:
        self.instance_id = instance_id
        self.itl_s = itl_s
        self.time_scale = time_scale
        self.due_horizon_s = due_horizon_s
        self.lending = lending  # the policy reads the members' `lends_tail` (GangPolicy.lends_tails)
        self.prefill_share = prefill_share  # its prompts' share of the GPUs beside the other side (GangShare)
        self._scheduler = scheduler
        self._out: asyncio.Queue[s_pb.GangReport] = asyncio.Queue()
        self._grants: asyncio.Queue[s_pb.GangGrant] = asyncio.Queue()
        self.shared = False  # the arbiter's latest word: the member is shared (its load report turns to shared rates)
        # called with each notice: (shared, tail_lent), the engine's LoadReporter.shared and .tail_lent
        self.on_sharing = lambda shared, tail_lent: None
        self.num_grants = 0
        self.num_shared_grants = 0
        self.num_notices = 0
        self._channel: grpc.aio.Channel | None = None
        self._reader: asyncio.Task | None = None
        self._began: float | None = None
        # (start, end) loop times of this member's steps, as its engine ran them (timelines, tests)
        self.steps: collections.deque[tuple[float, float]] = collections.deque(maxlen=100_000)

    def _send(self, event, batcher=None, **fields) -> None:
        now = asyncio.get_running_loop().time() / self.time_scale
        view = {} if batcher is None else _view_pb(batcher, self.itl_s, now, self.due_horizon_s, self.lending,
                                                   self.prefill_share)
        self._out.put_nowait(s_pb.GangReport(instance_id=self.instance_id, event=event, **view, **fields))

    async def _requests(self) -> AsyncIterator[s_pb.GangReport]:
        while True:
            yield await self._out.get()

    async def open(self, batcher) -> None:
        """Join the group (at engine start, before any step): HELLO, then this member's first view."""
        self._channel = grpc.aio.insecure_channel(self._scheduler)
        stream = s_grpc.SchedulerStub(self._channel).GangSteps(self._requests(), wait_for_ready=True)
        self._send(Event.HELLO, time_scale=self.time_scale)
        self._send(Event.BOUNDARY, batcher)

        async def read() -> None:
            async for grant in stream:
                if grant.notice:  # not a step: the member's sharing or lending changed, nothing to answer
                    self.shared = grant.shared
                    self.num_notices += 1
                    self.on_sharing(grant.shared, grant.tail_lent)
                else:
                    self._grants.put_nowait(grant)

        self._reader = asyncio.create_task(read(), name=f"gang-gate-{self.instance_id}")

    async def turn(self, batcher, wakeup: asyncio.Event) -> float:
        """Report this boundary and wait for the arbiter's grant; report again whenever `wakeup` fires (new work
        changes the view). Returns the step's cap in modelled seconds."""
        if self._channel is None:
            await self.open(batcher)
        while True:
            wakeup.clear()
            self._send(Event.BOUNDARY, batcher)
            grant = asyncio.ensure_future(self._grants.get())
            woken = asyncio.ensure_future(wakeup.wait())
            done, _ = await asyncio.wait([grant, woken, self._reader], return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            if grant in done:
                return self._granted(grant.result())
            grant.cancel()
            if self._reader in done:  # the scheduler went away: rejoin (its restart), never step ungated
                log.warning("gang stream ended; rejoining", extra={"fields": {"instance": self.instance_id}})
                await self.close()
                await asyncio.sleep(REJOIN_S)
                await self.open(batcher)

    async def idle(self, wakeup: asyncio.Event) -> float | None:
        """After NOTHING: wait for new work (None) or for a grant the arbiter sends meanwhile (its cap), which the
        caller answers with one STARTED or NOTHING like any other. No BOUNDARY: the view NOTHING carried holds."""
        grant = asyncio.ensure_future(self._grants.get())
        woken = asyncio.ensure_future(wakeup.wait())
        waiters = [grant, woken] + ([self._reader] if self._reader is not None else [])
        done, _ = await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        woken.cancel()
        if grant in done:
            return self._granted(grant.result())
        grant.cancel()
        return None  # new work, or the stream ended (the next `turn` rejoins)

    def _granted(self, grant: s_pb.GangGrant) -> float:
        self.shared = grant.shared
        self.num_grants += 1
        self.num_shared_grants += grant.shared
        return grant.cap_s

    def started(self, step_s: float) -> None:
        self._began = asyncio.get_running_loop().time()
        self._send(Event.STARTED, step_s=step_s)

    def nothing(self, batcher) -> None:
        self._send(Event.NOTHING, batcher)

    def ended(self, batcher) -> None:
        if self._began is not None:
            self.steps.append((self._began, asyncio.get_running_loop().time()))
            self._began = None
        self._send(Event.ENDED, batcher)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        self._out = asyncio.Queue()  # a new stream starts with its own HELLO
        self._grants = asyncio.Queue()


def attach_gang_gate(engine, node_cfg: NodeConfig, instance_id: str, scheduler: str, time_scale: float) -> None:
    """Give a gang member's engine its gate (a no-op for instances outside gang groups)."""
    group = node_cfg.gang.group_of(instance_id) if node_cfg.gang else None
    if group is None:
        return
    if not scheduler:
        raise ValueError(f"instance {instance_id} is in a gang group: it steps only when the scheduler's arbiter "
                         "grants it, so give --scheduler HOST:PORT")
    if not hasattr(engine, "gate"):
        raise ValueError(f"instance {instance_id} is in a gang group, which needs an engine with a step gate "
                         "(--engine sim); pause/resume engines take turns with EngineSliceMember instead")
    engine.gate = GangGate(instance_id, scheduler, itl_s=node_cfg.slo.for_model(node_cfg.instance(instance_id).model).itl_ms / 1000.0,
                         time_scale=time_scale, due_horizon_s=node_cfg.gang.policy.due_horizon_ms / 1000.0,
                         lending=node_cfg.gang.policy.lends_tails, prefill_share=engine.reporter.gang.prefill_share)
    reporter = engine.reporter

    def on_sharing(shared: bool, tail_lent: bool) -> None:
        reporter.shared = shared
        reporter.note_lending(tail_lent, asyncio.get_running_loop().time() / time_scale)

    engine.gate.on_sharing = on_sharing


# ---- scheduler side ----------------------------------------------------------------------------------------------


class RemoteStepMember:
    """One member worker as the driver sees it: the latest view it reported, grants out, STARTED / ENDED in."""

    def __init__(self, member_id: str) -> None:
        self.member_id = member_id
        self.connected = False
        self.on_change = lambda: None
        self._view = MemberView(member_id, False, 0.0)
        self._grants: asyncio.Queue[s_pb.GangGrant] | None = None
        self._started: asyncio.Future | None = None
        self._ended = asyncio.Event()

    def connect(self) -> asyncio.Queue:
        self._grants = asyncio.Queue()
        self.connected = True
        return self._grants

    def disconnect(self) -> None:
        self.connected = False
        self._view = MemberView(self.member_id, False, 0.0)
        if self._started is not None and not self._started.done():
            self._started.set_result(None)
        self._ended.set()
        self.on_change()

    def on_report(self, r: s_pb.GangReport) -> None:
        if r.event in (Event.BOUNDARY, Event.ENDED, Event.NOTHING):
            self._view = MemberView(self.member_id, r.has_work, r.min_step_s, r.deadline_s if r.has_deadline else None,
                                    r.due_prefill_s, r.lends_tail)
        if r.event in (Event.STARTED, Event.NOTHING) and self._started is not None and not self._started.done():
            self._started.set_result(r.step_s if r.event == Event.STARTED else None)
        elif r.event == Event.ENDED:
            self._ended.set()
        elif r.event == Event.BOUNDARY:
            self.on_change()

    def view(self) -> MemberView:
        return self._view

    async def start(self, cap_s: float, shared: bool = False) -> float | None:
        if not self.connected or self._grants is None:
            return None
        self._ended.clear()
        self._started = asyncio.get_running_loop().create_future()
        self._grants.put_nowait(s_pb.GangGrant(cap_s=cap_s, shared=shared))
        return await self._started

    def notify(self, shared: bool, tail_lent: bool = False) -> None:
        if self.connected and self._grants is not None:
            self._grants.put_nowait(s_pb.GangGrant(shared=shared, tail_lent=tail_lent, notice=True))

    async def wait_end(self) -> None:
        await self._ended.wait()


class LiveGroup:
    def __init__(self, node: NodeConfig, group: GangGroup) -> None:
        self.group = group
        self.policy = node.gang.policy
        self.members = {m: RemoteStepMember(m) for m in (group.lm, *group.sms)}
        self.arbiter: GangArbiter | None = None
        self.driver: GangDriver | None = None
        self.time_scale: float | None = None
        self._task: asyncio.Task | None = None

    def hello(self, member: RemoteStepMember, time_scale: float) -> None:
        if self.time_scale is not None and abs(time_scale - self.time_scale) > 1e-9:
            log.error("gang member at another time scale", extra={"fields": {
                "instance": member.member_id, "time_scale": time_scale, "group_time_scale": self.time_scale}})
        self.time_scale = self.time_scale or time_scale or 1.0
        if self._task is None and all(m.connected for m in self.members.values()):
            self.arbiter = GangArbiter(self.policy, self.group.lm, self.group.sms)
            lm = self.members[self.group.lm]
            self.driver = GangDriver(self.arbiter, lm, [self.members[s] for s in self.group.sms],
                                     time_scale=self.time_scale)
            for m in self.members.values():
                m.on_change = self.driver.wake
            self._task = asyncio.create_task(self.driver.run(), name=f"gang-{self.group.lm}")
            self._task.add_done_callback(self._driver_done)
            log.info("gang group running", extra={"fields": {"lm": self.group.lm, "time_scale": self.time_scale}})
        elif self.driver is not None:
            assert self.arbiter is not None
            self.arbiter.forget(member.member_id)  # a rejoined worker starts unshared: tell it again
            self.driver.wake()

    def _driver_done(self, task: asyncio.Task) -> None:
        if not task.cancelled() and task.exception() is not None:
            log.error("gang driver failed", exc_info=task.exception(), extra={"fields": {"lm": self.group.lm}})

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)


class GangHub:
    """Every gang group of the node config, served over `Scheduler.GangSteps`."""

    def __init__(self, node: NodeConfig) -> None:
        self.groups: dict[str, LiveGroup] = {}
        self._group_of: dict[str, LiveGroup] = {}
        for g in node.gang.groups if node.gang else ():
            live = self.groups[g.lm] = LiveGroup(node, g)
            for m in live.members:
                self._group_of[m] = live

    async def steps(self, request_iterator, context) -> AsyncIterator[s_pb.GangGrant]:
        hello = await anext(aiter(request_iterator))
        group = self._group_of.get(hello.instance_id)
        if hello.event != Event.HELLO or group is None:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{hello.instance_id!r} is no gang member of this node's config (gang.groups); "
                                "open GangSteps with HELLO from a member")
        member = group.members[hello.instance_id]
        grants = member.connect()
        group.hello(member, hello.time_scale)

        async def read() -> None:
            async for report in request_iterator:
                member.on_report(report)

        reader = asyncio.create_task(read())
        try:
            while True:
                next_grant = asyncio.ensure_future(grants.get())
                done, _ = await asyncio.wait([next_grant, reader], return_when=asyncio.FIRST_COMPLETED)
                if next_grant not in done:
                    next_grant.cancel()
                    return
                yield next_grant.result()
        finally:
            reader.cancel()
            member.disconnect()

    def stats(self) -> dict[str, dict]:
        """Per group (by LM id): the arbiter's counters and the control-loop latency, for metrics and benchmarks."""
        out = {}
        for lm, g in self.groups.items():
            if g.arbiter is None or g.driver is None:
                continue
            s, d = g.arbiter.stats, g.driver.stats
            out[lm] = dict(
                shape=g.policy.shape, time_scale=g.time_scale, lm_steps=s.num_lm_steps, sm_steps=s.num_sm_steps,
                switches=s.num_switches, forced_lm=s.num_forced_lm, forced_sm=s.num_forced_sm,
                overruns=s.num_overruns, max_lm_wait_ms=1e3 * s.max_lm_wait_s, max_sm_stall_ms=1e3 * s.max_sm_stall_s,
                lm_held_s=s.lm_held_s, sm_held_s=s.sm_held_s, decisions=d.num_decisions,
                control_p50_ms=d.latency_ms(0.5), control_p95_ms=d.latency_ms(0.95), control_max_ms=d.latency_ms(1.0),
            )
        return out

    async def close(self) -> None:
        await asyncio.gather(*(g.close() for g in self.groups.values()))


def _unit(name: str) -> str:
    if name.endswith("_ms"):
        return "milliseconds on the modelled clock (wall / time scale)"
    if name.endswith("_s"):
        return "seconds on the modelled clock (wall / time scale)"
    return "factor" if name == "time_scale" else "count"


class GangCollector:
    """Prometheus view of `GangHub.stats()`, read at scrape time: `octoserve_gang_<figure>{group="<lm id>"}`."""

    def __init__(self, hub: GangHub) -> None:
        self._hub = hub

    def describe(self):
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        families: dict[str, GaugeMetricFamily] = {}
        for lm, figures in self._hub.stats().items():
            for name, value in figures.items():
                if isinstance(value, (int, float)) and value is not None:
                    family = families.setdefault(name, GaugeMetricFamily(
                        f"octoserve_gang_{name}", f"gang group {name.replace('_', ' ')}, {_unit(name)}",
                        labels=["group"]))
                    family.add_metric([lm], float(value))
        yield from families.values()
