"""Waiting-queue orders: which admitted-but-not-running request an engine instance takes next.

Each order is a static sort key computed once when a request enters the queue, so the queue is a heap and needs
no clock. A request preempted by recompute re-enters with its original key, so it goes back near the front.

- `fcfs`: arrival order.
- `priority`: tier first (INTERACTIVE < STANDARD < BATCH), arrival within a tier. A steady INTERACTIVE stream can
  starve BATCH: use it only where that is wanted.
- `edf`: earliest TTFT deadline first, deadline = arrival + the tier's TTFT SLO. This is priority with aging built
  in: a BATCH request (SLO e.g. 10 s) waiting since t0 precedes an INTERACTIVE request (200 ms) that arrives after
  t0 + 9.8 s, so no tier starves, and within a tier it is FCFS. A request whose own prefill alone already
  exceeds its SLO cannot meet its deadline whatever the order; serving it first would only make the requests
  behind it miss theirs too, so it is demoted to the BATCH tier's deadline (still served, never starved). The
  batcher demotes the same way a waiting head that has become lost while it waited (`demoted_key`; at the seed-000
  peak, for a decode slot): one for which even a step of its whole prompt would now end after its deadline, when a
  prompt of its tier or a more urgent one behind it can still make its own.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterator, Mapping
from typing import Generic, TypeVar

from octoserve.services.core.registry import Registry
from octoserve.services.core.types import Priority, RequestSpec

# (spec, default TTFT SLO per tier in ms, estimated own prefill time in s) -> sort key; smaller keys first.
QueueKey = Callable[[RequestSpec, Mapping[Priority, float], float], tuple]

QUEUE_POLICIES: Registry[QueueKey] = Registry("queue policy")


@QUEUE_POLICIES.register("fcfs")
def fcfs_key(spec: RequestSpec, tier_ttft_slo_ms: Mapping[Priority, float], prefill_s: float = 0.0) -> tuple:
    return (spec.arrival_s,)


@QUEUE_POLICIES.register("priority")
def priority_key(spec: RequestSpec, tier_ttft_slo_ms: Mapping[Priority, float], prefill_s: float = 0.0) -> tuple:
    return (int(spec.priority), spec.arrival_s)


@QUEUE_POLICIES.register("edf")
def edf_key(spec: RequestSpec, tier_ttft_slo_ms: Mapping[Priority, float], prefill_s: float = 0.0) -> tuple:
    slo_ms = spec.ttft_slo_ms if spec.ttft_slo_ms is not None else tier_ttft_slo_ms[spec.priority]
    if prefill_s * 1000.0 > slo_ms:  # infeasible: demoted to background
        return demoted_key(spec, tier_ttft_slo_ms)
    return (spec.ttft_deadline_s(tier_ttft_slo_ms[spec.priority]), int(spec.priority))


def demoted_key(spec: RequestSpec, tier_ttft_slo_ms: Mapping[Priority, float]) -> tuple:
    """The `edf` key of a request that cannot meet its TTFT deadline: the BATCH tier's deadline from its arrival,
    so it runs behind every request that still can, and ages to the head like BATCH work."""
    return (spec.arrival_s + tier_ttft_slo_ms[Priority.BATCH] / 1000.0, int(Priority.BATCH))


T = TypeVar("T")


class WaitingQueue(Generic[T]):
    """A heap of items under a static key; ties break by insertion order (a counter owned by the queue)."""

    def __init__(self) -> None:
        self._heap: list[tuple[tuple, int, T]] = []
        self._seq = 0

    def push(self, key: tuple, item: T) -> None:
        heapq.heappush(self._heap, (key, self._seq, item))
        self._seq += 1

    def peek(self) -> T:
        return self._heap[0][2]

    def pop(self) -> T:
        return heapq.heappop(self._heap)[2]

    def remove(self, item: T) -> bool:
        for i, entry in enumerate(self._heap):
            if entry[2] is item:
                self._heap[i] = self._heap[-1]
                self._heap.pop()
                heapq.heapify(self._heap)
                return True
        return False

    def __len__(self) -> int:
        return len(self._heap)

    def __bool__(self) -> bool:
        return bool(self._heap)

    def __iter__(self) -> Iterator[T]:
        """Items in no particular order (for load accounting)."""
        return (entry[2] for entry in self._heap)

    def head(self, n: int) -> list[T]:
        """The first `n` items in queue order (one pass over the heap, not a sort of it)."""
        return [entry[2] for entry in heapq.nsmallest(n, self._heap)]

    def ordered(self) -> list[T]:
        return [entry[2] for entry in sorted(self._heap)]
