"""Drain or migrate: what happens to a running decode on an instance that a reconfiguration retires.

The instance takes no new request. Each of its running decodes either finishes there (a drain) or moves by KV
hand-off to another instance of the same model (a migration, as Llumnix does), whichever ends the instance's part
sooner without hurting the request. One clock-free rule, shared by the queueing simulator
(services/sim/elastic_sim.py), the step-level simulator (services/sim/elastic_step.py) and the live node
(services/rpc/migration.py):

- `decide(remaining_s, transfer_s, pause_s, ...)`: migrate only when the hand-off is shorter than the decode left
  (`remaining_s`, what the drain would wait for this request) and the stall it adds to the request's stream
  (`pause_s`: the transfer, plus any wait for a slot on the target) is shorter than that too and within the larger
  of the request's TPOT slack and `max_pause_s`.
- `plan(running, targets, ...)`: the per-instance plan of the live node and the step-level simulator, with a
  hand-off's stall taken as the transfer plus one decode step. Longest remaining decode first (the drain waits
  for the longest one), each to the target with the most free KV that has a free slot and room for the request's
  context; a target's headroom shrinks with every request given to it. A request no target has room for stays.

Every decision carries its reason (`REASONS`), for the log line and the counter.

Invariants: pure (no clock, no I/O); times are modelled seconds on the caller's clock; a request is given to a target
only when that target had a free slot and the KV blocks for its context at the time of the plan.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

MIGRATE = "migrate"
DRAIN_SHORTER = "drain_shorter"  # the decode left ends before the hand-off would (or at the same time)
PAUSE_TOO_LONG = "pause_too_long"  # the stall would exceed the request's TPOT slack and the pause bound
NO_TARGET = "no_target"  # no other instance of the model takes requests
TARGET_FULL = "target_full"  # no target has a free slot and the KV for this request's context
TARGET_REFUSED = "target_refused"  # live only: the target's reservation said no (its headroom changed)
ENGINE_CANNOT = "engine_cannot_migrate"  # live only: this engine cannot hand a running request over
REASONS = (MIGRATE, DRAIN_SHORTER, PAUSE_TOO_LONG, NO_TARGET, TARGET_FULL, TARGET_REFUSED, ENGINE_CANNOT)

DEFAULT_MAX_PAUSE_S = 1.0  # modelled seconds a hand-off may stall a stream when the request has no TPOT slack


def decide(remaining_s: float, transfer_s: float, pause_s: float, *, max_pause_s: float = DEFAULT_MAX_PAUSE_S,
           tpot_slack_s: float = 0.0) -> str:
    """MIGRATE, or the reason to let the request finish where it is (DRAIN_SHORTER, PAUSE_TOO_LONG)."""
    if remaining_s <= transfer_s or pause_s >= remaining_s:
        return DRAIN_SHORTER
    if pause_s > max(tpot_slack_s, max_pause_s):
        return PAUSE_TOO_LONG
    return MIGRATE


def expected_remaining_tokens(spec, num_output_tokens: int) -> int:
    """Output tokens still to come for a RequestSpec: the true length when the request carries one (the sim engine's
    `sim_output_len`, unless it ignores EOS), else what max_tokens allows."""
    total = spec.max_tokens
    if spec.sim_output_len is not None and not spec.sampling.ignore_eos:
        total = min(total, spec.sim_output_len)
    return max(0, total - num_output_tokens)


@dataclass(frozen=True, slots=True)
class RunningDecode:
    request_id: str
    context_tokens: int  # prompt + output so far: the KV the hand-off moves
    remaining_tokens: int  # output tokens still to decode (the expected count when the true one is unknown)


@dataclass(frozen=True, slots=True)
class Target:
    instance_id: str
    free_blocks: int
    block_size: int
    free_slots: int


@dataclass(frozen=True, slots=True)
class Decision:
    request_id: str
    reason: str  # one of REASONS; MIGRATE when it moves
    target: str = ""  # the instance it moves to (MIGRATE only)
    remaining_s: float = 0.0
    transfer_s: float = 0.0

    @property
    def migrate(self) -> bool:
        return self.reason == MIGRATE


def plan(running: Sequence[RunningDecode], targets: Sequence[Target], *, step_s: float,
         transfer_s: Callable[[int], float], max_pause_s: float = DEFAULT_MAX_PAUSE_S) -> list[Decision]:
    """One decision per running decode of a retiring instance (in `running`'s order of remaining decode, longest
    first). `step_s`: the instance's decode step (modelled seconds per token); `transfer_s(tokens)`: the hand-off
    time of that much context."""
    free = {t.instance_id: [t.free_blocks, t.free_slots] for t in targets}
    size = {t.instance_id: max(1, t.block_size) for t in targets}
    out: list[Decision] = []
    for r in sorted(running, key=lambda r: (-r.remaining_tokens, r.request_id)):
        remaining_s = r.remaining_tokens * step_s
        xfer = transfer_s(r.context_tokens)
        # The stall: the transfer, plus about one decode step (the request leaves at a step boundary and joins the
        # target's batch at the target's next one), as the live node measures it.
        reason = decide(remaining_s, xfer, xfer + step_s, max_pause_s=max_pause_s)
        if reason != MIGRATE:
            out.append(Decision(r.request_id, reason, remaining_s=remaining_s, transfer_s=xfer))
            continue
        if not free:
            out.append(Decision(r.request_id, NO_TARGET, remaining_s=remaining_s, transfer_s=xfer))
            continue
        # The KV for the context plus the token being decoded, in the target's blocks.
        need = {i: -(-(r.context_tokens + 1) // size[i]) for i in free}
        fits = [i for i, (blocks, slots) in free.items() if slots > 0 and blocks >= need[i]]
        if not fits:
            out.append(Decision(r.request_id, TARGET_FULL, remaining_s=remaining_s, transfer_s=xfer))
            continue
        best = max(fits, key=lambda i: (free[i][0] - need[i], i))
        free[best][0] -= need[best]
        free[best][1] -= 1
        out.append(Decision(r.request_id, MIGRATE, best, remaining_s, xfer))
    return out
