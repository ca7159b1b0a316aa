"""Exact metric values on hand-built records and series (warm-up, window, both SLOs); PNG plots; the progress bar."""

import io
import json
import math

import pytest

from octoserve.services.core.types import Priority
from octoserve.services.metrics import (
    RequestRecord,
    SloSpec,
    Window,
    attainment_over_time,
    detect_window,
    format_summary,
    itl_gaps_s,
    latency_stats,
    meets_slo,
    mser_truncation,
    passes_capacity,
    percentile_inf,
    scale_record_times,
    steadiness,
    summarize,
    summary_to_dict,
)
from octoserve.services.progress import Progress

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
    rows = [ln.split()[0] for ln in lines[5:] if not ln.startswith("  ")]
    assert rows == ["all", "big", "small", "STANDARD"]
    assert lines[0].startswith("arrivals 0.0-1.0 s | warm-up 0.0 s (none; 0 requests left out) | window 0.0-1.0 s")
    assert "goodput 2.00 req/s" in lines[1] and "unfinished 0" in lines[1]
    assert lines[3].split()[-1] == "p95ok" and lines[5].split()[-1] == "yes"
    assert len({len(ln) for ln in lines[3:] if not ln.startswith("  ")}) == 1  # fixed width


# --- warm-up, window, steadiness -----------------------------------------------------------------------------


def _series(values):
    return [(float(t), float(v)) for t, v in enumerate(values)]


def test_mser5_finds_the_knee_of_a_ramp_within_a_batch():
    ramp_then_flat = [100.0 * t / 12 for t in range(12)] + [100.0] * 48  # the knee at sample 12
    assert mser_truncation(ramp_then_flat) == 15  # the first batch boundary past the knee
    w = detect_window(_series(ramp_then_flat), 59.0)
    assert (w.start_s, w.end_s, w.warmup_rule, w.mser_s) == (15.0, 59.0, "MSER-5", 15.0)
    assert (w.growth, w.steady) == (0.0, True)
    assert w.duration_s == 44.0


def test_a_flat_series_gets_the_floor():
    flat = _series([50.0] * 60)
    assert mser_truncation([50.0] * 60) == 0
    assert mser_truncation([1.0] * 9) == 0  # fewer than two batches: nothing to compare
    w = detect_window(flat, 59.0)
    assert (w.start_s, w.warmup_rule, w.mser_s, w.steady) == (5.0, "floor", 0.0, True)
    assert detect_window(flat, 59.0, min_warmup_s=8.0).start_s == 8.0  # a longer floor when given
    assert detect_window(flat[:7], 6.0).start_s == 3.0  # a short run: the floor is cut to half its window


def test_a_series_still_growing_is_not_steady():
    growing = _series(range(60))
    w = detect_window(growing, 59.0)
    assert (w.start_s, w.warmup_rule) == (30.0, "MSER-5")  # MSER searches the first half only
    # window samples 30..59: middle third 40..49 (mean 44.5), last third 50..59 (mean 54.5), mean 44.5
    assert w.growth == pytest.approx(10 / 44.5)
    assert w.steady is False
    assert "steady NO" in format_summary(summarize([], SLO, w))


def test_steadiness_edge_cases_and_a_stated_warmup():
    assert math.isnan(steadiness([1.0, 2.0])) and steadiness([0.0] * 6) == 0.0
    assert steadiness([1, 1, 2, 2, 3, 3]) == pytest.approx((3 - 2) / 2)
    w = detect_window(_series(range(60)), 59.0, warmup_s=10.0)  # stated: used as given, never detected
    assert (w.start_s, w.warmup_rule) == (10.0, "stated") and math.isnan(w.mser_s)
    assert detect_window(_series([5.0] * 3), 2.0).steady is None  # too short to judge
    with pytest.raises(ValueError):
        detect_window(_series(range(10)), 9.0, warmup_s=12.0)


def test_requests_arriving_during_the_warmup_are_left_out_and_throughput_divides_by_the_window():
    records = [
        rec("early_good", 1.0, [1.1]),
        rec("early_refused", 3.9, [], refused=True),
        rec("good", 4.0, [4.1, 4.12]),
        rec("slow", 6.0, [6.5, 6.51]),  # TTFT 500 ms: a miss
    ]
    s = summarize(records, SLO, 10.0, warmup_s=4.0)
    assert (s.window.start_s, s.window.end_s, s.window.warmup_rule, s.num_warmup) == (4.0, 10.0, "stated", 2)
    assert (s.overall.num_offered, s.overall.num_refused, s.overall.num_good) == (2, 0, 1)
    assert s.duration_s == 6.0
    assert s.overall.goodput_rps == pytest.approx(1 / 6)
    assert s.overall.request_throughput_rps == pytest.approx(2 / 6)
    assert s.overall.output_throughput_tps == pytest.approx(4 / 6)
    assert summarize(records, SLO, Window(4.0, 10.0)) == s  # the Window form is the same
    with pytest.raises(ValueError):
        summarize(records, SLO, Window(4.0, 10.0), warmup_s=4.0)
    with pytest.raises(ValueError):
        Window(11.0, 10.0)
    d = summary_to_dict(s)
    assert d["window"]["start_s"] == 4.0 and d["num_warmup"] == 2


# --- the fleet SLO (the seed's literal one) and SLO capacity -----------------------------------------------------


def _flat(pairs):
    return [x for pair in pairs for x in pair]


def test_fleet_ttft_p95_is_judged_per_tier_against_its_own_slo():
    inter = [rec(f"i{k}", 0.0, [ms / 1000], priority=Priority.INTERACTIVE, ttft_slo_ms=100.0) for k, ms in
             enumerate((50, 60, 90))]
    batch = [rec(f"b{k}", 0.0, [ms / 1000], priority=Priority.BATCH, ttft_slo_ms=1000.0) for k, ms in
             enumerate((900, 950))]
    s = summarize(inter + batch, SLO, 1.0)
    assert _flat(s.overall.fleet_ttft_p95_ms) == pytest.approx([100.0, 87.0, 1000.0, 947.5])
    assert s.overall.fleet_ttft_ok and s.overall.fleet_slo_met  # pooled, the P95 would be ~945 ms
    slow = rec("i_slow", 0.0, [0.2], priority=Priority.INTERACTIVE, ttft_slo_ms=100.0)
    s = summarize(inter + batch + [slow], SLO, 1.0)
    assert not s.overall.fleet_ttft_ok  # one tier failing fails the group
    assert [(g.name, g.fleet_ttft_ok) for g in s.per_tier] == [("INTERACTIVE", False), ("BATCH", True)]


def test_an_admitted_request_without_a_first_token_is_an_infinite_ttft():
    fast = [rec(f"r{k}", 0.0, [0.1]) for k in range(19)]
    s = summarize(fast + [rec("cut_off", 0.0, [], error="unfinished")], SLO, 1.0).overall
    assert s.ttft.p95_ms == pytest.approx(100.0)  # latency stats: completed requests only
    assert s.fleet_ttft_p95_ms == ((250.0, math.inf),)  # P95 at rank 18.05 of 20 touches the infinite one
    assert (s.fleet_ttft_ok, s.fleet_slo_met, s.num_unfinished) == (False, False, 1)
    refused = summarize(fast + [rec("refused", 0.0, [], refused=True)], SLO, 1.0).overall
    assert _flat(refused.fleet_ttft_p95_ms) == pytest.approx([250.0, 100.0])  # a refused request has no TTFT
    assert refused.fleet_ttft_ok and refused.num_unfinished == 0
    assert not summarize([rec("r", 0.0, [], refused=True)], SLO, 1.0).overall.fleet_ttft_ok  # nothing admitted
    assert summary_to_dict(summarize(fast + [rec("x", 0.0, [])], SLO, 1.0))["overall"]["fleet_ttft_p95_ms"] == [
        [250.0, None]]  # strict JSON: no Infinity


def test_fleet_itl_p95_is_pooled_per_token_over_every_stream():
    steady = rec("steady", 0.0, [0.1 + 0.01 * k for k in range(41)])  # 40 gaps of 10 ms
    stall = rec("stall", 0.0, [0.1, 0.2])  # one gap of 100 ms: TPOT 100 ms, not good
    s = summarize([steady, stall], SLO, 1.0).overall
    assert s.fleet_itl_p95_ms == pytest.approx(10.0)  # rank 38 of 41 gaps; per request it would be ~95.5
    assert (s.fleet_itl_ok, s.num_good) == (True, 1)
    failed = rec("failed", 0.0, [0.1, 0.15, 0.2, 0.25], error="engine died")  # its tokens were streamed too
    s = summarize([stall, failed], SLO, 1.0).overall
    assert s.itl.count == 1 and s.fleet_itl_p95_ms == pytest.approx(92.5)  # gaps 50, 50, 50, 100
    assert not s.fleet_itl_ok
    assert summarize([rec("one", 0.0, [0.1])], SLO, 1.0).overall.fleet_itl_ok  # no gap streamed


def test_groups_reused_from_the_overall_figures_equal_their_own_computation():
    # One model and one tier hold every record: `summarize` reuses the overall figures for them, and the pooled
    # fleet ITL P95 from the ITL statistics when every admitted stream completed. Both equal the direct figures.
    from octoserve.services.metrics import fleet_itl_p95_ms, group_stats

    records = [rec(f"r{i}", 0.01 * i, [0.1 + 0.01 * i + 0.013 * k * (1 + i % 3) for k in range(6)]) for i in range(20)]
    records.append(rec("refused", 0.5, [], refused=True))
    s = summarize(records, SLO, 1.0)
    assert s.per_model == (group_stats("m", records, SLO, 1.0),)
    assert s.per_tier == (group_stats("STANDARD", records, SLO, 1.0),)
    assert s.overall.fleet_itl_p95_ms == fleet_itl_p95_ms(records) == s.overall.itl.p95_ms


def test_passes_capacity_needs_90_percent_of_offered_good_and_the_fleet_slo():
    good = [rec(f"g{k}", 0.0, [0.1, 0.12, 0.14]) for k in range(9)]
    at_90 = summarize(good + [rec("refused", 0.0, [], refused=True)], SLO, 1.0).overall
    assert (at_90.attainment_offered, at_90.fleet_slo_met) == (0.9, True)
    assert passes_capacity(at_90) and not passes_capacity(at_90, threshold=0.95)
    under = summarize(good[:8] + [rec("slow", 0.0, [0.1, 0.15, 0.2])] + [rec("r", 0.0, [], refused=True)],
                      SLO, 1.0).overall
    assert under.attainment_offered == 0.8 and not passes_capacity(under)
    # every request good (TPOT 30 ms) yet the token gaps alternate 1 / 59 ms: ITL P95 fails the fleet SLO
    bursty = summarize([rec(f"b{k}", 0.0, [0.1, 0.101, 0.16]) for k in range(10)], SLO, 1.0).overall
    assert (bursty.attainment_offered, bursty.fleet_itl_ok) == (1.0, False)
    assert not passes_capacity(bursty)


def test_percentile_inf_is_numpys_linear_percentile_with_infinities():
    assert percentile_inf([1.0, 2.0, 3.0, 4.0], 95) == pytest.approx(3.85)
    assert percentile_inf([1.0, 2.0, math.inf], 50) == 2.0
    assert percentile_inf([1.0, math.inf, math.inf], 95) == math.inf
    assert math.isnan(percentile_inf([], 95))


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
    from octoserve.services import plots

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


def test_group_stats_in_one_pass_gives_each_figure_as_its_definition_does():
    # `group_stats` gathers every figure in one pass; each must equal its definition from the record's properties
    # and `meets_slo`, bit for bit, over records of every kind (refused, failed, cut off, never answered,
    # one-token, streamed, own TTFT SLO, preempted, cached prompt).
    import random

    from octoserve.services.metrics import fleet_ttft_p95_ms, group_stats, latency_stats

    rng = random.Random(7)
    records = []
    for i in range(400):
        arrival = rng.uniform(0.0, 10.0)
        kind = rng.choice(["ok", "ok", "ok", "refused", "error", "cut", "silent", "one"])
        n = {"one": 1, "silent": 0}.get(kind, rng.randint(2, 40))
        first = arrival + rng.uniform(0.01, 0.6)
        times = tuple(first + k * rng.uniform(0.005, 0.05) for k in range(n)) if kind != "refused" else ()
        records.append(RequestRecord(
            f"r{i}", "m", Priority.STANDARD, arrival, rng.choice([None, 150.0, 400.0]), rng.randint(1, 3000),
            rng.choice([0, 16, 512]), len(times), times[0] if times else None, times,
            None if kind in ("cut", "silent") or not times else times[-1] + rng.choice([0.0, 0.01]),
            kind == "refused", 50.0 if kind == "refused" else None, "lost" if kind == "error" else "",
            rng.choice([0, 0, 0, 1, 3]),
        ))
    g = group_stats("all", records, SLO, 10.0)
    done = [r for r in records if r.completed]
    admitted = [r for r in records if not r.refused]
    slo_of = lambda r: r.ttft_slo_ms if r.ttft_slo_ms is not None else SLO.ttft_ms  # noqa: E731
    assert (g.num_admitted, g.num_completed) == (len(admitted), len(done)) and 0 < len(done) < len(admitted)
    assert g.num_good == sum(meets_slo(r, SLO) for r in done) > 0
    assert g.num_errors == sum(bool(r.error) and not r.refused for r in records) > 0
    assert g.num_preempted == sum(r.num_preemptions > 0 for r in records)
    assert g.num_preemptions == sum(r.num_preemptions for r in records)
    assert g.num_unfinished == sum(not r.refused and r.finish_s is None for r in records) > 0
    assert g.ttft_attainment == sum(r.ttft_s * 1000.0 <= slo_of(r) for r in done) / len(done)
    assert g.output_throughput_tps == sum(r.num_output_tokens for r in done) / 10.0
    assert g.prefix_hit_fraction == (sum(r.num_cached_prompt_tokens for r in done)
                                     / sum(r.num_prompt_tokens for r in done))
    assert g.ttft == latency_stats([r.ttft_s for r in done])
    assert g.tpot == latency_stats([t for r in done if (t := r.tpot_s) is not None])
    assert g.e2e == latency_stats([r.e2e_s for r in done if r.e2e_s is not None])
    assert g.fleet_ttft_p95_ms == fleet_ttft_p95_ms(records, SLO)
    assert len(g.fleet_ttft_p95_ms) == 3
