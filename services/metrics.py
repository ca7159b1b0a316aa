"""SLO metrics shared by `octoserve simulate` (virtual clock) and `octoserve bench` (live clock).

Definitions follow `vllm bench serve`, so numbers compare directly:
- TTFT = first token time − arrival. E2E = finish − arrival (finish falls back to the last token's time).
- TPOT = (E2E − TTFT) / (output tokens − 1); undefined (skipped) for requests with fewer than 2 output tokens.
- ITL = every gap between consecutive token deliveries of one stream, pooled across all requests. When a
  message carries k tokens (k equal times in `token_times_s`), its gap from the previous message is split evenly
  into k gaps of gap/k, so a client batching tokens is not charged one long stall. Extra tokens delivered together
  with the first token add no ITL samples: they were waited for inside the TTFT.
- Percentiles are numpy's linear interpolation (what vLLM uses); latencies are reported in milliseconds.
- Goodput (DistServe definition): a request is *good* when it was admitted, finished without error, and met
  TTFT ≤ its TTFT SLO (its own `ttft_slo_ms`, else `SloSpec.ttft_ms`) and TPOT ≤ `SloSpec.itl_ms`. goodput_rps =
  good requests / duration. The pooled ITL P95 is reported next to it, since the seed's SLO is stated on ITL.
- Attainment "of admitted" = good / admitted; "of offered" = good / offered, where a refused request is a miss.
- Latency distributions cover completed requests only: admitted, no error, a first token seen.
- Fleet SLO (the seed's literal one), per group: TTFT P95 < its SLO over *admitted* requests, an admitted request
  that never produced a first token counting as an infinite TTFT; requests with different TTFT SLOs (tiers) are
  compared tier by tier and the group passes only if every tier passes. And ITL P95 < `SloSpec.itl_ms` over every
  token streamed to an admitted request (errors and cut-off streams included). Both comparisons are strict (<),
  as the seed states them; a group that admitted nothing fails. `passes_capacity` combines it with goodput.

Steady state (a run's first seconds are a transient: the running batch is still filling):
- A run is measured over a `Window`: arrivals in [warm-up end, arrival window end]. Requests that arrived during
  the warm-up are left out of every metric; throughputs and goodput divide by the window's length, not the run's.
- `detect_window` finds the warm-up on the run's occupancy series (requests admitted and not yet finished,
  sampled each second) with MSER-5 (`mser_truncation`), never shorter than a floor, and states how it was chosen;
  it also says whether occupancy still grows over the window (`steady`), i.e. whether the window is too short.

Invariants: records are seconds on one clock (the live harness divides by its time scale first); nothing here
reads a clock or mutates a record; empty groups report NaN latencies (None in `summary_to_dict`, as is an
infinite P95).

Why one module past 600 lines: every measured figure and its definition, shared by the simulator and the live node.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from octoserve.services.core.types import Priority


@dataclass(frozen=True, slots=True)
class SloSpec:
    ttft_ms: float = 250.0  # default TTFT SLO; a request's own ttft_slo_ms overrides it
    itl_ms: float = 30.0  # applied to TPOT for goodput (DistServe) and shown against pooled ITL P95
    # Per-model SLOs where a model has its own: ((model, ms), ...), sorted (a tuple: the spec stays hashable).
    model_ttft_ms: tuple[tuple[str, float], ...] = ()
    model_itl_ms: tuple[tuple[str, float], ...] = ()

    def ttft_ms_for(self, model: str) -> float:
        return next((ms for m, ms in self.model_ttft_ms if m == model), self.ttft_ms)

    def itl_ms_for(self, model: str) -> float:
        return next((ms for m, ms in self.model_itl_ms if m == model), self.itl_ms)

    @property
    def per_model(self) -> bool:
        return bool(self.model_ttft_ms or self.model_itl_ms)


def slo_spec_of(slo) -> SloSpec:
    """The report's SloSpec of a node config's `SloConfig` (its per-model SLOs included)."""
    models = sorted(slo.models.items())
    return SloSpec(slo.ttft_ms, slo.itl_ms,
                   tuple((m, s.ttft_ms) for m, s in models if s.ttft_ms != slo.ttft_ms),
                   tuple((m, s.itl_ms) for m, s in models if s.itl_ms != slo.itl_ms))


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """What happened to one request, as the client saw it."""

    request_id: str
    model: str
    priority: Priority
    arrival_s: float
    ttft_slo_ms: float | None = None  # None: SloSpec.ttft_ms
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_output_tokens: int = 0
    first_token_s: float | None = None
    token_times_s: tuple[float, ...] = ()  # arrival time of each output token; equal times = one message
    finish_s: float | None = None
    refused: bool = False
    retry_after_ms: float | None = None  # the hint a refusal carried
    error: str = ""  # non-empty: the request failed after admission
    num_preemptions: int = 0
    # Times its stream went on from its last token on another instance after its own was lost (simulator faults)
    num_continuations: int = 0

    @property
    def completed(self) -> bool:
        return not self.refused and not self.error and self.first_token_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def e2e_s(self) -> float | None:
        end = self.finish_s if self.finish_s is not None else (self.token_times_s[-1] if self.token_times_s else None)
        return None if end is None else end - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        ttft, e2e = self.ttft_s, self.e2e_s
        if ttft is None or e2e is None or self.num_output_tokens < 2:
            return None
        return (e2e - ttft) / (self.num_output_tokens - 1)


def scale_record_times(record: RequestRecord, divide_by: float) -> RequestRecord:
    """A dilated live run's record on the modelled clock: every time divided by the time scale."""

    def d(t: float | None) -> float | None:
        return None if t is None else t / divide_by

    return dataclasses.replace(
        record,
        arrival_s=record.arrival_s / divide_by,
        first_token_s=d(record.first_token_s),
        token_times_s=tuple(t / divide_by for t in record.token_times_s),
        finish_s=d(record.finish_s),
        retry_after_ms=d(record.retry_after_ms),
    )


# --- the measurement window ------------------------------------------------------------------------------------

MIN_WARMUP_S = 5.0  # the warm-up floor: no run is measured from its first seconds
MSER_BATCH = 5  # MSER-5: White's batch size
STEADY_GROWTH = 0.10  # occupancy growing more than this (relative, last third vs middle third) is not steady


@dataclass(frozen=True, slots=True)
class Window:
    """Which requests a summary measures: those arriving in [start_s, end_s], on the run's clock.

    `start_s` is the end of the warm-up and `end_s` the end of the arrival window (the last arrival); throughputs
    divide by `duration_s` = end_s − start_s. The other fields say how the warm-up was chosen and whether the
    system was steady over the window; `detect_window` fills them, a plain `Window(start_s, end_s)` leaves them
    unknown."""

    start_s: float
    end_s: float
    warmup_rule: str = "stated"  # "none" (start 0), "stated" (given by the caller), "floor" or "MSER-5" (detected)
    mser_s: float = math.nan  # where MSER-5 put the warm-up end, before the floor (NaN: not detected)
    growth: float = math.nan  # occupancy growth over the window, relative (see `steadiness`); NaN: not measured
    steady: bool | None = None  # growth <= STEADY_GROWTH; None: not measured

    def __post_init__(self) -> None:
        if not 0.0 <= self.start_s <= self.end_s:
            raise ValueError(f"need 0 <= warm-up end <= arrival window end, got {self.start_s} and {self.end_s}")

    @property
    def duration_s(self) -> float:
        return max(self.end_s - self.start_s, 1e-9)

    def contains(self, record: RequestRecord) -> bool:
        """Measured: arrived after the warm-up. Late arrivals (harness lag past the last send) stay in."""
        return record.arrival_s >= self.start_s


def mser_truncation(series: Sequence[float], batch_size: int = MSER_BATCH) -> int:
    """MSER-m (White 1997): how many leading samples of `series` to delete as warm-up.

    The series is cut into k = len // m batches of m samples (a trailing partial batch is dropped) with means
    Z_1..Z_k. For d = 0 .. k // 2 (only the first half is searched: deleting more leaves too little to judge),
    MSER(d) = Σ_{j>d} (Z_j − mean(Z_{d+1..k}))² / (k − d)², the squared standard error of the mean of the batches
    kept. Returns m · d for the d minimising it (the smallest such d on ties); 0 for fewer than two batches."""
    k = len(series) // batch_size
    if k < 2:
        return 0
    z = np.asarray(series[: k * batch_size], dtype=float).reshape(k, batch_size).mean(axis=1)
    best_d, best = 0, math.inf
    for d in range(k // 2 + 1):
        kept = z[d:]
        value = float(((kept - kept.mean()) ** 2).sum()) / len(kept) ** 2
        if value < best:
            best_d, best = d, value
    return best_d * batch_size


def steadiness(values: Sequence[float]) -> float:
    """Relative growth of a series over a window: (mean of its last third − mean of its middle third) / its mean.

    The first third is left out so that what remains of a ramp at the window's start does not count twice. 0 for an
    empty system (mean 0); NaN for fewer than 3 samples (too short to judge)."""
    n = len(values)
    if n < 3:
        return math.nan
    v = np.asarray(values, dtype=float)
    mean = float(v.mean())
    if mean == 0.0:
        return 0.0
    return (float(v[2 * n // 3:].mean()) - float(v[n // 3: 2 * n // 3].mean())) / mean


def detect_window(
    occupancy: Sequence[tuple[float, float]],
    arrival_end_s: float,
    *,
    warmup_s: float | None = None,
    min_warmup_s: float = MIN_WARMUP_S,
    growth_tolerance: float = STEADY_GROWTH,
) -> Window:
    """The measurement window of a run from its occupancy series [(t_s, requests in flight)], sampled regularly.

    Warm-up rule, when `warmup_s` is None: MSER-5 on the samples with t <= `arrival_end_s` gives d leading samples
    to delete; the warm-up ends at the time of sample d, or at the floor `min_warmup_s` if that is later. The floor
    is cut to half the arrival window for runs shorter than twice it, so a window always remains (MSER searches
    the first half only, so the warm-up never exceeds half the arrival window). A stated `warmup_s` is used as
    given. Steadiness: `steadiness` of the samples inside the window; steady when it is <= `growth_tolerance`."""
    inside_run = [(t, v) for t, v in occupancy if t <= arrival_end_s]
    mser_s = math.nan
    if warmup_s is not None:
        start_s, rule = warmup_s, ("stated" if warmup_s > 0 else "none")
    else:
        d = mser_truncation([v for _, v in inside_run])
        mser_s = inside_run[d][0] if d < len(inside_run) else 0.0
        floor_s = min(min_warmup_s, arrival_end_s / 2)
        start_s, rule = (mser_s, "MSER-5") if mser_s > floor_s else (floor_s, "floor")
    if start_s > arrival_end_s:
        raise ValueError(f"warm-up {start_s:g} s is not shorter than the {arrival_end_s:g} s arrival window")
    growth = steadiness([v for t, v in inside_run if t >= start_s])
    steady = None if math.isnan(growth) else growth <= growth_tolerance
    return Window(start_s, arrival_end_s, rule, mser_s, growth, steady)


def itl_gaps_s(token_times_s: Sequence[float]) -> list[float]:
    """Inter-token gaps of one stream; a k-token message splits its gap into k equal gaps (see module doc)."""
    gaps: list[float] = [b - a for a, b in zip(token_times_s, token_times_s[1:])]
    if 0.0 not in gaps:
        return gaps  # one token per message (the common case): the plain differences
    gaps = []
    prev_t = token_times_s[0]
    i = 1
    while i < len(token_times_s) and token_times_s[i] == prev_t:
        i += 1  # tokens delivered with the first one: part of the TTFT wait
    while i < len(token_times_s):
        t = token_times_s[i]
        j = i
        while j < len(token_times_s) and token_times_s[j] == t:
            j += 1
        k = j - i
        gaps.extend([(t - prev_t) / k] * k)
        prev_t, i = t, j
    return gaps


def meets_slo(record: RequestRecord, slo: SloSpec) -> bool:
    """DistServe goodput criterion: completed, TTFT within its SLO and TPOT within the ITL SLO."""
    if not record.completed:
        return False
    ttft_slo_ms = record.ttft_slo_ms if record.ttft_slo_ms is not None else slo.ttft_ms_for(record.model)
    if record.ttft_s * 1000.0 > ttft_slo_ms:
        return False
    tpot = record.tpot_s
    return tpot is None or tpot * 1000.0 <= slo.itl_ms_for(record.model)


@dataclass(frozen=True, slots=True)
class LatencyStats:
    count: int
    mean_ms: float
    p50_ms: float
    p95_ms: float
    p99_ms: float
    max_ms: float


def latency_stats(values_s: Sequence[float]) -> LatencyStats:
    if len(values_s) == 0:
        nan = math.nan
        return LatencyStats(0, nan, nan, nan, nan, nan)
    ms = np.asarray(values_s, dtype=float) * 1000.0
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return LatencyStats(len(ms), float(ms.mean()), float(p50), float(p95), float(p99), float(ms.max()))


def percentile_inf(values: Sequence[float], q: float) -> float:
    """numpy's linear-interpolation percentile, where +inf samples (never answered) make any percentile they
    touch infinite instead of NaN. NaN for no samples."""
    if len(values) == 0:
        return math.nan
    xs = sorted(values)
    pos = q / 100.0 * (len(xs) - 1)
    lo = int(math.floor(pos))
    frac = pos - lo
    if frac == 0.0:
        return xs[lo]
    hi = xs[lo + 1]
    return math.inf if math.isinf(hi) else xs[lo] + (hi - xs[lo]) * frac


def _ttft_slo_ms(record: RequestRecord, slo: SloSpec) -> float:
    return record.ttft_slo_ms if record.ttft_slo_ms is not None else slo.ttft_ms


def fleet_ttft_p95_ms(records: Iterable[RequestRecord], slo: SloSpec) -> tuple[tuple[float, float], ...]:
    """(TTFT SLO ms, TTFT P95 ms) for each TTFT SLO among the admitted requests, ascending by SLO; a request
    admitted but never given a first token counts as an infinite TTFT."""
    by_slo: dict[float, list[float]] = {}
    for r in records:
        if not r.refused:
            by_slo.setdefault(_ttft_slo_ms(r, slo), []).append(math.inf if r.ttft_s is None else r.ttft_s * 1000.0)
    return tuple((slo_ms, percentile_inf(v, 95)) for slo_ms, v in sorted(by_slo.items()))


_NO_GAPS = np.zeros(0)


def _record_gaps(record: RequestRecord, cache: dict | None) -> np.ndarray:
    """`itl_gaps_s` of a record as an array, computed once per `summarize` (every record sits in 3-4 of its
    groups): the plain differences (the same floats) unless some message carried several tokens."""
    gaps = None if cache is None else cache.get(id(record))
    if gaps is None:
        times = record.token_times_s
        gaps = np.diff(np.asarray(times, dtype=float)) if len(times) > 1 else _NO_GAPS
        if not gaps.all():  # a 0.0 gap: tokens delivered together
            gaps = np.asarray(itl_gaps_s(times), dtype=float)
        if cache is not None:
            cache[id(record)] = gaps
    return gaps


def fleet_itl_p95_ms(records: Iterable[RequestRecord], gaps_cache: dict | None = None) -> float:
    """ITL P95 over every token streamed to an admitted request (pooled); NaN when no gap was streamed.
    `gaps_cache`: a dict shared by calls over the same records (keyed by record identity), or None."""
    parts = [_record_gaps(r, gaps_cache) for r in records if not r.refused]
    gaps = np.concatenate(parts) if parts else _NO_GAPS
    return float(np.percentile(gaps * 1000.0, 95)) if gaps.size else math.nan


@dataclass(frozen=True, slots=True)
class GroupStats:
    """Metrics of one slice of the requests: all of them, one model, or one tier."""

    name: str
    num_offered: int
    num_admitted: int
    num_refused: int
    num_completed: int
    num_errors: int
    num_good: int
    num_preempted: int  # requests preempted at least once
    num_preemptions: int  # preemption events in total
    refused_fraction: float
    attainment_admitted: float  # good / admitted (NaN when none admitted)
    attainment_offered: float  # good / offered, refused counted as misses
    ttft_attainment: float  # of completed: TTFT within its SLO
    request_throughput_rps: float  # completed / duration
    output_throughput_tps: float  # output tokens of completed requests / duration
    goodput_rps: float
    prefix_hit_fraction: float  # cached prompt tokens / prompt tokens, completed requests
    ttft: LatencyStats
    tpot: LatencyStats
    itl: LatencyStats  # pooled across the group's streams
    e2e: LatencyStats
    num_unfinished: int = 0  # admitted but never finished: cut off by the drain or failed mid-stream (misses)
    # The seed's literal fleet SLO (module doc): (TTFT SLO ms, TTFT P95 ms over admitted) per SLO, pooled ITL P95
    fleet_ttft_p95_ms: tuple[tuple[float, float], ...] = ()
    fleet_itl_p95_ms: float = math.nan
    fleet_ttft_ok: bool = False  # every TTFT SLO's P95 < that SLO; False when nothing was admitted
    fleet_itl_ok: bool = False  # pooled ITL P95 < SloSpec.itl_ms; True when no token gap was streamed
    fleet_slo_met: bool = False  # both


def passes_capacity(group: GroupStats, threshold: float = 0.9) -> bool:
    """The SLO-capacity test of one run: at least `threshold` of the *offered* requests are good under the
    DistServe definition (refused = miss: `attainment_offered`), AND the fleet SLO (TTFT P95 and ITL P95, module
    doc) holds as well. The capacity is the highest rate at which this is true."""
    return group.attainment_offered >= threshold and group.fleet_slo_met


@dataclass(frozen=True, slots=True)
class Summary:
    duration_s: float  # the measurement window's length: what throughputs divide by
    slo: SloSpec
    overall: GroupStats
    per_model: tuple[GroupStats, ...]  # sorted by model name
    per_tier: tuple[GroupStats, ...]  # by Priority order, tiers present only
    window: Window | None = None  # None only for summaries built by hand; `summarize` always sets it
    num_warmup: int = 0  # requests left out because they arrived during the warm-up


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def group_stats(name: str, records: Sequence[RequestRecord], slo: SloSpec, duration_s: float,
                gaps_cache: dict | None = None) -> GroupStats:
    """`gaps_cache`: see `fleet_itl_p95_ms` (`summarize` shares one across its groups).

    One pass over the records gathers every count, sum and list, in record order: the same integers and the same
    arrays as one pass per figure with `RequestRecord`'s properties and `meets_slo` (the same float operations)."""
    slo_ttft_ms, slo_itl_ms = slo.ttft_ms, slo.itl_ms
    per_model = slo.per_model
    done: list[RequestRecord] = []
    ttfts: list[float] = []
    tpots: list[float] = []
    e2es: list[float] = []
    by_slo: dict[float, list[float]] = {}  # `fleet_ttft_p95_ms`'s lists
    admitted = good = ttft_ok = errors = preempted = preemptions = unfinished = 0
    output_tokens = cached_tokens = prompt_tokens = 0
    open_stream = False  # an admitted request that did not complete streamed more than one token
    for r in records:
        num_preemptions = r.num_preemptions
        preemptions += num_preemptions
        if num_preemptions > 0:
            preempted += 1
        if r.refused:
            continue
        admitted += 1
        if per_model:  # each request against its own model's SLOs
            slo_ttft_ms, slo_itl_ms = slo.ttft_ms_for(r.model), slo.itl_ms_for(r.model)
        ttft_slo_ms = r.ttft_slo_ms if r.ttft_slo_ms is not None else slo_ttft_ms
        first = r.first_token_s
        ttft = None if first is None else first - r.arrival_s
        by_slo.setdefault(ttft_slo_ms, []).append(math.inf if ttft is None else ttft * 1000.0)
        if r.finish_s is None:
            unfinished += 1
        if r.error:
            errors += 1
        times = r.token_times_s
        if r.error or ttft is None:  # not completed
            if len(times) > 1:
                open_stream = True
            continue
        done.append(r)
        end = r.finish_s if r.finish_s is not None else (times[-1] if times else None)
        e2e = None if end is None else end - r.arrival_s
        num_output = r.num_output_tokens
        tpot = None if e2e is None or num_output < 2 else (e2e - ttft) / (num_output - 1)
        ttft_ms = ttft * 1000.0
        if not ttft_ms > ttft_slo_ms and (tpot is None or tpot * 1000.0 <= slo_itl_ms):
            good += 1
        if ttft_ms <= ttft_slo_ms:
            ttft_ok += 1
        ttfts.append(ttft)
        if tpot is not None:
            tpots.append(tpot)
        if e2e is not None:
            e2es.append(e2e)
        output_tokens += num_output
        cached_tokens += r.num_cached_prompt_tokens
        prompt_tokens += r.num_prompt_tokens
    itl = np.concatenate([_record_gaps(r, gaps_cache) for r in done]) if done else _NO_GAPS
    itl_stats = latency_stats(itl)
    fleet_ttft = tuple((slo_ms, percentile_inf(v, 95)) for slo_ms, v in sorted(by_slo.items()))
    if open_stream:
        fleet_itl = fleet_itl_p95_ms(records, gaps_cache)
    else:  # no admitted stream beyond the completed ones: the same pooled gaps, so the same P95 (one pass less)
        fleet_itl = itl_stats.p95_ms
    fleet_ttft_ok = bool(fleet_ttft) and all(p95 < slo_ms for slo_ms, p95 in fleet_ttft)
    fleet_itl_ok = math.isnan(fleet_itl) or fleet_itl < slo.itl_ms
    if per_model:  # each model's pooled ITL P95 against its own SLO
        models = sorted({r.model for r in records})
        fleet_itl_ok = all(math.isnan(p95 := fleet_itl_p95_ms([r for r in records if r.model == m], gaps_cache))
                           or p95 < slo.itl_ms_for(m) for m in models)
    return GroupStats(
        name=name,
        num_offered=len(records),
        num_admitted=admitted,
        num_refused=len(records) - admitted,
        num_completed=len(done),
        num_errors=errors,
        num_good=good,
        num_preempted=preempted,
        num_preemptions=preemptions,
        refused_fraction=_ratio(len(records) - admitted, len(records)),
        attainment_admitted=_ratio(good, admitted),
        attainment_offered=_ratio(good, len(records)),
        ttft_attainment=_ratio(ttft_ok, len(done)),
        request_throughput_rps=_ratio(len(done), duration_s),
        output_throughput_tps=_ratio(output_tokens, duration_s),
        goodput_rps=_ratio(good, duration_s),
        prefix_hit_fraction=_ratio(cached_tokens, prompt_tokens),
        ttft=latency_stats(ttfts),
        tpot=latency_stats(tpots),
        itl=itl_stats,
        e2e=latency_stats(e2es),
        num_unfinished=unfinished,
        fleet_ttft_p95_ms=fleet_ttft,
        fleet_itl_p95_ms=fleet_itl,
        fleet_ttft_ok=fleet_ttft_ok,
        fleet_itl_ok=fleet_itl_ok,
        fleet_slo_met=fleet_ttft_ok and fleet_itl_ok,
    )


def summarize(
    records: Iterable[RequestRecord], slo: SloSpec, duration_s: float | Window, *, warmup_s: float = 0.0
) -> Summary:
    """All metrics for one run, over its measurement window.

    `duration_s` is the end of the arrival window (a float: the window is [`warmup_s`, `duration_s`]) or a
    `Window` (from `detect_window`; then `warmup_s` must be left at 0). Requests arriving before the window's
    start are left out of every metric; throughputs divide by the window's length."""
    if isinstance(duration_s, Window):
        if warmup_s:
            raise ValueError("pass the warm-up inside the Window, not as warmup_s as well")
        window = duration_s
    else:
        window = Window(warmup_s, duration_s, "stated" if warmup_s > 0 else "none")
    all_records = list(records)
    records = [r for r in all_records if window.contains(r)]
    duration_s = window.duration_s
    models = sorted({r.model for r in records})
    tiers = sorted({r.priority for r in records})
    gaps: dict = {}  # record identity -> its ITL gaps; `records` holds every record alive until we return
    overall = group_stats("all", records, slo, duration_s, gaps)

    def group(name: str, members: list[RequestRecord]) -> GroupStats:
        if len(members) == len(records):  # every record (one model, or one tier): the overall figures
            return dataclasses.replace(overall, name=name)
        return group_stats(name, members, slo, duration_s, gaps)

    return Summary(
        duration_s=duration_s,
        slo=slo,
        overall=overall,
        per_model=tuple(group(m, [r for r in records if r.model == m]) for m in models),
        per_tier=tuple(group(Priority(p).name, [r for r in records if r.priority == p]) for p in tiers),
        window=window,
        num_warmup=len(all_records) - len(records),
    )


@dataclass(frozen=True, slots=True)
class TimeBin:
    start_s: float
    num_offered: int
    num_admitted: int
    num_good: int

    @property
    def attainment_offered(self) -> float:
        return _ratio(self.num_good, self.num_offered)

    @property
    def attainment_admitted(self) -> float:
        return _ratio(self.num_good, self.num_admitted)


def attainment_over_time(records: Iterable[RequestRecord], slo: SloSpec, bin_s: float) -> list[TimeBin]:
    """Requests binned by arrival time from 0 (empty bins included up to the last arrival), with SLO outcomes."""
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    records = list(records)
    if not records:
        return []
    num_bins = int(max(r.arrival_s for r in records) // bin_s) + 1
    offered, admitted, good = [0] * num_bins, [0] * num_bins, [0] * num_bins
    for r in records:
        b = max(0, int(r.arrival_s // bin_s))
        offered[b] += 1
        admitted[b] += not r.refused
        good[b] += meets_slo(r, slo)
    return [TimeBin(b * bin_s, offered[b], admitted[b], good[b]) for b in range(num_bins)]


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN or infinity
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def summary_to_dict(summary: Summary) -> dict:
    """A plain JSON-ready dict (NaN -> None) for `--json`; the SLOs as {ttft_ms, itl_ms, models: {model: {ttft_ms,
    itl_ms}}}, the last only when some model has SLOs of its own."""
    d = _jsonable(dataclasses.asdict(summary))
    slo = summary.slo
    d["slo"] = {"ttft_ms": slo.ttft_ms, "itl_ms": slo.itl_ms}
    models = sorted({m for m, _ in slo.model_ttft_ms} | {m for m, _ in slo.model_itl_ms})
    if models:
        d["slo"]["models"] = {m: {"ttft_ms": slo.ttft_ms_for(m), "itl_ms": slo.itl_ms_for(m)} for m in models}
    return d


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


_COLUMNS = (
    ("group", 12), ("offered", 8), ("refused%", 9), ("done", 7), ("good", 7), ("att_adm%", 9), ("att_off%", 9),
    ("goodput/s", 10), ("ttft_p50", 9), ("ttft_p95", 9), ("ttft_p99", 9), ("tpot_p95", 9), ("itl_p95", 8),
    ("e2e_p95", 9), ("preempt", 8), ("p95ok", 6),
)  # (header, width); latencies in ms


def _row(g: GroupStats) -> str:
    cells = (
        g.name[:12], str(g.num_offered), _fmt(100 * g.refused_fraction), str(g.num_completed), str(g.num_good),
        _fmt(100 * g.attainment_admitted), _fmt(100 * g.attainment_offered), _fmt(g.goodput_rps),
        _fmt(g.ttft.p50_ms), _fmt(g.ttft.p95_ms), _fmt(g.ttft.p99_ms), _fmt(g.tpot.p95_ms), _fmt(g.itl.p95_ms),
        _fmt(g.e2e.p95_ms), str(g.num_preempted), "yes" if g.fleet_slo_met else "no",
    )
    return " ".join(c.rjust(w) if i else c.ljust(w) for i, (c, (_, w)) in enumerate(zip(cells, _COLUMNS)))


def _per_model_slos(slo: SloSpec) -> str:
    """" (llama-3-70b: TTFT 400 ms, ITL/TPOT 50 ms)" for the models with SLOs of their own; "" when none has."""
    models = sorted({m for m, _ in slo.model_ttft_ms} | {m for m, _ in slo.model_itl_ms})
    if not models:
        return ""
    return " (" + "; ".join(f"{m}: TTFT {slo.ttft_ms_for(m):g} ms, ITL/TPOT {slo.itl_ms_for(m):g} ms"
                            for m in models) + ")"


def format_window(window: Window, num_warmup: int = 0) -> str:
    """One line: the arrival window, the warm-up and how it was chosen, the measurement window, steadiness."""
    how = window.warmup_rule
    if window.warmup_rule == "floor" and not math.isnan(window.mser_s):
        how = f"floor; MSER-5 found {window.mser_s:.1f} s"
    if window.steady is None:
        steady = "steady ? (window too short to judge)"
    else:
        steady = (f"steady {'yes' if window.steady else 'NO'} (occupancy {100 * window.growth:+.1f} % "
                  f"last third vs middle third{'' if window.steady else ': the window is too short'})")
    return (
        f"arrivals 0.0-{window.end_s:.1f} s | warm-up {window.start_s:.1f} s ({how}; {num_warmup} requests left out)"
        f" | window {window.start_s:.1f}-{window.end_s:.1f} s ({window.duration_s:.1f} s) | {steady}"
    )


def format_summary(summary: Summary) -> str:
    """A fixed-width table: one row for all requests, then one per model and one per tier."""
    o = summary.overall
    window = summary.window or Window(0.0, summary.duration_s, "none")
    cut_off = o.num_unfinished - o.num_errors  # errors (a lost instance, say) are unfinished too, not the drain's
    unfinished = f" | unfinished {o.num_unfinished}" + (" (drain too short: counted as misses)" if cut_off > 0
                                                         else " (failed: counted as misses)" if o.num_unfinished else "")
    head = (
        f"window {summary.duration_s:.1f} s | SLO TTFT {summary.slo.ttft_ms:g} ms, ITL/TPOT {summary.slo.itl_ms:g} ms"
        f"{_per_model_slos(summary.slo)}"
        f" | throughput {_fmt(o.request_throughput_rps, 2)} req/s, {_fmt(o.output_throughput_tps, 0)} tok/s"
        f" | goodput {_fmt(o.goodput_rps, 2)} req/s | errors {o.num_errors}{unfinished}"
        f" | prefix hit {_fmt(100 * o.prefix_hit_fraction)} %"
    )
    legend = ("latencies in ms; good = TTFT <= its SLO and TPOT <= ITL SLO (DistServe); p95ok = TTFT P95 < SLO "
              "per tier over admitted (unstarted = inf) and ITL P95 < SLO over all streamed tokens")
    header = " ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(_COLUMNS))
    lines = [format_window(window, summary.num_warmup), head, legend, header, "-" * len(header)]
    lines.append(_row(o))
    lines += ["  by model"] + [_row(g) for g in summary.per_model]
    lines += ["  by tier"] + [_row(g) for g in summary.per_tier]
    return "\n".join(lines)
