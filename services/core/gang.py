"""Gang leases: who runs the next step on GPUs that a large model (LM) and small models (SMs) share.

A gang group is one LM instance (TP GPUs, any role) and SM instances resident on the same GPUs, all weights and
both KV pools in memory at once (placement proves it). Its GPUs run either one LM step (all of them, in lockstep:
the LM step starts only when every SM step on them has ended, the *barrier*) or SM steps (each GPU on its own).
`GangArbiter` makes that choice at every iteration boundary. It is pure and clock-free: every call takes `now`.

The adapter's loop (the simulator and the live scheduler run the same one):

    d = arbiter.decide(now, lm_view, sm_views)      # at every boundary: a step ended, work arrived
    if d.run_lm: run one LM step within d.lm_cap_s;               arbiter.started(lm_id, now, step_s, d.lm_cap_s)
    for sm, cap_s in d.sm_starts: run one step of sm within cap_s; arbiter.started(sm, now, step_s, cap_s)
    for member_id, shared in d.notices: tell the member (idle ones too); its load report turns to shared rates
    for member_id, lent in d.lend_notices: tell the member whether the other side lends it its ITL tail
    a member told to start that plans nothing:                     arbiter.nothing_to_run(member_id)
    when a step ends:                                              arbiter.finished(member_id, now); decide again

*Sharing*: a member is shared while the other side of its group has work, and for SHARING_HOLD_S after (the other
side's work comes and goes between two decisions: an LM decoding a few requests). A shared member's load report
gives the rates of capped steps taking turns with the other side's (`services/core/instance.py`), so admission
predicts what a prompt gets once both sides step. Every decision returns the members whose sharing changed
(`Decision.notices`), idle members included: a prompt routed to an idle SM just after the LM got work is predicted
at the shared rate, not at the rate of the GPUs alone that it had when it last stepped. The baselines that give
one side the GPUs whenever it has work never share that side: the LM under `lm_first`, the SMs under `sm_greedy`.

*Lending the ITL tail* (deadline shapes): an ITL SLO is a percentile, and each member's batcher keeps a tail budget
of slow gaps it may still spend (`services/core/tail_budget.py`); a member *lends* its tail
(`MemberView.lends_tail`) while that budget affords one slow gap on each of its running decodes. A side with a
prompt due whose step the other side's deadlines cut short (`MemberView.due_prefill_s` over the deadline cap) then
steps past the deadlines of every member of the other side that lends, up to the bounds: a 1,000-token prompt of a
large model runs in one step that costs each running decode of the other side one slow gap, instead of in chunks
that each pay the large model's weight reads again and miss its TTFT. Members that do not lend still cap the step.
The arbiter tells each member whether the other side lends (`Decision.lend_notices`, as sharing notices), so its
load report predicts the longer steps only while they are granted.

*Due prompts go first* (`deadline` shape): an LM that only decodes waits for its own latest start, but a prompt of
the LM that is due, whose step fits the cap it would get now (past the deadlines of the SMs that lend, within those
of the others), goes first while no SM is urgent. Waiting would only spend the prompt's TTFT margin: the SMs' gaps
are the same either way (each lender's decodes pay one slow gap, the others' deadlines are kept), and a prompt
served at its latest start reaches its first token just in time, which admission cannot promise with any margin.
The LM's latest start for a prompt counts its tokens at the share of the GPUs' time its steps get beside the SMs
(`GangShare.prefill_share`), since once urgent it alternates with them.

Every step the arbiter starts carries a *cap*: the member's batcher cuts its prefill chunk so that the step fits
(`Batcher.schedule(now, step_cap_s=...)`). A step is never shorter than its member's `MemberView.min_step_s` (the
decodes it must run) and the arbiter starts no step whose cap is below that. A step longer than its cap is the
adapter's error, counted in `GangStats.num_overruns`.

Shapes (`GangPolicy.shape`), compared in the simulator:
- `interleave`: one LM step per lease, then one SM round (every SM with work steps once);
- `periodic`: fixed-horizon leases: the LM holds the GPUs for `lease_ms` of every `period_ms`;
- `slack`: deadline-driven: each side reports the latest start of its next step that meets its most urgent
  deadline (a decode's next token one ITL after its last, a prompt's first token by its TTFT). The side holding
  the GPUs may step only until the other side's latest start (its cap shrinks to the other's slack, never below
  its floor), so a side whose requests have slack lends the GPUs whole while the other's prefill runs in long
  chunks; the side whose latest start is within the other's floor plus `urgent_ms` takes the GPUs; when neither
  or both are urgent, virtual-time fair share decides: each side's virtual time grows by the group time it held
  over its weight, the lower runs next (`min_slice_ms` of hysteresis), and neither banks over `max_lag_ms`.
- `deadline`: leases by each side's own deadline (per-model ITLs: the LM needs one step per its ITL, the SMs one
  per theirs): capped as `slack` (the other side's latest start and the bounds, no fixed shared-step caps), but
  the LM takes the GPUs only when its latest start is urgent (or no SM has work) and gives them back after the
  step unless it is still urgent and the SMs are not; the SMs run otherwise, several SM steps per LM step when the
  LM's ITL is the longer, and an LM that only decodes costs one step per its ITL instead of a fair share. When
  both are urgent they alternate (one round of every SM with work between LM steps).
In the deadline shapes a step of a member with a prompt due (`MemberView.due_prefill_s`) is never capped below
its floor plus `MIN_PREFILL_S` (or the whole prompt, when shorter), so a loaded node's prompts still progress.
Every SM slice lets each SM with work step at least once (no zero-length slices, no ping-pong).

Baseline shapes (`BASELINE_SHAPES`: seed 003's warnings, for comparison; all work-conserving):
- `lm_first`: LM-first reservation: while the LM has work the whole group is reserved for it (the SMs drain at
  once and start only fills); the SMs step only while the LM has none;
- `sm_greedy`: the LM steps only when no SM has work, and a lease ends at the first SM with work;
- `slices`: coarse time slices, as a pod-level gang scheduler: fixed wall-clock slices of `slice_ms`, SMs in the
  even ones and the LM in the odd ones; a side steps outside its slices only while the other has no work.

Bounds, enforced over every shape by the caps (they override the shape):
- LM wait <= `max_lm_wait_ms`, from the boundary the LM has work and is not running to its next step's start:
  every SM step must end by then (cap = that deadline - now; `max_lm_wait_ms` while the LM has no work, since its
  work may arrive at any moment); an idle SM whose floor does not fit makes the group drain, and while it drains
  SMs start only *fills*: steps that end before the barrier anyway, so they cost the LM nothing.
- SM stall <= `max_sm_stall_ms`, from the boundary an SM has work and is not running to its next step's start:
  an LM step's cap is the earliest stall deadline of the SMs (`max_sm_stall_ms` for an SM whose work may arrive
  during the step); when the LM's floor no longer fits, the lease ends.
Both hold whenever `max_lm_wait_ms >= S` and `max_sm_stall_ms >= max_lm_wait_ms + L` (S, L: the largest SM and LM
step floors); `check_bounds` says so and placement refuses configs that break it. No deadlock: the group never
leaves every GPU idle while a member has work it can run. tests/test_gang_properties.py checks all of this over
adversarial arrivals.

SM state during a lease is chosen per SM by `lease_state.lease_state` (drain / keep / swap / recompute), a cost-model
rule.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

SHAPES = ("interleave", "periodic", "slack", "deadline")
_DEADLINE_SHAPES = ("slack", "deadline")  # steps capped by the other side's latest start
# The schedulers seed 003 warns about, as shapes of the same arbiter so they run on the same node and workload
# (`services/lab/gang_bench.py`). Starving one side is what defines them, so they are run with the bounds out of reach.
BASELINE_SHAPES = ("lm_first", "sm_greedy", "slices")
_EPS = 1e-9
# A member stays shared this long after the other side of its group last had work at a decision.
SHARING_HOLD_S = 1.0


class Holder(enum.Enum):
    SM = "sm"
    LM = "lm"


@dataclass(frozen=True, slots=True)
class GangPolicy:
    shape: str = "slack"
    max_lm_wait_ms: float = 20.0  # bound: an LM with work waits at most this for its next step
    max_sm_stall_ms: float = 60.0  # bound: an SM with work waits at most this between two of its steps
    lm_weight: float = 1.0  # fair-share weights of the LM queue and the aggregate SM pool (group time)
    sm_weight: float = 1.0
    urgent_ms: float = 5.0  # slack shape: a deadline this close (past the other side's floor) takes the GPUs
    min_slice_ms: float = 5.0  # slack shape: hysteresis of the fair-share switch
    max_lag_ms: float = 100.0  # slack shape: the most virtual-time credit a side may bank
    lease_ms: float = 15.0  # periodic shape: the LM's lease in every period
    period_ms: float = 30.0  # periodic shape
    # While both sides have work, an LM step is capped at lm_shared_step_ms and an SM step at sm_shared_step_ms
    # (never below the step's floor), so one step of each fits one ITL; a side alone keeps its full steps.
    # 0: no such cap. Placement sets them from `gang.lm_step_share` and the ITL SLO.
    lm_shared_step_ms: float = 0.0
    sm_shared_step_ms: float = 0.0
    slice_ms: float = 1000.0  # slices shape: the length of each fixed slice
    # deadline shapes: a member's prompt whose first token is due within this is *due* (`MemberView.due_prefill_s`)
    due_horizon_ms: float = 1000.0

    @property
    def is_baseline(self) -> bool:
        return self.shape in BASELINE_SHAPES

    @property
    def lends_tails(self) -> bool:
        """Whether its steps may run past a lending member's deadlines (the deadline shapes): the only ones where a
        member's `MemberView.lends_tail` is read, so the adapters compute it only then."""
        return self.shape in _DEADLINE_SHAPES

    def problems(self) -> list[str]:
        out = []
        if self.shape not in SHAPES + BASELINE_SHAPES:
            out.append(f"gang.shape: unknown shape {self.shape!r}; choose one of: {', '.join(SHAPES + BASELINE_SHAPES)}")
        for name in ("max_lm_wait_ms", "max_sm_stall_ms", "lm_weight", "sm_weight", "period_ms", "slice_ms"):
            if not getattr(self, name) > 0:
                out.append(f"gang.{name} is {getattr(self, name)!r}; set a positive number")
        for name in ("urgent_ms", "min_slice_ms", "max_lag_ms", "lease_ms", "lm_shared_step_ms", "sm_shared_step_ms",
                     "due_horizon_ms"):
            if not getattr(self, name) >= 0:
                out.append(f"gang.{name} is {getattr(self, name)!r}; set a number >= 0")
        if self.lease_ms >= self.period_ms:
            out.append(f"gang.lease_ms ({self.lease_ms:g}) must be below gang.period_ms ({self.period_ms:g})")
        return out


def check_bounds(policy: GangPolicy, sm_floor_s: float, lm_floor_s: float) -> list[str]:
    """Problems that make the bounds unprovable, each saying what to change. `sm_floor_s`, `lm_floor_s`: the
    largest step floor (decodes only, full batch) of any SM and of the LM."""
    out = []
    s_ms, l_ms = sm_floor_s * 1e3, lm_floor_s * 1e3
    if policy.max_lm_wait_ms < s_ms:
        out.append(f"gang.max_lm_wait_ms ({policy.max_lm_wait_ms:g}) is below the longest SM step floor "
                   f"({s_ms:.1f} ms); raise it to at least {s_ms:.1f}")
    if policy.max_sm_stall_ms < policy.max_lm_wait_ms + l_ms:
        need = policy.max_lm_wait_ms + l_ms
        out.append(f"gang.max_sm_stall_ms ({policy.max_sm_stall_ms:g}) is below gang.max_lm_wait_ms plus the longest "
                   f"LM step floor ({policy.max_lm_wait_ms:g} + {l_ms:.1f} ms); raise it to at least {need:.1f}")
    return out


@dataclass(frozen=True, slots=True)
class MemberView:
    """One member at a boundary, as its batcher sees it."""

    member_id: str
    has_work: bool  # something to schedule (running, waiting or swapped requests)
    min_step_s: float  # its step floor now: the decodes it must run, no prefill
    deadline_s: float | None = None  # the latest start of its next step that meets its most urgent deadline
    # the step that brings every prompt due within the policy's due_horizon_ms to its first token (0: none due)
    due_prefill_s: float = 0.0
    # its ITL tail budget affords one slow gap on each of its running decodes (module doc, "Lending the ITL tail")
    lends_tail: bool = False


@dataclass(frozen=True, slots=True)
class Decision:
    run_lm: bool = False
    lm_cap_s: float = 0.0  # with run_lm: the LM step must end within this
    sm_starts: tuple[tuple[str, float], ...] = ()  # (SM id, cap s): the SMs that start a step now
    fills: bool = False  # those SM steps only fill the barrier while the group drains toward a lease
    # (member id, shared): the members whose sharing changed at this decision, each to be told even when idle.
    notices: tuple[tuple[str, bool], ...] = ()
    # (member id, lent): the members for which whether the other side lends its ITL tail changed, told likewise.
    lend_notices: tuple[tuple[str, bool], ...] = ()

    @property
    def start_sm_ids(self) -> tuple[str, ...]:
        return tuple(sm for sm, _ in self.sm_starts)


@dataclass(slots=True)
class GangStats:
    num_lm_steps: int = 0
    num_sm_steps: int = 0
    num_fill_steps: int = 0  # SM steps started while draining that end before the barrier
    num_switches: int = 0  # holder changes (SM -> LM and LM -> SM)
    num_forced_lm: int = 0  # leases forced by the LM-wait bound
    num_forced_sm: int = 0  # leases ended by the SM-stall bound
    num_overruns: int = 0  # steps longer than their cap
    max_lm_wait_s: float = 0.0
    max_sm_stall_s: float = 0.0
    barrier_idle_gpu_s: float = 0.0  # SM-GPU time idle between a drain decision and the LM step it leads to
    lm_held_s: float = 0.0  # group time held by the LM / by the SMs
    sm_held_s: float = 0.0
    lease_states: dict[str, int] = field(default_factory=dict)  # lease_state choice -> count


# Deadline shapes: the least prefill a capped step keeps beside its decodes while a prompt of its member is due.
# Caps cut to the other side's latest start would otherwise leave a due prompt no room at all while both sides are
# urgent step after step (a loaded node), and it would wait until some step happened to run uncapped.
MIN_PREFILL_S = 0.005


def _deadline_cut(now: float, floor_s: float, views: Sequence[MemberView]) -> float | None:
    """The cap the earliest latest start of `views` sets, never below `floor_s` (None: none has a deadline)."""
    deadlines = [v.deadline_s for v in views if v.deadline_s is not None]
    return max(floor_s, min(deadlines) - now) if deadlines else None


def min_cap_s(view: MemberView) -> float:
    """The shortest cap a deadline shape gives a step of `view`: its floor, plus room for a due prompt's first
    chunk (all of it when that fits)."""
    if view.due_prefill_s <= view.min_step_s:
        return view.min_step_s
    return min(view.due_prefill_s, view.min_step_s + MIN_PREFILL_S)


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
        self._lm_floor = 0.0
        self._lm_work_at = -float("inf")  # the last decision at which the LM / some SM had work
        self._sm_work_at = -float("inf")
        self._told: dict[str, bool] = {}  # member -> the sharing it was last told (absent: never, or forgotten)
        self._told_lent: dict[str, bool] = {}  # member -> whether the other side lends, as it was last told

    # ---- the protocol ------------------------------------------------------------------------------------------

    def decide(self, now: float, lm: MemberView, sms: Sequence[MemberView]) -> Decision:
        """What starts at this boundary. Call it after every step end and every arrival; it commits its decision:
        the adapter starts what it returns and reports each start with `started` (or `nothing_to_run`), and tells
        each member in `notices` its sharing."""
        notices = self._sharing(now, lm, sms)
        lend_notices = self._lending(lm, sms)
        d = self._decide(now, lm, sms)
        return dataclasses.replace(d, notices=notices, lend_notices=lend_notices) if notices or lend_notices else d

    def forget(self, member_id: str) -> None:
        """`member_id` (re)joined knowing nothing: the next decision tells it its sharing."""
        self._told.pop(member_id, None)
        self._told_lent.pop(member_id, None)

    def shared(self, member_id: str) -> bool:
        """The sharing `member_id` was last told (False before any): what its steps started now run under."""
        return self._told.get(member_id, False)

    def tail_lent(self, member_id: str) -> bool:
        """Whether `member_id` was last told that the other side lends it its ITL tail (False before any)."""
        return self._told_lent.get(member_id, False)

    def _sharing(self, now: float, lm: MemberView, sms: Sequence[MemberView]) -> tuple[tuple[str, bool], ...]:
        if lm.has_work:
            self._lm_work_at = now
        if any(s.has_work for s in sms):
            self._sm_work_at = now
        hold = SHARING_HOLD_S - _EPS
        shape = self.policy.shape
        lm_shared = shape != "lm_first" and now - self._sm_work_at < hold
        sm_shared = shape != "sm_greedy" and now - self._lm_work_at < hold
        return self._changes(self._told, lm_shared, sm_shared)

    def _lending(self, lm: MemberView, sms: Sequence[MemberView]) -> tuple[tuple[str, bool], ...]:
        """Whether the other side lends each member its ITL tail, and the members whose answer changed. Only the
        deadline shapes step past deadlines; the LM is lent the SMs' tail while every SM with work lends, and the
        SMs the LM's while it lends or has no work: a side with no work has no deadline to keep, so a member still
        shared (SHARING_HOLD_S) steps to the bounds, as lent."""
        lending = self.policy.lends_tails
        lm_lent = lending and all(s.lends_tail for s in sms if s.has_work)
        sm_lent = lending and (not lm.has_work or lm.lends_tail)
        return self._changes(self._told_lent, lm_lent, sm_lent)

    def _changes(self, told: dict[str, bool], lm_value: bool, sm_value: bool) -> tuple[tuple[str, bool], ...]:
        """The members whose value in `told` changes to `lm_value` (the LM) or `sm_value` (every SM), now told."""
        notices = []
        for member_id, value in ((self.lm_id, lm_value), *((sm, sm_value) for sm in self.sm_ids)):
            if told.get(member_id) is not value:
                told[member_id] = value
                notices.append((member_id, value))
        return tuple(notices)

    def _decide(self, now: float, lm: MemberView, sms: Sequence[MemberView]) -> Decision:
        self._note_waits(now, lm, sms)
        self._charge(now)
        if self._busy(self.lm_id):
            return Decision()
        sm_work = [s for s in sms if s.has_work]
        self._lm_floor = min_cap_s(lm) if self.policy.shape in _DEADLINE_SHAPES else lm.min_step_s
        if self.holder is Holder.LM:
            cap = self._lm_cap(now, lm, sm_work)
            if lm.has_work and cap >= lm.min_step_s - _EPS and self._lm_may_continue(now, lm, sm_work):
                return Decision(run_lm=True, lm_cap_s=cap)
            stall_cap = self._lm_cap(now, lm, sm_work, horizon=False)
            self._switch(now, Holder.SM, forced=lm.has_work and stall_cap < lm.min_step_s - _EPS)
        if not lm.has_work:
            self.draining = False
        elif not self.draining:
            due, forced = self._lm_due(now, lm, sm_work)
            if due:
                self.draining, self._drain_start, self._drain_forced = True, now, forced
        if self.draining and not any(self._busy(s) for s in self.sm_ids):
            self._note_barrier(now)
            self._switch(now, Holder.LM, self._drain_forced)
            return Decision(run_lm=True, lm_cap_s=self._lm_cap(now, lm, sm_work))
        return self._sm_starts(now, lm, sm_work)

    def started(self, member_id: str, now: float, step_s: float, cap_s: float) -> None:
        """A step of `member_id` began at `now`; it takes `step_s` and was given `cap_s`."""
        if step_s > cap_s + _EPS:
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
        """Count one SM's state choice at a lease start (`lease_state.lease_state`)."""
        self.stats.lease_states[choice] = self.stats.lease_states.get(choice, 0) + 1

    def last_step_end_s(self, member_id: str) -> float | None:
        """When the member's last step ended (None before its first)."""
        return self._last_end.get(member_id)

    def open_waits_s(self, now: float) -> tuple[float, float]:
        """(the LM's wait, the longest SM stall) still open at `now`: a side that never got the GPUs back before the
        run ended has waited this long, which `GangStats` (closed waits only) cannot show."""
        lm = now - self._lm_wait_since if self._lm_wait_since is not None else 0.0
        return lm, max((now - t for t in self._stall_since.values()), default=0.0)

    def barrier_end_s(self, now: float) -> float:
        """When the last running SM step ends (`now` when none runs): the earliest an LM step can start."""
        return max((t for m, t in self._busy_until.items() if m != self.lm_id), default=now)

    # ---- bookkeeping -------------------------------------------------------------------------------------------

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
        """Virtual time: the holder pays for the group time since the last charge, over its weight."""
        dt = max(0.0, now - self._charged_until)
        self._charged_until = max(self._charged_until, now)
        if self.holder is Holder.LM:
            self.stats.lm_held_s += dt
            self._vt_lm += dt / self.policy.lm_weight
        else:
            self.stats.sm_held_s += dt
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

    def _note_barrier(self, now: float) -> None:
        for s in self.sm_ids:
            self.stats.barrier_idle_gpu_s += now - max(self._drain_start, self._last_end.get(s, self._drain_start))

    # ---- caps and rules ----------------------------------------------------------------------------------------

    def _lm_cap(self, now: float, lm: MemberView, sm_work: Sequence[MemberView], horizon: bool = True) -> float:
        """How long the next LM step may run: until the earliest SM stall deadline (an SM without work may get
        some at any moment), in the periodic shape until the lease ends, and in the deadline shapes until the SMs'
        latest start, past that of every SM that lends its tail when the LM's due prompts need the longer step."""
        cap = self._max_stall_s
        for s in sm_work:
            cap = min(cap, self._stall_since.get(s.member_id, now) + self._max_stall_s - now)
        if horizon and sm_work and self.policy.lm_shared_step_ms > 0 and self.policy.shape != "deadline":
            cap = min(cap, max(self._lm_floor, self.policy.lm_shared_step_ms / 1e3))
        if horizon and self.policy.shape == "periodic" and sm_work and self.holder is Holder.LM:
            cap = min(cap, self._lease_start + self.policy.lease_ms / 1e3 - now)
        if horizon and self.policy.shape in _DEADLINE_SHAPES:
            # Deadlines already missed cap nothing: shrinking every step to its floor would stop all prefill.
            live = [s for s in sm_work if s.deadline_s is not None and s.deadline_s >= now]
            cut = _deadline_cut(now, self._lm_floor, live)
            if cut is not None and lm.due_prefill_s > cut:  # the due prompts need a longer step: spend lent tails
                cut = _deadline_cut(now, self._lm_floor, [s for s in live if not s.lends_tail])
            if cut is not None:
                cap = min(cap, cut)
        return cap

    def _sm_cap(self, now: float, lm: MemberView, floor_s: float, due_prefill_s: float = 0.0) -> float:
        cap = self._max_wait_s if self._lm_wait_since is None else self._lm_wait_since + self._max_wait_s - now
        if lm.has_work and self.policy.sm_shared_step_ms > 0 and self.policy.shape != "deadline":
            cap = min(cap, max(floor_s, self.policy.sm_shared_step_ms / 1e3))
        if self.policy.shape in _DEADLINE_SHAPES and lm.has_work and lm.deadline_s is not None and lm.deadline_s >= now:
            cut = max(floor_s, lm.deadline_s - now)
            if not (lm.lends_tail and due_prefill_s > cut):  # a due prompt that needs more spends the LM's tail
                cap = min(cap, cut)
        return cap

    def _lm_may_continue(self, now: float, lm: MemberView, sm_work: Sequence[MemberView]) -> bool:
        """The LM holds the GPUs, has work and its floor fits its cap: one more LM step (shape rule)?"""
        if not sm_work:
            return True
        p = self.policy
        if p.is_baseline:
            return p.shape == "lm_first" or (p.shape == "slices" and self._lm_slot(now))
        if p.shape == "interleave":
            return False  # one LM step per lease
        if p.shape == "periodic":
            return True  # the cap already ends the lease at its horizon
        lm_urgent, sm_urgent = self._urgent(now, lm, sm_work)
        if lm_urgent != sm_urgent:
            return lm_urgent
        if p.shape == "deadline":
            return False  # neither urgent: the SMs run; both: they alternate (the SMs' turn)
        self._pull_idle_vtime()
        return self._vt_lm <= self._vt_sm + p.min_slice_ms / 1e3

    def _lm_due(self, now: float, lm: MemberView, sm_work: Sequence[MemberView]) -> tuple[bool, bool]:
        """The SMs hold the GPUs and the LM has work: (drain toward a lease now?, forced by the LM-wait bound?)."""
        if not sm_work:
            return True, False
        bound_cap = self._lm_wait_since + self._max_wait_s - now if self._lm_wait_since is not None else self._max_wait_s
        if any(not self._busy(s.member_id) and s.min_step_s > bound_cap + _EPS for s in sm_work):
            return True, True
        p = self.policy
        if p.is_baseline:
            return p.shape == "lm_first" or (p.shape == "slices" and self._lm_slot(now)), False
        if not all(s.member_id in self._stepped_since_lease for s in sm_work):
            return False, False
        if p.shape == "interleave":
            return True, False
        if p.shape == "periodic":
            return now >= self._lease_start + (p.period_ms - p.lease_ms) / 1e3 - _EPS, False
        lm_urgent, sm_urgent = self._urgent(now, lm, sm_work)
        if p.shape == "deadline" and not sm_urgent and 0.0 < lm.due_prefill_s <= self._lm_cap(now, lm, sm_work):
            return True, False  # a due prompt whose step fits now goes first (module doc, "Due prompts go first")
        if lm_urgent != sm_urgent or p.shape == "deadline":
            return lm_urgent, False  # deadline: the LM takes the GPUs only when its own deadline calls
        self._pull_idle_vtime()
        return self._vt_sm > self._vt_lm + p.min_slice_ms / 1e3, False

    def _sm_starts(self, now: float, lm: MemberView, sm_work: Sequence[MemberView]) -> Decision:
        idle = [s for s in sm_work if not self._busy(s.member_id)]
        if self.draining:
            cap = self.barrier_end_s(now) - now
            starts = tuple((s.member_id, cap) for s in idle if s.min_step_s <= cap + _EPS and cap > _EPS)
            self.stats.num_fill_steps += len(starts)
            return Decision(sm_starts=starts, fills=bool(starts))
        starts = []
        for s in idle:
            cap = self._sm_cap(now, lm, min_cap_s(s) if self.policy.shape in _DEADLINE_SHAPES else s.min_step_s,
                               s.due_prefill_s)
            if s.min_step_s <= cap + _EPS:
                starts.append((s.member_id, cap))
        return Decision(sm_starts=tuple(starts))

    def _urgent(self, now: float, lm: MemberView, sm_work: Sequence[MemberView]) -> tuple[bool, bool]:
        """(LM urgent, SMs urgent): a side's latest start falls within the other side's step floor plus
        `urgent_ms` (one more step of the other side would make it late)."""
        guard = self.policy.urgent_ms / 1e3
        sm_floor = max((s.min_step_s for s in sm_work), default=0.0)
        lm_urgent = lm.deadline_s is not None and lm.deadline_s - now <= sm_floor + guard
        sm_deadlines = [s.deadline_s for s in sm_work if s.deadline_s is not None]
        sm_urgent = bool(sm_deadlines) and min(sm_deadlines) - now <= lm.min_step_s + guard
        return lm_urgent, sm_urgent

    def _lm_slot(self, now: float) -> bool:
        """slices shape: `now` falls in one of the LM's slices (the odd ones)."""
        return int(now * 1e3 // self.policy.slice_ms) % 2 == 1

    def _pull_idle_vtime(self) -> None:
        """Neither side banks more than `max_lag_ms` of credit (an idle side does not starve the other later)."""
        lag = self.policy.max_lag_ms / 1e3
        self._vt_lm = max(self._vt_lm, self._vt_sm - lag)
        self._vt_sm = max(self._vt_sm, self._vt_lm - lag)


def with_shared_steps(policy: GangPolicy, lm_step_share: float, itl_ms: float, headroom: float = 0.85) -> GangPolicy:
    """`policy` with the shared-step caps that split `headroom` x the ITL between one LM and one SM step."""
    target_ms = itl_ms * headroom
    return dataclasses.replace(policy, lm_shared_step_ms=lm_step_share * target_ms,
                               sm_shared_step_ms=(1.0 - lm_step_share) * target_ms)


def policy_from_mapping(raw: Mapping[str, object]) -> GangPolicy:
    """A GangPolicy from the config's `gang` keys (groups excluded); unknown keys are the caller's to report."""
    fields = {f for f in GangPolicy.__dataclass_fields__}
    kwargs = {k: (str(v) if k == "shape" else float(v)) for k, v in raw.items() if k in fields}  # type: ignore[arg-type]
    return GangPolicy(**kwargs)
