"""Build the core objects of one engine instance from the node config: batcher config, KV pool, cost model.

The live sim engine and the discrete-event simulator both call this, so an instance is the same object graph under
either clock: one policy, two clocks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from octoserve.services.core.batch_state import BatcherConfig
from octoserve.services.core.batcher import Batcher
from octoserve.services.core.tail_budget import FREE_STEP_SHARE, SHORT_WINDOW_GAPS
from octoserve.services.core.cost_model import CostModel
from octoserve.services.core.kv_cache import KVCacheManager
from octoserve.services.core.placement import InstanceConfig, NodeConfig, gang_step_floor_s, num_kv_blocks_for
from octoserve.services.core.slo_sizing import (
    CHUNK_QUANTUM,
    NARROW_BATCH_BELOW,
    NARROW_DECODE_SHARE,
    SLOT_CEILING_CONTEXT,
    TAIL_SIZING_BELOW,
    WIDE_BATCH_AT,
    size_for_slo,
)
from octoserve.services.core.types import EngineLoad, Role, StepPlan

EOS_TOKEN_ID = 2


@dataclass(frozen=True, slots=True)
class InstanceParts:
    batcher_config: BatcherConfig
    num_kv_blocks: int
    cost_model: CostModel

    def new_kv(self, instance: InstanceConfig) -> KVCacheManager:
        # The model name is the prefix-cache key: blocks of different models never match.
        return KVCacheManager(
            self.num_kv_blocks, instance.block_size, instance.enable_prefix_caching, extra_key=instance.model
        )


def instance_parts(node: NodeConfig, instance: InstanceConfig, cost_model: CostModel | None = None) -> InstanceParts:
    model = node.models[instance.model]
    policies = node.policies
    cost_model = cost_model or node.cost_model(instance)
    sizing = _sizing_fields(node, instance, cost_model)
    swap_block_bytes = instance.block_size * model.kv_bytes_per_token
    batcher_config = BatcherConfig(
        role=instance.role,
        max_model_len=model.max_context_len,
        queue_policy=policies.queue,
        reservation_policy=policies.reservation,
        preemption_mode=policies.preemption,
        num_swap_blocks=policies.swap_space_bytes // swap_block_bytes,
        eos_token_id=EOS_TOKEN_ID,
        tier_ttft_slo_ms=dict(node.slo.for_model(instance.model).tier_ttft_ms),
        predictor_prior_tokens=policies.predicted_output_tokens,
        batch_min_share=policies.batch_min_share,
        **sizing,
    )
    return InstanceParts(
        batcher_config=batcher_config,
        num_kv_blocks=num_kv_blocks_for(node, instance),
        cost_model=cost_model,
    )


def _sizing_fields(node: NodeConfig, instance: InstanceConfig, cost_model: CostModel) -> dict:
    """The batcher's batch and budget fields: as configured, or SLO-sized (and slack-aware) per the policies."""
    policies = node.policies
    itl_ms = node.slo.for_model(instance.model).itl_ms  # each model's own ITL SLO
    fields = dict(max_num_seqs=instance.max_num_seqs, max_num_batched_tokens=instance.max_num_batched_tokens)
    if not policies.slo_sizing:
        return fields
    sized = size_for_slo(
        cost_model, instance.role, itl_slo_ms=itl_ms, max_num_seqs=instance.max_num_seqs,
        max_num_batched_tokens=instance.max_num_batched_tokens,
    )
    # A gang member's steps are capped by its lease share, so its batch keeps room for prefill chunks (and the
    # gang's bounds, checked on that batch, hold).
    in_gang = node.gang is not None and node.gang.group_of(instance.id) is not None
    # ...and keeps the short ITL tail window (short_tail_window_gaps), as a wide batch does below.
    tail_window_gaps = short_tail_window_gaps(policies) if in_gang else policies.tail_window_gaps
    if (policies.slack_chunking and not in_gang and instance.role is Role.COLOCATED
            and TAIL_SIZING_BELOW <= sized.max_num_seqs < NARROW_BATCH_BELOW):
        # Context-aware decode slots (slo_sizing, SLOT_CEILING_CONTEXT): the step tables stay at the sized context
        # and reach the most decodes that fit at a short one; the batcher fills them by the running contexts.
        common = dict(itl_slo_ms=itl_ms, max_num_seqs=instance.max_num_seqs,
                      max_num_batched_tokens=instance.max_num_batched_tokens, decode_share=NARROW_DECODE_SHARE)
        ceiling = size_for_slo(cost_model, instance.role, context_tokens=SLOT_CEILING_CONTEXT, **common).max_num_seqs
        sized = size_for_slo(cost_model, instance.role, num_slots=ceiling, **common)
        fields["decode_slot_target_s"] = sized.step_target_s * NARROW_DECODE_SHARE
    elif policies.slack_chunking and not in_gang and sized.max_num_seqs < TAIL_SIZING_BELOW:
        sized = size_for_slo(
            cost_model, instance.role, itl_slo_ms=itl_ms, max_num_seqs=instance.max_num_seqs,
            max_num_batched_tokens=instance.max_num_batched_tokens, tail_budget=True,
        )
    elif policies.slack_chunking and not in_gang and sized.max_num_seqs >= WIDE_BATCH_AT:
        sized = size_for_slo(
            cost_model, instance.role, itl_slo_ms=itl_ms, max_num_seqs=instance.max_num_seqs,
            max_num_batched_tokens=instance.max_num_batched_tokens, headroom=FREE_STEP_SHARE,
        )
        tail_window_gaps = short_tail_window_gaps(policies)
    fields.update(max_num_seqs=sized.max_num_seqs, max_num_batched_tokens=sized.max_num_batched_tokens)
    if instance.role is Role.PREFILL:
        fields.update(prefill_step_model(cost_model, instance.max_num_batched_tokens))
    if sized.budget_by_num_decodes:
        fields["budget_by_num_decodes"] = sized.budget_by_num_decodes
    if policies.slack_chunking and sized.decode_step_s_by_num_decodes:
        fields.update(
            # The configured budget stays the ceiling; the sized table is the floor of every step's budget.
            max_num_batched_tokens=instance.max_num_batched_tokens,
            # A request is good when its mean time per output token is within the ITL SLO: the target is the SLO
            # less the share kept for the step model's error, not the tighter per-step target of the sizing.
            tpot_target_s=FREE_STEP_SHARE * itl_ms / 1000.0,
            tpot_horizon_tokens=policies.tpot_horizon_tokens,
            max_step_s=sized.step_target_s * policies.max_step_factor,
            itl_slo_s=itl_ms / 1000.0,
            tail_budget_fraction=policies.tail_budget_fraction,
            tail_window_gaps=tail_window_gaps,
            decode_step_s_by_num_decodes=sized.decode_step_s_by_num_decodes,
            prefill_s_per_token=sized.prefill_s_per_token,
            sized_context_tokens=sized.context_tokens,
            kv_s_per_context_token=sized.kv_s_per_context_token,
            attn_s_per_pair=cost_model.attn_s_per_pair(),
        )
    return fields


def short_tail_window_gaps(policies) -> int:
    """The ITL tail window of a wide batch (WIDE_BATCH_AT sequences or more, sized to the free share of the ITL SLO)
    and of a gang member: SHORT_WINDOW_GAPS, or the configured window where it is shorter.

    A wide batch: the tail affords no long step over more than 160 of its decodes at 4 %. Its free steps already end
    at the TPOT target, so a long step over a wide batch is paid back by shorter steps after it. Measured with the
    70B on the long window in runs that set the 8B's window alone (an instrumented run: no config key sets one
    model's window), `octoserve simulate --duration 60s --warmup 20s`: the seed-000 peak's mean over seeds 0-5 was
    94.8 req/s with the 8B's 215-sequence batch on 4,000 gaps, 94.6 on 4,600 and 94.3 on 5,375; over seeds 0-2,
    95.5 on 4,000 and 94.5 on 8,000 or 138,000. 3,200 (no long step over more than 128 decodes) served the peak at
    94.7 but left seed 003's BATCH share of goodput on the suite's placement at 10.0 % against 10.6 % (seeds 0-5).
    A gang member: with every window long, seed 003's node under the pessimistic profile at 20 req/s left the
    180B's admitted requests 85.7 % good (`python -m octoserve.services.lab.gang_bench` at commit cede92d, its grid
    run at that rate, seed 0); 100 % with the LM alone on the short window (instrumented). Not traced further: the
    short window is the one the gang's admission was measured and tuned with."""
    return min(policies.tail_window_gaps, SHORT_WINDOW_GAPS)


def prefill_step_model(cost_model: CostModel, max_num_batched_tokens: int) -> dict:
    """A prefill instance's step model (`BatcherConfig` fields): a fixed step time plus a time per token, fitted
    between a full step and a half one (compute-bound, close to linear; the attention over long prompts makes it
    over-predict mid-size steps a little). It only dates the step in flight: the load report's `busy_until_s`
    (every newcomer waits for it, whatever its tier, so admission must see a long BATCH chunk running) and the
    in-flight tokens that leave the queue. It sets no ITL or TPOT target, so no tail budget or slack logic runs.
    Without it a prefill instance reports itself idle through a 1.4 s step (the 70B at TP=2 under the pessimistic
    profile, a 8,192-token chunk), and admitted INTERACTIVE requests missed their TTFT SLO by up to 300 ms."""
    big = max(2 * CHUNK_QUANTUM, max_num_batched_tokens)
    per_token = (cost_model.step_time_s([(big, 0)]) - cost_model.step_time_s([(big // 2, 0)])) / (big - big // 2)
    base_s = max(0.0, cost_model.step_time_s([(CHUNK_QUANTUM, 0)]) - CHUNK_QUANTUM * per_token)
    return dict(decode_step_s_by_num_decodes=(base_s,), prefill_s_per_token=per_token)


def gang_duty(node: NodeConfig, instance: InstanceConfig) -> float:
    """The share of its GPUs' time an instance gets: its step share inside a gang group, else 1."""
    return node.step_itl_ms(instance) / node.slo.for_model(instance.model).itl_ms


@dataclass(frozen=True, slots=True)
class GangShare:
    """What a gang member gets of its GPUs while the other side of its group has work: its steps are capped at
    `own_cap_s` and each is followed by one of the other side's, capped at `other_cap_s` (the policy's shared-step
    caps, `GangPolicy.lm/sm_shared_step_ms`); `duty` is its step share, used where the policy sets no caps. While
    the other side has no work the member steps alone, in full. `lent_cap_s` (deadline shape): its cap while the
    other side lends it its ITL tail, the bound that caps its steps (0: lending changes no cap), and
    `lent_other_cap_s` the other side's step between two of its own meanwhile."""

    duty: float
    own_cap_s: float
    other_cap_s: float
    lent_cap_s: float = 0.0
    lent_other_cap_s: float = 0.0
    # The share of the GPUs' time its prompts' latest starts are reckoned at (`Batcher.earliest_deadline_s`): the
    # deadline shape's LM takes the GPUs only when its latest start calls, then steps one cycle's share of the time.
    prefill_share: float = 1.0


def gang_share(node: NodeConfig, instance: InstanceConfig) -> GangShare | None:
    """The member's GangShare; None outside a gang group."""
    group = node.gang.group_of(instance.id) if node.gang else None
    if group is None:
        return None
    policy = node.gang.policy
    is_lm = instance.id == group.lm
    if policy.shape != "deadline":
        lm_s, sm_s = policy.lm_shared_step_ms / 1e3, policy.sm_shared_step_ms / 1e3
        own, other = (lm_s, sm_s) if is_lm else (sm_s, lm_s)
        return GangShare(gang_duty(node, instance), own, other)
    # Deadline shape: the member holds the GPUs the rest of the other side's ITL (less the arbiter's urgency guard),
    # within the bound that caps its steps. The LM takes the GPUs when its deadline calls, so SMs with prompts of
    # their own may hold them up to its wait bound between two of its steps; SMs that only decode lend their tail
    # and step at their floor once the LM's due prompt has gone first. The LM steps only at its deadline, at its
    # floor as the SMs see it.
    others = group.sms if is_lm else (group.lm,)
    other_floor_s = max(gang_step_floor_s(node, node.instance(x)) for x in others)
    other_itl_s = node.slo.for_model(node.instance(others[0]).model).itl_ms / 1e3
    bound_s = (policy.max_sm_stall_ms if is_lm else policy.max_lm_wait_ms) / 1e3
    own = max(0.0, min(bound_s, other_itl_s - other_floor_s - policy.urgent_ms / 1e3))
    other = max(other_floor_s, policy.max_lm_wait_ms / 1e3) if is_lm else other_floor_s
    share = own / (own + other) if is_lm and own > 0 else 1.0
    return GangShare(gang_duty(node, instance), own, other, bound_s, other_floor_s, share)


class LoadReporter:
    """EngineLoad snapshots of one sim instance: the batcher's state plus rates from the cost model.

    The prefill rate it reports is what the NEXT steps can give a new prompt: the budget left after this step's
    decodes, at the step time that mix costs (memoised by batch size), so admission sees a busy colocated instance
    prefill slower than an idle one. With slack chunking the batcher's own step model gives both rates it plans
    with: steps within the ITL SLO's free share, and a step past it while the ITL tail budget affords one. The
    decode step time is an exponential average of recent decode-only steps.

    A gang member lent the other side's ITL tail reports the lent rate only for as long as lending lasts: the
    arbiter's notice says whether it is lent now, not for how long, and a prompt queued behind seconds of prefill
    (a BATCH prompt of the large model) is served mostly after the state it arrived in has changed. So the reporter
    keeps, from the notices and their times, the share of recent time it was lent (`lent_share`, an exponential
    average over `LENT_WINDOW_S`) and the mean length of its lent periods (`lent_period_s`): a prompt gets the lent
    rate for one lent period, then the rate of that mix of lent and unlent steps.
    """

    EMA = 0.2  # weight of the newest decode step
    CONTEXT_TOKENS = 1200  # typical decode context for the rate estimate
    LENT_WINDOW_S = 4.0  # time constant of `lent_share`, in model seconds: a few BATCH prefills' worth
    LENT_PERIOD_EMA = 0.2  # weight of the newest lent period in `lent_period_s`

    def __init__(self, instance_id: str, model: str, batcher: Batcher, cost: CostModel,
                 gang: GangShare | None = None) -> None:
        # gang: what the instance gets of its GPUs while it shares them (a gang member); `shared`: the arbiter's
        # notice (services/core/gang.py, sharing), set by the gang adapter (the simulator's, or the live gate):
        # shared, the rates it reports are those of capped steps taking turns with the other side's. `tail_lent`:
        # the arbiter's lending notice: the other side lends its ITL tail, so a due prompt's step may run to the
        # bound (`GangShare.lent_cap_s`) instead of the other side's latest start.
        self.gang = gang
        self.shared = False
        self.tail_lent = False
        # No notice yet: the state it is told of is taken to last (a share of 1, periods without end).
        self.lent_share = 1.0
        self.lent_period_s = math.inf
        self._lent_told_at: float | None = None
        self.instance_id = instance_id
        self.model = model
        self.batcher = batcher
        self.cost = cost
        self.decode_step_time_s = cost.decode_step_time_s(1, self.CONTEXT_TOKENS)
        self._prefill_rate: dict[int, float] = {}  # running requests -> tokens/s

    def note_lending(self, lent: bool, now_s: float) -> None:
        """The arbiter's lending notice (`tail_lent`) at `now_s`, in model seconds of any one clock: the time since
        the last change, in the state it told, enters `lent_share` and, if lent, `lent_period_s`. A notice that
        repeats the state (the live gate hears lending with every sharing notice) changes nothing."""
        told_at = self._lent_told_at
        if told_at is not None:
            if lent == self.tail_lent:
                return
            held_s = max(0.0, now_s - told_at)
            keep = math.exp(-held_s / self.LENT_WINDOW_S)
            self.lent_share = keep * self.lent_share + (1.0 - keep) * (1.0 if self.tail_lent else 0.0)
            if self.tail_lent:
                last = self.lent_period_s
                self.lent_period_s = held_s if math.isinf(last) else last + self.LENT_PERIOD_EMA * (held_s - last)
        self._lent_told_at = now_s
        self.tail_lent = lent

    def note_step(self, plan: StepPlan, step_time_s: float) -> None:
        if plan.chunks:
            self.note_step_shape(len(plan.chunks), plan.num_batched_tokens, step_time_s)

    def note_step_shape(self, num_chunks: int, num_batched_tokens: int, step_time_s: float) -> None:
        """`note_step` from a step's counts (the simulator's compact steps carry no `StepPlan`)."""
        if num_chunks and num_batched_tokens == num_chunks:
            self.decode_step_time_s += self.EMA * (step_time_s - self.decode_step_time_s)

    def prefill_tokens_per_s(self, num_running: int) -> float:
        """The prefill rate of the steps the batcher runs beside `num_running` requests, by the cost model: the
        sized budget, or past it steps that end within the SLO's free share (no slow gap)."""
        rate = self._prefill_rate.get(num_running)
        if rate is None:
            b = self.batcher
            ceiling = b.config.max_num_batched_tokens
            budget = max(b.budget.step_budget(num_running), min(ceiling, b.budget.free_budget(num_running)))
            chunk = max(CHUNK_QUANTUM, budget - num_running)
            step_s = self.cost.step_time_s([(chunk, 0)] + [(1, self.CONTEXT_TOKENS)] * num_running)
            rate = self._prefill_rate[num_running] = chunk / step_s
        return rate

    def load(self) -> EngineLoad:
        b = self.batcher
        n = b.num_running
        if self.gang is not None and self.shared:
            return self._shared_load()
        if b.config.tpot_target_s > 0:  # the batcher's own step model: the rates it plans with (`_long_step_tokens`)
            rate = self._free_rate()
            long_rate = b.budget.long_prefill_tokens_per_s()
            long_wait = b.budget.long_step_wait_s() if long_rate > 0 else 0.0
            burst, sustained = b.budget.long_burst_tokens(), b.budget.long_sustained_tokens_per_s()
        else:
            rate, long_rate, long_wait = self.prefill_tokens_per_s(n), 0.0, 0.0
            burst, sustained = 0.0, 0.0
        return b.load(self.instance_id, self.model, rate, self.decode_step_time_s, long_rate, long_wait, burst, sustained)

    def _free_rate(self) -> float:
        """The prefill rate of steps within the ITL SLO's free share beside the running decodes (the batcher's step
        model), else of its sized steps."""
        b = self.batcher
        return b.budget.free_prefill_tokens_per_s() or self.prefill_tokens_per_s(b.num_running)

    def _shared_load(self) -> EngineLoad:
        """The snapshot of a gang member whose group's other side has work: each of its steps is capped and
        followed by one of the other side's, so a prompt gets the prefill tokens a capped step carries beside the
        decodes of every request it holds once per cycle (its cap plus the other side's), a running request one
        token per cycle, and no step runs past the cap (no long steps). While the other side lends its ITL tail
        (`tail_lent`), the cap is the bound instead (`GangShare.lent_cap_s`), for one lent period (`lent_period_s`);
        past it the rate is that of the recent share of lent and unlent steps (`lent_share`). A policy without
        shared-step caps: the step share (`duty`) of the rates of steps alone."""
        b, share = self.batcher, self.gang
        assert share is not None
        if share.own_cap_s <= 0 or share.other_cap_s <= 0:
            rate = share.duty * self._free_rate()
            return b.load(self.instance_id, self.model, rate, self.decode_step_time_s / share.duty, 0.0, 0.0, 0.0, 0.0)
        if not (self.tail_lent and share.lent_cap_s > 0):
            rate, cadence_s = self._capped_rate(share.own_cap_s, share.other_cap_s)
            return b.load(self.instance_id, self.model, rate, cadence_s, 0.0, 0.0, 0.0, 0.0)
        lent_rate, cadence_s = self._capped_rate(share.lent_cap_s, share.lent_other_cap_s)
        if self.lent_share >= 1.0 or math.isinf(self.lent_period_s):
            return b.load(self.instance_id, self.model, lent_rate, cadence_s, 0.0, 0.0, 0.0, 0.0)
        # Lent for one lent period, then the mix of lent and unlent steps the recent past had: the rescue fields
        # carry the first (a burst at the lent rate), the rate the second.
        unlent_rate, _ = self._capped_rate(share.own_cap_s, share.other_cap_s)
        mixed_rate = self.lent_share * lent_rate + (1.0 - self.lent_share) * unlent_rate
        burst = lent_rate * self.lent_period_s
        return b.load(self.instance_id, self.model, mixed_rate, cadence_s, lent_rate, 0.0, burst, mixed_rate)

    def _capped_rate(self, own_cap_s: float, other_cap_s: float) -> tuple[float, float]:
        """The prefill rate of steps capped at `own_cap_s`, each followed by one of the other side's capped at
        `other_cap_s`, and the decode cadence they give."""
        b = self.batcher
        # The chunk beside every request it holds decoding, queued ones included: each prompt it admits becomes a
        # decode in the capped step, so a burst of short prompts (a cached system prompt and a few tokens) shrinks
        # the prefill left to the later ones. Decodes that fill the cap leave no prefill until some finish: one
        # token a cycle stands for that (a rate of 0 would read as "unknown", which routing replaces by the cost
        # model's rate alone).
        num_decodes = b.num_future_decodes()
        chunk = b.budget.capped_prefill_tokens(own_cap_s, num_decodes)
        if num_decodes and not b.budget.tail.affordable(num_decodes):
            # Its decodes' ITL tail is spent: each step ends within the free share of their ITL counted from their
            # previous tokens, the other side's step between included (`Batcher._plan_step`), lent or not.
            chunk = min(chunk, b.budget.free_budget(num_decodes, other_cap_s) - num_decodes)
        chunk = max(1, chunk)
        return chunk / (own_cap_s + other_cap_s), self.decode_step_time_s + other_cap_s
