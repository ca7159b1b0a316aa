"""What a batcher is configured with and what it keeps per request: `BatcherConfig`, `Request` and its
`RequestStatus`, and `SteadyState` (the hook of the simulator's steady batcher). `services/core/batcher.py` plans
steps over them; a request is in exactly one status at a time (its module docstring states the invariants).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field

from octoserve.services.core.preemption import PREEMPTION_MODES, VICTIM_POLICIES
from octoserve.services.core.queues import QUEUE_POLICIES
from octoserve.services.core.types import Priority, RequestSpec, Role

DEFAULT_TIER_TTFT_SLO_MS: Mapping[Priority, float] = {
    Priority.INTERACTIVE: 200.0,
    Priority.STANDARD: 250.0,
    Priority.BATCH: 10_000.0,
}


@dataclass(frozen=True, slots=True)
class BatcherConfig:
    role: Role = Role.COLOCATED
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    max_model_len: int = 8192
    queue_policy: str = "edf"
    reservation_policy: str = "predicted"
    victim_policy: str = "lowest-tier-latest"
    preemption_mode: str = "recompute"
    num_swap_blocks: int = 0  # host-memory blocks available for swap-out (0: swap degrades to recompute)
    eos_token_id: int = 2
    tier_ttft_slo_ms: Mapping[Priority, float] = field(default_factory=lambda: dict(DEFAULT_TIER_TTFT_SLO_MS))
    predictor_quantile: float = 0.9
    predictor_prior_tokens: int = 512
    # Optional: number of decodes in a step -> token budget of that step (SLO sizing); () = always the budget above.
    budget_by_num_decodes: tuple[int, ...] = ()
    # Slack-aware chunking (0 = off): a step may exceed the per-step budget above, up to `max_num_batched_tokens`
    # and `max_step_s`, when every running decode keeps its mean time per output token under `tpot_target_s`.
    tpot_target_s: float = 0.0
    max_step_s: float = 0.0
    # A long step's delay is paid back over this many of each decode's next tokens at the current step pace (its
    # TPOT is a mean over its whole output): 0 = the mean so far must stay on target after this very step.
    tpot_horizon_tokens: int = 0
    # The ITL tail budget (services/core/tail_budget.py; with slack chunking): a step the step model puts past
    # FREE_STEP_SHARE x `itl_slo_s` delays every decode in it past the SLO, so it runs only while the slow share
    # of the last `tail_window_gaps` inter-token gaps stays within `tail_budget_fraction`; shorter steps are free.
    itl_slo_s: float = 0.0
    tail_budget_fraction: float = 0.04
    tail_window_gaps: int = 32000
    # Tier preemption (1.0 = off): BATCH keeps at least this share of max_num_seqs when more urgent work waits.
    batch_min_share: float = 1.0
    decode_step_s_by_num_decodes: tuple[float, ...] = ()  # d -> step time of d decodes alone
    prefill_s_per_token: float = 0.0  # marginal step time of one more prefill token
    # Context-aware budgets (0 = off): the tables above assume decodes of `sized_context_tokens`; every token of
    # context beyond that adds `kv_s_per_context_token` of KV reading to a step, taken out of its prefill chunk.
    sized_context_tokens: int = 0
    kv_s_per_context_token: float = 0.0
    # Attention time of one (new token, context token) pair, by the cost model: what a prefill chunk over a long
    # computed context adds beyond the linear step model; a gang cap's chunk is cut by it (0: not modelled).
    attn_s_per_pair: float = 0.0
    # Context-aware decode slots (0 = off): a waiting request joins the running set only while the decode step of
    # the set with it, by the step model at the requests' actual contexts, stays within this; `max_num_seqs` is
    # then the ceiling at short contexts.
    decode_slot_target_s: float = 0.0

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        QUEUE_POLICIES.get(self.queue_policy)
        VICTIM_POLICIES.get(self.victim_policy)


class SteadyState:
    """The per-request state of a Batcher subclass that advances steady decodes implicitly (`Request.steady`);
    `Batcher` itself never reads it."""

    __slots__ = ()


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    RESERVED = "reserved"  # decode role: KV held, waiting for the hand-off
    HANDOFF = "handoff"  # prefill role: prompt done, KV held until sent
    FINISHED = "finished"


class Request:
    """Mutable state of one request inside one batcher."""

    __slots__ = (
        "spec",
        "request_id",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "num_cached_tokens",
        "capacity_tokens",
        "status",
        "num_preemptions",
        "num_swapped_blocks",
        "queue_key",
        "victim_key",
        "first_token_s",
        "last_token_s",
        "stop_len",
        "executor_key",
        "run_seq",
        "steady",
    )

    def __init__(self, spec: RequestSpec, queue_key: tuple, victim_key: tuple) -> None:
        self.spec = spec
        self.request_id = spec.request_id
        self.token_ids: list[int] = list(spec.prompt_token_ids)
        self.num_prompt_tokens = len(spec.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0
        self.capacity_tokens = 0  # tokens the held KV blocks can store
        self.status = RequestStatus.WAITING
        self.num_preemptions = 0
        self.num_swapped_blocks = 0
        self.queue_key = queue_key
        self.victim_key = victim_key
        self.first_token_s: float | None = None  # when its first output token was produced here (slack accounting)
        self.last_token_s: float | None = None  # when its latest output token was produced here (gang deadlines)
        # Length (prompt + output tokens) at which it stops for length: min(prompt + max_tokens, max_model_len);
        # set by the batcher, which knows max_model_len.
        self.stop_len = self.num_prompt_tokens + spec.sampling.max_tokens
        # Opaque to the batcher: what an in-process executor derives once per request and caches here
        # (SimExecutor: the constants of its token formula). None until the executor first sees the request.
        self.executor_key: tuple | None = None
        # Order among running requests of equal victim key (bisect puts a newcomer after its equals): stamped when
        # it starts running, so (victim_key, run_seq) sorts like the running list.
        self.run_seq = 0
        # Opaque to `Batcher`: a subclass that advances steady decodes implicitly (the simulator's,
        # services/sim/steady_batcher.py) keeps its per-request state here; None while the request's tokens are
        # explicit.
        self.steady: SteadyState | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens
