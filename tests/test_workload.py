"""Workload profiles and the seeded trace generator: determinism, shares, rates, prefixes, lengths."""

import dataclasses
import math
import random
import statistics

import pytest

from octoserve.services.core.types import Priority
from octoserve.services.metrics import SloSpec
from octoserve.services.workload import (
    PROFILES,
    LengthDist,
    ModelTraffic,
    TierShare,
    WorkloadProfile,
    generate_trace,
    iter_trace,
    scaled,
    trace_from_jsonl,
    trace_to_jsonl,
    with_context_limits,
)


def small_profile(**kw) -> WorkloadProfile:
    traffic = (
        ModelTraffic("a", 0.75, LengthDist.fixed(40), LengthDist.uniform(1, 20), num_prefix_groups=3,
                     prefix_len_tokens=32, prefix_hit_rate=0.5, max_context_len=512),
        ModelTraffic("b", 0.25, LengthDist.uniform(10, 60), LengthDist.fixed(8),
                     tiers=(TierShare(Priority.INTERACTIVE, 0.5, 200.0), TierShare(Priority.BATCH, 0.5, 10_000.0)),
                     max_context_len=512),
    )
    return WorkloadProfile("small", rate_rps=kw.pop("rate_rps", 100.0), duration_s=kw.pop("duration_s", 10.0),
                           traffic=traffic, **kw)


@pytest.fixture(scope="module")
def seed000_trace():
    # ~20k requests: seed 000 at its 300 req/s for 66.7 s, fixed seed so the statistical checks are deterministic
    return generate_trace(scaled(PROFILES["seed-000"], duration_s=66.7), seed=7)


def test_length_dists_sample_and_clip():
    rng = random.Random(0)
    assert LengthDist.fixed(5).sample(rng) == 5
    assert {LengthDist.uniform(3, 5).sample(rng) for _ in range(200)} == {3, 4, 5}
    clipped = LengthDist.lognormal(1000.0, 2.0, min_tokens=100, max_tokens=2000)
    xs = [clipped.sample(rng) for _ in range(2000)]
    assert min(xs) == 100 and max(xs) == 2000
    free = LengthDist.lognormal(1000.0, 0.5)
    assert statistics.mean(free.sample(rng) for _ in range(20_000)) == pytest.approx(1000.0, rel=0.02)
    with pytest.raises(ValueError):
        LengthDist("normal")
    with pytest.raises(ValueError):
        LengthDist.uniform(5, 3)


def test_trace_is_deterministic_for_a_seed():
    p = small_profile()
    assert generate_trace(p, 3) == generate_trace(p, 3)
    assert generate_trace(p, 3) == generate_trace(p, random.Random(3))
    assert generate_trace(p, 3) != generate_trace(p, 4)
    trace = generate_trace(p, 3)
    assert [r.request_id for r in trace[:3]] == ["r0000000", "r0000001", "r0000002"]
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(trace, trace[1:]))
    assert 0 < trace[0].arrival_s and trace[-1].arrival_s < 10.0


def test_seed000_shares_rate_and_lengths(seed000_trace):
    trace = seed000_trace
    n = len(trace)
    assert n == pytest.approx(300 * 66.7, rel=0.02)
    small = sum(r.model == "llama-3-8b" for r in trace) / n
    assert small == pytest.approx(0.75, abs=0.01)
    assert {r.priority for r in trace} == {Priority.STANDARD}
    assert {r.ttft_slo_ms for r in trace} == {250.0}
    assert statistics.mean(len(r.prompt_token_ids) for r in trace) == pytest.approx(1000, rel=0.03)
    assert statistics.mean(r.output_len for r in trace) == pytest.approx(400, rel=0.03)
    assert sum(r.prefix_group >= 0 for r in trace) / n == pytest.approx(0.10, abs=0.01)


def test_max_tokens_is_ceil_factor_times_output_within_context(seed000_trace):
    uncapped = capped = 0
    for r in seed000_trace:
        room = 8192 - len(r.prompt_token_ids)
        assert 1 <= r.output_len <= r.max_tokens <= room
        if math.ceil(4 * r.output_len) <= room:
            assert r.max_tokens == math.ceil(4 * r.output_len)
            uncapped += 1
        else:
            assert r.max_tokens == room
            capped += 1
    assert uncapped > 0.95 * len(seed000_trace) and capped > 0  # both branches exercised


def test_token_ids_avoid_specials(seed000_trace):
    lo = min(min(r.prompt_token_ids) for r in seed000_trace[:2000])
    hi = max(max(r.prompt_token_ids) for r in seed000_trace[:2000])
    assert 1000 <= lo and hi < 30000


def test_prefix_groups_share_exact_tokens_and_nothing_else():
    trace = generate_trace(small_profile(), 1)
    a = [r for r in trace if r.model == "a"]
    groups = {}
    for r in a:
        if r.prefix_group >= 0:
            groups.setdefault(r.prefix_group, set()).add(r.prompt_token_ids[:32])
    assert sorted(groups) == [0, 1, 2]
    assert all(len(prefixes) == 1 for prefixes in groups.values())
    assert len({next(iter(p)) for p in groups.values()}) == 3  # distinct groups, distinct prompts
    # beyond the group prefix, the next token(s) encode the request index: no two prompts share them
    heads = [r.prompt_token_ids[32 if r.prefix_group >= 0 else 0:][:2] for r in trace]
    assert len(set(heads)) == len(trace)
    assert sum(r.prefix_group >= 0 for r in a) / len(a) == pytest.approx(0.5, abs=0.05)
    assert all(r.prefix_group == -1 for r in trace if r.model == "b")


def test_zipf_groups_favour_group_zero():
    p = small_profile()
    zipf = dataclasses.replace(p, traffic=(dataclasses.replace(p.traffic[0], prefix_zipf_exponent=1.0), p.traffic[1]))
    trace = generate_trace(scaled(zipf, duration_s=60.0), 2)
    counts = [sum(r.prefix_group == g for r in trace) for g in range(3)]
    total = sum(counts)
    # weights 1, 1/2, 1/3 -> 6/11, 3/11, 2/11
    assert [c / total for c in counts] == pytest.approx([6 / 11, 3 / 11, 2 / 11], abs=0.03)


def test_tiers_carry_their_ttft_slo():
    trace = generate_trace(small_profile(), 5)
    b = [r for r in trace if r.model == "b"]
    assert {(r.priority, r.ttft_slo_ms) for r in b} == {(Priority.INTERACTIVE, 200.0), (Priority.BATCH, 10_000.0)}
    inter = sum(r.priority == Priority.INTERACTIVE for r in b) / len(b)
    assert inter == pytest.approx(0.5, abs=0.07)


def _interarrival_cv(trace):
    gaps = [b.arrival_s - a.arrival_s for a, b in zip(trace, trace[1:])]
    return statistics.pstdev(gaps) / statistics.mean(gaps), len(gaps) / (trace[-1].arrival_s - trace[0].arrival_s)


def test_gamma_burstiness_raises_interarrival_cv():
    p = small_profile(rate_rps=200.0, duration_s=100.0)
    cv_poisson, rate_poisson = _interarrival_cv(generate_trace(p, 9))
    cv_bursty, rate_bursty = _interarrival_cv(generate_trace(scaled(p, burstiness=0.25), 9))
    assert cv_poisson == pytest.approx(1.0, abs=0.05)
    assert cv_bursty == pytest.approx(2.0, abs=0.2)  # gamma CV = 1 / sqrt(shape)
    assert rate_poisson == pytest.approx(200.0, rel=0.05) and rate_bursty == pytest.approx(200.0, rel=0.05)


def test_seed003_tiers_prefix_reuse_and_context():
    trace = generate_trace(scaled(PROFILES["seed-003"], duration_s=4.0), 11)
    assert len(trace) == pytest.approx(625 * 4, rel=0.06)
    assert {r.priority for r in trace} == {Priority.INTERACTIVE, Priority.BATCH}
    assert {r.ttft_slo_ms for r in trace if r.priority == Priority.INTERACTIVE} == {200.0}
    assert sum(r.prefix_group >= 0 for r in trace) / len(trace) == pytest.approx(0.8, abs=0.03)
    assert all(len(r.prompt_token_ids) + r.max_tokens <= 32_768 for r in trace)
    assert max(len(r.prompt_token_ids) for r in trace) > 16_000  # long tail reaches long contexts


def test_context_limit_is_respected_and_overridable():
    p = with_context_limits(small_profile(), {"a": 64})
    assert p.model_traffic("a").max_context_len == 64 and p.model_traffic("b").max_context_len == 512
    for r in generate_trace(p, 0):
        if r.model == "a":
            assert len(r.prompt_token_ids) + r.max_tokens <= 64 and r.output_len >= 1


def test_scaled_and_overrides():
    p = PROFILES["seed-000"]
    q = scaled(p, rate_rps=10.0, duration_s=2.0, burstiness=0.5)
    assert (q.rate_rps, q.duration_s, q.burstiness, q.arrival) == (10.0, 2.0, 0.5, "gamma")
    assert p.rate_rps == 300.0  # the original is untouched
    assert generate_trace(p, 1, rate_rps=10.0, duration_s=2.0) == generate_trace(scaled(p, rate_rps=10.0,
                                                                                          duration_s=2.0), 1)
    assert PROFILES["seed-003"].slo == SloSpec(200.0, 30.0)


def test_profile_validation():
    with pytest.raises(ValueError):
        small_profile(arrival="uniform")
    with pytest.raises(ValueError):
        small_profile(rate_rps=0.0)
    with pytest.raises(ValueError):
        ModelTraffic("x", 1.0, LengthDist.fixed(5), LengthDist.fixed(5), prefix_hit_rate=0.5)


def test_jsonl_round_trip_and_request_spec(tmp_path):
    trace = generate_trace(small_profile(duration_s=1.0), 2)
    path = tmp_path / "trace.jsonl"
    trace_to_jsonl(trace, path)
    assert trace_from_jsonl(path) == trace
    r = trace[0]
    spec = r.to_request_spec(arrival_s=123.0)
    assert (spec.request_id, spec.arrival_s, spec.max_tokens, spec.sim_output_len, spec.ttft_slo_ms) == (
        r.request_id, 123.0, r.max_tokens, r.output_len, r.ttft_slo_ms)
    assert spec.prompt_token_ids == r.prompt_token_ids
    record = r.record(first_token_s=r.arrival_s + 0.1, refused=False)
    assert (record.request_id, record.model, record.num_prompt_tokens) == (r.request_id, r.model,
                                                                           len(r.prompt_token_ids))


def test_iter_trace_yields_the_same_requests_lazily():
    p = small_profile(duration_s=2.0)
    it = iter_trace(p, 6)
    first = next(it)
    assert [first, *it] == generate_trace(p, 6)
