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

Invariants: records are seconds on one clock (the live harness divides by its time scale first); nothing here
reads a clock or mutates a record; empty groups report NaN latencies (None in `summary_to_dict`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from services.core.types import Priority


@dataclass(frozen=True, slots=True)
class SloSpec:
    ttft_ms: float = 250.0  # default TTFT SLO; a request's own ttft_slo_ms overrides it
    itl_ms: float = 30.0  # applied to TPOT for goodput (DistServe) and shown against pooled ITL P95


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
    ttft_slo_ms = record.ttft_slo_ms if record.ttft_slo_ms is not None else slo.ttft_ms
    if record.ttft_s * 1000.0 > ttft_slo_ms:
        return False
    tpot = record.tpot_s
    return tpot is None or tpot * 1000.0 <= slo.itl_ms


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


@dataclass(frozen=True, slots=True)
class Summary:
    duration_s: float
    slo: SloSpec
    overall: GroupStats
    per_model: tuple[GroupStats, ...]  # sorted by model name
    per_tier: tuple[GroupStats, ...]  # by Priority order, tiers present only


def _ratio(num: float, den: float) -> float:
    return num / den if den else math.nan


def group_stats(name: str, records: Sequence[RequestRecord], slo: SloSpec, duration_s: float) -> GroupStats:
    done = [r for r in records if r.completed]
    admitted = sum(not r.refused for r in records)
    good = sum(meets_slo(r, slo) for r in done)
    ttft_ok = sum(r.ttft_s * 1000.0 <= (r.ttft_slo_ms if r.ttft_slo_ms is not None else slo.ttft_ms) for r in done)
    itl: list[float] = []
    for r in done:
        itl.extend(itl_gaps_s(r.token_times_s))
    return GroupStats(
        name=name,
        num_offered=len(records),
        num_admitted=admitted,
        num_refused=len(records) - admitted,
        num_completed=len(done),
        num_errors=sum(bool(r.error) and not r.refused for r in records),
        num_good=good,
        num_preempted=sum(r.num_preemptions > 0 for r in records),
        num_preemptions=sum(r.num_preemptions for r in records),
        refused_fraction=_ratio(len(records) - admitted, len(records)),
        attainment_admitted=_ratio(good, admitted),
        attainment_offered=_ratio(good, len(records)),
        ttft_attainment=_ratio(ttft_ok, len(done)),
        request_throughput_rps=_ratio(len(done), duration_s),
        output_throughput_tps=_ratio(sum(r.num_output_tokens for r in done), duration_s),
        goodput_rps=_ratio(good, duration_s),
        prefix_hit_fraction=_ratio(
            sum(r.num_cached_prompt_tokens for r in done), sum(r.num_prompt_tokens for r in done)
        ),
        ttft=latency_stats([r.ttft_s for r in done]),
        tpot=latency_stats([t for r in done if (t := r.tpot_s) is not None]),
        itl=latency_stats(itl),
        e2e=latency_stats([r.e2e_s for r in done if r.e2e_s is not None]),
    )


def summarize(records: Iterable[RequestRecord], slo: SloSpec, duration_s: float) -> Summary:
    """All metrics for one run. `duration_s` is the measurement window that throughputs divide by."""
    records = list(records)
    models = sorted({r.model for r in records})
    tiers = sorted({r.priority for r in records})
    return Summary(
        duration_s=duration_s,
        slo=slo,
        overall=group_stats("all", records, slo, duration_s),
        per_model=tuple(group_stats(m, [r for r in records if r.model == m], slo, duration_s) for m in models),
        per_tier=tuple(
            group_stats(Priority(p).name, [r for r in records if r.priority == p], slo, duration_s) for p in tiers
        ),
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
    if isinstance(value, float) and math.isnan(value):
        return None  # JSON has no NaN
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value


def summary_to_dict(summary: Summary) -> dict:
    """A plain JSON-ready dict (NaN -> None) for `--json`."""
    return _jsonable(dataclasses.asdict(summary))


def _fmt(value: float, digits: int = 1) -> str:
    return "-" if value is None or math.isnan(value) else f"{value:.{digits}f}"


_COLUMNS = (
    ("group", 12), ("offered", 8), ("refused%", 9), ("done", 7), ("good", 7), ("att_adm%", 9), ("att_off%", 9),
    ("goodput/s", 10), ("ttft_p50", 9), ("ttft_p95", 9), ("ttft_p99", 9), ("tpot_p95", 9), ("itl_p95", 8),
    ("e2e_p95", 9), ("preempt", 8),
)  # (header, width); latencies in ms


def _row(g: GroupStats) -> str:
    cells = (
        g.name[:12], str(g.num_offered), _fmt(100 * g.refused_fraction), str(g.num_completed), str(g.num_good),
        _fmt(100 * g.attainment_admitted), _fmt(100 * g.attainment_offered), _fmt(g.goodput_rps),
        _fmt(g.ttft.p50_ms), _fmt(g.ttft.p95_ms), _fmt(g.ttft.p99_ms), _fmt(g.tpot.p95_ms), _fmt(g.itl.p95_ms),
        _fmt(g.e2e.p95_ms), str(g.num_preempted),
    )
    return " ".join(c.rjust(w) if i else c.ljust(w) for i, (c, (_, w)) in enumerate(zip(cells, _COLUMNS)))


def format_summary(summary: Summary) -> str:
    """A fixed-width table: one row for all requests, then one per model and one per tier."""
    o = summary.overall
    head = (
        f"duration {summary.duration_s:.1f} s | SLO TTFT {summary.slo.ttft_ms:g} ms, ITL/TPOT {summary.slo.itl_ms:g} ms"
        f" | throughput {_fmt(o.request_throughput_rps, 2)} req/s, {_fmt(o.output_throughput_tps, 0)} tok/s"
        f" | goodput {_fmt(o.goodput_rps, 2)} req/s | errors {o.num_errors}"
        f" | prefix hit {_fmt(100 * o.prefix_hit_fraction)} %"
    )
    header = " ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(_COLUMNS))
    lines = [head, "latencies in ms; good = TTFT <= its SLO and TPOT <= ITL SLO (DistServe)", header, "-" * len(header)]
    lines.append(_row(o))
    lines += ["  by model"] + [_row(g) for g in summary.per_model]
    lines += ["  by tier"] + [_row(g) for g in summary.per_tier]
    return "\n".join(lines)
