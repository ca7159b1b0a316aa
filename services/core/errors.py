"""Typed errors a user (or the load) can cause, raised by the core and mapped once to gRPC at the edge.

Invariants:
- Every error carries `message`, a sentence that says what to change (or, for overload, when to retry).
- The core never imports grpc: the edge maps `InvalidArgument` -> INVALID_ARGUMENT, `UnknownModel` -> NOT_FOUND,
  `Overloaded` -> RESOURCE_EXHAUSTED (+ RetryInfo / `retry-after-ms` from `retry_after_ms`),
  `SloInfeasible` and `ItlInfeasible` -> FAILED_PRECONDITION, `DeadlineExceeded` -> DEADLINE_EXCEEDED, `Draining` -> UNAVAILABLE,
  `Unauthenticated` -> UNAUTHENTICATED.
- Errors are plain values (compare equal by fields) so tests and `Refuse` can hold and compare them.
"""

from __future__ import annotations

from collections.abc import Iterable

from octoserve.services.core.types import Priority


class OctoserveError(Exception):
    """Base of every user-causable error; `message` says what to change."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def _fields(self) -> tuple:
        return (self.message,)

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other._fields() == self._fields()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._fields()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r})"


class InvalidArgument(OctoserveError):
    """A request field is out of range; `field` names it (e.g. "max_tokens", "sampling.top_p")."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field

    def _fields(self) -> tuple:
        return (self.field, self.message)


class UnknownModel(OctoserveError):
    """The request names a model this node does not serve; `known` lists the ones it does."""

    def __init__(self, model: str, known: Iterable[str]) -> None:
        self.model = model
        self.known = tuple(sorted(known))
        super().__init__(f"unknown model {model!r}; this node serves: {', '.join(self.known) or '(none)'}")

    def _fields(self) -> tuple:
        return (self.model, self.known)


class Overloaded(OctoserveError):
    """Shed at admission: the node cannot serve this request within its SLO now; retry after `retry_after_ms`."""

    def __init__(self, model: str, tier: Priority, retry_after_ms: int, reason: str) -> None:
        self.model = model
        self.tier = tier
        self.retry_after_ms = retry_after_ms
        self.reason = reason
        super().__init__(
            f"{model} is overloaded for {tier.name} requests ({reason}); retry after {retry_after_ms} ms"
        )

    def _fields(self) -> tuple:
        return (self.model, self.tier, self.retry_after_ms, self.reason)


class SloInfeasible(OctoserveError):
    """Refused at once: the request's own prefill takes longer than its TTFT SLO on every instance of the model
    even when idle, so no amount of waiting helps. Carries the numbers and what to change."""

    def __init__(self, model: str, tier: Priority, num_prompt_tokens: int, prefill_ms: float, slo_ms: float,
                 max_prompt_tokens: int) -> None:
        self.model = model
        self.tier = tier
        self.num_prompt_tokens = num_prompt_tokens
        self.prefill_ms = prefill_ms
        self.slo_ms = slo_ms
        self.max_prompt_tokens = max_prompt_tokens
        super().__init__(
            f"the {num_prompt_tokens}-token prompt alone takes {prefill_ms:.0f} ms to prefill on {model} as placed "
            f"(uncached, on an idle instance), over its {slo_ms:.0f} ms {tier.name} TTFT SLO; shorten it to at most "
            f"{max_prompt_tokens} tokens, send it as BATCH or with a larger ttft_slo_ms, or place {model} at a "
            "higher tensor parallelism"
        )

    def _fields(self) -> tuple:
        return (self.model, self.tier, self.num_prompt_tokens, round(self.prefill_ms, 3), self.slo_ms,
                self.max_prompt_tokens)


class ItlInfeasible(OctoserveError):
    """Refused at once: the model's decode step, even alone in the batch, is longer than the ITL SLO on every
    instance that would decode it, so no request of it can meet the SLO on this placement."""

    def __init__(self, model: str, tier: Priority, num_prompt_tokens: int, step_ms: float, itl_ms: float) -> None:
        super().__init__(
            f"{model} as placed takes {step_ms:.1f} ms per decode step even alone in its batch (at a "
            f"{num_prompt_tokens}-token context), over the {itl_ms:.0f} ms ITL SLO, so no request of it can meet "
            f"the SLO here; place {model} at a higher tensor parallelism",
        )
        self.model = model
        self.tier = tier
        self.num_prompt_tokens = num_prompt_tokens
        self.step_ms = step_ms
        self.itl_ms = itl_ms

    def _fields(self) -> tuple:
        return (self.model, self.tier, self.num_prompt_tokens, round(self.step_ms, 3), self.itl_ms)


class DeadlineExceeded(OctoserveError):
    """The request's deadline passed before it could be served."""

    def __init__(self, message: str = "the deadline passed before the first token; raise the deadline or retry") -> None:
        super().__init__(message)


class Unauthenticated(OctoserveError):
    """No API key, or a key this node does not know (the key itself is never repeated back)."""


class Draining(OctoserveError):
    """The service is shutting down and takes no new requests."""

    def __init__(self, message: str = "the server is draining and takes no new requests; retry on another replica") -> None:
        super().__init__(message)
