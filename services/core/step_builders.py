"""One step under construction, and one planned step: the builders `Batcher.schedule` and
`Batcher.schedule_compact` fill while they walk the queues (`StepBuilder`: a `StepPlan` of `ScheduledChunk`
messages; `CompactBuilder`: parallel columns), the protocol the walks use (`StepUnderConstruction`), and the compact
step and outputs in-process executors take (`CompactStep`, `CompactOutputs`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from octoserve.services.core.batch_state import Request
from octoserve.services.core.types import HandoffReady, RequestOutput, ScheduledChunk, StepPlan


class CompactStep:
    """One planned step as parallel tuples (index i is one chunk): what `schedule_compact` returns.

    The same content as a `StepPlan`, holding the batcher's `Request` objects instead of one message per chunk;
    for in-process executors only (it never crosses a process or a thread). Built once, never mutated."""

    __slots__ = ("step_id", "reqs", "num_new", "contexts", "samples", "preempted_ids", "swap_out_blocks",
                 "swap_in_blocks", "num_steady", "steady_tokens")

    def __init__(self, step_id: int, reqs: tuple[Request, ...], num_new: tuple[int, ...], contexts: tuple[int, ...],
                 samples: tuple[bool, ...], preempted_ids: tuple[str, ...], swap_out_blocks: int,
                 swap_in_blocks: int, num_steady: int = 0, steady_tokens: int = 0) -> None:
        self.step_id = step_id
        self.reqs = reqs
        self.num_new = num_new  # tokens computed this step, per chunk
        self.contexts = contexts  # tokens already in KV before this step, per chunk
        self.samples = samples  # whether the chunk samples a token
        self.preempted_ids = preempted_ids
        self.swap_out_blocks = swap_out_blocks
        self.swap_in_blocks = swap_in_blocks
        # Steady decodes (services/sim/steady_batcher.py) in the step besides the columns: each computes one token
        # on top of its context and samples it; `steady_tokens` is the sum of their lengths (context + 1).
        self.num_steady = num_steady
        self.steady_tokens = steady_tokens

    @property
    def num_chunks(self) -> int:
        return len(self.reqs) + self.num_steady

    @property
    def num_batched_tokens(self) -> int:
        return sum(self.num_new) + self.num_steady

    @property
    def is_empty(self) -> bool:
        return not self.reqs and not self.num_steady and not self.swap_out_blocks and not self.swap_in_blocks

    def to_plan(self) -> StepPlan:
        chunks = tuple(ScheduledChunk(r.request_id, n, c, s)
                       for r, n, c, s in zip(self.reqs, self.num_new, self.contexts, self.samples))
        return StepPlan(self.step_id, chunks, self.preempted_ids, self.swap_out_blocks, self.swap_in_blocks)


@dataclass(frozen=True, slots=True, init=False)  # __init__ written out: see core/types.py
class CompactOutputs:
    """What `update_compact` returns: `StepOutputs` less one `RequestOutput` per plain decode token."""

    outputs: tuple[RequestOutput, ...]  # first tokens, final tokens, hand-offs, truncations (as `update`)
    handoffs: tuple[HandoffReady, ...]
    kv_events: tuple
    plain: tuple[Request, ...]  # requests that got exactly one more token that neither starts nor ends them

    def __init__(
        self,
        outputs: tuple[RequestOutput, ...],
        handoffs: tuple[HandoffReady, ...],
        kv_events: tuple,
        plain: tuple[Request, ...],
    ) -> None:
        object.__setattr__(self, "outputs", outputs)
        object.__setattr__(self, "handoffs", handoffs)
        object.__setattr__(self, "kv_events", kv_events)
        object.__setattr__(self, "plain", plain)


class StepUnderConstruction(Protocol):
    """A step under construction, as the walks of the queues use it (`StepBuilder`, `CompactBuilder`)."""

    budget: int  # tokens left
    preempted_ids: list[str]
    swap_out_blocks: int
    swap_in_blocks: int

    @property
    def used(self) -> int: ...

    @property
    def scheduled_ids(self) -> set[str]: ...

    def add(self, req: Request, num_new_tokens: int) -> None: ...

    def unschedule(self, request_id: str) -> None: ...


class StepBuilder:
    """Accumulates one step's plan while `schedule` walks the queues."""

    __slots__ = ("budget", "initial_budget", "chunks", "scheduled_ids", "preempted_ids", "swap_out_blocks",
                 "swap_in_blocks")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.initial_budget = budget
        self.chunks: list[ScheduledChunk] = []
        self.scheduled_ids: set[str] = set()
        self.preempted_ids: list[str] = []
        self.swap_out_blocks = 0
        self.swap_in_blocks = 0

    def add(self, req: Request, num_new_tokens: int) -> None:
        context = req.num_computed_tokens
        samples = context + num_new_tokens == req.num_tokens
        self.chunks.append(ScheduledChunk(req.request_id, num_new_tokens, context, samples))
        self.scheduled_ids.add(req.request_id)
        self.budget -= num_new_tokens

    @property
    def used(self) -> int:
        return self.initial_budget - self.budget

    def unschedule(self, request_id: str) -> None:
        """Take back a chunk of a request preempted later in the same step (its KV is gone)."""
        if request_id not in self.scheduled_ids:
            return
        self.scheduled_ids.discard(request_id)
        for i, chunk in enumerate(self.chunks):
            if chunk.request_id == request_id:
                self.budget += chunk.num_new_tokens
                del self.chunks[i]
                return


class CompactBuilder:
    """A `StepBuilder` that keeps parallel lists instead of `ScheduledChunk` messages (`schedule_compact`)."""

    __slots__ = ("budget", "initial_budget", "preempted_ids", "swap_out_blocks", "swap_in_blocks", "reqs", "num_new",
                 "contexts", "samples")

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self.initial_budget = budget
        self.preempted_ids: list[str] = []
        self.swap_out_blocks = 0
        self.swap_in_blocks = 0
        self.reqs: list[Request] = []
        self.num_new: list[int] = []
        self.contexts: list[int] = []
        self.samples: list[bool] = []

    def add(self, req: Request, num_new_tokens: int) -> None:
        context = req.num_computed_tokens
        self.reqs.append(req)
        self.num_new.append(num_new_tokens)
        self.contexts.append(context)
        self.samples.append(context + num_new_tokens == len(req.token_ids))
        self.budget -= num_new_tokens

    @property
    def used(self) -> int:
        return self.initial_budget - self.budget

    @property
    def scheduled_ids(self) -> set[str]:  # only asked for when a request runs out of KV
        return {r.request_id for r in self.reqs}

    def unschedule(self, request_id: str) -> None:
        for i, req in enumerate(self.reqs):
            if req.request_id == request_id:
                self.budget += self.num_new[i]
                for column in (self.reqs, self.num_new, self.contexts, self.samples):
                    del column[i]
                return
