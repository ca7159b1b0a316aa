"""Preemption: which running request gives up its KV when a running request needs a block the pool lacks.

A victim policy maps a request to a key; the running request with the LARGEST key is preempted first.
- `lowest-tier-latest` (default): the least urgent tier first, within a tier the latest arrival (it has the least
  sunk work and the most slack). This is vLLM's priority-mode choice extended with tiers.
- `latest`: the latest arrival whatever its tier (vLLM's FCFS-mode choice).

The mode (what happens to the victim's KV) is the batcher's: `recompute` frees it and re-queues the request;
`swap` copies it to a bounded host-memory pool over PCIe and brings it back when blocks free up, falling back to
recompute when the host pool is full.
"""

from __future__ import annotations

from collections.abc import Callable

from octoserve.services.core.registry import Registry
from octoserve.services.core.types import RequestSpec

VictimKey = Callable[[RequestSpec], tuple]

VICTIM_POLICIES: Registry[VictimKey] = Registry("preemption victim policy")

PREEMPTION_MODES = ("recompute", "swap")


@VICTIM_POLICIES.register("lowest-tier-latest")
def lowest_tier_latest(spec: RequestSpec) -> tuple:
    return (int(spec.priority), spec.arrival_s)


@VICTIM_POLICIES.register("latest")
def latest(spec: RequestSpec) -> tuple:
    return (spec.arrival_s,)
