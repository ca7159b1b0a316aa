"""A router in miniature over `ReconfigurableInstance` slots, for the reconfiguration tests and benchmark on vLLM.

`SlotRouter.complete(spec)` does what the router and the workers do for one request, on whatever the slots' roles
are at that moment: with an accepting PREFILL and an accepting DECODE slot of the model, reserve on the decode slot,
prefill (max_tokens 1) on the prefill slot, decode from the received KV, release the prefill side's KV; otherwise
generate on an accepting COLOCATED slot. A refusal (`DrainingError`, a reservation answered False) sends the request
to another slot, after `retry_s` when none accepts; nothing refused is dropped. Every outcome is recorded.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from octoserve.services.core.types import FinishReason, RequestSpec, Role, SamplingParams
from octoserve.services.engine.vllm_reconfig import DrainingError, ReconfigurableInstance


def fresh_prompt(k: int, salt: int = 0) -> tuple[int, ...]:
    """The k-th prompt of a run: 150 to 449 tokens (never a multiple of the 128-token block), distinct per (k, salt)."""
    n = 150 + (k * 53 + salt * 17) % 300
    if n % 128 == 0:
        n += 1
    a, b = 37 + 4 * k + 3 * salt, 11 * k + 7 * salt + 1
    return tuple((i * a + b) % 3997 + 3 for i in range(n))


def spec(request_id: str, model: str, prompt: tuple[int, ...], max_tokens: int) -> RequestSpec:
    return RequestSpec(request_id, model, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       arrival_s=0.0)


@dataclass
class Served:
    request_id: str
    prompt: tuple[int, ...]
    tokens: list[int]
    finish_reason: FinishReason | None
    num_output_tokens: int
    path: str  # "pd" or "colocated"
    prefill_slot: str  # instance id ("" for colocated)
    serving_slot: str  # the decode (or colocated) instance id
    num_cached_prompt_tokens: int  # on the serving slot: for "pd", the KV received from the prefill slot
    num_refusals: int
    admitted_s: float  # the serving slot admitted it (monotonic)
    finished_s: float


@dataclass
class SlotRouter:
    slots: list[ReconfigurableInstance]
    retry_s: float = 0.01
    give_up_s: float = 300.0
    served: list[Served] = field(default_factory=list)
    num_refusals: int = 0
    _rr: itertools.count = field(default_factory=itertools.count)

    def pick(self, model: str, role: Role) -> ReconfigurableInstance | None:
        """Round robin over the accepting slots of `model` in `role`."""
        ready = [s for s in self.slots if s.accepting and s.model == model and s.role is role]
        return ready[next(self._rr) % len(ready)] if ready else None

    async def complete(self, s: RequestSpec) -> Served:
        deadline = time.monotonic() + self.give_up_s
        refusals = 0
        while time.monotonic() < deadline:
            prefill, decode = self.pick(s.model, Role.PREFILL), self.pick(s.model, Role.DECODE)
            colocated = self.pick(s.model, Role.COLOCATED)
            try:
                if prefill is not None and decode is not None:
                    result = await self._pd(s, prefill, decode, refusals)
                elif colocated is not None:
                    result = await self._colocated(s, colocated, refusals)
                else:
                    result = None  # nothing of this model accepts right now (its slots are switching)
            except DrainingError:
                result = None
            if result is not None:
                self.served.append(result)
                return result
            refusals += 1
            self.num_refusals += 1
            await asyncio.sleep(self.retry_s)
        raise TimeoutError(f"{s.request_id}: no slot of {s.model} took it within {self.give_up_s} s")

    async def _pd(self, s: RequestSpec, prefill: ReconfigurableInstance, decode: ReconfigurableInstance,
                  refusals: int) -> Served | None:
        if not await decode.reserve(s):
            return None
        admitted = time.monotonic()
        try:
            handoff = await prefill.prefill(s)
        except DrainingError:
            await decode.release(s.request_id)
            return None
        tokens, last = [handoff.first_token_id], None
        try:
            async for out in decode.decode(s, handoff):
                tokens.extend(out.new_token_ids)
                last = out
        finally:
            await prefill.release(s.request_id)
        return Served(s.request_id, s.prompt_token_ids, tokens, last.finish_reason if last else None,
                      last.num_output_tokens if last else 0, "pd", prefill.instance_id, decode.instance_id,
                      last.num_cached_prompt_tokens if last else 0, refusals, admitted, time.monotonic())

    async def _colocated(self, s: RequestSpec, slot: ReconfigurableInstance, refusals: int) -> Served:
        stream = slot.generate(s)  # raises DrainingError before anything runs
        admitted = time.monotonic()
        tokens, last = [], None
        async for out in stream:
            tokens.extend(out.new_token_ids)
            last = out
        return Served(s.request_id, s.prompt_token_ids, tokens, last.finish_reason if last else None,
                      last.num_output_tokens if last else 0, "colocated", "", slot.instance_id,
                      last.num_cached_prompt_tokens if last else 0, refusals, admitted, time.monotonic())


async def closed_loop(router: SlotRouter, model: str, clients: int, stop: asyncio.Event, *, tag: str, salt: int,
                      max_tokens: int, first_k: int = 0) -> list[Served]:
    """`clients` clients each sending one request after another until `stop` is set; every result, in order."""
    counter = itertools.count(first_k)
    results: list[Served] = []

    async def client() -> None:
        while not stop.is_set():
            k = next(counter)
            results.append(await router.complete(spec(f"{tag}-{k}", model, fresh_prompt(k, salt), max_tokens)))

    await asyncio.gather(*(client() for _ in range(clients)))
    return results
