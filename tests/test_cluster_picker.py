"""The cluster tier's pure parts: headroom summaries (services/cluster/headroom.py) and the cluster picker
(services/cluster/picker.py), driven directly with hand-built summaries and real router policies; no clocks."""

from __future__ import annotations

import dataclasses
import random

import pytest

from octoserve.services.cluster.headroom import (
    HeadroomPublisher,
    HeadroomSummary,
    ModelHeadroom,
    TierHeadroom,
    cached_prefix_tokens,
)
from octoserve.services.cluster.picker import ClusterPicker, ClusterPolicy, ClusterRefuse, NodePick, RoundRobinPicker
from octoserve.services.config import load_node_config
from octoserve.services.core.kv_cache import prefix_block_hashes
from octoserve.services.core.routing import RouterPolicy, build_cost_models
from octoserve.services.core.types import BlockStored, EngineLoad, Priority, RequestSpec, Role, SamplingParams

SM = "llama-3-8b"
TIERS = (Priority.INTERACTIVE, Priority.STANDARD, Priority.BATCH)


def _model(wait_ms=0.0, admitting=True, retry_ms=0, rate=10_000.0, free=1000, capacity=1.0, instances=1,
           correction_ms=0.0, idle_rate=0.0):
    tiers = tuple(TierHeadroom(t, admitting, retry_ms, wait_ms, correction_ms) for t in TIERS)
    return ModelHeadroom(SM, tiers, rate, free, 2000, 16, capacity, instances, idle_rate)


def _summary(node, *, hot=frozenset(), healthy=True, as_of_s=0.0, **model):
    return HeadroomSummary(node, healthy, as_of_s, (_model(**model),), frozenset(hot))


def _spec(n_tokens=1000, tokens=None, tier=Priority.STANDARD, rid="r"):
    tokens = tuple(tokens) if tokens is not None else tuple(range(1000, 1000 + n_tokens))
    return RequestSpec(rid, SM, tokens, SamplingParams(max_tokens=64), 0.0, tier)


def _picker(*summaries, **policy):
    p = ClusterPicker(ClusterPolicy(**policy), random.Random(0))
    for s in summaries:
        p.on_summary(s)
    return p


def test_fallbacks_are_the_next_cheapest_nodes_that_pass_the_filters():
    # Predicted TTFT 100 + wait ms against a 250-ms SLO: d (200 ms of queue) is past it, so never a fallback.
    nodes = [_summary("a", wait_ms=40.0), _summary("b", wait_ms=0.0), _summary("c", wait_ms=20.0),
             _summary("d", wait_ms=200.0), _summary("e", wait_ms=60.0)]
    chosen = _picker(*nodes, max_node_tries=3).pick(_spec(), 0.0)
    assert chosen.node_id == "b"
    assert [(f.node_id, f.predicted_ttft_ms) for f in chosen.fallbacks] == [("c", 120.0), ("a", 140.0)]
    assert [f.node_id for f in _picker(*nodes).pick(_spec(), 0.0).fallbacks] == ["c", "a", "e"]  # default: 4 tries
    assert _picker(*nodes, max_node_tries=1).pick(_spec(), 0.0).fallbacks == ()
    with pytest.raises(ValueError, match="max_node_tries must be >= 1"):
        ClusterPolicy(max_node_tries=0)


@pytest.mark.parametrize("waits, expected", [
    ((0.0, 50.0), "a"),
    ((80.0, 10.0), "b"),
    ((30.0, 30.0, 5.0), "c"),
])
def test_lowest_predicted_ttft_wins(waits, expected):
    picker = _picker(*(_summary(n, wait_ms=w) for n, w in zip("abc", waits)))
    chosen = picker.pick(_spec(), 0.0)
    assert isinstance(chosen, NodePick) and chosen.node_id == expected
    # 1000 uncached tokens at 10,000 tokens/s: 100 ms of prefill on top of the wait.
    assert chosen.predicted_ttft_ms == pytest.approx(min(waits) + 100.0)


def test_prefix_locality_sends_a_hot_prompt_where_it_is_cached():
    prompt = tuple(range(5000, 5000 + 1000))
    hot = frozenset(prefix_block_hashes(prompt[:512], 16, SM))  # 32 leading blocks cached on b
    picker = _picker(_summary("a"), _summary("b", hot=hot))
    chosen = picker.pick(_spec(tokens=prompt), 0.0)
    assert (chosen.node_id, chosen.expected_cached_tokens) == ("b", 512)
    assert chosen.predicted_ttft_ms == pytest.approx((1000 - 512) / 10.0)
    assert cached_prefix_tokens(prompt[:512], SM, 16, hot) == 496  # never the whole prompt: the last block computes


def test_backpressure_refuses_with_the_soonest_retry_across_nodes():
    picker = _picker(_summary("a", admitting=False, retry_ms=900, wait_ms=1000.0),
                     _summary("b", admitting=False, retry_ms=300, wait_ms=400.0),
                     _summary("c", healthy=False, admitting=False, retry_ms=50))
    refused = picker.pick(_spec(), 0.0)
    assert refused == ClusterRefuse(300, "every node refuses llama-3-8b STANDARD now")
    # A node that admits the reference prompt but is predicted late for this longer one: the excess is its delay.
    picker = _picker(_summary("a", wait_ms=200.0))
    assert picker.pick(_spec(2000), 0.0) == ClusterRefuse(150, "every node refuses llama-3-8b STANDARD now")
    assert _picker(_summary("a", healthy=False)).pick(_spec(), 0.0).retry_after_ms == 1000


def test_stale_or_forgotten_nodes_are_not_picked():
    picker = _picker(_summary("a", as_of_s=0.0), _summary("b", as_of_s=9.0, wait_ms=100.0))
    assert picker.pick(_spec(), 10.0).node_id == "b"  # a's summary is 10 s old
    picker.forget("b")
    assert isinstance(picker.pick(_spec(), 10.0), ClusterRefuse)


def test_work_sent_since_the_summary_counts_against_the_node():
    picker = _picker(_summary("a", wait_ms=0.0), _summary("b", wait_ms=40.0))
    picks = []
    for k in range(3):
        spec = _spec(rid=f"r{k}")
        chosen = picker.pick(spec, 0.0)
        picker.on_dispatched(chosen.node_id, spec, chosen)
        picks.append(chosen.node_id)
    # a: 100 ms, then 200 ms (1000 pending tokens); b: 140 ms. So a, b, then a again (200 < 240).
    assert picks == ["a", "b", "a"]
    picker.on_summary(_summary("a", wait_ms=0.0))  # the new summary includes what was sent: pending cleared
    assert picker.pick(_spec(), 0.0).node_id == "a"


def test_a_squeezed_node_spills_sm_work_and_counts_it():
    picker = _picker(_summary("a", wait_ms=0.0, capacity=0.4), _summary("b", wait_ms=30.0))
    chosen = picker.pick(_spec(), 0.0)
    # a would take 100 ms at full capacity, 250 ms at 40 %; b takes 130 ms.
    assert (chosen.node_id, chosen.spilled) == ("b", True)
    assert picker.num_spilled == 1
    unsqueezed = _picker(_summary("a", wait_ms=0.0), _summary("b", wait_ms=30.0)).pick(_spec(), 0.0)
    assert (unsqueezed.node_id, unsqueezed.spilled) == ("a", False)


def test_an_empty_queue_prefills_at_the_idle_rate_a_queue_at_the_loaded_one():
    picker = _picker(_summary("a", idle_rate=40_000.0), _summary("b", wait_ms=10.0, idle_rate=40_000.0))
    assert picker.pick(_spec(), 0.0).predicted_ttft_ms == pytest.approx(25.0)  # 1000 tokens at 40k/s, nothing ahead
    picker.forget("a")
    assert picker.pick(_spec(), 0.0).predicted_ttft_ms == pytest.approx(110.0)  # 10 ms queue, then 10k/s


def test_kv_headroom_filter_counts_pending_blocks():
    picker = _picker(_summary("a", free=70), _summary("b", free=2000, wait_ms=500.0))
    spec = _spec()  # 1000 + 64 tokens: 67 blocks of 16
    first = picker.pick(spec, 0.0)
    assert first.node_id == "a"
    picker.on_dispatched("a", spec, first)
    assert isinstance(picker.pick(_spec(rid="x"), 0.0), ClusterRefuse)  # b is too late, a is now full


def test_round_robin_ignores_load_and_skips_down_nodes():
    rr = RoundRobinPicker(["n1", "n0", "n2"])
    assert [rr.pick(_spec(), 0.0).node_id for _ in range(4)] == ["n0", "n1", "n2", "n0"]
    rr.on_summary(_summary("n1", healthy=False))
    assert [rr.pick(_spec(), 0.0).node_id for _ in range(3)] == ["n2", "n0", "n2"]


# --- the publisher over a real router policy ---------------------------------------------------------------


def _policy():
    config = load_node_config(None)
    return config, RouterPolicy(config, build_cost_models(config), random.Random(0))


def _load(inst, *, queued=0, free=None, waiting=0):
    total = 10_000
    return EngineLoad(inst.id, inst.model, Role.COLOCATED, 0, waiting, total, total if free is None else free, 16,
                      queued, 20_000.0, 0.01, max_num_seqs=256)


def test_summary_of_an_idle_node_admits_every_tier():
    config, policy = _policy()
    publisher = HeadroomPublisher("n", policy)
    loads = {i.id: _load(i) for i in config.instances}
    s = publisher.summary(loads, 3.0)
    assert (s.node_id, s.healthy, s.as_of_s) == ("n", True, 3.0)
    sm = s.model(SM)
    assert [t.admitting for t in sm.tiers] == [True, True, True]
    assert [t.retry_after_ms for t in sm.tiers] == [0, 0, 0]
    assert sm.num_instances == 4 and sm.kv_free_blocks == 10_000 and sm.capacity_fraction == 1.0
    assert all(t.wait_ms == 0.0 for t in sm.tiers)


def test_summary_of_a_queued_node_refuses_urgent_tiers_with_a_retry_delay():
    config, policy = _policy()
    publisher = HeadroomPublisher("n", policy)
    loads = {i.id: _load(i, queued=40_000, waiting=40) for i in config.instances}  # 2 s of prefill queued
    sm = publisher.summary(loads, 0.0).model(SM)
    interactive, standard, batch = sm.tiers
    assert not interactive.admitting and not standard.admitting and batch.admitting
    assert interactive.retry_after_ms > 1000 and interactive.wait_ms == pytest.approx(2000.0)
    squeezed = publisher.summary({i.id: _load(i) for i in config.instances}, 0.0, capacity_fraction={SM: 0.5})
    assert squeezed.model(SM).capacity_fraction == 0.5


def test_hot_prefix_hashes_are_the_routed_prompts_blocks_that_the_node_caches():
    config, policy = _policy()
    publisher = HeadroomPublisher("n", policy, max_hot_blocks=4, hot_refresh_every=1)
    prompt = tuple(range(2000, 2000 + 160))  # 10 blocks
    hashes = prefix_block_hashes(prompt, 16, SM)
    loads = {i.id: _load(i) for i in config.instances}
    for k in range(3):
        policy.route(RequestSpec(f"p{k}", SM, prompt, SamplingParams(max_tokens=8), 0.0), loads, 0.0)
    assert publisher.summary(loads, 0.0).hot_prefix_hashes == frozenset()  # routed, not yet cached anywhere
    policy.on_kv_events("sm-0", [BlockStored(tuple(hashes[:6]), None)])
    hot = publisher.summary(loads, 0.0).hot_prefix_hashes
    assert len(hot) == 4 and hot <= set(hashes[:6])


def test_prompt_counts_stay_bounded_when_no_summary_is_ever_read():
    config, policy = _policy()
    publisher = HeadroomPublisher("n", policy, max_hot_blocks=10, max_heat_hashes=20)
    loads = {i.id: _load(i) for i in config.instances}
    hot_prompt = tuple(range(2000, 2000 + 160))  # 10 blocks
    for k in range(4):
        policy.route(RequestSpec(f"hot{k}", SM, hot_prompt, SamplingParams(max_tokens=8), 0.0), loads, 0.0)
    assert publisher.num_heat_hashes() == 10
    policy.route(RequestSpec("c0", SM, tuple(range(5000, 5160)), SamplingParams(max_tokens=8), 0.0), loads, 0.0)
    assert publisher.num_heat_hashes() == 20  # at the bound: kept
    policy.route(RequestSpec("c1", SM, tuple(range(6000, 6160)), SamplingParams(max_tokens=8), 0.0), loads, 0.0)
    # 30 > 20: halved until at most 10 remain; the prompts seen once cool out, the one seen 4 times stays.
    assert publisher.num_heat_hashes() == 10
    hashes = prefix_block_hashes(hot_prompt, 16, SM)
    policy.on_kv_events("sm-0", [BlockStored(tuple(hashes), None)])
    assert publisher.summary(loads, 0.0).hot_prefix_hashes == frozenset(hashes)


def test_a_lease_that_pushes_decode_steps_past_the_itl_slo_takes_the_node_out():
    def summary(node, capacity, step_ms):
        s = _summary(node, capacity=capacity)
        return HeadroomSummary(node, True, 0.0, (dataclasses.replace(s.models[0], decode_step_ms=step_ms),),
                               frozenset())

    # 12 ms steps at half capacity are 24 ms: within 30 ms, so the squeezed (but otherwise idle) node still counts.
    assert _picker(summary("a", 0.5, 12.0), summary("b", 1.0, 12.0)).pick(_spec(), 0.0).node_id == "b"
    assert _picker(summary("a", 0.5, 12.0)).pick(_spec(), 0.0).node_id == "a"
    # 18 ms steps at half capacity are 36 ms: every stream there would miss its ITL SLO.
    assert isinstance(_picker(summary("a", 0.5, 18.0)).pick(_spec(), 0.0), ClusterRefuse)
    assert _picker(summary("a", 1.0, 40.0)).pick(_spec(), 0.0).node_id == "a"  # only a lease triggers it


def test_published_decode_step_is_the_cost_models_next_sequence_step_not_the_observed_one():
    """The observed step (0.5 s here) is ignored: it carries a lease's stretch and goes stale on an idle node."""
    from octoserve.services.cluster.headroom import DECODE_CONTEXT_TOKENS

    config, policy = _policy()
    publisher = HeadroomPublisher("n", policy)
    running = iter((7, 3, 9, 5, 4))  # sequences each instance runs; every observed decode step was 0.5 s
    loads = {i.id: dataclasses.replace(_load(i), num_running=next(running), decode_step_time_s=0.5)
             for i in config.instances}
    sm = publisher.summary(loads, 0.0).model(SM)
    sm_inst = min((i for i in config.instances if i.model == SM), key=lambda i: loads[i.id].num_running)
    assert loads[sm_inst.id].num_running == 3
    cost = policy.cost_model_of(sm_inst)  # the router's own (the least busy 8B instance: 3 running)
    assert sm.decode_step_ms == pytest.approx(cost.decode_step_time_s(4, DECODE_CONTEXT_TOKENS) * 1000.0)
    per_seq = (cost.decode_step_time_s(5, DECODE_CONTEXT_TOKENS) - cost.decode_step_time_s(4, DECODE_CONTEXT_TOKENS))
    assert sm.decode_step_per_seq_ms == pytest.approx(per_seq * 1000.0) and sm.decode_step_per_seq_ms > 0
    assert sm.mixed_step_ms == config.slo.itl_ms  # colocated: prefill chunks fill steps up to the ITL SLO
    assert sm.decode_step_ms < 100.0


def test_requests_sent_since_the_summary_lengthen_the_step_a_squeezed_node_is_judged_by():
    def summary(node, capacity):
        s = _summary(node, capacity=capacity, instances=2, rate=1_000_000.0)  # TTFT never binds here
        return HeadroomSummary(node, True, 0.0, (dataclasses.replace(
            s.models[0], decode_step_ms=12.0, decode_step_per_seq_ms=1.0),), frozenset())

    picker = _picker(summary("a", 0.5))
    taken = []
    for k in range(8):
        chosen = picker.pick(_spec(rid=f"r{k}"), 0.0)
        if isinstance(chosen, ClusterRefuse):
            break
        picker.on_dispatched(chosen.node_id, _spec(rid=f"r{k}"), chosen)
        taken.append(chosen.node_id)
    # (12 + n / 2 instances x 1 ms) / 0.5 <= 30 ms holds for n <= 6 requests sent since the summary: 7 fit.
    assert taken == ["a"] * 7
    picker.on_summary(summary("a", 0.5))  # a new summary counts them: the node takes work again
    assert picker.pick(_spec(), 0.0).node_id == "a"


def test_a_squeezed_colocated_node_is_out_for_new_streams_while_its_mixed_steps_pass_the_slo():
    def summary(node, capacity, mixed_ms):
        s = _summary(node, capacity=capacity)
        return HeadroomSummary(node, True, 0.0, (dataclasses.replace(
            s.models[0], decode_step_ms=10.0, mixed_step_ms=mixed_ms),), frozenset())

    assert isinstance(_picker(summary("a", 0.5, 30.0)).pick(_spec(), 0.0), ClusterRefuse)  # 60 ms mixed steps
    assert _picker(summary("a", 0.5, 15.0)).pick(_spec(), 0.0).node_id == "a"  # steps sized for the lease: 30 ms
    assert _picker(summary("a", 0.5, 30.0), summary("b", 1.0, 30.0)).pick(_spec(), 0.0).node_id == "b"
    assert _picker(summary("a", 1.0, 30.0)).pick(_spec(), 0.0).node_id == "a"  # no lease: the node's own SLO sizing


def test_the_queue_a_summary_reports_drains_with_its_age():
    """The node keeps prefilling after it publishes: 100 ms queued at t=0 is 40 ms at t=0.06 (20 ms more under a
    half-capacity lease, whose GPU share drains it at half speed), and never below zero."""
    picker = _picker(_summary("a", wait_ms=100.0))
    assert picker.pick(_spec(), 0.0).predicted_ttft_ms == pytest.approx(100.0 + 100.0)
    assert picker.pick(_spec(), 0.06).predicted_ttft_ms == pytest.approx(40.0 + 100.0)
    assert picker.pick(_spec(), 0.5).predicted_ttft_ms == pytest.approx(0.0 + 100.0)
    squeezed = _picker(_summary("a", wait_ms=100.0, capacity=0.5))
    late = squeezed.pick(_spec(tier=Priority.BATCH), 0.06)  # 340 ms: past STANDARD's SLO, within BATCH's
    assert late.predicted_ttft_ms == pytest.approx((0.1 - 0.03 + 0.1) / 0.5 * 1000.0)
