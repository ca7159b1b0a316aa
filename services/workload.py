"""Workloads as data, and the seeded trace generator shared by `octoserve simulate` and `octoserve bench`.

A `WorkloadProfile` says what arrives (rate, arrival process, per-model traffic); `generate_trace(profile, seed)`
turns it into a list of `TraceRequest`s that both the simulator and the live harness replay.

Invariants:
- A trace is a pure function of (profile, seed): `random.Random(seed)` is the only source of randomness, and the
  order of draws is fixed. Request ids are "r{index:07d}" in arrival order.
- Every prompt token id lies in [token_id_min, token_id_max) (default [1000, 30000)), so EOS (2) and other special
  ids never appear.
- num_prompt_tokens + max_tokens <= the model's `max_context_len`; 1 <= output_len <= max_tokens.
- max_tokens = min(ceil(max_tokens_factor * output_len), room left in the context), modelling clients that ask for
  far more than they use (seed 000 follow-up 3).
- Prefix sharing is exactly what the profile says: requests of one prefix group start with identical tokens (so
  prefix caching hits), and every prompt then carries a unique "head" of tokens encoding its index, so two
  requests never share more than their group prefix by accident (random slices of one token pool could
  otherwise start at the same offset).

Prefix groups: a fraction `prefix_hit_rate` of a model's requests start with one of its `num_prefix_groups`
system prompts of `prefix_len_tokens` tokens. Group g (0-based) is chosen with weight 1 / (g + 1) ** s, where
s = `prefix_zipf_exponent`: s = 0 is uniform, s = 1 is Zipf-like (a few hot system prompts, a long tail).
The sampled prompt length includes the prefix when it fits; a sampled length shorter than prefix + head grows to
prefix + head + 1 tokens.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import random
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from octoserve.services.core.types import Priority, RequestSpec, SamplingParams
from octoserve.services.metrics import RequestRecord, SloSpec

LENGTH_KINDS = ("fixed", "uniform", "lognormal")
ARRIVAL_PROCESSES = ("poisson", "gamma")


@dataclass(frozen=True, slots=True)
class LengthDist:
    """A token-length distribution, clipped to [min_tokens, max_tokens].

    fixed: always `value`; uniform: integer in [lo, hi]; lognormal: `mean` is the mean of the unclipped
    distribution (not of its log) and `sigma` the std of its log, so mu = ln(mean) - sigma**2 / 2.
    """

    kind: str
    value: int = 0  # fixed
    lo: int = 0  # uniform
    hi: int = 0  # uniform, inclusive
    mean: float = 0.0  # lognormal
    sigma: float = 0.0  # lognormal
    min_tokens: int = 1
    max_tokens: int = 1 << 30

    def __post_init__(self) -> None:
        if self.kind not in LENGTH_KINDS:
            raise ValueError(f"LengthDist kind must be one of {LENGTH_KINDS}, got {self.kind!r}")
        if self.min_tokens < 0 or self.max_tokens < self.min_tokens:
            raise ValueError(f"need 0 <= min_tokens <= max_tokens, got [{self.min_tokens}, {self.max_tokens}]")
        if self.kind == "uniform" and self.hi < self.lo:
            raise ValueError(f"uniform needs lo <= hi, got ({self.lo}, {self.hi})")
        if self.kind == "lognormal" and (self.mean <= 0 or self.sigma < 0):
            raise ValueError(f"lognormal needs mean > 0 and sigma >= 0, got ({self.mean}, {self.sigma})")

    @staticmethod
    def fixed(value: int) -> LengthDist:
        return LengthDist("fixed", value=value, min_tokens=min(1, value))

    @staticmethod
    def uniform(lo: int, hi: int) -> LengthDist:
        return LengthDist("uniform", lo=lo, hi=hi, min_tokens=min(1, lo))

    @staticmethod
    def lognormal(mean: float, sigma: float, min_tokens: int = 1, max_tokens: int = 1 << 30) -> LengthDist:
        return LengthDist("lognormal", mean=mean, sigma=sigma, min_tokens=min_tokens, max_tokens=max_tokens)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            n = self.value
        elif self.kind == "uniform":
            n = rng.randint(self.lo, self.hi)
        else:
            mu = math.log(self.mean) - self.sigma**2 / 2.0
            n = round(rng.lognormvariate(mu, self.sigma))
        return min(max(n, self.min_tokens), self.max_tokens)


@dataclass(frozen=True, slots=True)
class TierShare:
    """One service tier in a model's traffic: its share and an optional TTFT SLO override."""

    priority: Priority
    share: float
    ttft_slo_ms: float | None = None  # None: the profile's SLO


@dataclass(frozen=True, slots=True)
class ModelTraffic:
    model: str
    share: float  # of all requests; shares are normalised over the profile's traffic
    prompt_len: LengthDist
    output_len: LengthDist
    num_prefix_groups: int = 0
    prefix_len_tokens: int = 0
    prefix_hit_rate: float = 0.0  # fraction of this model's requests that start with a group prefix
    prefix_zipf_exponent: float = 0.0  # 0: groups chosen uniformly; 1: Zipf-like (see module doc)
    tiers: tuple[TierShare, ...] = (TierShare(Priority.STANDARD, 1.0),)
    max_context_len: int = 8192  # prompt + max_tokens never exceeds this
    # This model's own SLOs (None: the profile's, or the node config's for the model): TTFT of its tiers without an
    # override, and ITL; they size its instances and judge its requests like the node config's `slo.models`.
    ttft_ms: float | None = None
    itl_ms: float | None = None

    def __post_init__(self) -> None:
        for key in ("ttft_ms", "itl_ms"):
            value = getattr(self, key)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                raise ValueError(f"{self.model}: {key} is {value!r}; set a positive number of milliseconds")
        if self.share < 0 or not 0.0 <= self.prefix_hit_rate <= 1.0:
            raise ValueError(f"{self.model}: share must be >= 0 and prefix_hit_rate in [0, 1]")
        if self.prefix_hit_rate > 0 and (self.num_prefix_groups < 1 or self.prefix_len_tokens < 1):
            raise ValueError(f"{self.model}: prefix_hit_rate > 0 needs num_prefix_groups and prefix_len_tokens >= 1")
        if not self.tiers or sum(t.share for t in self.tiers) <= 0:
            raise ValueError(f"{self.model}: tiers must have a positive total share")
        if self.prefix_len_tokens + 8 >= self.max_context_len:
            raise ValueError(f"{self.model}: prefix_len_tokens must leave room in max_context_len")


@dataclass(frozen=True, slots=True)
class WorkloadProfile:
    name: str
    rate_rps: float
    duration_s: float
    traffic: tuple[ModelTraffic, ...]
    arrival: str = "poisson"  # or "gamma"
    burstiness: float = 1.0  # gamma shape, as in `vllm bench serve`: < 1 burstier than Poisson, 1 == Poisson
    max_tokens_factor: float = 4.0
    token_id_min: int = 1000
    token_id_max: int = 30000  # exclusive
    slo: SloSpec = SloSpec()

    def __post_init__(self) -> None:
        if self.rate_rps <= 0 or self.duration_s <= 0:
            raise ValueError(f"rate_rps and duration_s must be > 0, got {self.rate_rps}, {self.duration_s}")
        if self.arrival not in ARRIVAL_PROCESSES:
            raise ValueError(f"arrival must be one of {ARRIVAL_PROCESSES}, got {self.arrival!r}")
        if self.burstiness <= 0 or self.max_tokens_factor < 1.0:
            raise ValueError("burstiness must be > 0 and max_tokens_factor >= 1")
        if not self.traffic or sum(t.share for t in self.traffic) <= 0:
            raise ValueError("traffic must have a positive total share")
        if not 0 <= self.token_id_min < self.token_id_max - 1:
            raise ValueError(f"need 0 <= token_id_min < token_id_max - 1, got {self.token_id_min}, {self.token_id_max}")

    def model_traffic(self, model: str) -> ModelTraffic:
        for t in self.traffic:
            if t.model == model:
                return t
        raise KeyError(model)


def scaled(
    profile: WorkloadProfile,
    *,
    rate_rps: float | None = None,
    duration_s: float | None = None,
    burstiness: float | None = None,
) -> WorkloadProfile:
    """The same workload at another rate / length / burstiness (burstiness set => gamma arrivals)."""
    changes: dict = {}
    if rate_rps is not None:
        changes["rate_rps"] = rate_rps
    if duration_s is not None:
        changes["duration_s"] = duration_s
    if burstiness is not None:
        changes.update(burstiness=burstiness, arrival="gamma")
    return dataclasses.replace(profile, **changes)


def with_context_limits(profile: WorkloadProfile, max_context_len: dict[str, int]) -> WorkloadProfile:
    """Apply the serving models' context windows (model name -> tokens) to the profile's traffic."""
    traffic = tuple(
        dataclasses.replace(t, max_context_len=max_context_len.get(t.model, t.max_context_len)) for t in profile.traffic
    )
    return dataclasses.replace(profile, traffic=traffic)


# --- the seed workloads -------------------------------------------------------------------------------------

_SEED_000 = WorkloadProfile(
    # Seed 000 at peak: 300 req/s, 75 % 8B / 25 % 70B, prompts ~1,000 tokens, outputs ~400, clients asking for
    # max_tokens = 4x what they use; light reuse (10 % of prompts start with one of 4 system prompts).
    name="seed-000",
    rate_rps=300.0,
    duration_s=60.0,
    traffic=tuple(
        ModelTraffic(
            model=model,
            share=share,
            prompt_len=LengthDist.lognormal(1000.0, 0.8, min_tokens=8, max_tokens=7000),
            output_len=LengthDist.lognormal(400.0, 0.8, min_tokens=1, max_tokens=4000),
            num_prefix_groups=4,
            prefix_len_tokens=256,
            prefix_hit_rate=0.10,
            max_context_len=8192,  # Llama-3 shape
        )
        for model, share in (("llama-3-8b", 0.75), ("llama-3-70b", 0.25))
    ),
    max_tokens_factor=4.0,
)

# Seed 003's peak is "~1,500 SM req/s or ~100 LM req/s". As a mix, with 90 % SM / 10 % LM, a rate r uses
# r * (0.9 / 1500 + 0.1 / 100) = r * 0.0016 of the node's stated peak, so r = 625 req/s is exactly one peak's
# worth: 562.5 SM req/s (37.5 % of the SM peak) plus 62.5 LM req/s (62.5 % of the LM peak).
_SEED_003_TIERS = (
    TierShare(Priority.INTERACTIVE, 0.7, ttft_slo_ms=200.0),  # the latency tier: TTFT <= 200 ms
    TierShare(Priority.BATCH, 0.3, ttft_slo_ms=10_000.0),  # background / throughput queries
)
_SEED_003 = WorkloadProfile(
    # Long-tailed prompts up to 32,000 tokens in a 32,768-token context; ~80 % of prompts start with one of 16
    # system prompts per model (Zipf-chosen: a few hot prefixes), which is what makes this rate plausible.
    name="seed-003",
    rate_rps=625.0,
    duration_s=60.0,
    traffic=tuple(
        ModelTraffic(
            model=model,
            share=share,
            prompt_len=LengthDist.lognormal(2000.0, 1.2, min_tokens=16, max_tokens=32_000),
            output_len=LengthDist.lognormal(300.0, 1.0, min_tokens=1, max_tokens=4000),
            num_prefix_groups=16,
            prefix_len_tokens=1024,
            prefix_hit_rate=0.80,
            prefix_zipf_exponent=1.0,
            tiers=_SEED_003_TIERS,
            max_context_len=32_768,
        )
        for model, share in (("llama-3-8b", 0.9), ("llama-3-70b", 0.1))
    ),
    max_tokens_factor=4.0,
    slo=SloSpec(ttft_ms=200.0, itl_ms=30.0),
)

PROFILES: dict[str, WorkloadProfile] = {p.name: p for p in (_SEED_000, _SEED_003)}


# --- traces ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, init=False)  # __init__ written out: see core/types.py
class TraceRequest:
    request_id: str
    arrival_s: float  # offset from the start of the run
    model: str
    prompt_token_ids: tuple[int, ...]
    output_len: int  # true length: the "model" emits EOS after this many tokens
    max_tokens: int
    priority: Priority
    ttft_slo_ms: float  # the effective TTFT SLO (tier override or the profile's)
    prefix_group: int = -1  # -1: no shared prefix
    prompt_text: str | None = None  # a user trace's text prompt: `bench` sends it as text (ids: one per byte)

    def __init__(
        self,
        request_id: str,
        arrival_s: float,
        model: str,
        prompt_token_ids: tuple[int, ...],
        output_len: int,
        max_tokens: int,
        priority: Priority,
        ttft_slo_ms: float,
        prefix_group: int = -1,
        prompt_text: str | None = None,
    ) -> None:
        object.__setattr__(self, "request_id", request_id)
        object.__setattr__(self, "arrival_s", arrival_s)
        object.__setattr__(self, "model", model)
        object.__setattr__(self, "prompt_token_ids", prompt_token_ids)
        object.__setattr__(self, "output_len", output_len)
        object.__setattr__(self, "max_tokens", max_tokens)
        object.__setattr__(self, "priority", priority)
        object.__setattr__(self, "ttft_slo_ms", ttft_slo_ms)
        object.__setattr__(self, "prefix_group", prefix_group)
        object.__setattr__(self, "prompt_text", prompt_text)

    def to_request_spec(self, arrival_s: float | None = None) -> RequestSpec:
        """The engine-facing request; `arrival_s` replaces the trace offset with the caller's clock."""
        return RequestSpec(
            request_id=self.request_id,
            model=self.model,
            prompt_token_ids=self.prompt_token_ids,
            sampling=SamplingParams(max_tokens=self.max_tokens),
            arrival_s=self.arrival_s if arrival_s is None else arrival_s,
            priority=self.priority,
            ttft_slo_ms=self.ttft_slo_ms,
            sim_output_len=self.output_len,
        )

    def record(self, **fields) -> RequestRecord:
        """A metrics record for this request with its identity filled in; `fields` gives the outcome."""
        base = dict(
            request_id=self.request_id,
            model=self.model,
            priority=self.priority,
            arrival_s=self.arrival_s,
            ttft_slo_ms=self.ttft_slo_ms,
            num_prompt_tokens=len(self.prompt_token_ids),
        )
        return RequestRecord(**{**base, **fields})


@dataclass(frozen=True, slots=True, init=False)  # __init__ written out: see core/types.py
class _Draw:
    """Everything random about one request except its tokens (drawn first, so the token pool can be sized)."""

    arrival_s: float
    traffic: ModelTraffic
    prompt_len: int
    output_len: int
    tier: TierShare
    prefix_group: int

    def __init__(
        self,
        arrival_s: float,
        traffic: ModelTraffic,
        prompt_len: int,
        output_len: int,
        tier: TierShare,
        prefix_group: int,
    ) -> None:
        object.__setattr__(self, "arrival_s", arrival_s)
        object.__setattr__(self, "traffic", traffic)
        object.__setattr__(self, "prompt_len", prompt_len)
        object.__setattr__(self, "output_len", output_len)
        object.__setattr__(self, "tier", tier)
        object.__setattr__(self, "prefix_group", prefix_group)


def _arrival_times(profile: WorkloadProfile, duration_s: float, rate_rps: float, rng: random.Random) -> list[float]:
    if profile.arrival == "poisson":
        gap = lambda: rng.expovariate(rate_rps)  # noqa: E731
    else:  # gamma with mean 1/rate: shape k, scale 1/(rate k); CV = 1/sqrt(k)
        k = profile.burstiness
        gap = lambda: rng.gammavariate(k, 1.0 / (rate_rps * k))  # noqa: E731
    times: list[float] = []
    t = gap()
    while t < duration_s:
        times.append(t)
        t += gap()
    return times


def _pick(rng: random.Random, cum_weights: Sequence[float], items: Sequence):
    return items[min(_bisect(cum_weights, rng.random() * cum_weights[-1]), len(items) - 1)]


def _bisect(cum: Sequence[float], x: float) -> int:
    lo, hi = 0, len(cum)
    while lo < hi:
        mid = (lo + hi) // 2
        if cum[mid] <= x:
            lo = mid + 1
        else:
            hi = mid
    return lo


@functools.lru_cache(maxsize=64)
def _tier_cum(traffic: ModelTraffic) -> tuple[float, ...]:
    return tuple(itertools.accumulate(x.share for x in traffic.tiers))


@functools.lru_cache(maxsize=64)
def _group_cum(traffic: ModelTraffic) -> tuple[float, ...]:
    weights = (1.0 / (g + 1) ** traffic.prefix_zipf_exponent for g in range(traffic.num_prefix_groups))
    return tuple(itertools.accumulate(weights))


def _draw_one(t: float, traffic_cum: Sequence[float], profile: WorkloadProfile, rng: random.Random,
              cums: Sequence[tuple[tuple[float, ...], tuple[float, ...]]] | None = None) -> _Draw:
    """`cums`: (`_tier_cum`, `_group_cum`) of each of the profile's traffics, in order (looked up once per trace
    rather than hashing the traffic's dataclass at every draw); None looks them up."""
    index = min(_bisect(traffic_cum, rng.random() * traffic_cum[-1]), len(profile.traffic) - 1)  # as `_pick`
    traffic = profile.traffic[index]
    prompt_len = traffic.prompt_len.sample(rng)
    output_len = traffic.output_len.sample(rng)
    tier_cum, group_cum = (_tier_cum(traffic), _group_cum(traffic)) if cums is None else cums[index]
    tier = _pick(rng, tier_cum, traffic.tiers)
    group = -1
    if traffic.prefix_hit_rate > 0 and rng.random() < traffic.prefix_hit_rate:
        group = _pick(rng, group_cum, range(traffic.num_prefix_groups))
    return _Draw(t, traffic, prompt_len, output_len, tier, group)


def _head_tokens(index: int, num_digits: int, lo: int, base: int) -> tuple[int, ...]:
    """The request index in base `base`, as token ids: unique per request, so no accidental shared prefix."""
    digits = []
    for _ in range(num_digits):
        index, d = divmod(index, base)
        digits.append(lo + d)
    return tuple(digits)


def _group_prefixes(profile: WorkloadProfile, rng: random.Random) -> dict[tuple[str, int], tuple[int, ...]]:
    lo, hi = profile.token_id_min, profile.token_id_max
    return {
        (t.model, g): tuple(rng.choices(range(lo, hi), k=t.prefix_len_tokens))
        for t in profile.traffic
        for g in range(t.num_prefix_groups if t.prefix_hit_rate > 0 else 0)
    }


def _lengths(d: _Draw, head_len: int, factor: float) -> tuple[int, int, int]:
    """(prompt tail length after prefix + head, output_len, max_tokens) within the model's context."""
    ctx = d.traffic.max_context_len
    prefix = d.traffic.prefix_len_tokens if d.prefix_group >= 0 else 0
    prompt = min(max(d.prompt_len, prefix + head_len + 1), ctx - 1)
    tail = max(0, prompt - prefix - head_len)
    prompt = prefix + head_len + tail
    output = max(1, min(d.output_len, ctx - prompt))
    max_tokens = min(math.ceil(factor * output), ctx - prompt)
    return tail, output, max_tokens


def iter_trace(
    profile: WorkloadProfile,
    seed: int | random.Random,
    *,
    rate_rps: float | None = None,
    duration_s: float | None = None,
) -> Iterator[TraceRequest]:
    """The requests of one run, in arrival order, built lazily: a long seed-003 trace holds ~1 GB of token tuples,
    so a consumer that replays as it goes can avoid holding them all. Same requests as `generate_trace`."""
    rng = seed if isinstance(seed, random.Random) else random.Random(seed)
    rate = profile.rate_rps if rate_rps is None else rate_rps
    duration = profile.duration_s if duration_s is None else duration_s
    traffic_cum = list(itertools.accumulate(t.share for t in profile.traffic))
    cums = [(_tier_cum(t), _group_cum(t)) for t in profile.traffic]
    draws = [_draw_one(t, traffic_cum, profile, rng, cums) for t in _arrival_times(profile, duration, rate, rng)]
    prefixes = _group_prefixes(profile, rng)
    lo, base = profile.token_id_min, profile.token_id_max - profile.token_id_min
    head_len = max(1, math.ceil(math.log(max(len(draws), 2)) / math.log(base)))
    # Prompt tails are slices of one random pool at random offsets: O(1) Python work per request, not per token.
    max_tail = max((d.traffic.max_context_len for d in draws), default=1)
    pool = tuple(rng.choices(range(lo, profile.token_id_max), k=max_tail + 4096))
    for i, d in enumerate(draws):
        tail, output, max_tokens = _lengths(d, head_len, profile.max_tokens_factor)
        start = rng.randrange(len(pool) - tail + 1)
        prefix = prefixes[(d.traffic.model, d.prefix_group)] if d.prefix_group >= 0 else ()
        tokens = prefix + _head_tokens(i, head_len, lo, base) + pool[start : start + tail]
        slo_ms = d.tier.ttft_slo_ms if d.tier.ttft_slo_ms is not None else (
            d.traffic.ttft_ms if d.traffic.ttft_ms is not None else profile.slo.ttft_ms_for(d.traffic.model))
        yield TraceRequest(
            f"r{i:07d}", d.arrival_s, d.traffic.model, tokens, output, max_tokens, d.tier.priority, slo_ms,
            d.prefix_group,
        )


def generate_trace(
    profile: WorkloadProfile,
    seed: int | random.Random,
    *,
    rate_rps: float | None = None,
    duration_s: float | None = None,
) -> list[TraceRequest]:
    """The requests of one run, in arrival order; deterministic for (profile, seed, rate_rps, duration_s)."""
    return list(iter_trace(profile, seed, rate_rps=rate_rps, duration_s=duration_s))


def trace_to_jsonl(trace: Iterable[TraceRequest], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for r in trace:
            # not dataclasses.asdict: it deep-copies every token tuple
            row = {f.name: getattr(r, f.name) for f in dataclasses.fields(r)}
            row["priority"] = r.priority.name
            row["prompt_token_ids"] = list(r.prompt_token_ids)
            f.write(json.dumps(row, separators=(",", ":")) + "\n")


def trace_from_jsonl(path: str | Path) -> list[TraceRequest]:
    trace = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            row["priority"] = Priority[row["priority"]]
            row["prompt_token_ids"] = tuple(row["prompt_token_ids"])
            trace.append(TraceRequest(**row))
    return trace
