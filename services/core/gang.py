"""Gang leases: who runs the next step on GPUs that a large model (LM) and small models (SMs) share.

A gang group is one LM instance (TP GPUs, any role) and SM instances resident on the same GPUs, all weights and
both KV pools in memory at once (placement proves it). Its GPUs run either one LM step (all of them, in lockstep:
the LM step starts only when every SM step on them has ended, the *barrier*) or SM steps (each GPU on its own).
`GangArbiter` makes that choice at every iteration boundary. It is pure and clock-free: every call takes `now`.

The adapter's loop (the simulator and the live scheduler run the same one):

    d = arbiter.decide(now, lm_view, sm_views)      # at every boundary: a step ended, work arrived
    if d.run_lm: start one LM step;  arbiter.started(lm_id, now, step_s)
    for sm in d.start_sm_ids: start one step of sm;  arbiter.started(sm, now, step_s)
    ...when a step ends: arbiter.finished(member_id, now), then decide again.

`MemberView.max_step_s` is the member's declared longest step (its batcher is sized to keep it); the bounds are
proved against it, so a step longer than declared is the adapter's bug and `GangStats.num_overruns` counts it.

Shapes (`GangPolicy.shape`), compared in the simulator:
- `interleave`: one LM step per lease, then one SM round (every SM with work has stepped once since the lease);
- `periodic`: fixed-horizon leases: the LM holds the GPUs for `lease_ms` of every `period_ms`;
- `slack`: deadline-driven: the side whose earliest deadline (decode ITL, or latest prefill start for its TTFT)
  is due within `urgent_ms` gets the GPUs; otherwise virtual-time fair share: each side's virtual time grows by
  the GPU time it held divided by its weight, the lower one runs next (with `min_slice_ms` of hysteresis), and an
  idle side's virtual time is pulled up to within `max_lag_ms` of the other's, so idling banks no credit.

Bounds, enforced over every shape (they override it):
- LM wait <= `max_lm_wait_ms`: from the boundary the LM has work and is not running to its next step's start. An
  SM may start a step only if it ends (at its declared max) by that deadline; once it could not, the group drains
  (no SM starts except *fills*: steps that end before the barrier anyway, so they cost the LM nothing).
- SM stall <= `max_sm_stall_ms`: from the boundary an SM has work and is not running to its next step's start. An
  LM step starts only if it ends (at its declared max) before any waiting SM's stall bound.
Both hold whenever `max_lm_wait_ms >= S` and `max_sm_stall_ms >= S + L` (S, L: the longest declared SM and LM
steps); `check_bounds` says so and placement refuses configs that break it. No deadlock: the group is never left
with every GPU idle while a member has work (proved by the property tests, tests/test_gang_properties.py).

SM state during a lease is chosen per SM by `lease_state` (drain / keep / swap / recompute), a cost-model rule.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

SHAPES = ("interleave", "periodic", "slack")
_EPS = 1e-9


class Holder(enum.Enum):
    SM = "sm"
    LM = "lm"


@dataclass(frozen=True, slots=True)
class GangPolicy:
    shape: str = "slack"
    max_lm_wait_ms: float = 40.0  # bound: LM with work waits at most this for a step
    max_sm_stall_ms: float = 60.0  # bound: an SM with work waits at most this between steps
    lm_weight: float = 1.0  # fair-share weights of the LM queue and the SM pool (GPU time, slack shape)
    sm_weight: float = 1.0
    urgent_ms: float = 10.0  # slack shape: a deadline this close (after the other side's step) takes the GPUs
    min_slice_ms: float = 5.0  # slack shape: hysteresis of the fair-share switch
    max_lag_ms: float = 100.0  # slack shape: how far an idle side's virtual time may fall behind
    lease_ms: float = 15.0  # periodic shape: LM lease per period
    period_ms: float = 30.0  # periodic shape

    def problems(self) -> list[str]:
        out = []
        if self.shape not in SHAPES:
            out.append(f"gang.shape: unknown shape {self.shape!r}; choose one of: {', '.join(SHAPES)}")
        for name in ("max_lm_wait_ms", "max_sm_stall_ms", "lm_weight", "sm_weight", "period_ms"):
            if not getattr(self, name) > 0:
                out.append(f"gang.{name} is {getattr(self, name)!r}; set a positive number")
        for name in ("urgent_ms", "min_slice_ms", "max_lag_ms", "lease_ms"):
            if not getattr(self, name) >= 0:
                out.append(f"gang.{name} is {getattr(self, name)!r}; set a number >= 0")
        if self.lease_ms >= self.period_ms:
            out.append(f"gang.lease_ms ({self.lease_ms:g}) must be below gang.period_ms ({self.period_ms:g})")
        return out


def check_bounds(policy: GangPolicy, max_sm_step_s: float, max_lm_step_s: float) -> list[str]:
    """Problems that make the bounds unprovable: each says what to change."""
    out = []
    s_ms, l_ms = max_sm_step_s * 1e3, max_lm_step_s * 1e3
    if policy.max_lm_wait_ms < s_ms:
        out.append(f"gang.max_lm_wait_ms ({policy.max_lm_wait_ms:g}) is below the longest SM step ({s_ms:.1f} ms); "
                   f"raise it to at least {s_ms:.1f}")
    if policy.max_sm_stall_ms < s_ms + l_ms:
        out.append(f"gang.max_sm_stall_ms ({policy.max_sm_stall_ms:g}) is below the longest SM step plus the longest "
                   f"LM step ({s_ms:.1f} + {l_ms:.1f} ms); raise it to at least {s_ms + l_ms:.1f}")
    return out


@dataclass(frozen=True, slots=True)
class MemberView:
    """One member at a boundary, as its batcher sees it."""

    member_id: str
    has_work: bool  # anything to schedule (running, waiting or swapped requests)
    max_step_s: float  # declared longest step
    deadline_s: float | None = None  # earliest of: a running decode's next-token deadline, a prefill's latest start


@dataclass(frozen=True, slots=True)
class Decision:
    run_lm: bool = False
    start_sm_ids: tuple[str, ...] = ()  # SMs that start a step now
    fill_sm_ids: tuple[str, ...] = ()  # of those, the ones that only fill the barrier (drain)


@dataclass(slots=True)
class GangStats:
    num_lm_steps: int = 0
    num_sm_steps: int = 0
    num_fill_steps: int = 0  # SM steps started while draining that end before the barrier
    num_switches: int = 0  # holder changes (SM -> LM and LM -> SM)
    num_forced_lm: int = 0  # switches to the LM forced by the LM-wait bound
    num_forced_sm: int = 0  # releases forced by the SM-stall bound
    num_overruns: int = 0  # steps longer than their member's declared max
    max_lm_wait_s: float = 0.0
    max_sm_stall_s: float = 0.0
    barrier_idle_gpu_s: float = 0.0  # GPU time SM GPUs idled at a barrier while SMs had work or the LM waited
    lm_gpu_s: float = 0.0  # group time held by the LM / by the SMs
    sm_gpu_s: float = 0.0
    lease_states: dict[str, int] = field(default_factory=dict)  # lease_state choice -> count


class GangArbiter:
    """The lease decisions of one gang group (see the module docstring for the protocol and the bounds)."""

    def __init__(self, policy: GangPolicy, lm_id: str, sm_ids: Sequence[str]) -> None:
        self.policy = policy
        self.lm_id = lm_id
        self.sm_ids = tuple(sm_ids)
        self.holder = Holder.SM
        self.draining = False  # SM -> LM switch decided; waiting for the barrier
        self.stats = GangStats()
        self._busy_until: dict[str, float] = {}  # member -> end of its running step
        self._lm_wait_since: float | None = None
        self._stall_since: dict[str, float] = {}
        self._last_end: dict[str, float] = {}
        self._vt_lm = 0.0
        self._vt_sm = 0.0
        self._charged_until = 0.0
        self._stepped_since_lease: set[str] = set()  # SMs that started a step since the SMs got the GPUs
        self._lease_start = 0.0  # when the current holder got the GPUs
        self._drain_start = 0.0
        self._drain_forced = False
        self._max_wait_s = policy.max_lm_wait_ms / 1e3
        self._max_stall_s = policy.max_sm_stall_ms / 1e3

    # ---- the protocol --------------------------------------------------------------------------------------------

    def decide(self, now: float, lm: MemberView, sms: Sequence[MemberView]) -> Decision:
        """What starts at this boundary. Call it after every step end and every arrival; it commits its decision
        (the adapter must start what it returns and report each start with `started`)."""
        self._note_waits(now, lm, sms)
        self._charge(now)
        if self._busy(self.lm_id):
            return Decision()
        sm_work = [s for s in sms if s.has_work]
        if self.holder is Holder.LM:
            if lm.has_work and self._lm_may_continue(now, lm, sm_work):
                return Decision(run_lm=True)
            forced = lm.has_work and bool(sm_work) and self._stall_forces(now, lm, sm_work)
            self._switch(now, Holder.SM, forced)
        if not lm.has_work:
            self.draining = False
        elif not self.draining:
            due, forced = self._lm_due(now, lm, sm_work)
            if due:
                self._start_drain(now, forced)
        if self.draining and not any(self._busy(s) for s in self.sm_ids):
            self._note_barrier(now)
            self._switch(now, Holder.LM, self._drain_forced)
            return Decision(run_lm=True)
        return self._sm_starts(now, lm, sm_work)

    def started(self, member_id: str, now: float, step_s: float, max_step_s: float) -> None:
        """A step of `member_id` began at `now` and takes `step_s` (its declared max is `max_step_s`)."""
        if step_s > max_step_s + _EPS:
            self.stats.num_overruns += 1
        self._busy_until[member_id] = now + max(step_s, 0.0)
        if member_id == self.lm_id:
            self.stats.num_lm_steps += 1
            if self._lm_wait_since is not None:
                self.stats.max_lm_wait_s = max(self.stats.max_lm_wait_s, now - self._lm_wait_since)
            self._lm_wait_since = None
            return
        self.stats.num_sm_steps += 1
        since = self._stall_since.pop(member_id, None)
        if since is not None:
            self.stats.max_sm_stall_s = max(self.stats.max_sm_stall_s, now - since)
        self._stepped_since_lease.add(member_id)

    def finished(self, member_id: str, now: float) -> None:
        """The running step of `member_id` ended at `now`."""
        self._busy_until.pop(member_id, None)
        self._last_end[member_id] = now

    def nothing_to_run(self, member_id: str) -> None:
        """The member was told to start but its batcher planned nothing (e.g. out of KV): it is not waiting on the
        arbiter, so its wait or stall clock stops; the adapter reports it without work until something changes."""
        if member_id == self.lm_id:
            self._lm_wait_since = None
        else:
            self._stall_since.pop(member_id, None)

    def note_lease_state(self, choice: str) -> None:
        """Count one SM's state choice at a lease start (`lease_state`)."""
        self.stats.lease_states[choice] = self.stats.lease_states.get(choice, 0) + 1

    def barrier_end_s(self, now: float) -> float:
        """When the last running SM step ends (now when none runs): the earliest an LM step can start."""
        return max((t for m, t in self._busy_until.items() if m != self.lm_id), default=now)

    # ---- bookkeeping ---------------------------------------------------------------------------------------------

    def _busy(self, member_id: str) -> bool:
        return member_id in self._busy_until

    def _note_waits(self, now: float, lm: MemberView, sms: Sequence[MemberView]) -> None:
        if not lm.has_work:
            self._lm_wait_since = None
        elif not self._busy(self.lm_id) and self._lm_wait_since is None:
            self._lm_wait_since = now
        for s in sms:
            if not s.has_work:
                self._stall_since.pop(s.member_id, None)
            elif not self._busy(s.member_id):
                self._stall_since.setdefault(s.member_id, now)

    def _charge(self, now: float) -> None:
        """Virtual time: the holder pays for the group time since the last charge, divided by its weight."""
        dt = max(0.0, now - self._charged_until)
        self._charged_until = max(self._charged_until, now)
        if self.holder is Holder.LM:
            self.stats.lm_gpu_s += dt
            self._vt_lm += dt / self.policy.lm_weight
        else:
            self.stats.sm_gpu_s += dt
            self._vt_sm += dt / self.policy.sm_weight

    def _switch(self, now: float, to: Holder, forced: bool) -> None:
        if to is self.holder:
            return
        self.stats.num_switches += 1
        if to is Holder.LM:
            self.stats.num_forced_lm += forced
            self.draining = False
        else:
            self.stats.num_forced_sm += forced
            self._stepped_since_lease.clear()
        self.holder = to
        self._lease_start = now

    def _start_drain(self, now: float, forced: bool) -> None:
        self.draining = True
        self._drain_start = now
        self._drain_forced = forced

    def _note_barrier(self, now: float) -> None:
        """GPU time the SM GPUs idled between the drain decision and the LM step (the barrier's cost)."""
        for s in self.sm_ids:
            self.stats.barrier_idle_gpu_s += now - max(self._drain_start, self._last_end.get(s, self._drain_start))

    # ---- rules ------------------------------------------------------------------------------------------------

    def _stall_forces(self, now: float, lm: MemberView, sm_work: Sequence[MemberView]) -> bool:
        """The next LM step (at its declared max) would push a waiting SM past the stall bound."""
        end = now + lm.max_step_s
        return any(end - self._stall_since.get(s.member_id, now) > self._max_stall_s + _EPS for s in sm_work)

    def _lm_may_continue(self, now: float, lm: MemberView, sm_work: Sequence[MemberView]) -> bool:
        """LM holds the GPUs and has work: one more LM step?"""
        if not sm_work:
            return True
        if self._stall_forces(now, lm, sm_work):
            return False
        p = self.policy
        if p.shape == "interleave":
            return False  # one LM step per lease
        if p.shape == "periodic":
            return now + lm.max_step_s <= self._lease_start + p.lease_ms / 1e3 + _EPS
        lm_urgent, sm_urgent = self._urgent(now, lm, sm_work)
        if lm_urgent != sm_urgent:
            return lm_urgent
        self._pull_idle_vtime()
        return self._vt_lm <= self._vt_sm + p.min_slice_ms / 1e3

    def _lm_due(self, now: float, lm: MemberView, sm_work: Sequence[MemberView]) -> tuple[bool, bool]:
        """SMs hold the GPUs and the LM has work: (drain toward a lease now?, forced by the LM-wait bound?)."""
        if not sm_work:
            return True, False
        wait_since = self._lm_wait_since if self._lm_wait_since is not None else now
        longest = max(s.max_step_s for s in sm_work)
        if now + longest > wait_since + self._max_wait_s + _EPS:
            return True, True
        # Every SM with work steps at least once per SM slice: no zero-length slices, no ping-pong.
        if not all(s.member_id in self._stepped_since_lease for s in sm_work):
            return False, False
        p = self.policy
        if p.shape == "interleave":
            return True, False
        if p.shape == "periodic":
            return now >= self._lease_start + (p.period_ms - p.lease_ms) / 1e3 - _EPS, False
        lm_urgent, sm_urgent = self._urgent(now, lm, sm_work)
        if lm_urgent != sm_urgent:
            return lm_urgent, False
        self._pull_idle_vtime()
        return self._vt_sm > self._vt_lm + p.min_slice_ms / 1e3, False

    def _sm_starts(self, now: float, lm: MemberView, sm_work: Sequence[MemberView]) -> Decision:
        idle = [s for s in sm_work if not self._busy(s.member_id)]
        if self.draining:
            # Fills: a step that ends (at its declared max) before the barrier costs the LM nothing.
            barrier = self.barrier_end_s(now)
            fills = tuple(s.member_id for s in idle if now + s.max_step_s <= barrier + _EPS)
            self.stats.num_fill_steps += len(fills)
            return Decision(start_sm_ids=fills, fill_sm_ids=fills)
        return Decision(start_sm_ids=tuple(s.member_id for s in idle))

    def _urgent(self, now: float, lm: MemberView, sm_work: Sequence[MemberView]) -> tuple[bool, bool]:
        """(LM urgent, SMs urgent): a deadline falls within the other side's next step plus `urgent_ms`."""
        guard = self.policy.urgent_ms / 1e3
        sm_step = max((s.max_step_s for s in sm_work), default=0.0)
        lm_urgent = lm.deadline_s is not None and lm.deadline_s - now <= sm_step + guard
        sm_deadlines = [s.deadline_s for s in sm_work if s.deadline_s is not None]
        sm_urgent = bool(sm_deadlines) and min(sm_deadlines) - now <= lm.max_step_s + guard
        return lm_urgent, sm_urgent

    def _pull_idle_vtime(self) -> None:
        """Neither side banks more than `max_lag_ms` of credit (an idle side does not starve the other later)."""
        lag = self.policy.max_lag_ms / 1e3
        self._vt_lm = max(self._vt_lm, self._vt_sm - lag)
        self._vt_sm = max(self._vt_sm, self._vt_lm - lag)


# ---- SM state during a lease ------------------------------------------------------------------------------------

LEASE_STATES = ("drain", "keep", "swap", "recompute")


@dataclass(frozen=True, slots=True)
class LeaseStateCosts:
    """What one SM instance's choice at a lease start costs, in seconds of GPU time, from its cost model."""

    fill_fits: bool  # its next step ends before the barrier anyway (drain costs the LM nothing)
    kv_resident_ok: bool  # its KV pool stays resident through the lease (placement's static split)
    swap_out_in_s: float  # PCIe time to move its running KV to host and back
    recompute_s: float  # prefill time to rebuild its running KV
    host_room: bool  # swap space holds it


def lease_state(c: LeaseStateCosts) -> str:
    """drain: finish one more step inside the barrier (free); keep: pause with KV on GPU (free while the pools are
    resident); else the cheaper of swap (PCIe both ways) and recompute (prefill again)."""
    if c.fill_fits:
        return "drain"
    if c.kv_resident_ok:
        return "keep"
    if c.host_room and c.swap_out_in_s <= c.recompute_s:
        return "swap"
    return "recompute"


def lease_state_costs(
    *, fill_fits: bool, kv_resident_ok: bool, running_context_tokens: int, swap_s_per_token: float,
    prefill_s_per_token: float, host_room: bool,
) -> LeaseStateCosts:
    return LeaseStateCosts(
        fill_fits=fill_fits,
        kv_resident_ok=kv_resident_ok,
        swap_out_in_s=2 * running_context_tokens * swap_s_per_token,
        recompute_s=running_context_tokens * prefill_s_per_token,
        host_room=host_room,
    )


def policy_from_mapping(raw: Mapping[str, object]) -> GangPolicy:
    """A GangPolicy from the config's `gang` keys (groups excluded); unknown keys are the caller's to report."""
    fields = {f for f in GangPolicy.__dataclass_fields__}
    kwargs = {k: (str(v) if k == "shape" else float(v)) for k, v in raw.items() if k in fields}  # type: ignore[arg-type]
    return GangPolicy(**kwargs)
