"""Messages shared by every layer of octoserve: requests, step plans, step results, load snapshots.

Invariants:
- Every message here is a frozen, slotted dataclass: built once, never mutated. Mutable per-request state
  lives in `octoserve.services.core.batch_state.Request`, owned by exactly one batcher.
- The messages the simulator builds per arrival, step or KV block write their `__init__` out (`init=False`, each
  field set with `object.__setattr__`, as the generated one does): compiled with mypyc (services/compiled.py), the
  generated `__init__` still runs as interpreted code, about 5x slower to call. Fields, defaults, equality,
  hashing, `replace` and immutability are the dataclass's. The same holds for a few hot messages elsewhere
  (`CompactOutputs`, `TraceRequest`, `Route`, `Refuse`, `Dispatched`).
- Times are seconds on the caller's clock (`*_s`), durations carry their unit in the name.
- Nothing here knows about protobuf, asyncio or a clock.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from octoserve.types import FinishReason, Priority  # the public API's enums, defined once in the SDK

__all__ = ["FinishReason", "Priority"]  # re-exported; the node's other names are public by convention


class Role(str, enum.Enum):
    """What an engine instance does with a request."""

    COLOCATED = "colocated"  # prefill and decode on the same instance, chunked prefill mixed into decode steps
    PREFILL = "prefill"  # computes the prompt, samples the first token, hands the KV off
    DECODE = "decode"  # starts from received KV and generates the rest


@dataclass(frozen=True, slots=True, init=False)  # __init__ written out: module doc
class SamplingParams:
    max_tokens: int
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False

    def __init__(
        self,
        max_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int | None = None,
        stop: tuple[str, ...] = (),
        ignore_eos: bool = False,
    ) -> None:
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "temperature", temperature)
        object.__setattr__(self, "top_p", top_p)
        object.__setattr__(self, "seed", seed)
        object.__setattr__(self, "stop", stop)
        object.__setattr__(self, "ignore_eos", ignore_eos)


@dataclass(frozen=True, slots=True, init=False)  # __init__ written out: module doc
class RequestSpec:
    """One admitted request as the engines see it."""

    request_id: str
    model: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival_s: float  # when the router admitted it, on the caller's clock
    priority: Priority = Priority.STANDARD
    ttft_slo_ms: float | None = None  # per-request TTFT deadline; None: the model's default SLO
    # Simulation only: how many tokens the "model" generates before EOS. Real engines ignore it.
    sim_output_len: int | None = None

    def __init__(
        self,
        request_id: str,
        model: str,
        prompt_token_ids: tuple[int, ...],
        sampling: SamplingParams,
        arrival_s: float,
        priority: Priority = Priority.STANDARD,
        ttft_slo_ms: float | None = None,
        sim_output_len: int | None = None,
    ) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "prompt_token_ids", prompt_token_ids)
        object.__setattr__(self, "sampling", sampling)
        object.__setattr__(self, "arrival_s", arrival_s)
        object.__setattr__(self, "priority", priority)
        object.__setattr__(self, "ttft_slo_ms", ttft_slo_ms)
        object.__setattr__(self, "sim_output_len", sim_output_len)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def max_tokens(self) -> int:
        return self.sampling.max_tokens

    def ttft_deadline_s(self, default_ttft_slo_ms: float) -> float:
        slo_ms = self.ttft_slo_ms if self.ttft_slo_ms is not None else default_ttft_slo_ms
        return self.arrival_s + slo_ms / 1000.0


@dataclass(frozen=True, slots=True)
class ScheduledChunk:
    """Work for one request in one engine step."""

    request_id: str
    num_new_tokens: int  # tokens computed this step: 1 for a decode, up to the budget for a prefill chunk
    num_context_tokens: int  # tokens already in KV before this step (attention reads them)
    samples: bool  # True when this step ends at the sequence's last known token, so a token is sampled


@dataclass(frozen=True, slots=True)
class StepPlan:
    """What one engine step runs. Produced by `Batcher.schedule(now)`, consumed by the executor."""

    step_id: int
    chunks: tuple[ScheduledChunk, ...]
    preempted_ids: tuple[str, ...] = ()  # preempted this step (recompute or swapped out)
    swap_out_blocks: int = 0  # blocks copied GPU -> host this step (PCIe time)
    swap_in_blocks: int = 0  # blocks copied host -> GPU this step

    @property
    def num_batched_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.chunks)

    @property
    def is_empty(self) -> bool:
        return not self.chunks and not self.swap_out_blocks and not self.swap_in_blocks


@dataclass(frozen=True, slots=True)
class StepResult:
    """What the executor returns for a plan: the sampled token for every chunk whose `samples` is True."""

    sampled_token_ids: dict[str, int]  # request_id -> the token sampled this step
    step_time_s: float = 0.0  # measured (real engine) or modelled (sim engine)


@dataclass(frozen=True, slots=True, init=False)  # __init__ written out: module doc
class RequestOutput:
    """New tokens of one request after one step; `finish_reason` set on its last output."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache (or received KV)
    num_output_tokens: int = 0  # total so far

    def __init__(
        self,
        request_id: str,
        new_token_ids: tuple[int, ...],
        finish_reason: FinishReason | None = None,
        num_prompt_tokens: int = 0,
        num_cached_prompt_tokens: int = 0,
        num_output_tokens: int = 0,
    ) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "new_token_ids", new_token_ids)
        object.__setattr__(self, "finish_reason", finish_reason)
        object.__setattr__(self, "num_prompt_tokens", num_prompt_tokens)
        object.__setattr__(self, "num_cached_prompt_tokens", num_cached_prompt_tokens)
        object.__setattr__(self, "num_output_tokens", num_output_tokens)


@dataclass(frozen=True, slots=True)
class HandoffReady:
    """Prefill role: the prompt KV of `request_id` sits in `block_ids` and waits to be sent."""

    request_id: str
    block_ids: tuple[int, ...]
    num_prompt_tokens: int
    first_token_id: int


@dataclass(frozen=True, slots=True, init=False)  # __init__ written out: module doc
class EngineLoad:
    """A load snapshot of one engine instance, as the router and the scheduler see it."""

    instance_id: str
    model: str
    role: Role
    num_running: int
    num_waiting: int
    num_total_blocks: int
    num_free_blocks: int  # free now, cached-but-evictable blocks included
    block_size: int
    queued_prefill_tokens: int  # prompt tokens admitted but not yet computed (waiting + partially prefilled)
    prefill_tokens_per_s: float  # prefill throughput estimate of this instance
    decode_step_time_s: float  # recent decode step time (ITL proxy)
    healthy: bool = True
    paused: bool = False
    max_num_seqs: int = 0  # decode slots now (by context: at the running mean context); 0: unknown, no limit
    mean_output_tokens: float = 0.0  # recent mean completion length (0: unknown)
    num_reserved: int = 0  # decode reservations whose KV has not arrived (each decodes here once it does)
    # Prefill rate of a step past the ITL SLO (0: none, or the ITL tail budget never affords one); the batcher runs
    # one only for a prompt that steps within the SLO would bring to its first token too late.
    long_prefill_tokens_per_s: float = 0.0
    # When the instance's step in flight ends by its step model, on the modelled clock routers decide on (seconds;
    # 0: unknown): a prompt arriving before then starts no sooner.
    busy_until_s: float = 0.0
    # Seconds until the ITL tail budget affords such a step (0: now), the prefill tokens the steps it then affords
    # back to back take (inf: any number), and the long steps' prefill rate once those are spent (one step in
    # 1 / tail_budget_fraction may be long; 0: unknown, the rate above).
    long_step_wait_s: float = 0.0
    long_burst_tokens: float = 0.0
    long_sustained_tokens_per_s: float = 0.0

    def __init__(
        self,
        instance_id: str,
        model: str,
        role: Role,
        num_running: int,
        num_waiting: int,
        num_total_blocks: int,
        num_free_blocks: int,
        block_size: int,
        queued_prefill_tokens: int,
        prefill_tokens_per_s: float,
        decode_step_time_s: float,
        healthy: bool = True,
        paused: bool = False,
        max_num_seqs: int = 0,
        mean_output_tokens: float = 0.0,
        num_reserved: int = 0,
        long_prefill_tokens_per_s: float = 0.0,
        busy_until_s: float = 0.0,
        long_step_wait_s: float = 0.0,
        long_burst_tokens: float = 0.0,
        long_sustained_tokens_per_s: float = 0.0,
    ) -> None:
        object.__setattr__(self, "instance_id", instance_id)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "role", role)
        object.__setattr__(self, "num_running", num_running)
        object.__setattr__(self, "num_waiting", num_waiting)
        object.__setattr__(self, "num_total_blocks", num_total_blocks)
        object.__setattr__(self, "num_free_blocks", num_free_blocks)
        object.__setattr__(self, "block_size", block_size)
        object.__setattr__(self, "queued_prefill_tokens", queued_prefill_tokens)
        object.__setattr__(self, "prefill_tokens_per_s", prefill_tokens_per_s)
        object.__setattr__(self, "decode_step_time_s", decode_step_time_s)
        object.__setattr__(self, "healthy", healthy)
        object.__setattr__(self, "paused", paused)
        object.__setattr__(self, "max_num_seqs", max_num_seqs)
        object.__setattr__(self, "mean_output_tokens", mean_output_tokens)
        object.__setattr__(self, "num_reserved", num_reserved)
        object.__setattr__(self, "long_prefill_tokens_per_s", long_prefill_tokens_per_s)
        object.__setattr__(self, "busy_until_s", busy_until_s)
        object.__setattr__(self, "long_step_wait_s", long_step_wait_s)
        object.__setattr__(self, "long_burst_tokens", long_burst_tokens)
        object.__setattr__(self, "long_sustained_tokens_per_s", long_sustained_tokens_per_s)

    @property
    def kv_usage(self) -> float:
        if self.num_total_blocks == 0:
            return 1.0
        return 1.0 - self.num_free_blocks / self.num_total_blocks


@dataclass(frozen=True, slots=True, init=False)  # __init__ written out: module doc
class BlockStored:
    """KV event: full blocks with these chained hashes are now cached on an instance."""

    block_hashes: tuple[int, ...]
    parent_hash: int | None

    def __init__(self, block_hashes: tuple[int, ...], parent_hash: int | None) -> None:
        object.__setattr__(self, "block_hashes", block_hashes)
        object.__setattr__(self, "parent_hash", parent_hash)


@dataclass(frozen=True, slots=True, init=False)  # __init__ written out: module doc
class BlockRemoved:
    """KV event: cached blocks with these hashes were evicted."""

    block_hashes: tuple[int, ...]

    def __init__(self, block_hashes: tuple[int, ...]) -> None:
        object.__setattr__(self, "block_hashes", block_hashes)


KVEvent = BlockStored | BlockRemoved


@dataclass(frozen=True, slots=True)
class StepOutputs:
    """What `Batcher.update(plan, result)` returns."""

    outputs: tuple[RequestOutput, ...] = ()
    handoffs: tuple[HandoffReady, ...] = ()  # prefill role only
    kv_events: tuple[KVEvent, ...] = field(default=())
