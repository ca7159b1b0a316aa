"""Gang admission keeps its promise: a gang member reports the rates it gets while the other side of its group has
work (steps capped at its shared-step cap, each followed by one of the other side's), so the router admits only
what the member serves in time.

Checked: the arbiter's decisions say when the other side had work; a member's load report turns to the shared
rates exactly then (prefill: the tokens a capped step carries over a cycle of both caps, one token a cycle when its
decodes fill the cap; decode cadence: its step plus the other side's cap); and at the seed-003 workload's peak,
on seed 003's node under both cost profiles and on the 70B gang under the default one, every model's and tier's
admitted requests are >= 95 % good in the simulator.
"""

from __future__ import annotations

import dataclasses

import pytest

from octoserve.services.config import default_config_text, parse_yaml_mapping
from octoserve.services.core.batcher import Batcher
from octoserve.services.core.gang import GangArbiter, MemberView
from octoserve.services.core.instance import GangShare, LoadReporter, gang_share, instance_parts
from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.core.types import RequestSpec, SamplingParams


def _node(cost_profile: str = "default"):
    raw = parse_yaml_mapping(default_config_text("node-seed003.yaml"), "node-seed003.yaml")
    return dataclasses.replace(node_config_from_dict(raw), cost_profile=cost_profile)


def _reporter(node, instance_id: str) -> LoadReporter:
    inst = node.instance(instance_id)
    parts = instance_parts(node, inst)
    batcher = Batcher(parts.batcher_config, parts.new_kv(inst))
    return LoadReporter(inst.id, inst.model, batcher, parts.cost_model, gang_share(node, inst))


def test_each_member_shares_at_its_own_cap_beside_the_others():
    node = _node()
    assert gang_share(node, node.instance("lm-0")) == GangShare(0.6, pytest.approx(0.03315), pytest.approx(0.0221))
    assert gang_share(node, node.instance("sm-3")) == GangShare(0.4, pytest.approx(0.0221), pytest.approx(0.03315))
    solo = node_config_from_dict(parse_yaml_mapping(default_config_text("node-default.yaml"), "node-default.yaml"))
    assert gang_share(solo, solo.instances[0]) is None


def test_decisions_say_whether_the_other_side_had_work():
    arb = GangArbiter(_node().gang.policy, "lm", ["sm"])
    idle, busy = MemberView("sm", False, 0.0), MemberView("sm", True, 0.01)
    d = arb.decide(0.0, MemberView("lm", True, 0.02), [idle])
    assert d.run_lm and d.lm_shared is False  # the SMs have nothing: the LM steps alone
    arb.started("lm", 0.0, 0.02, d.lm_cap_s)
    arb.finished("lm", 0.02)
    d = arb.decide(0.02, MemberView("lm", False, 0.0), [busy])
    assert d.start_sm_ids == ("sm",) and d.sm_shared is False
    arb.started("sm", 0.02, 0.01, d.sm_starts[0][1])
    arb.finished("sm", 0.03)
    d = arb.decide(0.03, MemberView("lm", True, 0.02, deadline_s=0.03), [busy])
    started = (d.run_lm, d.lm_shared) if d.run_lm else (False, d.sm_shared)
    assert started in ((True, True), (False, True))  # whoever steps, it steps beside the other side's work


@pytest.mark.parametrize("instance_id", ["lm-0", "sm-0"])
def test_a_shared_member_reports_capped_steps_taking_turns(instance_id):
    node = _node()
    rep = _reporter(node, instance_id)
    share = rep.gang
    b = rep.batcher
    spec = RequestSpec("r", node.instance(instance_id).model, tuple(range(10, 4010)), SamplingParams(max_tokens=8),
                       arrival_s=0.0)
    b.add_request(spec, 0.0)
    alone = rep.load()
    rep.shared = True
    shared = rep.load()
    chunk = b.capped_prefill_tokens(share.own_cap_s)
    assert chunk > 0
    assert shared.prefill_tokens_per_s == pytest.approx(chunk / (share.own_cap_s + share.other_cap_s))
    assert shared.decode_step_time_s == pytest.approx(rep.decode_step_time_s + share.other_cap_s)
    assert shared.long_prefill_tokens_per_s == 0.0  # no step runs past its cap while shared
    # Alone, the member steps in full: several times the shared rate, at its own decode step.
    assert alone.prefill_tokens_per_s > 3 * shared.prefill_tokens_per_s
    assert alone.decode_step_time_s == rep.decode_step_time_s
    # The capped chunk is what the batcher cuts a capped step to.
    plan = b.schedule(0.0, step_cap_s=share.own_cap_s)
    assert plan.num_batched_tokens == chunk


def test_decodes_that_fill_the_cap_leave_no_prefill_while_shared():
    node = _node("pessimistic")
    rep = _reporter(node, "lm-0")
    rep.shared = True
    # The pessimistic LM's one-decode step (32.3 ms) nearly fills its 33.15 ms shared cap.
    assert rep.batcher.capped_prefill_tokens(rep.gang.own_cap_s) == 4
    assert rep.batcher.capped_prefill_tokens(0.02) == 0
    # Its report: 4 tokens a cycle of both caps; a cap its decodes fill still reports one token a cycle, never 0
    # (which routing reads as "unknown" and replaces by the cost model's rate alone).
    cycle_s = rep.gang.own_cap_s + rep.gang.other_cap_s
    assert rep.load().prefill_tokens_per_s == pytest.approx(4 / cycle_s)
    rep.gang = dataclasses.replace(rep.gang, own_cap_s=0.02)
    assert rep.load().prefill_tokens_per_s == pytest.approx(1 / (0.02 + rep.gang.other_cap_s))


@pytest.mark.parametrize("case,cost_profile", [("seed003", "default"), ("seed003", "pessimistic"), ("70b", "default")])
def test_admitted_requests_keep_the_promise_at_the_seed_003_peak(case, cost_profile):
    from octoserve.services.gang_bench import config_for, workload
    from octoserve.services.sim.driver import run_simulation
    from octoserve.services.workload import generate_trace

    node = config_for(case, "gang", cost_profile)
    trace = generate_trace(workload(case), 0, duration_s=12.0)
    result = run_simulation(node, trace, warmup_s=4.0)
    s = result.summary
    groups = {g.name: g for g in (*s.per_model, *s.per_tier)}
    lm = "dense-180b" if case == "seed003" else "llama-3-70b"
    assert set(groups) == {lm, "llama-3-8b", "INTERACTIVE", "BATCH"}
    admitting = {name for name, g in groups.items() if g.num_admitted > 0}
    # Under the pessimistic profile the LM's decodes nearly fill its shared-step cap: it has no prefill to offer
    # while the SMs work, and admission says so by refusing nearly all of it (what the arbiter's shape has to
    # change).
    assert admitting == set(groups) - ({lm} if cost_profile == "pessimistic" else set())
    for name in admitting:
        g = groups[name]
        assert g.attainment_admitted >= 0.95, (name, g.num_good, g.num_admitted)
