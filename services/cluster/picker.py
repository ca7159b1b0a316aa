"""The cluster picker: which node serves a request, from the nodes' headroom summaries (filter -> scorers -> pick).

The same shape and the same pieces as the node router (services/core/routing.py): a candidate per node, named
filters, scorers that are pure functions returning [0, 1] (0 best) weighted from configuration, and
`routing.pick` (lowest cost, seeded tie-break). Pure and clock-free: `now` is an argument (summary age only).

pick(spec, now):
1. candidates = nodes whose latest summary serves the model.
2. filters (`ClusterPolicy.filters`): "healthy" (the node says so and its summary is at most `max_summary_age_s`
   old), "kv_headroom" (prompt + reservation fits the node's largest free KV, less what was sent since),
   "itl" (on a node whose gang lease leaves the model a fraction f of GPU time, the decode step this request
   would see there, at full capacity from the summary plus the requests sent since, / f within the ITL SLO), "ttft" (predicted TTFT + the node's calibrated margin within the request's SLO).
3. predicted TTFT on node n = (queue + uncached prompt / rate) / capacity_fraction, with queue = tier wait +
   prefill tokens sent to n since its summary / (rate x its instances), less what drained over the summary's age
   (age x capacity_fraction; never below 0), and the idle rate instead of the loaded
   one when the queue is empty (the node router's own rule), where the uncached prompt counts the leading blocks found in n's
   hot prefix hashes as cached. A gang lease that leaves the SM instances a fraction f of GPU time stretches every
   SM prefill on that node by 1 / f, so SM work spills to nodes with headroom without any special case.
4. scorers: "ttft" (relative to the slowest candidate), "prefix" (uncached share of the prompt: locality keeps
   hot prefixes where they are cached), "kv_headroom" (KV use after taking it); the cost is their weighted sum.
5. fallbacks: the next-best kept nodes, cheapest first, up to `max_node_tries` - 1 of them. The picker predicts
   from summaries up to one publication old; the node's own admission sees its exact queue, and may refuse what the
   prediction let through while another node had room. The caller then tries the fallbacks in order (the cluster
   simulator; the lookaside client; a gateway behind the endpoint picker, which gets them as the comma-separated
   endpoint list of the Gateway API Inference Extension's protocol and goes down it on retry). Without them a node's
   refusal was final, and the picker trailed independent nodes behind round-robin on uniform load (BENCHMARKS.md,
   "Cluster tier").
6. none left -> ClusterRefuse: RESOURCE_EXHAUSTED with the soonest retry delay across the nodes that serve the
   model (each node's own retry delay for the tier, or the time until its prediction would fit).
`spilled` on a pick: the node the picker would have chosen with every capacity_fraction at 1 is squeezed, and
the pick went elsewhere (the cross-node spill count of the benchmarks).

`RoundRobinPicker` is the baseline: healthy nodes in turn, blind to load, cache and admission.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from octoserve.services.cluster.headroom import HeadroomSummary, ModelHeadroom, TierHeadroom, cached_prefix_tokens
from octoserve.services.core import admission as adm
from octoserve.services.core.placement import PolicyConfig
from octoserve.services.core.registry import Registry
from octoserve.services.core.routing import pick
from octoserve.services.core.types import Priority, RequestSpec


@dataclass(frozen=True, slots=True)
class ClusterPolicy:
    filters: tuple[str, ...] = ("healthy", "kv_headroom", "itl", "ttft")
    scorer_weights: Mapping[str, float] = field(default_factory=lambda: {"ttft": 1.0, "prefix": 0.3, "kv_headroom": 0.1})
    max_summary_age_s: float = 2.0  # a node silent for longer is treated as gone
    tier_ttft_ms: Mapping[Priority, float] = field(default_factory=lambda: {
        Priority.INTERACTIVE: 200.0, Priority.STANDARD: 250.0, Priority.BATCH: 10_000.0})
    min_retry_after_ms: int = 50
    reservation_tokens: int = 512  # output tokens a request reserves in KV (as the nodes' predicted reservation)
    itl_ms: float = 30.0  # the nodes' ITL SLO
    max_node_tries: int = 4  # nodes a request may be offered to: the pick and up to this - 1 fallbacks

    def __post_init__(self) -> None:
        if self.max_node_tries < 1:
            raise ValueError(f"max_node_tries must be >= 1 (the pick itself), got {self.max_node_tries}")


@dataclass(frozen=True, slots=True)
class NodeCandidate:
    node_id: str
    summary: HeadroomSummary
    model: ModelHeadroom
    tier: TierHeadroom
    cached_tokens: int  # prompt tokens the node's hot hashes say it caches
    required_blocks: int
    pending_blocks: int  # KV sent since the summary
    pending_requests: int  # requests sent since the summary
    predicted_ttft_s: float  # with the capacity fraction applied
    unsqueezed_ttft_s: float  # as if the node had its full capacity
    slo_ms: float
    age_s: float
    num_prompt_tokens: int

    @property
    def excess_s(self) -> float:
        return adm.ttft_excess_s(self.predicted_ttft_s, self.tier.correction_ms / 1000.0, self.slo_ms)


@dataclass(frozen=True, slots=True)
class NodePick:
    node_id: str
    predicted_ttft_ms: float
    expected_cached_tokens: int
    spilled: bool  # moved off a squeezed node it would otherwise have gone to
    fallbacks: tuple[NodePick, ...] = ()  # the next-best nodes, to try in order when this one refuses


@dataclass(frozen=True, slots=True)
class ClusterRefuse:
    retry_after_ms: int  # the soonest retry delay across the nodes
    reason: str
    no_node: bool = False  # no healthy node serves the model at all (unavailable, not overloaded)


NodeFilter = Callable[[NodeCandidate, ClusterPolicy], bool]
NodeScorer = Callable[[Sequence[NodeCandidate]], dict[str, float]]
NODE_FILTERS: Registry[NodeFilter] = Registry("cluster filter")
NODE_SCORERS: Registry[NodeScorer] = Registry("cluster scorer")


@NODE_FILTERS.register("healthy")
def filter_healthy(c: NodeCandidate, policy: ClusterPolicy) -> bool:
    return c.summary.healthy and c.age_s <= policy.max_summary_age_s


@NODE_FILTERS.register("kv_headroom")
def filter_kv_headroom(c: NodeCandidate, policy: ClusterPolicy) -> bool:
    return c.required_blocks + c.pending_blocks <= c.model.kv_free_blocks


@NODE_FILTERS.register("itl")
def filter_itl(c: NodeCandidate, policy: ClusterPolicy) -> bool:
    # A gang lease stretches every decode step of the squeezed instances by 1 / capacity: once that passes the ITL
    # SLO, every request decoding there misses it, however soon its first token comes. The step is the longer of
    # the decode step this request would see (the summary's next-sequence step plus what the requests sent since
    # add, spread over the model's instances) and the step a prefill chunk is mixed into, which colocated batchers
    # size to the full ITL SLO: under any lease those pass the SLO, so a squeezed colocated node is out for new
    # streams until the lease ends (BENCHMARKS.md, "Cluster tier": what a squeezed node's new streams then get).
    if c.model.capacity_fraction >= 1.0:
        return True
    extra = c.pending_requests / max(1, c.model.num_instances) * c.model.decode_step_per_seq_ms
    step_ms = max(c.model.decode_step_ms + extra, c.model.mixed_step_ms)
    return step_ms / max(c.model.capacity_fraction, 1e-6) <= policy.itl_ms


@NODE_FILTERS.register("ttft")
def filter_ttft(c: NodeCandidate, policy: ClusterPolicy) -> bool:
    # A node that refuses the tier's reference prompt can still take a shorter (or better cached) one when its
    # refusal is about the TTFT rule; the excess test below is that rule for this very prompt.
    return c.excess_s <= 0


def _relative(values: Mapping[str, float]) -> dict[str, float]:
    top = max(values.values(), default=0.0)
    return {k: (v / top if top > 0 else 0.0) for k, v in values.items()}


@NODE_SCORERS.register("ttft")
def score_ttft(cands: Sequence[NodeCandidate]) -> dict[str, float]:
    return _relative({c.node_id: c.predicted_ttft_s for c in cands})


@NODE_SCORERS.register("prefix")
def score_prefix(cands: Sequence[NodeCandidate]) -> dict[str, float]:
    return {c.node_id: 1.0 - c.cached_tokens / max(1, c.num_prompt_tokens) for c in cands}


@NODE_SCORERS.register("kv_headroom")
def score_kv_headroom(cands: Sequence[NodeCandidate]) -> dict[str, float]:
    out = {}
    for c in cands:
        left = c.model.kv_free_blocks - c.pending_blocks - c.required_blocks
        out[c.node_id] = 1.0 if c.model.kv_total_blocks <= 0 else min(1.0, max(0.0, 1.0 - left / c.model.kv_total_blocks))
    return out


class ClusterPicker:
    """Chooses a node per request; see the module docstring. `rng` is seeded by the caller."""

    def __init__(self, policy: ClusterPolicy, rng: Any) -> None:
        self.policy = policy
        self.rng = rng
        self.summaries: dict[str, HeadroomSummary] = {}
        self._filters = [NODE_FILTERS.get(n) for n in policy.filters]
        self._scorers = [(NODE_SCORERS.get(n), w) for n, w in sorted(policy.scorer_weights.items()) if w > 0]
        self._pending_tokens: dict[tuple[str, str], float] = {}  # (node, model) -> prefill tokens since its summary
        self._pending_blocks: dict[tuple[str, str], int] = {}
        self._pending_requests: dict[tuple[str, str], int] = {}
        self.num_spilled = 0
        self.num_refused = 0

    def on_summary(self, summary: HeadroomSummary) -> None:
        """A node published: its summary replaces the last one, and what was sent before it is now counted in it."""
        self.summaries[summary.node_id] = summary
        for key in [k for k in self._pending_tokens if k[0] == summary.node_id]:
            del self._pending_tokens[key]
            self._pending_blocks.pop(key, None)
            self._pending_requests.pop(key, None)

    def forget(self, node_id: str) -> None:
        """The node is gone (its connection failed): stop picking it until it publishes again."""
        self.summaries.pop(node_id, None)

    def on_dispatched(self, node_id: str, spec: RequestSpec, chosen: NodePick) -> None:
        key = (node_id, spec.model)
        self._pending_tokens[key] = self._pending_tokens.get(key, 0.0) + spec.num_prompt_tokens - chosen.expected_cached_tokens
        model = self.summaries[node_id].model(spec.model)
        self._pending_blocks[key] = self._pending_blocks.get(key, 0) + self._blocks(spec, model)
        self._pending_requests[key] = self._pending_requests.get(key, 0) + 1

    def _blocks(self, spec: RequestSpec, model: ModelHeadroom) -> int:
        reserve = min(spec.max_tokens, self.policy.reservation_tokens)
        return adm.blocks_for(spec.num_prompt_tokens + reserve, model.block_size)

    def candidates(self, spec: RequestSpec, now: float, among: Collection[str] | None = None) -> list[NodeCandidate]:
        slo_ms = spec.ttft_slo_ms if spec.ttft_slo_ms is not None else self.policy.tier_ttft_ms[spec.priority]
        out = []
        for node_id in sorted(self.summaries if among is None else set(self.summaries) & set(among)):
            summary = self.summaries[node_id]
            model = summary.model(spec.model)
            if model is None:
                continue
            tier = model.tier(spec.priority)
            cached = cached_prefix_tokens(spec.prompt_token_ids, spec.model, model.block_size,
                                          summary.hot_prefix_hashes)
            rate = model.prefill_tokens_per_s
            pending = self._pending_tokens.get((node_id, spec.model), 0.0)
            # Work sent since the summary spreads over the model's instances on the node; this prompt runs on one.
            spread = max(1, model.num_instances)
            queue_s = tier.wait_ms / 1000.0 + (pending / (rate * spread) if rate > 0 else math.inf)
            # The node kept prefilling since it wrote the summary: what it had queued then, and what was sent since,
            # has drained by the summary's age (at the GPU share its lease leaves it). Without this the queue is
            # counted twice at the end of every publication interval, and the picker refuses work the node would
            # take.
            age_s = max(0.0, now - summary.as_of_s)
            queue_s = max(0.0, queue_s - age_s * min(1.0, model.capacity_fraction))
            # As the node predicts it: a prompt with nothing ahead prefills at the idle rate, behind a queue at the
            # rate the running decodes leave.
            own_rate = model.idle_prefill_tokens_per_s if queue_s == 0 and model.idle_prefill_tokens_per_s > 0 else rate
            full_s = queue_s + (spec.num_prompt_tokens - cached) / own_rate if own_rate > 0 else math.inf
            capacity = max(model.capacity_fraction, 1e-6)
            out.append(NodeCandidate(
                node_id=node_id, summary=summary, model=model, tier=tier, cached_tokens=cached,
                required_blocks=self._blocks(spec, model),
                pending_blocks=self._pending_blocks.get((node_id, spec.model), 0),
                pending_requests=self._pending_requests.get((node_id, spec.model), 0),
                predicted_ttft_s=full_s / capacity, unsqueezed_ttft_s=full_s, slo_ms=slo_ms,
                age_s=now - summary.as_of_s, num_prompt_tokens=spec.num_prompt_tokens,
            ))
        return out

    def pick(self, spec: RequestSpec, now: float, among: Collection[str] | None = None) -> NodePick | ClusterRefuse:
        """The node for `spec`, or the refusal; `among` restricts the choice to those node ids (a gateway's subset)."""
        cands = self.candidates(spec, now, among)
        kept = [c for c in cands if all(f(c, self.policy) for f in self._filters)]
        if not kept:
            self.num_refused += 1
            return self._refuse(spec, cands)
        costs = {c.node_id: 0.0 for c in kept}
        for scorer, weight in self._scorers:
            for node_id, s in scorer(kept).items():
                costs[node_id] += weight * s
        chosen_id = pick(costs, self.rng)
        chosen = next(c for c in kept if c.node_id == chosen_id)
        spilled = self._spilled(cands, chosen)
        self.num_spilled += spilled
        rest = sorted((c for c in kept if c.node_id != chosen_id), key=lambda c: (round(costs[c.node_id], 12), c.node_id))
        fallbacks = tuple(NodePick(c.node_id, round(c.predicted_ttft_s * 1000.0, 3), c.cached_tokens, spilled)
                          for c in rest[: self.policy.max_node_tries - 1])
        return NodePick(chosen.node_id, round(chosen.predicted_ttft_s * 1000.0, 3), chosen.cached_tokens, spilled,
                        fallbacks)

    def _spilled(self, cands: Sequence[NodeCandidate], chosen: NodeCandidate) -> bool:
        if all(c.model.capacity_fraction >= 1.0 for c in cands):
            return False
        live = [c for c in cands if filter_healthy(c, self.policy) and filter_kv_headroom(c, self.policy)]
        home = min(live, key=lambda c: (c.unsqueezed_ttft_s, c.node_id))
        return home.model.capacity_fraction < 1.0 and home.node_id != chosen.node_id

    def _refuse(self, spec: RequestSpec, cands: Sequence[NodeCandidate]) -> ClusterRefuse:
        live = [c for c in cands if filter_healthy(c, self.policy)]
        if not live:
            return ClusterRefuse(self.policy.min_retry_after_ms * 20, f"no healthy node serves {spec.model}", True)
        retries = []
        for c in live:
            if not c.tier.admitting and c.tier.retry_after_ms > 0:
                retries.append(c.tier.retry_after_ms)
            else:
                retries.append(max(self.policy.min_retry_after_ms, math.ceil(max(c.excess_s, 0.0) * 1000.0 - 1e-9)))
        return ClusterRefuse(min(retries), f"every node refuses {spec.model} {spec.priority.name} now")


class RoundRobinPicker:
    """The baseline: healthy nodes in turn (id order), whatever their load, cache or admission state."""

    def __init__(self, node_ids: Sequence[str]) -> None:
        self.node_ids = sorted(node_ids)
        self.down: set[str] = set()
        self._turn = 0
        self.num_spilled = 0
        self.num_refused = 0

    def pick(self, spec: RequestSpec, now: float) -> NodePick | ClusterRefuse:
        for k in range(len(self.node_ids)):
            node_id = self.node_ids[(self._turn + k) % len(self.node_ids)]
            if node_id not in self.down:
                self._turn = (self._turn + k + 1) % len(self.node_ids)
                return NodePick(node_id, 0.0, 0, False)
        self.num_refused += 1
        return ClusterRefuse(1000, "no healthy node")

    def on_summary(self, summary: HeadroomSummary) -> None:
        (self.down.discard if summary.healthy else self.down.add)(summary.node_id)

    def on_dispatched(self, node_id: str, spec: RequestSpec, chosen: NodePick) -> None:
        pass

    def forget(self, node_id: str) -> None:
        self.down.add(node_id)


def policy_from_node(policies: PolicyConfig, tier_ttft_ms: Mapping[Priority, float], itl_ms: float = 30.0,
                     **overrides: Any) -> ClusterPolicy:
    """Cluster policy with the nodes' own retry floor, reservation and SLOs (`overrides`: other ClusterPolicy fields)."""
    return ClusterPolicy(tier_ttft_ms=dict(tier_ttft_ms), min_retry_after_ms=policies.min_retry_after_ms,
                         reservation_tokens=policies.predicted_output_tokens, itl_ms=itl_ms, **overrides)
