"""Routing: each filter and scorer table-driven, the seeded picker, exact picks on hand-built loads, warm vs cold."""

import random

import pytest
from router_fixtures import LM, SM, FixedRng, LinearCost, colocated_config, disagg_config, load, policy, request

from octoserve.services.core.routing import (
    FILTERS,
    SCORERS,
    Candidate,
    Route,
    filter_healthy,
    filter_kv_headroom,
    filter_model,
    pick,
    score_kv_headroom,
    score_queue,
    score_ttft,
    warm_beats_cold,
)
from octoserve.services.core.types import BlockStored, Role

CFG = colocated_config()


def cand(iid="sm-0", model=SM, *, headroom=100, required=50, ahead=0.0, queued=0, wait_s=0.0, own_s=0.1,
         cached=0, total=1000, healthy=True, paused=False) -> Candidate:
    inst = CFG.instance(iid)
    ld = load(iid, inst.model, inst.role, total=total, healthy=healthy, paused=paused)
    return Candidate(inst, ld, headroom, required, ahead, queued, cached, wait_s, own_s, model)


def test_registries_hold_the_configurable_names():
    assert FILTERS.names() == ["healthy", "kv_headroom", "model"]
    assert SCORERS.names() == ["kv_headroom", "queue", "ttft"]


@pytest.mark.parametrize(
    "c, expected",
    [(cand("sm-0", SM), True), (cand("lm-0", SM), False), (cand("lm-0", LM), True), (cand("sm-1", LM), False)],
)
def test_filter_model(c, expected):
    assert filter_model(c) is expected


def test_filter_model_rejects_decode_instances():
    dcfg = disagg_config()
    d = dcfg.instance("d-0")
    c = Candidate(d, load("d-0", LM, Role.DECODE), 100, 1, 0.0, 0, 0, 0.0, 0.1, LM)
    assert filter_model(c) is False
    assert filter_model(Candidate(dcfg.instance("p-0"), load("p-0", LM, Role.PREFILL), 100, 1, 0.0, 0, 0, 0.0, 0.1, LM))


@pytest.mark.parametrize(
    "healthy, paused, expected", [(True, False, True), (False, False, False), (True, True, False), (False, True, False)]
)
def test_filter_healthy(healthy, paused, expected):
    assert filter_healthy(cand(healthy=healthy, paused=paused)) is expected


@pytest.mark.parametrize("headroom, required, expected", [(100, 50, True), (50, 50, True), (49, 50, False), (-3, 1, False)])
def test_filter_kv_headroom(headroom, required, expected):
    assert filter_kv_headroom(cand(headroom=headroom, required=required)) is expected


@pytest.mark.parametrize(
    "times, expected",
    [
        ([(0.0, 0.1), (0.1, 0.1), (0.3, 0.1)], [0.25, 0.5, 1.0]),
        ([(0.0, 0.0), (0.0, 0.0), (0.0, 0.0)], [0.0, 0.0, 0.0]),
    ],
)
def test_score_ttft(times, expected):
    cands = [cand(f"sm-{i}", wait_s=w, own_s=o) for i, (w, o) in enumerate(times)]
    assert list(score_ttft(cands).values()) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize(
    "headroom, required, total, expected",
    [(1000, 0, 1000, 0.0), (600, 100, 1000, 0.5), (100, 100, 1000, 1.0), (50, 100, 1000, 1.0), (10, 1, 0, 1.0)],
)
def test_score_kv_headroom(headroom, required, total, expected):
    assert score_kv_headroom([cand(headroom=headroom, required=required, total=total)]) == {"sm-0": expected}


@pytest.mark.parametrize("queued, expected", [([0, 2, 4], [0.0, 0.5, 1.0]), ([0, 0, 0], [0.0, 0.0, 0.0])])
def test_score_queue(queued, expected):
    cands = [cand(f"sm-{i}", queued=q) for i, q in enumerate(queued)]
    assert list(score_queue(cands).values()) == expected


def test_pick_lowest_cost_then_seeded_tie_break():
    assert pick({"a": 0.3, "b": 0.1, "c": 0.2}, FixedRng(0.9, 0.9, 0.1)) == "b"
    assert pick({"a": 0.1, "b": 0.1, "c": 0.2}, FixedRng(0.9, 0.2, 0.0)) == "b"  # draws in id order: a .9, b .2
    assert pick({"a": 0.1, "b": 0.1}, FixedRng(0.1, 0.2)) == "a"
    picks = {pick({"a": 0.0, "b": 0.0}, random.Random(seed)) for seed in range(20)}
    assert picks == {"a", "b"}
    assert [pick({"a": 0.0, "b": 0.0}, random.Random(7)) for _ in range(3)] == [pick({"a": 0.0, "b": 0.0}, random.Random(7))] * 3


def test_route_picks_by_weighted_cost():
    # Default weights ttft 1.0, kv_headroom 0.2, queue 0.1.
    # sm-0: queue 2000 -> 300 ms, 2 waiting; sm-1: 1000 -> 200 ms, 1 waiting, nearly full; sm-2: 1500 -> 250 ms.
    loads = {
        "lm-0": load("lm-0", LM),
        "sm-0": load("sm-0", queued=2000, waiting=2),
        "sm-1": load("sm-1", queued=1000, waiting=1, free=200),
        "sm-2": load("sm-2", queued=1500, waiting=1, free=900),
    }
    # sm-0 (300 ms) is over the 250 ms SLO and dropped before scoring. Over sm-1 and sm-2:
    # sm-1: 200/250 + .2 * (1 - 131/1000) + .1 * 1 = 1.0738; sm-2: 1 + .2 * (1 - 831/1000) + .1 * 1 = 1.1338.
    assert policy(CFG).route(request(), loads, 0.0) == Route("sm-1", None, 200.0, 0)
    # sm-2 sits at the SLO exactly: with no prior margin (the step model's error on its 150 ms queue would add
    # 30 ms) it stays feasible, and only KV headroom decides.
    only_kv = colocated_config(scorer_weights={"ttft": 0.0, "kv_headroom": 1.0, "queue": 0.0}, ttft_prior_error=0.0)
    assert policy(only_kv).route(request(), loads, 0.0).instance_id == "sm-2"
    no_admission = colocated_config(admission=False, scorer_weights={"kv_headroom": 1.0})
    assert policy(no_admission).route(request(), loads, 0.0).instance_id == "sm-0"


def test_route_accepts_a_sequence_of_loads_and_skips_instances_without_a_snapshot():
    r = policy(CFG).route(request(), [load("sm-2", queued=500)], 0.0)
    assert r == Route("sm-2", None, 150.0, 0)


def test_prefix_overlap_gives_cached_tokens_and_never_the_whole_prompt():
    loads = {f"sm-{i}": load(f"sm-{i}") for i in range(3)}
    r = policy(CFG, overlaps={"sm-1": 10}).route(request(prompt=1000), loads, 0.0)
    assert r == Route("sm-1", None, 84.0, 160)  # 840 uncached tokens
    r = policy(CFG, overlaps={"sm-2": 63}).route(request(prompt=1008), loads, 0.0)
    assert r.instance_id == "sm-2" and r.expected_cached_tokens == 992  # 62 blocks: 16 tokens left to compute


def test_disaggregated_route_picks_prefill_and_the_roomiest_decode():
    cfg = disagg_config()
    loads = {
        "p-0": load("p-0", LM, Role.PREFILL),
        "d-0": load("d-0", LM, Role.DECODE, free=500, running=3),
        "d-1": load("d-1", LM, Role.DECODE, free=800, running=9),
    }
    assert policy(cfg).route(request(model=LM), loads, 0.0) == Route("p-0", "d-1", 100.0, 0)
    loads["d-1"] = load("d-1", LM, Role.DECODE, free=500, running=2)  # equal headroom: fewer running wins
    assert policy(cfg).route(request(model=LM), loads, 0.0).decode_instance_id == "d-1"
    loads["d-1"] = load("d-1", LM, Role.DECODE, free=800, paused=True)
    assert policy(cfg).route(request(model=LM), loads, 0.0).decode_instance_id == "d-0"


def test_a_colocated_entry_of_a_mixed_placement_takes_no_decode_side():
    """A model with a prefill, a decode and a colocated instance (a placement mid-reconfiguration, or one the elastic
    balancer chose): a request routed to the colocated instance runs whole there, with no decode reservation (a
    decode side would send its prompt to Prefill on an instance that does not take one)."""
    import dataclasses

    cfg = disagg_config()
    colocated = dataclasses.replace(cfg.instance("d-1"), role=Role.COLOCATED)
    cfg = dataclasses.replace(cfg, instances=(cfg.instance("p-0"), cfg.instance("d-0"), colocated))
    busy_prefill = {"p-0": load("p-0", LM, Role.PREFILL, queued=50_000), "d-0": load("d-0", LM, Role.DECODE),
                    "d-1": load("d-1", LM, Role.COLOCATED)}
    route = policy(cfg).route(request(model=LM), busy_prefill, 0.0)
    assert (route.instance_id, route.decode_instance_id) == ("d-1", None)
    idle_prefill = {**busy_prefill, "p-0": load("p-0", LM, Role.PREFILL),
                    "d-1": load("d-1", LM, Role.COLOCATED, queued=50_000)}
    route = policy(cfg).route(request(model=LM), idle_prefill, 0.0)
    assert (route.instance_id, route.decode_instance_id) == ("p-0", "d-0")


def test_dispatch_to_a_decode_instance_reserves_its_blocks_there_only():
    cfg = disagg_config()
    p = policy(cfg)
    loads = {"p-0": load("p-0", LM, Role.PREFILL), "d-0": load("d-0", LM, Role.DECODE, free=500),
             "d-1": load("d-1", LM, Role.DECODE, free=400)}
    spec = request(model=LM)
    p.on_dispatched("a", p.route(spec, loads, 0.0), spec)
    assert (p.ledger.pending_blocks("p-0"), p.ledger.pending_blocks("d-0"), p.ledger.pending_blocks("d-1")) == (63, 69, 0)
    # d-0 has 431 free after a's reservation, still more than d-1's 400.
    assert p.route(request("b", model=LM), loads, 0.0).decode_instance_id == "d-0"
    p.on_dispatched("b", p.route(request("b", model=LM), loads, 0.0), request("b", model=LM))
    p.on_first_token("a")
    p.on_first_token("b")  # prefill work is done; the decode reservations stay until a new snapshot
    assert p.route(request("c", model=LM), loads, 0.0).decode_instance_id == "d-1"  # 362 < 400


def test_kv_events_feed_the_prefix_index():
    p = policy(CFG)
    ev = BlockStored((1, 2), None)
    p.on_kv_events("sm-0", [ev])
    assert p.prefix_index.events == [("sm-0", ev)]


# --- seed 003 follow-up: warm busy instance vs cold idle instance, 80 % prefix hit ------------------------------


@pytest.mark.parametrize("warm_queue_tokens, expected", [(0, "sm-0"), (700, "sm-0"), (799, "sm-0"), (900, "sm-1")])
def test_ttft_scorer_waits_for_a_warm_instance_only_while_it_is_faster(warm_queue_tokens, expected):
    """1000-token prompt, 800 cached on sm-0 (50 blocks): warm TTFT = queue/10k + 20 ms, cold = 100 ms.
    Waiting wins exactly while the warm queue is under 800 tokens (80 ms), the prefill the cache saves."""
    ttft_only = colocated_config(scorer_weights={"ttft": 1.0})
    loads = {"sm-0": load("sm-0", queued=warm_queue_tokens, waiting=3), "sm-1": load("sm-1")}
    r = policy(ttft_only, overlaps={"sm-0": 50}).route(request(prompt=1000), loads, 0.0)
    assert r.instance_id == expected
    warm_ms = warm_queue_tokens / 10 + 20.0
    assert r.predicted_ttft_ms == pytest.approx(warm_ms if expected == "sm-0" else 100.0)
    assert warm_beats_cold(LinearCost(), 1000, 800, warm_queue_tokens / 10_000) is (expected == "sm-0")


def test_warm_beats_cold_with_the_real_cost_model():
    from octoserve.services.core.cost_model import CostModel
    from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS

    cost = CostModel(MODEL_PRESETS[SM], GPU_PRESETS["h100-sxm-80gb"], 1)
    saved_s = cost.prefill_time_s(2000) - cost.prefill_time_s(400, 1600)
    assert saved_s > 0
    assert warm_beats_cold(cost, 2000, 1600, saved_s * 0.99)
    assert not warm_beats_cold(cost, 2000, 1600, saved_s * 1.01)


def test_real_prefix_index_sees_blocks_an_engine_cached():
    from octoserve.services.core.kv_cache import KVCacheManager

    kv = KVCacheManager(100, 16, True, extra_key=SM)  # what octoserve.services.core.instance builds for an 8B instance
    prompt = tuple(range(1000, 1100))  # 6 full blocks + 4 tokens
    kv.allocate("old", prompt, len(prompt))
    kv.cache_computed("old", prompt, len(prompt))
    ttft_only = colocated_config(scorer_weights={"ttft": 1.0})
    from octoserve.services.core.routing import RouterPolicy

    p = RouterPolicy(ttft_only, {i.id: LinearCost() for i in ttft_only.instances}, FixedRng(0.5, 0.5, 0.5))
    p.on_kv_events("sm-2", kv.drain_events())
    spec = request(prompt=120)
    spec = type(spec)(spec.request_id, SM, prompt + tuple(range(5000, 5020)), spec.sampling, 0.0)
    loads = {f"sm-{i}": load(f"sm-{i}") for i in range(3)}
    assert p.route(spec, loads, 0.0) == Route("sm-2", None, 2.4, 96)  # 24 uncached tokens at 10k tokens/s


# --- baseline options: round-robin picker, cache-blind routing ---------------------------------------------------


def test_round_robin_takes_instances_in_id_order_and_skips_filtered_ones():
    p = policy(colocated_config(picker="round_robin"))
    loads = {f"sm-{i}": load(f"sm-{i}", queued=100 * i) for i in range(3)}
    picks = [p.route(request(f"r{k}"), loads, 0.0).instance_id for k in range(4)]
    assert picks == ["sm-0", "sm-1", "sm-2", "sm-0"]  # queue lengths ignored
    loads["sm-1"] = load("sm-1", free=0)  # the kv_headroom filter drops it: its turn goes to the next one
    assert [p.route(request(f"s{k}"), loads, 0.0).instance_id for k in range(3)] == ["sm-2", "sm-0", "sm-2"]


def test_round_robin_keeps_one_turn_per_model():
    p = policy(colocated_config(picker="round_robin"))
    loads = {"lm-0": load("lm-0", LM), **{f"sm-{i}": load(f"sm-{i}") for i in range(3)}}
    assert p.route(request("a"), loads, 0.0).instance_id == "sm-0"
    assert p.route(request("b", model=LM), loads, 0.0).instance_id == "lm-0"
    assert p.route(request("c"), loads, 0.0).instance_id == "sm-1"


def test_cache_blind_routing_predicts_no_hit():
    loads = {f"sm-{i}": load(f"sm-{i}") for i in range(3)}
    aware = policy(CFG, overlaps={"sm-1": 10}).route(request(prompt=1000), loads, 0.0)
    blind = policy(colocated_config(prefix_aware_routing=False), overlaps={"sm-1": 10}, rng=FixedRng(0.3, 0.2, 0.1))
    r = blind.route(request(prompt=1000), loads, 0.0)
    assert aware == Route("sm-1", None, 84.0, 160)
    assert r == Route("sm-2", None, 100.0, 0)  # equal costs: the smallest tie-break draw (sm-2's 0.1) wins
