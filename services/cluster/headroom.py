"""A node's headroom summary: the compact state each node router publishes for the cluster picker.

Per model and tier it says whether the node would admit a reference prompt now, the retry delay it would give if
not, and the queue wait a new prompt of that tier would see; per model the prefill rate, the KV headroom and the
share of GPU time the model's instances get (`capacity_fraction`: below 1 while an LM gang lease takes GPU time
from the SM instances); per node the hashes of its hot prefix blocks.

Job of `HeadroomPublisher`: turn a node's `RouterPolicy` state and load snapshots into a `HeadroomSummary`,
using the router's own candidate computation (`RouterPolicy.candidates`), so the summary and the node's
admission decisions come from one piece of arithmetic. Pure and clock-free: `now` is only stamped on the summary.

Invariants: a summary is a frozen value, built once; `admitting` is exactly "the node's filters and TTFT rule keep
at least one instance for the reference prompt"; the hot set holds at most `max_hot_blocks` hashes, each cached on
the node when the hot set was last rebuilt (every `hot_refresh_every` summaries: it changes slowly), most requested
first (a decayed count over recent prompts, halved at every rebuild, so an old hot prefix cools within a few).
The counts are bounded too: past `max_heat_hashes` counted hashes they are halved (the rebuild's decay) until at
most half remain, so a router whose summaries nobody reads (a node without a cluster picker) does not keep every
prompt block it ever routed.
8,192 hashes of 8 bytes are 64 KiB: about 130k cached prompt tokens, the hot system prompts of a node.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from octoserve.services.core import admission as adm
from octoserve.services.core.kv_cache import prefix_block_hashes
from octoserve.services.core.types import EngineLoad, Priority, RequestSpec, Role, SamplingParams

TIERS = (Priority.INTERACTIVE, Priority.STANDARD, Priority.BATCH)
DECODE_CONTEXT_TOKENS = 1200  # typical decode context for the published step (as the instances' own rate estimate)


@dataclass(frozen=True, slots=True)
class TierHeadroom:
    tier: Priority
    admitting: bool  # the node would admit the model's reference prompt of this tier now
    retry_after_ms: int  # the delay the node would give when it refuses (0 while admitting)
    wait_ms: float  # queue wait before a new prompt of this tier starts its prefill, best instance
    correction_ms: float  # the node's calibrated TTFT margin for this model and tier


@dataclass(frozen=True, slots=True)
class ModelHeadroom:
    model: str
    tiers: tuple[TierHeadroom, ...]  # in TIERS order
    prefill_tokens_per_s: float  # the best instance's rate at full capacity
    kv_free_blocks: int  # the largest free KV of one entry instance (a request lands on one)
    kv_total_blocks: int  # of that instance
    block_size: int
    capacity_fraction: float = 1.0  # share of GPU time the model's instances get (< 1 under a gang lease)
    num_instances: int = 1  # entry instances that can take a request now (what new work spreads over)
    idle_prefill_tokens_per_s: float = 0.0  # a prompt alone in prefill (slack-extended chunks); 0: as loaded
    decode_step_ms: float = 0.0  # full capacity: the decode step one more sequence would see on the least busy
    #                              entry instance (the router's cost model at its running batch + 1; ITL proxy)
    decode_step_per_seq_ms: float = 0.0  # full capacity: what each further sequence adds to that step
    mixed_step_ms: float = 0.0  # full capacity: what a step carrying a prefill chunk is sized to (the ITL SLO on
    #                             colocated instances, whose batchers fill steps up to it; 0: no prefill mixed in)

    def tier(self, tier: Priority) -> TierHeadroom:
        return next(t for t in self.tiers if t.tier == tier)


@dataclass(frozen=True, slots=True)
class HeadroomSummary:
    node_id: str
    healthy: bool
    as_of_s: float  # the node's clock when it was built
    models: tuple[ModelHeadroom, ...]
    hot_prefix_hashes: frozenset[int]  # block hashes the node caches, hottest first when truncated

    def model(self, name: str) -> ModelHeadroom | None:
        return next((m for m in self.models if m.model == name), None)


class HeadroomPublisher:
    """Builds one node's summaries from its router policy; see the module docstring.

    reference_prompt_tokens: model -> the prompt length `admitting` is judged for (the workload's typical prompt).
    """

    def __init__(self, node_id: str, policy, *, reference_prompt_tokens: Mapping[str, int] | None = None,
                 max_hot_blocks: int = 8192, max_prompt_blocks: int = 128, hot_refresh_every: int = 10,
                 max_heat_hashes: int = 4 * 8192) -> None:
        self.node_id = node_id
        self.policy = policy
        self.reference_prompt_tokens = dict(reference_prompt_tokens or {})
        self.max_hot_blocks = max_hot_blocks
        self.max_prompt_blocks = max_prompt_blocks
        self.hot_refresh_every = hot_refresh_every
        self.max_heat_hashes = max_heat_hashes
        self._heat: dict[int, float] = {}  # block hash -> decayed request count
        self._hot: frozenset[int] = frozenset()
        self._num_summaries = 0
        self._block_size = {i.model: i.block_size for i in policy.config.instances}
        policy.observers.append(self.observe_prompt)

    def observe_prompt(self, spec: RequestSpec) -> None:
        """Count the prompt's leading blocks towards the hot set (the router calls it for every request)."""
        block_size = self._block_size.get(spec.model)
        if block_size is None:
            return
        tokens = spec.prompt_token_ids[: self.max_prompt_blocks * block_size]
        for h in prefix_block_hashes(tokens, block_size, spec.model):
            self._heat[h] = self._heat.get(h, 0.0) + 1.0
        if len(self._heat) > self.max_heat_hashes:
            while len(self._heat) > self.max_heat_hashes // 2:
                self._cool()

    def num_heat_hashes(self) -> int:
        """Hashes with a request count (the hot set's candidates): at most `max_heat_hashes` after any prompt."""
        return len(self._heat)

    def _cool(self) -> None:
        self._heat = {h: v / 2.0 for h, v in self._heat.items() if v >= 0.25}

    def summary(self, loads: Mapping[str, EngineLoad], now: float, *, healthy: bool = True,
                capacity_fraction: Mapping[str, float] | None = None) -> HeadroomSummary:
        capacity_fraction = capacity_fraction or {}
        models = tuple(
            self._model(name, loads, capacity_fraction.get(name, 1.0)) for name in sorted(self.policy.config.models)
        )
        # Which prefixes are hot changes slowly: the hot set is rebuilt every `hot_refresh_every` summaries.
        if self._num_summaries % self.hot_refresh_every == 0:
            self._hot = self._hot_hashes()
        self._num_summaries += 1
        return HeadroomSummary(self.node_id, healthy, now, models, self._hot)

    def _model(self, model: str, loads: Mapping[str, EngineLoad], capacity: float) -> ModelHeadroom:
        tiers = []
        rate, free, total, block_size, num, idle_rate, step_ms, per_seq_ms = 0.0, 0, 0, 16, 0, 0.0, 0.0, 0.0
        for tier in TIERS:
            spec = self._reference(model, tier)
            cands = self.policy.candidates(spec, loads)
            kept = [c for c in cands if self.policy.passes_filters(c)]
            slo_ms = self.policy.config.slo.ttft_ms_for_request(spec)
            correction_s = self.policy.ttft_correction_s(model, tier, slo_ms)
            if not kept:
                tiers.append(TierHeadroom(tier, False, adm.retry_after_ms(math.inf, self.policy.config.policies),
                                          math.inf, correction_s * 1000.0))
                continue
            best = min(kept, key=lambda c: (c.predicted_ttft_s, c.instance.id))
            # The gang lease stretches everything on the instance by 1 / capacity.
            predicted_s = best.predicted_ttft_s / capacity
            excess_s = adm.ttft_excess_s(predicted_s, correction_s, slo_ms)
            bound = adm.tier_bound_reached(self.policy.ledger, spec, self.policy.config.policies.tier_queue_bound)
            admitting = excess_s <= 0 and bound is None
            retry = 0 if admitting else adm.retry_after_ms(max(excess_s, 0.0), self.policy.config.policies)
            tiers.append(TierHeadroom(tier, admitting, retry, max(best.wait_s, best.slot_wait_s) * 1000.0,
                                      correction_s * 1000.0))
            if tier is Priority.STANDARD:
                top = max(kept, key=lambda c: (c.headroom_blocks, c.instance.id))
                rate = best.load.prefill_tokens_per_s or spec.num_prompt_tokens / max(best.own_prefill_s, 1e-9)
                free, total, block_size = top.headroom_blocks, top.load.num_total_blocks, top.instance.block_size
                num = len(kept)
                idle_rate = spec.num_prompt_tokens / max(best.own_prefill_s, 1e-9)
                step_ms, per_seq_ms = self._decode_step_ms(kept)
                mixed_ms = max((self.policy.config.slo.itl_ms for c in kept if c.instance.role is Role.COLOCATED),
                               default=0.0)
        return ModelHeadroom(model, tuple(tiers), rate, free, total, block_size, capacity, num, idle_rate, step_ms,
                             per_seq_ms, mixed_ms)

    def _decode_step_ms(self, kept) -> tuple[float, float]:
        """(step with one more sequence, what each further one adds), at full capacity, on the least busy instance.

        Predicted by the router's cost model from the running batch, not the engines' observed step: an observed step
        already carries a gang lease's stretch (the picker divides by `capacity_fraction` itself) and goes stale on
        a node that gets no new work, which would keep a squeezed node out for the rest of its lease once taken out."""
        least = min(kept, key=lambda c: (c.load.num_running, c.instance.id))
        cost = self.policy.cost_model_of(least.instance)
        b = least.load.num_running
        one = cost.decode_step_time_s(b + 1, DECODE_CONTEXT_TOKENS)
        two = cost.decode_step_time_s(b + 2, DECODE_CONTEXT_TOKENS)
        return one * 1000.0, max(0.0, two - one) * 1000.0

    def _reference(self, model: str, tier: Priority) -> RequestSpec:
        n = self.reference_prompt_tokens.get(model, 1024)
        # Token ids no workload uses, so the reference prompt never scores a cache hit.
        return RequestSpec(f"headroom-{model}-{tier.name}", model, (0,) * n, SamplingParams(max_tokens=256), 0.0, tier)

    def _hot_hashes(self) -> frozenset[int]:
        cached = self.policy.prefix_index
        held = {h for h in self._heat if cached.overlap_blocks([h])}
        hot = sorted(held, key=lambda h: (-self._heat[h], h))[: self.max_hot_blocks]
        self._cool()
        return frozenset(hot)


def cached_prefix_tokens(prompt_token_ids: Sequence[int], model: str, block_size: int,
                         hot: frozenset[int]) -> int:
    """Prompt tokens a node's hot set says it caches: the leading blocks found in it, never the whole prompt."""
    n = 0
    for h in prefix_block_hashes(prompt_token_ids, block_size, model):
        if h not in hot:
            break
        n += 1
    return min(n * block_size, (len(prompt_token_ids) - 1) // block_size * block_size)
