"""The one async interface the workers call, whatever runs the model underneath (sim or vLLM).

Roles (octoserve.services.core.types.Role):
- COLOCATED: `generate(spec)` streams every token.
- PREFILL:   `prefill(spec)` computes the prompt, samples the first token and returns a `KVHandoff` describing the
             KV that now waits on this instance; `release(request_id)` frees it once the decode side has it.
- DECODE:    `reserve(spec)` holds KV capacity for the prompt before any prefill starts (so a hand-off never finds
             the decode side full); `decode(spec, handoff)` takes the KV in and streams the remaining tokens;
             `release(request_id)` drops a reservation that will not be used.
Every role: `abort` frees the request's KV; `pause`/`resume` stop and restart the step loop at an iteration
boundary, keeping requests and KV (the gang-lease primitive); `load()` is a cheap synchronous snapshot.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from octoserve.services.core.types import EngineLoad, RequestOutput, RequestSpec, Role


@dataclass(frozen=True, slots=True)
class KVHandoff:
    """The prompt KV of one request, ready on a prefill instance, as the decode instance needs to know it."""

    request_id: str
    source_instance_id: str
    num_prompt_tokens: int
    first_token_id: int
    num_kv_bytes: int  # payload size across all TP ranks (transfer time, metrics)
    num_cached_prompt_tokens: int = 0  # prompt tokens the prefill side served from its prefix cache
    # Non-empty ("stop" / "length") when the first token already ended the request: nothing to decode.
    finish_reason: str = ""
    # Engine-specific connector parameters, e.g. vLLM's kv_transfer_params serialised as JSON.
    connector_params_json: str = ""
    # A live migration of a running decode: its output tokens so far (the KV covers all but the last).
    output_token_ids: tuple[int, ...] = ()


class EngineError(Exception):
    """Base of the errors an engine raises to its worker."""


class CapacityError(EngineError):
    """The engine cannot take this request now (no KV to reserve, queue full)."""


class HandoffError(EngineError):
    """A KV hand-off failed (timed out, the source released it, the transfer was corrupt)."""


@runtime_checkable
class Engine(Protocol):
    instance_id: str
    model: str
    role: Role

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]: ...

    async def prefill(self, spec: RequestSpec) -> KVHandoff: ...

    async def reserve(self, spec: RequestSpec) -> bool: ...

    def decode(self, spec: RequestSpec, handoff: KVHandoff) -> AsyncIterator[RequestOutput]: ...

    async def release(self, request_id: str) -> None: ...

    async def abort(self, request_id: str) -> None: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    def load(self) -> EngineLoad: ...
