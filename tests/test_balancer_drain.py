"""The live balancer's drain estimate knows about migration: with `elastic.migrate` on, a retired instance's drain is
what the migration rule (services/core/migration.py) makes of its running decodes against the other instances of
its model (the hand-off of those it would move, the decode left of those it would keep), not their remaining
decode; the balancer's cost check and its planned reconfiguration carry that estimate."""

from __future__ import annotations

import dataclasses

import pytest

from octoserve.services.core import migration
from octoserve.services.core.balancer import BalancerPolicy
from octoserve.services.core.elastic_load import ModelDemand
from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.core.types import EngineLoad, Role
from octoserve.services.core.live_balancer import LiveElasticBalancer, LiveView, node_load
from tests.fault_fixtures import two_replica_config
from tests.service_fixtures import COLOCATED_MODEL

NODE = node_config_from_dict(two_replica_config())  # one 8B on c0 and c1, 703 KV blocks of 16 tokens each
STEP_S = 0.007
MEAN_OUTPUT = 400.0


def _load(iid: str, running: int, free: int, slots: int = 64, step_s: float = STEP_S, waiting: int = 0) -> EngineLoad:
    return EngineLoad(iid, COLOCATED_MODEL, Role.COLOCATED, running, waiting, 703, free, 16, 0, 1e4, step_s,
                      max_num_seqs=slots, mean_output_tokens=MEAN_OUTPUT)


def _view(loads: dict[str, EngineLoad], migrate: bool) -> LiveView:
    return LiveView(NODE.instances, {i.id: True for i in NODE.instances}, loads,
                    (ModelDemand(COLOCATED_MODEL, 1.0),), 10.0, migrate)


def _drain(node, loads, migrate: bool = True) -> float:
    return node_load(_view(loads, migrate), node).load_of("c1").est_drain_s


def test_drain_estimate_is_the_hand_off_when_the_rule_moves_every_decode():
    # c1: 6 decodes holding 114 blocks (1824 tokens: 304 each); c0 has the slots, the KV and the step for all six.
    loads = {"c1": _load("c1", 6, 703 - 114), "c0": _load("c0", 2, 650)}
    drain_only = MEAN_OUTPUT * STEP_S
    hand_off = NODE.cost_model(NODE.instance("c1")).kv_transfer_time_s(304) + STEP_S
    assert _drain(NODE, loads, migrate=False) == pytest.approx(drain_only)
    assert _drain(NODE, loads) == pytest.approx(hand_off)
    assert hand_off < drain_only / 100
    # Requests still waiting for their prefill on c1 finish there: the drain waits for them; so does a decode
    # reservation whose KV is on its way (it decodes there once it arrives).
    waiting = {**loads, "c1": _load("c1", 6, 703 - 114, waiting=1)}
    assert _drain(NODE, waiting) == pytest.approx(drain_only)
    reserved = {**loads, "c1": dataclasses.replace(loads["c1"], num_reserved=1)}
    assert _drain(NODE, reserved) == pytest.approx(drain_only)
    only_reserved = dataclasses.replace(loads["c1"], num_running=0, num_reserved=2)
    assert _drain(NODE, {**loads, "c1": only_reserved}, migrate=False) == pytest.approx(drain_only)


def test_drain_estimate_waits_for_the_decodes_the_rule_would_keep():
    # Two free slots on c0: two decodes move, four stay and decode on (a whole mean output each).
    loads = {"c1": _load("c1", 6, 703 - 114), "c0": _load("c0", 2, 650, slots=4)}
    assert _drain(NODE, loads) == pytest.approx(MEAN_OUTPUT * STEP_S)
    # No other instance takes requests: nothing moves.
    view = dataclasses.replace(_view({"c1": loads["c1"], "c0": _load("c0", 2, 650)}, True),
                               accepting={"c0": False, "c1": True})
    assert node_load(view, NODE).load_of("c1").est_drain_s == pytest.approx(MEAN_OUTPUT * STEP_S)


def test_drain_estimate_counts_the_targets_step_against_the_itl_slo():
    """c0 has slots and KV for all six, but with an ITL SLO between its step with two and with three of them added,
    the rule moves two and keeps four: the drain is their decode left."""
    loads = {"c1": _load("c1", 6, 703 - 114), "c0": _load("c0", 2, 650)}
    cost = NODE.cost_model(NODE.instance("c0"))
    kv0 = (703 - 650) * 16
    with_two = migration.batch_step_s(cost, 4, kv0 + 2 * 305)
    with_three = migration.batch_step_s(cost, 5, kv0 + 3 * 305)
    tight = dataclasses.replace(NODE, slo=dataclasses.replace(NODE.slo, itl_ms=(with_two + with_three) / 2 * 1000))
    assert _drain(tight, loads) == pytest.approx(MEAN_OUTPUT * STEP_S)
    with_six = migration.batch_step_s(cost, 8, kv0 + 6 * 305)  # an SLO that allows all six moves them all
    loose = dataclasses.replace(NODE, slo=dataclasses.replace(NODE.slo, itl_ms=with_six * 1000))
    assert _drain(loose, loads) == pytest.approx(cost.kv_transfer_time_s(304) + STEP_S)


def test_the_balancers_planned_move_carries_the_migration_drain():
    from tests.test_balancer import LM, NODE as BNODE, SM_C, inst

    current = (LM, *SM_C)
    grown = (LM, inst("lm-1", "llama-3-70b", Role.COLOCATED, (4, 5)), SM_C[2], SM_C[3])
    loads = {i.id: EngineLoad(i.id, i.model, i.role, 8, 0, 20000, 20000 - 8 * 40, 16, 0, 1e4, 0.008,
                              max_num_seqs=256, mean_output_tokens=500.0) for i in current}
    demand = (ModelDemand("llama-3-70b", 12.0, recent_rps=12.0, step_z=9.0), ModelDemand("llama-3-8b", 10.0))

    def planned(migrate: bool):
        balancer = LiveElasticBalancer(BNODE, BalancerPolicy(confirm_periods=1))
        balancer.inner.layouts = [current, grown]
        view = LiveView(current, {i.id: True for i in current}, loads, demand, 10.0, migrate)
        (r,) = balancer.plan(10.0, view, [])
        return r

    drained, migrated = planned(False), planned(True)
    assert drained.retire == migrated.retire == ("sm-0", "sm-1")
    assert drained.est_drain_s == pytest.approx(500.0 * 0.008)
    # Each retired 8B's eight decodes (640 tokens each) move to sm-2 / sm-3: the drain is one hand-off.
    cost = BNODE.cost_model(SM_C[0])
    assert migrated.est_drain_s == pytest.approx(cost.kv_transfer_time_s(640) + 0.008)
    assert f"lost to drain {migrated.est_drain_s:.1f} s" in migrated.reason
