"""Preemption: which running request gives up its KV when a running request needs a block the pool lacks, and
with tier preemption which one a more urgent waiting request may take the place of (`tier_victim`).

A victim policy maps a request to a key; the running request with the LARGEST key is preempted first.
- `lowest-tier-latest` (default): the least urgent tier first, within a tier the latest arrival (it has the least
  sunk work and the most slack). This is vLLM's priority-mode choice extended with tiers.
- `latest`: the latest arrival whatever its tier (vLLM's FCFS-mode choice).

The mode (what happens to the victim's KV) is the batcher's: `recompute` frees it and re-queues the request;
`swap` copies it to a bounded host-memory pool over PCIe and brings it back when blocks free up, falling back to
recompute when the host pool is full.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from octoserve.services.core.registry import Registry
from octoserve.services.core.types import Priority, RequestSpec

if TYPE_CHECKING:  # batch_state imports this module's registries
    from octoserve.services.core.batch_state import Request

VictimKey = Callable[[RequestSpec], tuple]

VICTIM_POLICIES: Registry[VictimKey] = Registry("preemption victim policy")

PREEMPTION_MODES = ("recompute", "swap")


@VICTIM_POLICIES.register("lowest-tier-latest")
def lowest_tier_latest(spec: RequestSpec) -> tuple:
    return (int(spec.priority), spec.arrival_s)


@VICTIM_POLICIES.register("latest")
def latest(spec: RequestSpec) -> tuple:
    return (spec.arrival_s,)


def tier_victim(running: Sequence[Request], head: Request, batch_min_share: float,
                max_num_seqs: int) -> Request | None:
    """The running request `head` may preempt (tier preemption): a strictly less urgent tier that the queue order
    puts after the head (so a recomputed victim re-enters behind it and cannot bounce back: EDF-aged BATCH work is
    safe), the least urgent first, within it one still in prefill (no stream stalls), then the latest arrival; None
    when there is none or BATCH's floor (`batch_min_share` of `max_num_seqs`) forbids it."""
    if batch_min_share >= 1.0:
        return None
    tier = head.spec.priority
    floor = math.ceil(batch_min_share * max_num_seqs)
    num_batch = sum(1 for r in running if r.spec.priority is Priority.BATCH)
    best: Request | None = None
    for r in running:
        p = r.spec.priority
        if p <= tier or r.queue_key <= head.queue_key or (p is Priority.BATCH and num_batch <= floor):
            continue
        key = (p, r.num_output_tokens == 0, r.spec.arrival_s)
        if best is None or key > (best.spec.priority, best.num_output_tokens == 0, best.spec.arrival_s):
            best = r
    return best
