"""A tiny discrete-event gang group for the arbiter's tests: members are queues of abstract steps.

Each member holds a queue of step durations it wants to run; a step runs for min(duration, the arbiter's cap) and
the rest stays at the head of the queue (chunked prefill), but never below the member's floor (its decodes).
The harness drives `GangArbiter` by its protocol and measures, independently of the arbiter's own stats, every LM wait and SM stall, whether an LM step
ever overlapped an SM step, and whether work was left when the events ran out (a deadlock).
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

from octoserve.services.core.gang import GangArbiter, GangPolicy, MemberView


@dataclass
class Member:
    member_id: str
    floor_s: float
    steps: deque = field(default_factory=deque)  # durations of the steps it still has to run
    busy_until: float | None = None
    waiting_since: float | None = None
    deadline_s: float | None = None


@dataclass
class HarnessResult:
    max_lm_wait_s: float
    max_sm_stall_s: float
    overlaps: int
    steps_left: int
    end_s: float
    arbiter: GangArbiter


def run_gang(policy: GangPolicy, lm_floor_s: float, sm_floor_s: float, num_sms: int,
             arrivals: list[tuple[float, str, list[float]]], deadline_offset_s: float | None = None) -> HarnessResult:
    """`arrivals`: (time, member id, step durations); member ids are "lm" and "sm0".."smN-1"."""
    lm = Member("lm", lm_floor_s)
    sms = [Member(f"sm{i}", sm_floor_s) for i in range(num_sms)]
    members = {m.member_id: m for m in [lm, *sms]}
    arbiter = GangArbiter(policy, "lm", [m.member_id for m in sms])
    events: list = []
    seq = 0
    for t, mid, steps in arrivals:
        heapq.heappush(events, (t, seq, "arrive", (mid, steps)))
        seq += 1
    max_wait = max_stall = 0.0
    overlaps = 0
    now = 0.0

    def view(m: Member) -> MemberView:
        deadline = None if deadline_offset_s is None or not m.steps else now + deadline_offset_s
        return MemberView(m.member_id, bool(m.steps), m.floor_s, deadline)

    while events:
        now, _, kind, payload = heapq.heappop(events)
        if kind == "arrive":
            mid, steps = payload
            members[mid].steps.extend(steps)
        else:
            m = members[payload]
            m.busy_until = None
            arbiter.finished(m.member_id, now)
        for m in members.values():
            if m.steps and m.busy_until is None and m.waiting_since is None:
                m.waiting_since = now
        d = arbiter.decide(now, view(lm), [view(s) for s in sms])
        to_start = ([("lm", d.lm_cap_s)] if d.run_lm else []) + list(d.sm_starts)
        for mid, cap_s in to_start:
            m = members[mid]
            assert m.busy_until is None and m.steps, f"{mid} told to start while busy or without work"
            assert cap_s >= m.floor_s - 1e-9, f"{mid} given a cap {cap_s} below its floor {m.floor_s}"
            wanted = max(m.steps.popleft(), m.floor_s)
            duration = min(wanted, cap_s) if wanted > cap_s else wanted
            if wanted - duration > 1e-12:
                m.steps.appendleft(wanted - duration)
            if mid == "lm":
                overlaps += sum(1 for s in sms if s.busy_until is not None)
                max_wait = max(max_wait, now - m.waiting_since)
            else:
                overlaps += lm.busy_until is not None
                max_stall = max(max_stall, now - m.waiting_since)
            m.waiting_since = None
            m.busy_until = now + duration
            arbiter.started(mid, now, duration, cap_s)
            heapq.heappush(events, (m.busy_until, seq, "end", mid))
            seq += 1
    left = sum(len(m.steps) for m in members.values())
    return HarnessResult(max_wait, max_stall, overlaps, left, now, arbiter)
