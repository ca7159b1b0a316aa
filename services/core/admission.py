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

Retry hints: the drain time of the queue ahead of this tier on the best instance (queued prefill tokens / prefill
throughput), i.e. when a retry would find enough of today's queue gone, floored at `min_retry_after_ms`.

Invariants: no clock (the caller passes loads that carry time implicitly), no randomness; all state mutates only
through the `on_*` hooks and `observe_load`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

from services.core.placement import InstanceConfig, PolicyConfig
from services.core.types import EngineLoad, Priority, RequestSpec, Role


@dataclass(frozen=True, slots=True)
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


@dataclass
class InFlightLedger:
    """Router-side accounting of dispatched work; see the module docstring."""

    snapshots: dict[str, EngineLoad] = field(default_factory=dict)  # instance -> snapshot held
    pending: dict[str, dict[str, Dispatched]] = field(default_factory=dict)  # instance -> request -> record
    outstanding: dict[str, Dispatched] = field(default_factory=dict)  # request -> record, until first token
    dispatched: dict[str, Dispatched] = field(default_factory=dict)  # request -> record, until finished

    def observe_load(self, load: EngineLoad) -> None:
        """A snapshot unlike the one held is newer: it already counts what was pending on that instance."""
        if self.snapshots.get(load.instance_id) != load:
            self.snapshots[load.instance_id] = load
            self.pending.pop(load.instance_id, None)

    def on_dispatched(self, record: Dispatched) -> None:
        self.dispatched[record.request_id] = record
        self.outstanding[record.request_id] = record
        for iid in (record.instance_id, record.decode_instance_id):
            if iid is not None:
                self.pending.setdefault(iid, {})[record.request_id] = record

    def on_first_token(self, request_id: str) -> None:
        self.outstanding.pop(request_id, None)

    def on_finished(self, request_id: str) -> None:
        record = self.dispatched.pop(request_id, None)
        self.outstanding.pop(request_id, None)
        if record is not None:
            for iid in (record.instance_id, record.decode_instance_id):
                self.pending.get(iid or "", {}).pop(request_id, None)

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

    def outstanding_tokens_by_tier(self, instance_id: str) -> dict[Priority, int]:
        out = {t: 0 for t in Priority}
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
    snapshot carries no tiers; the ledger does). EDF is approximated by tier order since tier deadlines differ
    by far more than a queue's wait.
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


def slot_wait_s(load: EngineLoad, ledger: InFlightLedger) -> float:
    """How long a new request waits for a decode slot on an instance whose batch is full.

    An instance sized for the ITL SLO runs at most `max_num_seqs` sequences; past that, requests queue for a slot
    however idle its prefill is. Slots free at the rate the batch completes: `max_num_seqs` sequences every
    `mean_output_tokens` decode steps. A request with k requests ahead of it past the limit waits k of those
    intervals. 0 when the snapshot reports no limit (a real engine that does not say) or the role has no decode.
    """
    if load.max_num_seqs <= 0 or load.role is Role.PREFILL:
        return 0.0
    occupied = load.num_running + load.num_waiting + ledger.num_pending(load.instance_id)
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


def ttft_excess_s(predicted_ttft_s: float, own_prefill_s: float, slo_ms: float, slack: float) -> float:
    """How much later than allowed the first token would come (<= 0: feasible).

    Allowed = the tier's SLO x slack, or LONG_PROMPT_WAIT x the request's own prefill when that is longer: a
    prompt that cannot meet the SLO even on an idle instance is still served, but only when it would start at
    once; it is never allowed to queue behind others (its queueing would push every short prompt behind it over
    the SLO), and it is not refused forever either."""
    return predicted_ttft_s - max(slo_ms * slack / 1000.0, LONG_PROMPT_WAIT * own_prefill_s)


LONG_PROMPT_WAIT = 1.25
