"""KV reservation policies: how much KV a request holds when it is admitted, and when it may be admitted.

This is the answer to clients whose `max_tokens` is far above what they generate. Three policies:

- `full`: hold prompt + max_tokens from admission on. A running request never needs another block, so nothing is
  ever preempted, at the price of KV that sits reserved and unused (4x over-reservation quarters the batch).
- `predicted`: hold prompt + a per-model online estimate of the output length (a high quantile of recent
  completions, capped at max_tokens); grow block by block on demand; when the pool is dry a victim is preempted.
- `watermark`: hold only the known tokens; admit while the free blocks left after admission stay above a
  watermark fraction of the pool (vLLM's approach); grow on demand; preempt on overflow.

Invariant shared by all three: blocks come only from `KVCacheManager.allocate`, which returns None rather than
over-allocate, so no step ever uses a block the pool does not have. OOM is impossible by construction; the
policies differ only in utilisation, preemptions and goodput.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from octoserve.services.core.registry import Registry
from octoserve.services.core.types import RequestSpec


class OutputLengthPredictor:
    """Online estimate of output length: the `quantile` of the last `window` completed lengths.

    Until `min_samples` completions are seen, it predicts `prior_tokens`. Clock-free; fed by the batcher.
    """

    def __init__(self, quantile: float = 0.9, window: int = 512, prior_tokens: int = 512, min_samples: int = 16):
        if not 0.0 < quantile <= 1.0:
            raise ValueError(f"quantile must be in (0, 1], got {quantile}")
        self.quantile = quantile
        self.prior_tokens = prior_tokens
        self.min_samples = min_samples
        self._recent: deque[int] = deque(maxlen=window)
        self._sorted: list[int] = []  # the same lengths in order, kept as they come and go (no sort per completion)
        self._cached: int | None = None
        self._mean: float | None = None  # mean() since the last observe (every load snapshot asks for it)
        self._sum = 0  # of `_recent`, kept as they come and go: an int, so exactly sum(_recent)

    def observe(self, num_output_tokens: int) -> None:
        recent, ordered = self._recent, self._sorted
        if recent and len(recent) == recent.maxlen:
            del ordered[bisect.bisect_left(ordered, recent[0])]  # the deque drops its oldest below
            self._sum -= recent[0]
        recent.append(num_output_tokens)
        self._sum += num_output_tokens
        bisect.insort(ordered, num_output_tokens)
        self._cached = None
        self._mean = None

    def mean(self) -> float:
        """Mean of the recent completions (the prior until enough are seen): slot turnover for admission."""
        if len(self._recent) < self.min_samples:
            return float(self.prior_tokens)
        if self._mean is None:
            self._mean = self._sum / len(self._recent)
        return self._mean

    def predict(self) -> int:
        if len(self._recent) < self.min_samples:
            return self.prior_tokens
        if self._cached is None:
            ordered = self._sorted
            index = min(len(ordered) - 1, int(self.quantile * len(ordered)))
            self._cached = ordered[index]
        return self._cached


@dataclass(frozen=True, slots=True)
class ReservationContext:
    """What a policy may look at when deciding on one request."""

    num_free_blocks: int
    num_total_blocks: int
    block_size: int
    predicted_output_tokens: int


class ReservationPolicy(Protocol):
    name: str

    def initial_tokens(self, spec: RequestSpec, num_known_tokens: int, ctx: ReservationContext) -> int:
        """Tokens of KV to hold when the request is admitted (at least its known tokens)."""
        ...

    def may_admit(self, num_new_blocks: int, ctx: ReservationContext) -> bool:
        """Whether taking `num_new_blocks` more blocks for a new request is allowed now."""
        ...


RESERVATION_POLICIES: Registry[type] = Registry("reservation policy")


@RESERVATION_POLICIES.register("full")
@dataclass(frozen=True, slots=True)
class FullReservation:
    name: str = "full"

    def initial_tokens(self, spec: RequestSpec, num_known_tokens: int, ctx: ReservationContext) -> int:
        return max(num_known_tokens, spec.num_prompt_tokens + spec.max_tokens)

    def may_admit(self, num_new_blocks: int, ctx: ReservationContext) -> bool:
        return num_new_blocks <= ctx.num_free_blocks


@RESERVATION_POLICIES.register("predicted")
@dataclass(frozen=True, slots=True)
class PredictedReservation:
    name: str = "predicted"

    def initial_tokens(self, spec: RequestSpec, num_known_tokens: int, ctx: ReservationContext) -> int:
        predicted = min(spec.max_tokens, ctx.predicted_output_tokens)
        return max(num_known_tokens, spec.num_prompt_tokens + predicted)

    def may_admit(self, num_new_blocks: int, ctx: ReservationContext) -> bool:
        return num_new_blocks <= ctx.num_free_blocks


@RESERVATION_POLICIES.register("watermark")
@dataclass(frozen=True, slots=True)
class WatermarkReservation:
    name: str = "watermark"
    watermark: float = 0.01  # fraction of the pool kept free at admission (vLLM's default)

    def initial_tokens(self, spec: RequestSpec, num_known_tokens: int, ctx: ReservationContext) -> int:
        return num_known_tokens

    def may_admit(self, num_new_blocks: int, ctx: ReservationContext) -> bool:
        return ctx.num_free_blocks - num_new_blocks >= self.watermark * ctx.num_total_blocks


def make_reservation_policy(name: str) -> ReservationPolicy:
    return RESERVATION_POLICIES.get(name)()
