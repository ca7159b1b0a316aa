"""Python SDK for octoserve's public API (`octoserve.v1.Generation`): `AsyncClient` and a blocking `Client`.

    async with AsyncClient("127.0.0.1:50051", retry=RetryPolicy()) as client:
        async for chunk in client.generate("llama-3-8b", "Hello", max_tokens=32):
            print(chunk.text, end="")

Invariants:
- Only RESOURCE_EXHAUSTED and UNAVAILABLE are retried, and only before the first response message: once tokens
  have streamed, a failure is never replayed (the caller has seen tokens; a replay would repeat them).
- Resume: a stream that ends UNAVAILABLE after tokens (its router restarted, or refused to continue it on another
  worker) may instead be resumed: the same request, with the same id, sent again with `resume_from` = every token
  received so far; the router appends them to the prompt, generates only the rest of max_tokens and reports usage
  for the whole request, so the caller's iterator goes on as one stream. Greedy decoding gives exactly the tokens an
  uninterrupted run gives. At most `RetryPolicy.max_resumes` resumes per call; each waits the server's retry hint
  (or the backoff), then up to `resume_wait_s` for the router to be reachable, within the call's deadline, and
  withdraws from the retry budget; the resumed request's own sends are retried as a new call's. On by default
  (`generate(resume=None)`) only where it is exact: with a retry policy, for greedy requests without stop strings;
  `resume=True` resumes any request, `resume=False` none.
- A retry waits the server's delay (google.rpc.RetryInfo, else the `retry-after-ms` trailer, else exponential
  backoff), stretched by a random factor in [1, 1 + jitter_fraction): never shorter than the server asked, and
  spread so that clients refused together do not come back together.
- No retry outlives the call's deadline, and none exceeds the client's retry budget: a token bucket shared by
  all calls of one client (gRPC retry throttling, Finagle's RetryBudget). Every call deposits `budget_ratio`
  tokens, every retry withdraws one, so retries <= budget_max_tokens + budget_ratio * calls and an overloaded
  node is not hit by a multiple of its offered load.
- Randomness comes from a `random.Random` the caller may seed, and the sleep is injectable, so tests check
  retry delays exactly without waiting.
- Every failure surfaces as an `OctoserveClientError` subclass chosen by gRPC status code; grpc types do not leak.

Why one module past 600 lines: the SDK's two clients, sync and async, side by side in the one module users read.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass

import grpc
import grpc.aio
from google.rpc import error_details_pb2, status_pb2

from octoserve.types import FinishReason, Priority
from octoserve.v1 import generate_pb2 as pb
from octoserve.v1 import generate_pb2_grpc as pb_grpc

RETRY_AFTER_MS_KEY = "retry-after-ms"
# gRPC's own reconnect backoff grows to 120 s by default, so after a router restart a channel could stay down long
# after the router is back, failing every retry in between; capped at 2 s, a retry finds the router within about
# that much of its return. Options passed to a client override these.
DEFAULT_CHANNEL_OPTIONS: tuple[tuple[str, object], ...] = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
)
STATUS_DETAILS_KEY = "grpc-status-details-bin"

# --- errors --------------------------------------------------------------------------------------------------


class OctoserveClientError(Exception):
    """A failed call. `code` is the gRPC status, `attempts` how many times the call was sent."""

    def __init__(
        self, message: str, *, code: grpc.StatusCode = grpc.StatusCode.UNKNOWN,
        retry_after_ms: float | None = None, attempts: int = 1,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.retry_after_ms = retry_after_ms  # the server's hint, when it sent one
        self.attempts = attempts

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code.name}: {self.message!r}, attempts={self.attempts})"


class InvalidArgumentError(OctoserveClientError):
    """The request is malformed or out of range; the message names the field to change. `field` names it too
    when the SDK found the problem before sending (empty when the server did)."""

    def __init__(self, message: str, *, field: str = "", **kwargs) -> None:
        super().__init__(message, **kwargs)
        self.field = field


def _invalid(field: str, message: str) -> InvalidArgumentError:
    """An argument the wire cannot carry, caught before sending (attempts=0: nothing was sent)."""
    return InvalidArgumentError(f"{field}: {message}", field=field, code=grpc.StatusCode.INVALID_ARGUMENT, attempts=0)


class ModelNotFoundError(OctoserveClientError):
    """The node does not serve the requested model; `list_models()` says which it does."""


class OverloadedError(OctoserveClientError):
    """Shed at admission (RESOURCE_EXHAUSTED); `retry_after_ms` says when the node expects room."""


class SloInfeasibleError(OctoserveClientError):
    """FAILED_PRECONDITION: the request's own prefill exceeds its TTFT SLO even on an idle node; retrying cannot
    help. The message gives the numbers and what to change (shorter prompt, BATCH tier or a larger ttft_slo_ms)."""


class DeadlineExceededError(OctoserveClientError):
    """The call's deadline passed (on the client or the server)."""


class UnavailableError(OctoserveClientError):
    """The router is unreachable or draining."""


class UnauthenticatedError(OctoserveClientError):
    """UNAUTHENTICATED: the node requires a tenant API key and none or an unknown one was sent; pass
    `api_key=` to the client (sent as `authorization: Bearer <key>`). Not retried."""


_ERROR_TYPES: dict[grpc.StatusCode, type[OctoserveClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: ModelNotFoundError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: OverloadedError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.FAILED_PRECONDITION: SloInfeasibleError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}


def _key_metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The metadata a client's `api_key` becomes: `authorization: Bearer <key>`, which the router's tenant gate
    reads (router/tenants.py)."""
    if api_key is None:
        return ()
    if not isinstance(api_key, str) or not api_key or api_key != api_key.strip() or not api_key.isprintable():
        raise ValueError("api_key must be a non-empty printable string without surrounding spaces, or None")
    return (("authorization", f"Bearer {api_key}"),)


def _call_metadata(key_metadata: tuple[tuple[str, str], ...],
                   metadata: Sequence[tuple[str, str]]) -> tuple[tuple[str, str], ...] | None:
    """The client's key plus a call's own metadata; a call that sends its own key (authorization or x-api-key)
    sends only that one."""
    own = tuple(metadata)
    if any(k.lower() in ("authorization", "x-api-key") for k, _ in own):
        return own or None
    return (*key_metadata, *own) or None


def retry_after_ms_from_trailers(trailing_metadata: Sequence[tuple[str, str | bytes]] | None) -> float | None:
    """The server's retry delay: google.rpc.RetryInfo in the status details first, else `retry-after-ms`."""
    trailer_ms = None
    for key, value in trailing_metadata or ():
        if key == STATUS_DETAILS_KEY:
            status = status_pb2.Status.FromString(value)
            for detail in status.details:
                if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                    info = error_details_pb2.RetryInfo()
                    detail.Unpack(info)
                    return info.retry_delay.seconds * 1000.0 + info.retry_delay.nanos / 1e6
        elif key == RETRY_AFTER_MS_KEY:
            try:
                trailer_ms = float(value)
            except ValueError:
                pass  # a malformed hint is no hint: fall back to backoff
    return trailer_ms


_TOO_LARGE = re.compile(r"(Received|Sent) message larger than max \((\d+) vs\. (\d+)\)")


def message_too_large(code: grpc.StatusCode, details: str | None,
                      trailing_metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """When a RESOURCE_EXHAUSTED is the gRPC transport's message-size limit (grpc's own wording, no retry delay),
    not the router's overload (which always carries RetryInfo): what to change, naming the limit. Else None."""
    if code != grpc.StatusCode.RESOURCE_EXHAUSTED or retry_after_ms_from_trailers(trailing_metadata) is not None:
        return None
    m = _TOO_LARGE.search(details or "")
    if m is None:
        return None
    size, limit = int(m.group(2)), int(m.group(3))
    if m.group(1) == "Sent":
        return (f"the request is {size} bytes, over this client's {limit}-byte gRPC message limit "
                "(grpc.max_send_message_length); shorten the prompt or raise the channel option")
    return (f"the message is {size} bytes, over the {limit}-byte gRPC message size the receiving side accepts; "
            "shorten the prompt (send it as token ids, or split the work), or raise the node's "
            "limits.max_message_bytes (the router's transport accepts twice that)")


def error_from_rpc(error: grpc.RpcError, attempts: int = 1) -> OctoserveClientError:
    """Map a grpc failure (sync or aio) to the SDK's typed error. The transport's message-size RESOURCE_EXHAUSTED
    is invalid input (`InvalidArgumentError`, field `prompt`, never retried), not an overload."""
    code = error.code()
    too_large = message_too_large(code, error.details(), error.trailing_metadata())
    if too_large is not None:
        return InvalidArgumentError(too_large, field="prompt", code=grpc.StatusCode.INVALID_ARGUMENT,
                                    attempts=attempts)
    error_type = _ERROR_TYPES.get(code, OctoserveClientError)
    return error_type(
        error.details() or code.name,
        code=code,
        retry_after_ms=retry_after_ms_from_trailers(error.trailing_metadata()),
        attempts=attempts,
    )


# --- retries -------------------------------------------------------------------------------------------------

RETRYABLE_CODES = frozenset({grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE})


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    max_attempts: int = 4  # sends per call, the first one included
    initial_backoff_s: float = 0.1  # first retry's delay when the server gives none
    backoff_multiplier: float = 2.0
    max_backoff_s: float = 10.0  # a server delay above this is not waited for: the error is raised instead
    jitter_fraction: float = 0.2  # delays are stretched by a factor drawn from [1, 1 + jitter_fraction)
    budget_ratio: float = 0.1  # retry tokens each call deposits
    budget_max_tokens: float = 10.0  # bucket size; the bucket starts full
    retryable_codes: frozenset[grpc.StatusCode] = RETRYABLE_CODES
    max_resumes: int = 2  # streams cut after tokens resumed per call (see generate's `resume`); 0: never
    resume_wait_s: float = 10.0  # how long a resume waits for the router to be reachable again (a restart)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff_s < 0 or self.max_backoff_s < 0 or self.backoff_multiplier < 1:
            raise ValueError("backoffs must be >= 0 and backoff_multiplier >= 1")
        if self.jitter_fraction < 0 or self.budget_ratio < 0 or self.budget_max_tokens < 0:
            raise ValueError("jitter_fraction, budget_ratio and budget_max_tokens must be >= 0")
        if self.max_resumes < 0 or self.resume_wait_s < 0:
            raise ValueError(f"max_resumes and resume_wait_s must be >= 0, got {self.max_resumes} and "
                             f"{self.resume_wait_s}")

    def delay_s(self, retry_index: int, server_delay_s: float | None, rng: random.Random) -> float:
        """Delay before retry number `retry_index` (0 = the first retry)."""
        if server_delay_s is None:
            base_s = min(self.initial_backoff_s * self.backoff_multiplier**retry_index, self.max_backoff_s)
        else:
            base_s = server_delay_s
        return base_s * (1.0 + self.jitter_fraction * rng.random())


class RetryBudget:
    """Token bucket limiting retries to a ratio of calls; kept in integer milli-tokens so counts are exact."""

    def __init__(self, ratio: float, max_tokens: float) -> None:
        self._deposit_milli = round(ratio * 1000)
        self._max_milli = round(max_tokens * 1000)
        self._milli = self._max_milli

    @property
    def tokens(self) -> float:
        return self._milli / 1000

    def record_call(self) -> None:
        self._milli = min(self._max_milli, self._milli + self._deposit_milli)

    def try_withdraw(self) -> bool:
        if self._milli < 1000:
            return False
        self._milli -= 1000
        return True


class _Attempts:
    """One call's retry state: how many sends so far, and whether a failure earns another one (a retry before the
    first token, a resume after)."""

    def __init__(
        self, policy: RetryPolicy | None, budget: RetryBudget | None, rng: random.Random, deadline_s: float | None
    ) -> None:
        self.count = 0  # sends of the current request (the original, or its latest resume): max_attempts bounds it
        self.sends = 0  # sends of the whole call
        self.resumes = 0
        self._policy, self._budget, self._rng, self._deadline_s = policy, budget, rng, deadline_s
        if budget is not None:
            budget.record_call()

    def timeout_s(self, now_s: float) -> float | None:
        """The per-send grpc timeout: what is left of the call's deadline."""
        self.count += 1
        self.sends += 1
        if self._deadline_s is None:
            return None
        remaining_s = self._deadline_s - now_s
        if remaining_s <= 0:
            raise DeadlineExceededError("the call's deadline passed before it could be sent",
                                        code=grpc.StatusCode.DEADLINE_EXCEEDED, attempts=self.sends - 1)
        return remaining_s

    def wait_s(self, now_s: float, limit_s: float) -> float:
        """`limit_s`, cut to what is left of the call's deadline."""
        return limit_s if self._deadline_s is None else max(0.0, min(limit_s, self._deadline_s - now_s))

    def resume_delay_s(self, error: OctoserveClientError, now_s: float, num_received: int, max_tokens: int,
                       policy: RetryPolicy) -> float | None:
        """Seconds to wait before resuming a stream cut after `num_received` tokens, or None when the error must
        be raised. The resumed request's sends are bounded afresh by max_attempts, under `policy` when the client
        has none (the caller asked for `resume=True`)."""
        if error.code != grpc.StatusCode.UNAVAILABLE or self.resumes >= policy.max_resumes:
            return None
        if not 0 < num_received < max_tokens:
            return None  # nothing to resume from, or nothing left to generate
        server_delay_s = None if error.retry_after_ms is None else error.retry_after_ms / 1000.0
        if server_delay_s is not None and server_delay_s > policy.max_backoff_s:
            return None
        delay_s = policy.delay_s(self.resumes, server_delay_s, self._rng)
        if self._deadline_s is not None and now_s + delay_s >= self._deadline_s:
            return None
        if self._budget is not None and not self._budget.try_withdraw():
            return None
        self.resumes += 1
        self.count = 0
        if self._policy is None:
            self._policy = policy
        return delay_s

    def retry_delay_s(self, error: OctoserveClientError, now_s: float) -> float | None:
        """Seconds to wait before resending, or None when the error must be raised."""
        p = self._policy
        if p is None or error.code not in p.retryable_codes or self.count >= p.max_attempts:
            return None
        server_delay_s = None if error.retry_after_ms is None else error.retry_after_ms / 1000.0
        if server_delay_s is not None and server_delay_s > p.max_backoff_s:
            return None  # the server will not have room within what this caller is willing to wait
        delay_s = p.delay_s(self.count - 1, server_delay_s, self._rng)
        if self._deadline_s is not None and now_s + delay_s >= self._deadline_s:
            return None
        if self._budget is not None and not self._budget.try_withdraw():
            return None
        return delay_s


# --- results -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """One streamed message: the tokens new since the previous one; finish_reason and usage on the last only."""

    request_id: str  # the server's id for the request, repeated on every chunk
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None = None
    usage: Usage | None = None


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation, reassembled from its chunks."""

    request_id: str
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    usage: Usage | None
    num_chunks: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    context_window: int
    state: str  # READY, LOADING, DRAINING, UNAVAILABLE
    num_instances: int


def assemble(chunks: Sequence[Chunk]) -> Completion:
    """The completion a sequence of chunks adds up to."""
    last = chunks[-1] if chunks else None
    return Completion(
        request_id=chunks[0].request_id if chunks else "",
        token_ids=tuple(t for c in chunks for t in c.token_ids),
        text="".join(c.text for c in chunks),
        finish_reason=last.finish_reason if last else None,
        usage=last.usage if last else None,
        num_chunks=len(chunks),
    )


_FINISH_REASONS = {pb.STOP: FinishReason.STOP, pb.LENGTH: FinishReason.LENGTH, pb.ABORT: FinishReason.ABORT}


def chunk_from_response(response: pb.GenerateResponse, request_id: str) -> Chunk:
    usage = None
    if response.HasField("usage"):
        u = response.usage
        usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)
    return Chunk(
        request_id=response.request_id or request_id,
        token_ids=tuple(response.token_ids),
        text=response.text,
        finish_reason=_FINISH_REASONS.get(response.finish_reason),
        usage=usage,
    )


UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
_TIERS = ", ".join(p.name for p in Priority)


def _priority_to_proto(priority: Priority | str | None) -> int:
    if priority is None:
        return pb.PRIORITY_UNSPECIFIED
    if isinstance(priority, Priority):
        return pb.Priority.Value(priority.name)
    if isinstance(priority, str) and priority.upper() in Priority.__members__:
        return pb.Priority.Value(priority.upper())
    if isinstance(priority, int) and not isinstance(priority, bool) and priority in set(Priority):
        return pb.Priority.Value(Priority(priority).name)
    raise _invalid("priority", f"{priority!r} is not a tier; use one of {_TIERS} (a name, a Priority, or 0-2), "
                               "or None for the server's default")


def _check_int(field: str, value, lo: int, hi: int, hint: str = "") -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _invalid(field, f"{value!r} is not an integer; use an integer from {lo} to {hi}{hint}")
    if not lo <= value <= hi:
        raise _invalid(field, f"{value} is out of range; use an integer from {lo} to {hi}{hint}")


def _check_number(field: str, value, valid: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _invalid(field, f"{value!r} is not a number; use {valid}")


def build_request(
    model: str,
    prompt: str | Sequence[int],
    *,
    max_tokens: int = 16,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
    priority: Priority | str | None = None,
    ttft_slo_ms: int | None = None,
    request_id: str = "",
    resume_from: Sequence[int] = (),
) -> pb.GenerateRequest:
    """The wire request (`resume_from`: the tokens a cut stream already received, see the module docstring). Raises `InvalidArgumentError` naming the field for what the wire cannot carry (a negative
    or too large integer, a wrong type, an unknown tier); limits that depend on the model (its context window,
    vocabulary) are the server's to check, with the same error type."""
    if not isinstance(model, str):
        raise _invalid("model", f"{model!r} is not a string; use a served model's name (see list_models())")
    _check_int("max_tokens", max_tokens, 1, UINT32_MAX)
    _check_number("temperature", temperature, "0 (greedy) or a positive number")
    _check_number("top_p", top_p, "a number in (0, 1]")
    if top_p == 0:  # the router refuses it too; refused here before anything is sent, as every range is
        raise _invalid("top_p", "0 is out of range; use a number in (0, 1] (1 disables nucleus sampling), "
                                "or temperature=0 for greedy decoding")
    if seed is not None:
        _check_int("seed", seed, 0, UINT64_MAX, ", or None for a random seed")
    if ttft_slo_ms is not None:
        _check_int("ttft_slo_ms", ttft_slo_ms, 1, UINT32_MAX, " milliseconds, or None for the model's default")
    if isinstance(stop, str) or any(not isinstance(s, str) for s in stop):
        raise _invalid("stop", f"{stop!r} is not a sequence of strings; use e.g. stop=['\\n\\n']")
    request = pb.GenerateRequest(
        model=model, max_tokens=max_tokens, temperature=temperature, top_p=top_p, stop=list(stop),
        ignore_eos=bool(ignore_eos), priority=_priority_to_proto(priority), ttft_slo_ms=ttft_slo_ms or 0,
        request_id=request_id,
    )
    if isinstance(prompt, str):
        request.text = prompt
    elif isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
        raise _invalid("prompt", f"a {type(prompt).__name__} is not a prompt; use a str or a sequence of token ids")
    else:
        for position, token_id in enumerate(prompt):
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id <= UINT32_MAX:
                raise _invalid("prompt", f"token id {token_id!r} at position {position} is not a token id; use "
                                         f"integers from 0 to {UINT32_MAX} (the model's vocabulary is checked "
                                         "by the server)")
        request.token_ids.SetInParent()  # an empty list still selects token_ids, so the server names the problem
        request.token_ids.ids.extend(prompt)
    if seed is not None:
        request.seed = seed
    if resume_from:
        request.resume_from.ids.extend(resume_from)
    return request


def _resume_on(resume: bool | None, policy: RetryPolicy | None, temperature: float, stop: Sequence[str]) -> bool:
    """Whether a stream cut after tokens is resumed: as asked, else (None) where the resumed stream is exactly the
    uninterrupted one: a greedy request without stop strings (the server matches a stop string in the new output
    only, so one split by the cut would be missed), on a client with a retry policy."""
    if resume is not None and not isinstance(resume, bool):
        raise _invalid("resume", f"{resume!r} is not a bool; use True, False or None (resume greedy requests "
                                 "without stop strings when the client has a retry policy)")
    if resume is not None:
        return resume
    return policy is not None and policy.max_resumes > 0 and temperature == 0 and not stop


class _Resume:
    """What a call keeps to resume its stream: the request, the id the server gave it, every token received."""

    def __init__(self, request: pb.GenerateRequest, enabled: bool, policy: RetryPolicy | None) -> None:
        self.request = request
        self.enabled = enabled
        self.policy = policy or RetryPolicy()
        self.request_id = request.request_id
        self.received: list[int] = []

    def next_request(self) -> pb.GenerateRequest:
        """The original request, or once tokens were received, the request that resumes it."""
        if not self.received:
            return self.request
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(self.request)
        resumed.request_id = self.request_id
        resumed.resume_from.ids[:] = self.received
        return resumed

    def on_chunk(self, chunk: Chunk) -> None:
        self.request_id = chunk.request_id
        self.received.extend(chunk.token_ids)

    def delay_s(self, error: OctoserveClientError, responded: bool, attempts: _Attempts) -> float | None:
        """Before resending: a retry when this send had no response yet, a resume when tokens had streamed."""
        now_s = time.monotonic()
        if not responded:
            return attempts.retry_delay_s(error, now_s)
        if not self.enabled:
            return None
        return attempts.resume_delay_s(error, now_s, len(self.received), self.request.max_tokens, self.policy)


def _channel_options(given: Sequence[tuple[str, object]]) -> list[tuple[str, object]]:
    names = {name for name, _ in given}
    return [*(o for o in DEFAULT_CHANNEL_OPTIONS if o[0] not in names), *given]


def _model_info(m: pb.Model) -> ModelInfo:
    return ModelInfo(m.name, m.context_window, pb.ModelState.Name(m.state), m.num_instances)


# --- clients -------------------------------------------------------------------------------------------------


class _RetryCore:
    """What both clients share: the retry policy, the budget shared by all their calls, the rng and the default
    deadline."""

    def __init__(self, retry: RetryPolicy | None, default_timeout_s: float | None, rng: random.Random | None) -> None:
        self.retry = retry
        self.budget = None if retry is None else RetryBudget(retry.budget_ratio, retry.budget_max_tokens)
        self.default_timeout_s = default_timeout_s
        self.rng = rng if rng is not None else random.Random()

    def attempts(self, timeout_s: float | None) -> _Attempts:
        timeout_s = self.default_timeout_s if timeout_s is None else timeout_s
        deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        return _Attempts(self.retry, self.budget, self.rng, deadline_s)


class AsyncClient:
    """asyncio client over one grpc.aio channel; safe to share among many concurrent tasks of one loop."""

    def __init__(
        self,
        target: str,
        *,
        retry: RetryPolicy | None = None,
        default_timeout_s: float | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        channel_options: Sequence[tuple[str, object]] = (),
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the tenant key, sent on every call (list_models included) as `authorization: Bearer <key>`."""
        self._key_metadata = _key_metadata(api_key)
        self._channel = grpc.aio.insecure_channel(target, options=_channel_options(channel_options))
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._core = _RetryCore(retry, default_timeout_s, rng)
        self._sleep = sleep

    @property
    def retry_budget(self) -> RetryBudget | None:
        return self._core.budget

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    async def close(self) -> None:
        await self._channel.close()

    async def wait_ready(self, timeout_s: float) -> None:
        """Block until the channel connects (raises UnavailableError after `timeout_s`)."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), timeout_s)
        except asyncio.TimeoutError:
            raise UnavailableError(f"no connection within {timeout_s} s", code=grpc.StatusCode.UNAVAILABLE) from None

    async def generate(
        self,
        model: str,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        priority: Priority | str | None = None,
        ttft_slo_ms: int | None = None,
        request_id: str = "",
        timeout_s: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        resume: bool | None = None,
    ) -> AsyncIterator[Chunk]:
        """Stream the chunks of one generation. `timeout_s` bounds the whole call, retries and resumes included
        (default: the client's `default_timeout_s`). Closing the iterator early cancels the call, which frees the
        request's KV on the node. `metadata` is sent as gRPC request metadata. `resume`: whether a stream cut
        after tokens (UNAVAILABLE: a router restart) is resumed where it stopped, at most
        `RetryPolicy.max_resumes` times; None (default) resumes greedy requests without stop strings when the
        client has a retry policy (see the module docstring)."""
        request = build_request(
            model, prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop,
            ignore_eos=ignore_eos, priority=priority, ttft_slo_ms=ttft_slo_ms, request_id=request_id,
        )
        stream = _Resume(request, _resume_on(resume, self._core.retry, temperature, stop), self._core.retry)
        attempts = self._core.attempts(timeout_s)
        while True:
            call = self._stub.Generate(stream.next_request(), timeout=attempts.timeout_s(time.monotonic()),
                                       metadata=_call_metadata(self._key_metadata, metadata))
            responded = False
            try:
                async for response in call:
                    responded = True
                    chunk = chunk_from_response(response, stream.request_id)
                    stream.on_chunk(chunk)
                    yield chunk
                return
            except grpc.RpcError as rpc_error:
                error = error_from_rpc(rpc_error, attempts.sends)
                delay_s = stream.delay_s(error, responded, attempts)
                if delay_s is None:
                    raise error from None
            finally:
                call.cancel()  # a no-op once the stream ended; otherwise the consumer left early
            await self._sleep(delay_s)
            if responded:  # a resume: its router may be restarting
                await self._wait_reachable(attempts.wait_s(time.monotonic(), stream.policy.resume_wait_s))

    async def _wait_reachable(self, wait_s: float) -> None:
        """Up to `wait_s` for the channel to connect; past that the send fails UNAVAILABLE and the retry rules
        decide."""
        try:
            await asyncio.wait_for(self._channel.channel_ready(), wait_s)
        except asyncio.TimeoutError:
            pass

    async def complete(self, model: str, prompt: str | Sequence[int], **kwargs) -> Completion:
        """The whole generation at once."""
        return assemble([chunk async for chunk in self.generate(model, prompt, **kwargs)])

    async def list_models(self, *, timeout_s: float | None = None,
                          metadata: Sequence[tuple[str, str]] = ()) -> list[ModelInfo]:
        attempts = self._core.attempts(timeout_s)
        while True:
            try:
                response = await self._stub.ListModels(
                    pb.ListModelsRequest(), timeout=attempts.timeout_s(time.monotonic()),
                    metadata=_call_metadata(self._key_metadata, metadata))
                return [_model_info(m) for m in response.models]
            except grpc.RpcError as rpc_error:
                error = error_from_rpc(rpc_error, attempts.count)
                delay_s = attempts.retry_delay_s(error, time.monotonic())
                if delay_s is None:
                    raise error from None
            await self._sleep(delay_s)


class Client:
    """Blocking client with the same API and retry rules as `AsyncClient`, over a sync grpc channel."""

    def __init__(
        self,
        target: str,
        *,
        retry: RetryPolicy | None = None,
        default_timeout_s: float | None = None,
        rng: random.Random | None = None,
        sleep: Callable[[float], None] = time.sleep,
        channel_options: Sequence[tuple[str, object]] = (),
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the tenant key, sent on every call (list_models included) as `authorization: Bearer <key>`."""
        self._key_metadata = _key_metadata(api_key)
        self._channel = grpc.insecure_channel(target, options=_channel_options(channel_options))
        self._stub = pb_grpc.GenerationStub(self._channel)
        self._core = _RetryCore(retry, default_timeout_s, rng)
        self._sleep = sleep

    @property
    def retry_budget(self) -> RetryBudget | None:
        return self._core.budget

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        self._channel.close()

    def generate(
        self,
        model: str,
        prompt: str | Sequence[int],
        *,
        max_tokens: int = 16,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: Sequence[str] = (),
        ignore_eos: bool = False,
        priority: Priority | str | None = None,
        ttft_slo_ms: int | None = None,
        request_id: str = "",
        timeout_s: float | None = None,
        metadata: Sequence[tuple[str, str]] = (),
        resume: bool | None = None,
    ) -> Iterator[Chunk]:
        """Like `AsyncClient.generate`, as a blocking iterator."""
        request = build_request(
            model, prompt, max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed, stop=stop,
            ignore_eos=ignore_eos, priority=priority, ttft_slo_ms=ttft_slo_ms, request_id=request_id,
        )
        stream = _Resume(request, _resume_on(resume, self._core.retry, temperature, stop), self._core.retry)
        attempts = self._core.attempts(timeout_s)
        while True:
            call = self._stub.Generate(stream.next_request(), timeout=attempts.timeout_s(time.monotonic()),
                                       metadata=_call_metadata(self._key_metadata, metadata))
            responded = False
            try:
                for response in call:
                    responded = True
                    chunk = chunk_from_response(response, stream.request_id)
                    stream.on_chunk(chunk)
                    yield chunk
                return
            except grpc.RpcError as rpc_error:
                error = error_from_rpc(rpc_error, attempts.sends)
                delay_s = stream.delay_s(error, responded, attempts)
                if delay_s is None:
                    raise error from None
            finally:
                call.cancel()
            self._sleep(delay_s)
            if responded:  # a resume: its router may be restarting
                self._wait_reachable(attempts.wait_s(time.monotonic(), stream.policy.resume_wait_s))

    def _wait_reachable(self, wait_s: float) -> None:
        ready = grpc.channel_ready_future(self._channel)
        try:
            ready.result(timeout=wait_s)
        except grpc.FutureTimeoutError:
            ready.cancel()

    def complete(self, model: str, prompt: str | Sequence[int], **kwargs) -> Completion:
        return assemble(list(self.generate(model, prompt, **kwargs)))

    def list_models(self, *, timeout_s: float | None = None,
                    metadata: Sequence[tuple[str, str]] = ()) -> list[ModelInfo]:
        attempts = self._core.attempts(timeout_s)
        while True:
            try:
                response = self._stub.ListModels(pb.ListModelsRequest(), timeout=attempts.timeout_s(time.monotonic()),
                                                 metadata=_call_metadata(self._key_metadata, metadata))
                return [_model_info(m) for m in response.models]
            except grpc.RpcError as rpc_error:
                error = error_from_rpc(rpc_error, attempts.count)
                delay_s = attempts.retry_delay_s(error, time.monotonic())
                if delay_s is None:
                    raise error from None
            self._sleep(delay_s)
