"""Admission control for the router: the in-flight ledger and the per-request checks that shed load early.

A request is admitted only when some instance can give it its first token within its tier's TTFT SLO (x slack)
and hold its KV (prompt + reservation) without preempting anyone; otherwise it is refused with `Overloaded` and a
retry hint, before it costs any GPU time.

The ledger exists because live load snapshots lag: work the router dispatched since an instance's last snapshot
is not in that snapshot, so without it a burst would be admitted against a stale, empty-looking queue.
- `pending` (per instance): requests dispatched since the snapshot now held for the instance; cleared when a
  snapshot that differs from the held one arrives (a new report includes them).
- `outstanding` (per request): dispatched, no first token yet. Exact at the router, so the per-tier queue bounds
  and the tier mix of the queue ahead come from it, not from the snapshot.

TTFT calibration: the prediction below is a mean-field estimate; its error depends on the load and the model.
`TtftCalibrator` keeps, per (model, tier), the last `window` errors (observed TTFT - predicted TTFT, seconds). A
request predicted with slack s before its SLO misses it with the probability that an error exceeds s: the share
of those errors above s. A request is admitted when that probability is at most 1 - `quantile` (3 % with the
default 0.97: predicted + the error quantile <= SLO), or, spending the risk as a budget as the batcher spends the
ITL tail, at most `max_risk` while the mean miss probability of the model's and tier's last `window` admissions,
this one included, stays within 1 - `quantile` (the 2 points above the 95 % promise leave room for TPOT misses
and for the error drifting with the load). At light load most admissions carry no risk, and a prompt predicted
close to its SLO is still admitted. Under overload a risky admission takes capacity that a safe one behind it
would have used, so the budget is spent only while the model refuses under `RISK_PRESSURE` of its recent
latency-tier requests (routing.py); past that the quantile rule alone holds. Until `min_samples` errors are in, the prior decides alone: (1 - ttft_slack) x SLO plus
`ttft_prior_error` x the queued part of the prediction, as a correction (admit when the slack covers it).

Tiers: a request of tier T never waits behind lower tiers (larger Priority values) except BATCH's protected floor:
the batcher preempts lower-tier work at iteration boundaries for it (services/core/batcher.py), so only
occupancy of tiers at least as urgent as T, plus `batch_min_share` of the slots, counts in its decode-slot wait.
And while a model's more urgent tiers are being shed (`TierPressure`), BATCH is admitted to an instance only
below its minimum share of the decode slots there (rounded up): the latency tier gets the capacity first,
background keeps its share.

Shortest prompts first under overload (`ShortestFirst`): past its capacity a model admits only part of a tier's
arrivals, and which part sets its goodput. Arrival order admits whatever prompt finds the queue short enough, long
or short; one long prompt's prefill takes the GPU time of several short ones, so while a tier is refused part of
its load, it admits only prompts no longer than those it has been served, and finds out step by step whether it can
be served longer ones.

Retry hints: the drain time of the queue ahead of this tier on the best instance (queued prefill tokens / prefill
throughput), i.e. when a retry would find enough of today's queue gone, floored at `min_retry_after_ms`.

Invariants: no clock (the caller passes loads that carry time implicitly), no randomness; all state mutates only
through the `on_*` hooks and `observe_load`.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

from octoserve.services.core.placement import InstanceConfig, PolicyConfig
from octoserve.services.core.types import EngineLoad, Priority, RequestSpec, Role


def same_load(a: EngineLoad, b: EngineLoad) -> bool:
    """`a == b` (the dataclass's equality: every field equal), field by field: compiled, the generated `__eq__`
    runs as interpreted code and builds two tuples of 18 fields at each routing decision."""
    if type(a) is not EngineLoad or type(b) is not EngineLoad:
        return a == b
    return (a.num_free_blocks == b.num_free_blocks and a.queued_prefill_tokens == b.queued_prefill_tokens
            and a.num_running == b.num_running and a.num_waiting == b.num_waiting
            and a.prefill_tokens_per_s == b.prefill_tokens_per_s and a.decode_step_time_s == b.decode_step_time_s
            and a.mean_output_tokens == b.mean_output_tokens and a.num_reserved == b.num_reserved
            and a.instance_id == b.instance_id and a.model == b.model and a.role == b.role
            and a.num_total_blocks == b.num_total_blocks and a.block_size == b.block_size
            and a.healthy == b.healthy and a.paused == b.paused and a.max_num_seqs == b.max_num_seqs
            and a.long_prefill_tokens_per_s == b.long_prefill_tokens_per_s and a.busy_until_s == b.busy_until_s
            and a.long_step_wait_s == b.long_step_wait_s and a.long_burst_tokens == b.long_burst_tokens
            and a.long_sustained_tokens_per_s == b.long_sustained_tokens_per_s)


@dataclass(frozen=True, slots=True, init=False)  # __init__ written out: see core/types.py
class Dispatched:
    """What the ledger remembers of one dispatched request."""

    request_id: str
    model: str
    tier: Priority
    instance_id: str  # prefill or colocated instance
    decode_instance_id: str | None
    uncached_prefill_tokens: int  # prefill work queued on instance_id until the first token
    entry_blocks: int  # KV blocks the request takes on instance_id
    decode_blocks: int  # KV blocks reserved on decode_instance_id (0 when colocated)
    arrival_s: float = 0.0  # on the clock `now` is on, for the TTFT calibration
    predicted_ttft_s: float = 0.0
    deadline_s: float = math.inf  # its TTFT deadline (arrival + its SLO): where an EDF queue puts it

    def __init__(
        self,
        request_id: str,
        model: str,
        tier: Priority,
        instance_id: str,
        decode_instance_id: str | None,
        uncached_prefill_tokens: int,
        entry_blocks: int,
        decode_blocks: int,
        arrival_s: float = 0.0,
        predicted_ttft_s: float = 0.0,
        deadline_s: float = math.inf,
    ) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "tier", tier)
        object.__setattr__(self, "instance_id", instance_id)
        object.__setattr__(self, "decode_instance_id", decode_instance_id)
        object.__setattr__(self, "uncached_prefill_tokens", uncached_prefill_tokens)
        object.__setattr__(self, "entry_blocks", entry_blocks)
        object.__setattr__(self, "decode_blocks", decode_blocks)
        object.__setattr__(self, "arrival_s", arrival_s)
        object.__setattr__(self, "predicted_ttft_s", predicted_ttft_s)
        object.__setattr__(self, "deadline_s", deadline_s)


_TIERS = tuple(Priority)  # iterating the enum class itself costs a generator per call (once per candidate)


@dataclass
class InFlightLedger:
    """Router-side accounting of dispatched work; see the module docstring."""

    snapshots: dict[str, EngineLoad] = field(default_factory=dict)  # instance -> snapshot held
    pending: dict[str, dict[str, Dispatched]] = field(default_factory=dict)  # instance -> request -> record
    outstanding: dict[str, Dispatched] = field(default_factory=dict)  # request -> record, until first token
    dispatched: dict[str, Dispatched] = field(default_factory=dict)  # request -> record, until finished
    by_tier: dict[str, dict[Priority, int]] = field(default_factory=dict)  # instance -> tier -> dispatched count
    # instance -> tier -> the TTFT deadlines of its dispatched, unfinished requests, sorted (INTERACTIVE's are never
    # asked for): which less urgent requests an EDF queue puts after a newcomer (`later_dispatched`)
    deadlines: dict[str, dict[Priority, list[float]]] = field(default_factory=dict)
    # instance -> a counter bumped by every hook that changes what the ledger says about that instance (its held
    # snapshot, its pending and outstanding records, its tier counts): figures derived from an unchanged snapshot
    # and an unchanged version are unchanged (the router reuses them, routing.RouterPolicy._instance_figures).
    versions: dict[str, int] = field(default_factory=dict)

    def version(self, instance_id: str) -> int:
        return self.versions.get(instance_id, 0)

    def _bump(self, instance_id: str | None) -> None:
        if instance_id is not None:
            self.versions[instance_id] = self.versions.get(instance_id, 0) + 1

    def observe_load(self, load: EngineLoad) -> None:
        """A snapshot unlike the one held is newer: it already counts what was pending on that instance."""
        held = self.snapshots.get(load.instance_id)
        if held is not load and (held is None or not same_load(held, load)):  # the simulator reuses unchanged ones
            self.snapshots[load.instance_id] = load
            self.pending.pop(load.instance_id, None)
            self._bump(load.instance_id)

    def on_dispatched(self, record: Dispatched) -> None:
        self.dispatched[record.request_id] = record
        self.outstanding[record.request_id] = record
        for iid in (record.instance_id, record.decode_instance_id):
            if iid is not None:
                self._bump(iid)
                self.pending.setdefault(iid, {})[record.request_id] = record
                counts = self.by_tier.setdefault(iid, dict.fromkeys(_TIERS, 0))
                counts[record.tier] += 1
                if record.tier is not Priority.INTERACTIVE:
                    bisect.insort(self._deadlines(iid, record.tier), record.deadline_s)

    def on_first_token(self, request_id: str) -> Dispatched | None:
        """The request's record the first time its first token is seen, else None."""
        record = self.outstanding.pop(request_id, None)
        if record is not None:
            self._bump(record.instance_id)
            self._bump(record.decode_instance_id)
        return record

    def on_finished(self, request_id: str) -> None:
        record = self.dispatched.pop(request_id, None)
        outstanding = self.outstanding.pop(request_id, None)
        if outstanding is not None:  # finished before its first token (normally the same record as `dispatched`'s)
            self._bump(outstanding.instance_id)
            self._bump(outstanding.decode_instance_id)
        if record is not None:
            for iid in (record.instance_id, record.decode_instance_id):
                self._bump(iid)
                self.pending.get(iid or "", {}).pop(request_id, None)
                if iid is not None:
                    self.by_tier[iid][record.tier] -= 1
                    if record.tier is not Priority.INTERACTIVE:
                        held = self._deadlines(iid, record.tier)
                        del held[bisect.bisect_left(held, record.deadline_s)]

    def _deadlines(self, instance_id: str, tier: Priority) -> list[float]:
        by_tier = self.deadlines.get(instance_id)
        if by_tier is None:
            by_tier = self.deadlines[instance_id] = {t: [] for t in _TIERS}
        return by_tier[tier]

    def later_dispatched(self, instance_id: str, tier: Priority, deadline_s: float) -> tuple[int, int]:
        """(requests of tiers less urgent than `tier` dispatched to the instance and unfinished whose deadlines come
        after `deadline_s`, how many of those are BATCH)."""
        by_tier = self.deadlines.get(instance_id)
        if by_tier is None:
            return 0, 0
        later = later_batch = 0
        for t in _TIERS:
            if t > tier:
                held = by_tier[t]
                n = len(held) - bisect.bisect_right(held, deadline_s)
                later += n
                if t is Priority.BATCH:
                    later_batch = n
        return later, later_batch

    def pending_blocks(self, instance_id: str) -> int:
        return sum(r.entry_blocks if r.instance_id == instance_id else r.decode_blocks
                   for r in self.pending.get(instance_id, {}).values())

    def pending_prefill_tokens(self, instance_id: str) -> int:
        """Prefill tokens sent since the snapshot whose first token has not come back yet."""
        return sum(r.uncached_prefill_tokens for rid, r in self.pending.get(instance_id, {}).items()
                   if r.instance_id == instance_id and rid in self.outstanding)

    def num_pending(self, instance_id: str) -> int:
        return sum(1 for r in self.pending.get(instance_id, {}).values() if r.instance_id == instance_id)

    def outstanding_count(self, model: str, tier: Priority) -> int:
        return sum(1 for r in self.outstanding.values() if r.model == model and r.tier == tier)

    def num_dispatched_by_tier(self, instance_id: str) -> dict[Priority, int]:
        """Requests admitted to the instance (entry or decode side) and not finished, per tier."""
        return self.by_tier.get(instance_id) or dict.fromkeys(_TIERS, 0)

    def outstanding_tokens_by_tier(self, instance_id: str) -> dict[Priority, int]:
        out = dict.fromkeys(_TIERS, 0)
        for r in self.outstanding.values():
            if r.instance_id == instance_id:
                out[r.tier] += r.uncached_prefill_tokens
        return out


def reservation_tokens(spec: RequestSpec, policies: PolicyConfig) -> int:
    """Output tokens whose KV admission reserves up front, by the configured reservation policy."""
    if policies.reservation == "full":
        return spec.max_tokens
    if policies.reservation == "predicted":
        return min(spec.max_tokens, policies.predicted_output_tokens)
    return 0  # watermark: no per-request reservation, a node-wide free fraction instead


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def kv_blocks_required(spec: RequestSpec, instance: InstanceConfig, policies: PolicyConfig, *, with_output: bool) -> int:
    """Blocks the request takes on `instance`: its prompt, plus its reservation unless `with_output` is False
    (a prefill instance holds the prompt only, until the hand-off)."""
    tokens = spec.num_prompt_tokens + (reservation_tokens(spec, policies) if with_output else 0)
    return blocks_for(tokens, instance.block_size)


def kv_headroom_blocks(load: EngineLoad, ledger: InFlightLedger, policies: PolicyConfig) -> int:
    """Blocks free on the instance once what was sent since its snapshot lands, less the watermark if any."""
    keep = math.ceil(policies.kv_watermark * load.num_total_blocks) if policies.reservation == "watermark" else 0
    return load.num_free_blocks - ledger.pending_blocks(load.instance_id) - keep


def queued_prefill_tokens(load: EngineLoad, ledger: InFlightLedger) -> int:
    """Prefill work queued on the instance: the snapshot's plus what was sent since it."""
    return load.queued_prefill_tokens + ledger.pending_prefill_tokens(load.instance_id)


def queue_ahead_tokens(load: EngineLoad, ledger: InFlightLedger, tier: Priority, queue_policy: str) -> float:
    """Queued prefill tokens that run before a new request of `tier`.

    Under "fcfs" that is the whole queue. Under "edf" / "priority" more urgent tiers go first: the queue is
    scaled by the share of it, in the router's own ledger, that belongs to tiers at least as urgent (the
    snapshot carries no tiers; the ledger does). Under "edf" this is the tier order; `aged_ahead_tokens` adds the
    less urgent requests whose deadlines have come before the new one's.
    """
    total = queued_prefill_tokens(load, ledger)
    if queue_policy == "fcfs":
        return float(total)
    by_tier = ledger.outstanding_tokens_by_tier(load.instance_id)
    known = sum(by_tier.values())
    if known == 0:
        return float(total)
    ahead = sum(n for t, n in by_tier.items() if t <= tier)
    return total * ahead / known


def aged_ahead_tokens(load: EngineLoad, ledger: InFlightLedger, tier: Priority, deadline_s: float) -> float:
    """Under "edf": queued prefill tokens of less urgent tiers whose deadlines come before `deadline_s`, a new
    request's of `tier`, so they run before it although `queue_ahead_tokens` (tier order) puts them after: a
    BATCH prompt that has waited most of its 10 s precedes an INTERACTIVE one. Scaled from the ledger's tokens to
    the snapshot's queue as `queue_ahead_tokens` is; 0 for the least urgent tier or an empty ledger."""
    return edf_figures(load, ledger, tier, deadline_s).aged_tokens


class EdfFigures(NamedTuple):
    """What an EDF queue means for a new request on one instance (`edf_figures`)."""

    aged_tokens: float  # `aged_ahead_tokens`
    num_lower: int  # dispatched requests of less urgent tiers, unfinished
    num_later: int  # those whose deadlines come after the new request's
    num_later_batch: int  # BATCH among them


def edf_figures(load: EngineLoad, ledger: InFlightLedger, tier: Priority, deadline_s: float) -> EdfFigures:
    """Under "edf": the less urgent work on the instance, in one pass over its outstanding requests. Only the later
    ones can be preempted for the new request: the batcher never preempts work that the queue order puts ahead of
    its newcomer (a recomputed victim would re-enter ahead of it and take its slot back)."""
    instance_id = load.instance_id
    num_lower = sum(n for t, n in ledger.num_dispatched_by_tier(instance_id).items() if t > tier)
    # Nothing less urgent dispatched there (a one-tier workload): no ledger pass on this per-candidate path.
    if not num_lower:
        return EdfFigures(0.0, 0, 0, 0)
    later, later_batch = ledger.later_dispatched(instance_id, tier, deadline_s)
    known = aged = 0
    for r in ledger.outstanding.values():
        if r.instance_id == instance_id:
            known += r.uncached_prefill_tokens
            if r.tier > tier and r.deadline_s <= deadline_s:
                aged += r.uncached_prefill_tokens
    aged_tokens = queued_prefill_tokens(load, ledger) * aged / known if aged else 0.0
    return EdfFigures(aged_tokens, num_lower, later, later_batch)


def preemptible_slots(load: EngineLoad, ledger: InFlightLedger, tier: Priority, batch_min_share: float,
                      later: tuple[int, int] | None = None) -> int:
    """Slots held by tiers less urgent than `tier` that the batcher would preempt for it: all of them but BATCH's
    protected floor of `batch_min_share` x max_num_seqs; with `later` (`EdfFigures.num_later` and
    `num_later_batch`: those whose deadlines come after the new request's, and BATCH among them), only those. 0
    with tier preemption off (share >= 1)."""
    if batch_min_share >= 1.0 or load.max_num_seqs <= 0:
        return 0
    by_tier = ledger.num_dispatched_by_tier(load.instance_id)
    num_batch = by_tier[Priority.BATCH]
    floor = math.ceil(batch_min_share * load.max_num_seqs) if tier < Priority.BATCH else 0
    if later is None:
        lower = sum(n for t, n in by_tier.items() if t > tier)
        return max(0, lower - min(floor, num_batch))
    num_later, later_batch = later
    # BATCH above its floor may go, but only the ones the queue order puts after the new request.
    return num_later - later_batch + min(later_batch, max(0, num_batch - floor))


def slot_wait_s(load: EngineLoad, ledger: InFlightLedger, preemptible: int = 0) -> float:
    """How long a new request waits for a decode slot on an instance whose batch is full.

    An instance sized for the ITL SLO runs at most `max_num_seqs` sequences; past that, requests queue for a slot
    however idle its prefill is. Slots free at the rate the batch completes: `max_num_seqs` sequences every
    `mean_output_tokens` decode steps. A request with k requests ahead of it past the limit waits k of those
    intervals. 0 when the snapshot reports no limit (a real engine that does not say) or the role has no decode.
    """
    if load.max_num_seqs <= 0 or load.role is Role.PREFILL:
        return 0.0
    occupied = load.num_running + load.num_waiting + ledger.num_pending(load.instance_id) - preemptible
    excess = occupied - load.max_num_seqs + 1
    if excess <= 0:
        return 0.0
    seconds_per_sequence = max(load.mean_output_tokens, 1.0) * load.decode_step_time_s
    return excess * seconds_per_sequence / load.max_num_seqs


def decode_slot_free(load: EngineLoad, ledger: InFlightLedger) -> bool:
    """A decode instance can take one more reservation without exceeding its batch limit."""
    if load.max_num_seqs <= 0:
        return True
    pending = sum(1 for r in ledger.pending.get(load.instance_id, {}).values() if r.decode_instance_id == load.instance_id)
    return load.num_running + load.num_waiting + pending < load.max_num_seqs


def prefill_wait_s(ahead_tokens: float, prefill_tokens_per_s: float) -> float:
    return ahead_tokens / prefill_tokens_per_s if prefill_tokens_per_s > 0 else math.inf


def retry_after_ms(wait_s: float, policies: PolicyConfig) -> int:
    """Round a drain-time estimate up to whole ms, floored at the configured minimum."""
    if math.isinf(wait_s):
        return policies.min_retry_after_ms * 20
    return max(policies.min_retry_after_ms, math.ceil(wait_s * 1000.0 - 1e-9))


def tier_bound_reached(ledger: InFlightLedger, spec: RequestSpec, bounds: Mapping[Priority, int]) -> int | None:
    """The tier's outstanding count when it has reached its bound, else None."""
    count = ledger.outstanding_count(spec.model, spec.priority)
    return count if count >= bounds.get(spec.priority, math.inf) else None


def ttft_excess_s(predicted_ttft_s: float, correction_s: float, slo_ms: float) -> float:
    """How much later than its SLO the first token would come once the prediction is corrected (<= 0: feasible)."""
    return predicted_ttft_s + correction_s - slo_ms / 1000.0


class TtftCalibrator:
    """Online error of the TTFT prediction per (model, tier), and the risk budget of admissions; see the module
    docstring.

    `observe` takes one observed - predicted error in seconds; `correction_s` is the `quantile` (nearest rank) of
    the last `window` errors of that key, or `prior_s` until `min_samples` are in. `miss_probability` is the share
    of those errors larger than a prediction's slack; `risk_allowance` is what the next admission of the key may
    carry so that the mean miss probability of its last `window` admissions stays within 1 - `quantile`, and never
    over `max_risk`. Exact and clock-free: the windows are counts of first tokens and admissions, not time spans.
    """

    def __init__(self, quantile: float, window: int, min_samples: int, max_risk: float = 0.25) -> None:
        if not 0.0 < quantile <= 1.0 or window < 1 or not 1 <= min_samples <= window:
            raise ValueError("need 0 < quantile <= 1 and 1 <= min_samples <= window")
        if not 0.0 <= max_risk <= 1.0:
            raise ValueError("need 0 <= max_risk <= 1")
        self.quantile = quantile
        self.window = window
        self.min_samples = min_samples
        self.max_risk = max_risk
        self._recent: dict[tuple[str, Priority], deque[float]] = {}
        self._sorted: dict[tuple[str, Priority], list[float]] = {}
        self._risks: dict[tuple[str, Priority], deque[float]] = {}
        self._risk_sum: dict[tuple[str, Priority], float] = {}

    def observe(self, model: str, tier: Priority, error_s: float) -> None:
        key = (model, tier)
        recent = self._recent.setdefault(key, deque())
        ordered = self._sorted.setdefault(key, [])
        recent.append(error_s)
        bisect.insort(ordered, error_s)
        if len(recent) > self.window:
            del ordered[bisect.bisect_left(ordered, recent.popleft())]

    def num_samples(self, model: str, tier: Priority) -> int:
        return len(self._sorted.get((model, tier), ()))

    def correction_s(self, model: str, tier: Priority, prior_s: float, cap_s: float = math.inf) -> float:
        """The correction, at most `cap_s`: a correction at or over the SLO would refuse every request, so no new
        error would ever be observed and the correction could never come down again."""
        ordered = self._sorted.get((model, tier), ())
        if len(ordered) < self.min_samples:
            return min(prior_s, cap_s)
        rank = max(1, math.ceil(self.quantile * len(ordered)))
        return min(ordered[rank - 1], cap_s)

    def miss_probability(self, model: str, tier: Priority, slack_s: float, prior_s: float,
                         cap_s: float = math.inf) -> float:
        """How likely a request predicted `slack_s` before its SLO misses it: the share of the key's recent errors
        larger than the slack. Until `min_samples` are in, 0 when the slack covers the prior and 1 when not (the
        prior as a correction). A slack of `cap_s` or more counts as safe, as the correction is capped."""
        if slack_s >= cap_s:
            return 0.0
        ordered = self._sorted.get((model, tier), ())
        if len(ordered) < self.min_samples:
            return 0.0 if slack_s >= min(prior_s, cap_s) else 1.0
        return (len(ordered) - bisect.bisect_right(ordered, slack_s)) / len(ordered)

    def risk_allowance(self, model: str, tier: Priority, spend: bool = True) -> float:
        """The largest miss probability the key's next admission may carry: 1 - `quantile` always (the calibrated
        correction's own rule), and with `spend` more, up to `max_risk`, while the mean over the key's last
        `window` admissions (the next one included) stays within 1 - `quantile`."""
        if not spend:
            return 1.0 - self.quantile
        key = (model, tier)
        risks = self._risks.get(key)
        total = self._risk_sum.get(key, 0.0)
        n = len(risks) if risks is not None else 0
        if risks is not None and n >= self.window:  # the oldest leaves the window as the next one enters
            total -= risks[0]
            n -= 1
        return max(1.0 - self.quantile, min(self.max_risk, (1.0 - self.quantile) * (n + 1) - total))

    def note_admitted(self, model: str, tier: Priority, risk: float) -> None:
        """An admission of the key that carried miss probability `risk`."""
        key = (model, tier)
        risks = self._risks.setdefault(key, deque())
        risks.append(risk)
        total = self._risk_sum.get(key, 0.0) + risk
        if len(risks) > self.window:
            total -= risks.popleft()
        if risk > 0.0 and len(risks) == self.window:
            total = math.fsum(risks)  # no drift: re-summed whenever the window is full and a risk came in
        self._risk_sum[key] = max(0.0, total)


class SlidingShare:
    """The share of True among the last `window` observations (0 when there are none)."""

    def __init__(self, window: int) -> None:
        self.window = window
        self._recent: deque[bool] = deque()
        self._num_true = 0

    def observe(self, flag: bool) -> None:
        self._recent.append(flag)
        self._num_true += flag
        if len(self._recent) > self.window:
            self._num_true -= self._recent.popleft()

    def share(self) -> float:
        return self._num_true / len(self._recent) if self._recent else 0.0


class TierPressure:
    """Whether a model's more urgent tiers are being shed: of the last `window` admission decisions for its
    INTERACTIVE and STANDARD requests, at least `threshold` were overload refusals. Counted in decisions, not
    seconds, so it needs no clock. While it holds, BATCH is held to its minimum share (routing.py)."""

    def __init__(self, window: int = 64, threshold: float = 0.1) -> None:
        self.window = window
        self.threshold = threshold
        self._refused: dict[str, SlidingShare] = {}

    def observe(self, model: str, refused: bool) -> None:
        """One admission decision for a request of a tier more urgent than BATCH."""
        share = self._refused.get(model)
        if share is None:  # not setdefault: that would build a SlidingShare at every decision
            share = self._refused[model] = SlidingShare(self.window)
        share.observe(refused)

    def under_pressure(self, model: str) -> bool:
        return self.refused_share(model) >= self.threshold

    def refused_share(self, model: str) -> float:
        """The share of overload refusals among the model's last `window` decisions (0 before any)."""
        refused = self._refused.get(model)
        return 0.0 if refused is None else refused.share()


class ShortestFirst:
    """Which prompts a model's tier admits while it is overloaded: the shortest.

    Of the last `window` arrivals of a model's tier that an idle instance could serve in time (the infeasible ones
    never count), it keeps each one's uncached prompt tokens and whether it was admitted. While the admitted share f
    of the window is below 1 / (1 + `margin`), only prompts no longer than the window's length at quantile
    f x (1 + `margin`) may be admitted (`cap_tokens`): the shortest share of the arrivals the tier has been served,
    plus a margin that probes whether it can be served more. Its own refusals count as not admitted, so the cap
    loosens only as far as the node admits what passes it: it settles where the other checks refuse about the
    margin's share of the prompts under it. The quantile is never below `margin` itself: where the other checks
    refuse more than that share for reasons a prompt's length does not change (no decode slot free soon enough),
    the cap would otherwise shrink step by step to nothing. Below capacity f is near 1 and there is no cap. Per
    tier, since each has its own SLO and its own share of the node (BATCH is held to its minimum share of the decode
    slots while the more urgent tiers are shed: its long prompts would spend that share on few requests). Counted
    in decisions, not seconds: no clock. The goodput bound (`octoserve.services.lab.goodput_bound`) serves the
    shortest prompts for the same reason: a request of either length is one good request, the short one costs
    less."""

    def __init__(self, window: int = 512, margin: float = 0.1) -> None:
        if window < 2 or margin <= 0.0:
            raise ValueError("need window >= 2 and margin > 0")
        self.window = window
        self.margin = margin
        # (model, tier) -> (uncached tokens, admitted) of its last decisions, oldest first; their tokens ascending;
        # how many were admitted
        self._recent: dict[tuple[str, Priority], deque[tuple[int, bool]]] = {}
        self._sorted: dict[tuple[str, Priority], list[int]] = {}
        self._num_admitted: dict[tuple[str, Priority], int] = {}

    def cap_tokens(self, model: str, tier: Priority) -> int:
        """The most uncached prompt tokens the model's tier admits now (-1: no cap; none before half a window)."""
        key = (model, tier)
        lengths = self._sorted.get(key)
        if lengths is None or 2 * len(lengths) < self.window:
            return -1
        share = self._num_admitted[key] / len(lengths) * (1.0 + self.margin)
        if share >= 1.0:
            return -1
        return lengths[int(max(share, self.margin) * len(lengths))]

    def num_decisions(self, model: str, tier: Priority) -> int:
        """How many of the model's tier's decisions the window holds."""
        recent = self._recent.get((model, tier))
        return 0 if recent is None else len(recent)

    def observe(self, model: str, tier: Priority, uncached_tokens: int, admitted: bool) -> None:
        """One decision on a feasible arrival of the model's tier."""
        key = (model, tier)
        recent = self._recent.get(key)
        if recent is None:
            recent = self._recent[key] = deque()
            self._sorted[key] = []
            self._num_admitted[key] = 0
        lengths = self._sorted[key]
        recent.append((uncached_tokens, admitted))
        bisect.insort(lengths, uncached_tokens)
        self._num_admitted[key] += admitted
        if len(recent) > self.window:
            old_tokens, old_admitted = recent.popleft()
            del lengths[bisect.bisect_left(lengths, old_tokens)]
            self._num_admitted[key] -= old_admitted
