"""Exact metric values on hand-built records; PNG plots; the progress bar."""

import io
import json
import math

import pytest

from services.core.types import Priority
from services.metrics import (
    RequestRecord,
    SloSpec,
    attainment_over_time,
    format_summary,
    itl_gaps_s,
    latency_stats,
    meets_slo,
    scale_record_times,
    summarize,
    summary_to_dict,
)
from services.progress import Progress

SLO = SloSpec(ttft_ms=250.0, itl_ms=30.0)


def rec(rid, arrival_s, token_times_s, *, model="m", priority=Priority.STANDARD, **kw):
    times = tuple(token_times_s)
    return RequestRecord(
        request_id=rid,
        model=model,
        priority=priority,
        arrival_s=arrival_s,
        num_prompt_tokens=kw.pop("num_prompt_tokens", 100),
        num_output_tokens=len(times),
        first_token_s=times[0] if times else None,
        token_times_s=times,
        finish_s=times[-1] if times else None,
        **kw,
    )


def test_ttft_percentiles_of_three_requests():
    records = [rec("a", 0.0, [0.1]), rec("b", 1.0, [1.2]), rec("c", 2.0, [2.3])]
    s = summarize(records, SLO, duration_s=10.0).overall
    assert s.ttft.count == 3
    assert s.ttft.p50_ms == pytest.approx(200.0)
    assert s.ttft.mean_ms == pytest.approx(200.0)
    assert s.ttft.p95_ms == pytest.approx(290.0)  # linear interpolation, as numpy / vllm bench serve
    assert s.ttft.max_ms == pytest.approx(300.0)
    assert s.tpot.count == 0  # one output token each: TPOT undefined
    assert s.request_throughput_rps == pytest.approx(0.3)


def test_tpot_and_e2e_follow_vllm_definitions():
    r = rec("a", 0.0, [0.1, 0.12, 0.15, 0.2])
    assert r.ttft_s == pytest.approx(0.1)
    assert r.e2e_s == pytest.approx(0.2)
    assert r.tpot_s == pytest.approx((0.2 - 0.1) / 3)
    # finish_s (end of stream) rather than the last token when present
    late = RequestRecord("b", "m", Priority.STANDARD, 0.0, num_output_tokens=2, first_token_s=0.1,
                         token_times_s=(0.1, 0.2), finish_s=0.5)
    assert late.e2e_s == pytest.approx(0.5)
    assert late.tpot_s == pytest.approx(0.4)


def test_itl_gaps_split_evenly_within_a_message():
    assert itl_gaps_s([]) == []
    assert itl_gaps_s([1.0]) == []
    assert itl_gaps_s([1.0, 1.01, 1.03]) == pytest.approx([0.01, 0.02])
    # three tokens in one message 0.06 s after the previous: three gaps of 0.02
    assert itl_gaps_s([1.0, 1.06, 1.06, 1.06]) == pytest.approx([0.02, 0.02, 0.02])
    # tokens delivered with the first token are part of the TTFT wait: no ITL samples
    assert itl_gaps_s([1.0, 1.0, 1.04]) == pytest.approx([0.04])


def test_itl_pooled_across_requests():
    records = [rec("a", 0.0, [0.1, 0.11, 0.12]), rec("b", 0.0, [0.1, 0.14])]
    s = summarize(records, SLO, duration_s=1.0).overall
    assert s.itl.count == 3
    assert s.itl.mean_ms == pytest.approx(20.0)  # gaps 10, 10, 40 ms
    assert s.itl.p50_ms == pytest.approx(10.0)
    assert s.itl.max_ms == pytest.approx(40.0)


def test_goodput_counts_ttft_and_tpot_and_refusals():
    records = [
        rec("good", 0.0, [0.2, 0.22, 0.24]),  # TTFT 200, TPOT 20
        rec("slow_first", 0.0, [0.3, 0.31]),  # TTFT 300 > 250
        rec("slow_decode", 0.0, [0.1, 0.15, 0.2]),  # TPOT 50 > 30
        rec("own_slo", 0.0, [0.3, 0.31], ttft_slo_ms=400.0),  # its own SLO: good
        rec("one_token", 0.0, [0.1]),  # no TPOT: judged on TTFT alone
        rec("refused", 0.0, [], refused=True, retry_after_ms=500.0),
        rec("failed", 0.0, [0.1, 0.11], error="engine died"),
        rec("never_started", 0.0, []),
    ]
    assert [meets_slo(r, SLO) for r in records] == [True, False, False, True, True, False, False, False]
    s = summarize(records, SLO, duration_s=2.0).overall
    assert (s.num_offered, s.num_admitted, s.num_refused, s.num_errors) == (8, 7, 1, 1)
    assert s.num_completed == 5
    assert s.num_good == 3
    assert s.goodput_rps == pytest.approx(1.5)
    assert s.attainment_admitted == pytest.approx(3 / 7)
    assert s.attainment_offered == pytest.approx(3 / 8)
    assert s.refused_fraction == pytest.approx(1 / 8)
    assert s.ttft_attainment == pytest.approx(4 / 5)
    assert s.output_throughput_tps == pytest.approx((3 + 2 + 3 + 2 + 1) / 2.0)


def test_per_model_and_per_tier_groups():
    records = [
        rec("a", 0.0, [0.1], model="small", priority=Priority.INTERACTIVE),
        rec("b", 0.0, [0.5], model="small", priority=Priority.BATCH, ttft_slo_ms=10_000.0),
        rec("c", 0.0, [], model="big", priority=Priority.INTERACTIVE, refused=True),
        rec("d", 0.0, [0.1], model="big", priority=Priority.INTERACTIVE, num_preemptions=2),
    ]
    s = summarize(records, SLO, duration_s=1.0)
    assert [g.name for g in s.per_model] == ["big", "small"]
    assert [g.name for g in s.per_tier] == ["INTERACTIVE", "BATCH"]
    big, small = s.per_model
    assert (big.num_offered, big.num_good, big.attainment_admitted, big.attainment_offered) == (2, 1, 1.0, 0.5)
    assert (small.num_good, small.attainment_offered) == (2, 1.0)
    inter, batch = s.per_tier
    assert (inter.num_offered, inter.num_refused, inter.num_good) == (3, 1, 2)
    assert (batch.num_good, batch.ttft.p50_ms) == (1, pytest.approx(500.0))
    assert (s.overall.num_preempted, s.overall.num_preemptions) == (1, 2)


def test_prefix_hit_fraction_of_completed():
    records = [rec("a", 0.0, [0.1], num_prompt_tokens=100, num_cached_prompt_tokens=64),
               rec("b", 0.0, [0.1], num_prompt_tokens=300, num_cached_prompt_tokens=0)]
    assert summarize(records, SLO, 1.0).overall.prefix_hit_fraction == pytest.approx(64 / 400)


def test_empty_groups_are_nan_and_json_null():
    s = summarize([rec("r", 0.0, [], refused=True)], SLO, duration_s=1.0)
    assert math.isnan(s.overall.ttft.p95_ms) and math.isnan(s.overall.attainment_admitted)
    d = summary_to_dict(s)
    assert d["overall"]["ttft"]["p95_ms"] is None
    assert d["overall"]["num_refused"] == 1
    assert d["slo"] == {"ttft_ms": 250.0, "itl_ms": 30.0}
    json.dumps(d, allow_nan=False)  # strict JSON
    assert latency_stats([]).count == 0


def test_format_summary_has_a_row_per_group():
    records = [rec("a", 0.0, [0.1, 0.12], model="small"), rec("b", 0.0, [0.1], model="big")]
    text = format_summary(summarize(records, SLO, duration_s=1.0))
    lines = text.splitlines()
    rows = [ln.split()[0] for ln in lines[4:] if not ln.startswith("  ")]
    assert rows == ["all", "big", "small", "STANDARD"]
    assert "goodput 2.00 req/s" in lines[0]
    assert len({len(ln) for ln in lines[2:] if not ln.startswith("  ")}) == 1  # fixed width


def test_attainment_over_time_bins_by_arrival():
    records = [
        rec("a", 0.2, [0.3]),
        rec("b", 0.7, [1.5]),  # TTFT 800 ms: miss
        rec("c", 2.1, [], refused=True),
    ]
    bins = attainment_over_time(records, SLO, bin_s=1.0)
    assert [(b.start_s, b.num_offered, b.num_admitted, b.num_good) for b in bins] == [
        (0.0, 2, 2, 1), (1.0, 0, 0, 0), (2.0, 1, 0, 0)]
    assert bins[0].attainment_offered == 0.5
    assert math.isnan(bins[1].attainment_offered)
    assert attainment_over_time([], SLO, 1.0) == []
    with pytest.raises(ValueError):
        attainment_over_time(records, SLO, 0.0)


def test_scale_record_times_divides_every_time():
    r = rec("a", 10.0, [12.0, 14.0], retry_after_ms=100.0)
    s = scale_record_times(r, 10.0)
    assert (s.arrival_s, s.first_token_s, s.token_times_s, s.finish_s, s.retry_after_ms) == (
        1.0, 1.2, (1.2, 1.4), 1.4, 10.0)
    assert s.num_output_tokens == 2


# --- plots ---------------------------------------------------------------------------------------------------

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _assert_png(path):
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert len(data) > 5_000  # axes, lines and text, not an empty canvas


def _records():
    out = []
    for i in range(50):
        t0 = i * 0.1
        out.append(rec(f"s{i}", t0, [t0 + 0.05 + i * 0.004 + k * 0.02 for k in range(5)], model="small"))
        out.append(rec(f"b{i}", t0, [t0 + 0.2 + k * 0.03 for k in range(3)], model="big", refused=i % 7 == 0))
    return out


def test_plots_write_png_files(tmp_path):
    from services import plots

    for p in (
        plots.plot_latency_cdfs(_records(), tmp_path / "cdf.png", SLO),
        plots.plot_attainment_over_time(_records(), SLO, tmp_path / "att.png", bin_s=0.5),
        plots.plot_goodput_vs_load([("fcfs", 100, 90), ("fcfs", 200, 120), ("slo", 100, 95), ("slo", 200, 160)],
                                   tmp_path / "goodput.png"),
        plots.plot_timeseries({"kv gpu0": [(0, 0.1), (1, 0.5), (2, 0.9)], "busy": [(0, 0.3), (2, 0.7)]},
                              tmp_path / "sub" / "ts.png", ylabel="fraction"),
    ):
        _assert_png(p)


# --- progress ------------------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_progress_throttles_and_always_ends_with_a_line():
    out, clock = io.StringIO(), FakeClock()
    p = Progress(10, "sim", stream=out, force=True, min_interval_s=0.2, width=10, clock=clock)
    p.update()  # drawn (first)
    clock.t = 0.1
    p.update(3)  # throttled
    clock.t = 0.3
    p.update()  # drawn
    clock.t = 1.0
    p.close()
    p.close()  # once only
    assert out.getvalue().split("\r")[1:] == [
        "sim [#.........]  10% 1/10 0.0 s",
        "sim [#####.....]  50% 5/10 0.3 s",
        "sim [#####.....]  50% 5/10 1.0 s\n",
    ]


def test_progress_silent_on_non_tty_until_close():
    out = io.StringIO()  # isatty() is False
    with Progress(None, "reqs", stream=out, clock=FakeClock()) as p:
        p.update(7)
        assert out.getvalue() == ""
    assert out.getvalue() == "reqs 7 in 0.0 s\n"
