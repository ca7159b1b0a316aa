"""Gang admission keeps its promise: a gang member reports the rates it gets while the other side of its group has
work (steps capped at its shared-step cap, each followed by one of the other side's), so the router admits only
what the member serves in time.

Checked: the arbiter's decisions tell each member, idle ones included, when the other side has work (and for a
hold after), so a prompt routed to an idle SM just after the LM got work is predicted shared; a member's load report turns to the shared
rates exactly then (prefill: the tokens a capped step carries over a cycle of both caps, one token a cycle when its
decodes fill the cap; decode cadence: its step plus the other side's cap); and at the seed-003 workload's peak,
on seed 003's node under both cost profiles and on the 70B gang under the default one, every model's and tier's
admitted requests are >= 95 % good in the simulator.
"""

from __future__ import annotations

import dataclasses
import math

import pytest

from octoserve.services.config import default_config_text, parse_yaml_mapping
from octoserve.services.core.batcher import Batcher
from octoserve.services.core.gang import SHARING_HOLD_S, Decision, GangArbiter, MemberView
from octoserve.services.core.instance import GangShare, LoadReporter, gang_share, instance_parts
from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.core.types import RequestSpec, SamplingParams, StepResult


def _node(cost_profile: str = "default"):
    raw = parse_yaml_mapping(default_config_text("node-seed003.yaml"), "node-seed003.yaml")
    return dataclasses.replace(node_config_from_dict(raw), cost_profile=cost_profile)


def _reporter(node, instance_id: str) -> LoadReporter:
    inst = node.instance(instance_id)
    parts = instance_parts(node, inst)
    batcher = Batcher(parts.batcher_config, parts.new_kv(inst))
    return LoadReporter(inst.id, inst.model, batcher, parts.cost_model, gang_share(node, inst))


def _fixed_caps(node):
    """`node` with the slack shape: steps capped at the fixed shared-step caps while both sides have work."""
    return dataclasses.replace(node, gang=dataclasses.replace(
        node.gang, policy=dataclasses.replace(node.gang.policy, shape="slack")))


def test_each_member_shares_at_its_own_cap_beside_the_others():
    # The shared-step caps split 0.85 x the tightest ITL (65 ms) 0.6 / 0.4.
    node = _fixed_caps(_node())
    assert gang_share(node, node.instance("lm-0")) == GangShare(0.6, pytest.approx(0.03315), pytest.approx(0.0221))
    assert gang_share(node, node.instance("sm-3")) == GangShare(0.4, pytest.approx(0.0221), pytest.approx(0.03315))
    # The deadline shape (seed 003's): a member holds the rest of the other side's ITL less the 5 ms urgency guard,
    # within its bound: the LM 65 - 11.93 ms (the SMs' full-batch floor) - 5 ms, the SMs min(60 ms LM-wait bound,
    # 100 - 29.59 ms (the LM's) - 5 ms). Between two LM steps, SMs with prompts of their own may hold the GPUs up to
    # the LM-wait bound (60 ms); the LM steps at its deadline, at its floor.
    node = _node()
    # While the other side lends its ITL tail, a member's step may run to its bound: the SM-stall bound (220 ms) for
    # the LM, the LM-wait bound (60 ms) for an SM; the lender steps at its floor between two of them. The LM's
    # prompts get 48.07 / (48.07 + 60) of the GPUs' time, so their latest starts come that much earlier; the SMs
    # hold the GPUs unless the LM's deadline calls.
    assert gang_share(node, node.instance("lm-0")) == GangShare(0.6, pytest.approx(0.0480683, abs=1e-6), 0.06, 0.22,
                                                                pytest.approx(0.0119317, abs=1e-6),
                                                                pytest.approx(0.444796, abs=1e-6))
    assert gang_share(node, node.instance("sm-3")) == GangShare(0.4, pytest.approx(0.06), pytest.approx(0.0295863,
                                                                abs=1e-6), 0.06, pytest.approx(0.0295863, abs=1e-6))
    solo = node_config_from_dict(parse_yaml_mapping(default_config_text("node-default.yaml"), "node-default.yaml"))
    assert gang_share(solo, solo.instances[0]) is None


def test_decisions_tell_each_member_its_sharing_idle_ones_too():
    """A member is shared while the other side has work and for SHARING_HOLD_S after; each decision names the members
    whose sharing changed, whether or not they step."""
    arb = GangArbiter(_node().gang.policy, "lm", ["sm"])
    idle, busy = MemberView("sm", False, 0.0), MemberView("sm", True, 0.01)
    d = arb.decide(0.0, MemberView("lm", True, 0.02), [idle])
    # The LM steps alone (the SMs have nothing); the idle SM is told at once that the LM has work.
    assert d.run_lm and arb.shared("lm") is False
    assert d.notices == (("lm", False), ("sm", True))
    arb.started("lm", 0.0, 0.02, d.lm_cap_s)
    arb.finished("lm", 0.02)
    d = arb.decide(0.02, MemberView("lm", False, 0.0), [busy])
    # The LM had work 20 ms ago: the SM steps shared (the hold); the LM, idle, is told the SMs have work.
    assert d.start_sm_ids == ("sm",) and arb.shared("sm") is True
    assert d.notices == (("lm", True),)
    arb.started("sm", 0.02, 0.01, d.sm_starts[0][1])
    arb.finished("sm", 0.03)
    t = SHARING_HOLD_S - 0.02  # the LM last had work at 0: within the hold, nothing changed
    d = arb.decide(t, MemberView("lm", False, 0.0), [busy])
    assert arb.shared("sm") is True and d.notices == ()
    arb.started("sm", t, 0.01, d.sm_starts[0][1])
    arb.finished("sm", t + 0.01)
    d = arb.decide(t + 0.03, MemberView("lm", False, 0.0), [busy])  # past the hold
    assert d.start_sm_ids == ("sm",) and arb.shared("sm") is False and d.notices == (("sm", False),)
    assert (arb.shared("lm"), arb.shared("sm")) == (True, False)
    arb.started("sm", t + 0.03, 0.01, d.sm_starts[0][1])
    arb.finished("sm", t + 0.04)
    arb.forget("sm")  # a worker that rejoined is told again: its sharing, and its lending
    d = arb.decide(t + 0.05, MemberView("lm", False, 0.0), [idle])
    # Neither side has work, so neither has a deadline to keep: each is lent the other's tail (the LM's changes now
    # that its busy SM, which did not lend, went idle).
    assert d == Decision(notices=(("sm", False),), lend_notices=(("lm", True), ("sm", True)))


@pytest.mark.parametrize("shape,told", [("deadline", {"lm": True, "sm": True}), ("lm_first", {"lm": False, "sm": True}),
                                        ("sm_greedy", {"lm": True, "sm": False})])
def test_a_side_that_gets_the_gpus_whenever_it_has_work_is_never_shared(shape, told):
    """LM-first reservation never makes the LM take turns, SM-greedy never the SMs: neither is told it is shared."""
    policy = dataclasses.replace(_node().gang.policy, shape=shape)
    arb = GangArbiter(policy, "lm", ["sm"])
    arb.decide(0.0, MemberView("lm", True, 0.02), [MemberView("sm", True, 0.01)])
    assert {m: arb.shared(m) for m in ("lm", "sm")} == told


def test_a_prompt_routed_just_after_the_lm_got_work_is_predicted_shared():
    """An 8B prompt of 3,000 tokens, 20 ms after a 70B request reached the idle gang group: on the GPUs alone its
    prefill takes ~100 ms, shared ~0.9 s; the SM it goes to was idle (no grant since), yet the router predicts the
    shared rate and refuses it. Without the 70B request it is admitted and served within its SLO."""
    from octoserve.services.core.types import Priority
    from octoserve.services.sim.driver import run_simulation
    from octoserve.services.workload import TraceRequest

    node = node_config_from_dict(parse_yaml_mapping(default_config_text("node-gang.yaml"), "node-gang.yaml"))

    def req(rid, arrival_s, model, n):
        return TraceRequest(rid, arrival_s, model, tuple(100 + i % 3000 for i in range(n)), 16, 16,
                            Priority.STANDARD, 250.0)

    sm_prompt = req("sm", 0.52, "llama-3-8b", 3000)
    alone = run_simulation(node, [sm_prompt], drain_s=10.0).records
    assert [(r.request_id, r.refused) for r in alone] == [("sm", False)]
    assert alone[0].ttft_s < 0.25
    beside = run_simulation(node, [req("lm", 0.5, "llama-3-70b", 200), sm_prompt], drain_s=10.0).records
    assert {r.request_id: r.refused for r in beside} == {"lm": False, "sm": True}


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
    chunk = b.budget.capped_prefill_tokens(share.own_cap_s, 1)  # beside the one decode the waiting prompt becomes
    assert chunk > 0
    assert shared.prefill_tokens_per_s == pytest.approx(chunk / (share.own_cap_s + share.other_cap_s))
    assert shared.decode_step_time_s == pytest.approx(rep.decode_step_time_s + share.other_cap_s)
    assert shared.long_prefill_tokens_per_s == 0.0  # no step runs past its cap while shared
    # Alone, the member steps in full: over 1.5 times the shared rate, at its own decode step.
    assert alone.prefill_tokens_per_s > 1.5 * shared.prefill_tokens_per_s
    assert alone.decode_step_time_s == rep.decode_step_time_s
    # The capped chunk is what the batcher cuts a capped step to (no decode yet in this one; a step without decodes
    # pays a one-decode step's fixed cost, so the chunk is the same).
    plan = b.schedule(0.0, step_cap_s=share.own_cap_s)
    assert plan.num_batched_tokens == b.budget.capped_prefill_tokens(share.own_cap_s, 0) == chunk


def test_a_member_lent_the_other_sides_tail_reports_steps_to_its_bound():
    """Seed 003's LM with a 900-token prompt waiting, shared: its steps are cut to the SMs' latest start (48 ms),
    with SMs holding the GPUs up to the LM-wait bound between them, unless the SMs lend their ITL tail; lent, a step
    may run to the SM-stall bound (220 ms) with the SMs at their floor between, so the prompt is predicted about as
    fast as alone instead of at a rate that refuses it."""
    node = _node()
    rep = _reporter(node, "lm-0")
    b, share = rep.batcher, rep.gang
    b.add_request(RequestSpec("r", "dense-180b", tuple(range(10, 910)), SamplingParams(max_tokens=8), arrival_s=0.0), 0.0)
    rep.shared = True
    cut = rep.load().prefill_tokens_per_s
    rep.tail_lent = True
    lent = rep.load().prefill_tokens_per_s
    chunk = b.budget.capped_prefill_tokens(share.lent_cap_s, 1)
    assert chunk >= 900  # the whole prompt in one step
    assert lent == pytest.approx(chunk / (share.lent_cap_s + share.lent_other_cap_s))
    assert cut == pytest.approx(b.budget.capped_prefill_tokens(share.own_cap_s, 1) / (share.own_cap_s + share.other_cap_s))
    assert lent > 3 * cut  # each cut step pays the 180B's weight reads again for a fraction of the tokens
    rep.shared = False  # alone, lending changes nothing
    assert rep.load().prefill_tokens_per_s == LoadReporter(rep.instance_id, rep.model, b, rep.cost, share).load().prefill_tokens_per_s


def test_a_lent_member_reports_the_lent_rate_for_one_lent_period_then_the_recent_mix():
    """Seed 003's LM lent the SMs' tail half the recent time, in lent periods of 0.1 s: a prompt is predicted at the
    lent rate for one lent period's worth of tokens, then at the mix of the lent and the unlent (cut) rates that
    the share gives; without a record (no notice with a time yet) the lent rate is taken to last (as before)."""
    node = _node()
    rep = _reporter(node, "lm-0")
    b, share = rep.batcher, rep.gang
    b.add_request(RequestSpec("r", "dense-180b", tuple(range(10, 9010)), SamplingParams(max_tokens=8), arrival_s=0.0), 0.0)
    rep.shared = True
    cut = rep.load().prefill_tokens_per_s
    rep.tail_lent = True
    lent = rep.load()
    assert (lent.long_prefill_tokens_per_s, lent.long_burst_tokens) == (0.0, 0.0)  # no record: lent throughout
    told = LoadReporter(rep.instance_id, rep.model, b, rep.cost, share)
    told.shared = True
    window = LoadReporter.LENT_WINDOW_S
    # Lent 0.1 s, unlent 0.1 s, lent again: the share decays from 1 over the unlent 0.1 s only.
    told.note_lending(True, 10.0)
    assert (told.lent_share, told.lent_period_s) == (1.0, math.inf)  # the first notice starts the record
    told.note_lending(False, 10.1)
    assert told.lent_share == 1.0 and told.lent_period_s == pytest.approx(0.1)
    told.note_lending(True, 10.2)
    mix = math.exp(-0.1 / window)
    assert told.lent_share == pytest.approx(mix)
    load = told.load()
    mixed = mix * lent.prefill_tokens_per_s + (1.0 - mix) * cut
    assert load.prefill_tokens_per_s == pytest.approx(mixed)
    assert load.long_prefill_tokens_per_s == pytest.approx(lent.prefill_tokens_per_s)
    assert load.long_burst_tokens == pytest.approx(lent.prefill_tokens_per_s * 0.1)
    assert load.long_sustained_tokens_per_s == pytest.approx(mixed)
    # A second lent period of 0.3 s moves the mean period by the EMA's weight; a notice that repeats the state
    # (the live gate's with each sharing notice) changes nothing: the unlent time runs on from the change at 10.5.
    told.note_lending(False, 10.5)
    assert told.lent_period_s == pytest.approx(0.1 + LoadReporter.LENT_PERIOD_EMA * 0.2)
    share_now = told.lent_share
    told.note_lending(False, 10.7)
    assert told.lent_share == share_now
    told.note_lending(True, 10.9)
    assert told.lent_share == pytest.approx(share_now * math.exp(-0.4 / window))
    told.note_lending(False, 11.0)
    # Unlent, the report is the cut rate whatever the record.
    assert told.load().prefill_tokens_per_s == pytest.approx(cut)


def test_queued_prompts_count_as_the_decodes_they_become():
    """A burst of short prompts on a shared member: each one queued becomes a decode of the capped step, so the
    prefill the report offers the next prompt shrinks with the queue (seed 003: a cached 1,024-token system prompt
    plus two tokens, admitted by the dozen at a rate that held for the first of them only)."""
    node = _node("pessimistic")
    rep = _reporter(node, "sm-0")
    rep.shared = True
    b, share = rep.batcher, rep.gang
    cycle_s = share.own_cap_s + share.other_cap_s
    rates = []
    for i in range(6):
        rates.append(rep.load().prefill_tokens_per_s)
        b.add_request(RequestSpec(f"r{i}", "llama-3-8b", tuple(range(10, 40)), SamplingParams(max_tokens=8),
                                  arrival_s=0.0), 0.0)
        assert b.num_future_decodes() == i + 1
    assert rates == [pytest.approx(max(1, b.budget.capped_prefill_tokens(share.own_cap_s, i)) / cycle_s) for i in range(6)]
    # The first prompt's decode costs what any step's fixed cost does; each one after it takes prefill away.
    assert rates[0] == rates[1] and all(later < earlier for earlier, later in zip(rates[1:], rates[2:]))


def test_decodes_that_fill_the_cap_leave_no_prefill_while_shared():
    node = _fixed_caps(_node("pessimistic"))
    rep = _reporter(node, "lm-0")
    rep.shared = True
    # The pessimistic LM's one-decode step (32.3 ms) nearly fills its 33.15 ms shared cap: 0.78 ms is left past the
    # 0.2 % kept for rounding, 5 tokens of 0.133 ms.
    assert rep.batcher.budget.capped_prefill_tokens(rep.gang.own_cap_s) == 5
    assert rep.batcher.budget.capped_prefill_tokens(0.02) == 0
    # Its report: 5 tokens a cycle of both caps; a cap its decodes fill still reports one token a cycle, never 0
    # (which routing reads as "unknown" and replaces by the cost model's rate alone).
    cycle_s = rep.gang.own_cap_s + rep.gang.other_cap_s
    assert rep.load().prefill_tokens_per_s == pytest.approx(5 / cycle_s)
    rep.gang = dataclasses.replace(rep.gang, own_cap_s=0.02)
    assert rep.load().prefill_tokens_per_s == pytest.approx(1 / (0.02 + rep.gang.other_cap_s))


@pytest.mark.parametrize("case,cost_profile", [("seed003", "default"), ("seed003", "pessimistic"), ("70b", "default")])
def test_admitted_requests_keep_the_promise_at_the_seed_003_peak(case, cost_profile):
    from octoserve.services.lab.gang_bench import config_for, workload
    from octoserve.services.sim.driver import run_simulation
    from octoserve.services.workload import generate_trace

    node = config_for(case, "gang", cost_profile)
    trace = generate_trace(workload(case), 0, duration_s=20.0)  # the benchmark's peak run (gang_bench)
    result = run_simulation(node, trace, warmup_s=5.0, drain_s=120.0)
    s = result.summary
    groups = {g.name: g for g in (*s.per_model, *s.per_tier)}
    lm = "dense-180b" if case == "seed003" else "llama-3-70b"
    assert set(groups) == {lm, "llama-3-8b", "INTERACTIVE", "BATCH"}
    admitting = {name for name, g in groups.items() if g.num_admitted > 0}
    # Under the pessimistic profile the LM's decodes nearly fill its shared-step cap: while the SMs work it has
    # next to no prefill to offer, and admission refuses nearly all of it, but not all: it admits in the SMs' lulls.
    assert admitting == set(groups)
    for name in admitting:
        g = groups[name]
        assert g.attainment_admitted >= 0.95, (name, g.num_good, g.num_admitted)


@pytest.mark.parametrize("cost_profile", ["default", "pessimistic"])
def test_capped_chunks_of_a_long_prompt_end_within_their_cap(cost_profile):
    """A 24,000-token prompt on a gang SM, prefilled in steps capped at 50 ms: each chunk attends over the ones
    before it, which the linear step model leaves out, so the cap's chunk shrinks as the context grows and every
    step, timed by the cost model, ends within its cap (an overrun would stretch the LM's wait past its bound)."""
    from octoserve.services.core.sim_executor import SimExecutor

    node = _node(cost_profile)
    rep = _reporter(node, "sm-0")
    b = rep.batcher
    executor = SimExecutor(rep.cost, node.instance("sm-0").block_size)
    b.add_request(RequestSpec("long", "llama-3-8b", tuple(10 + i % 3000 for i in range(24000)),
                              SamplingParams(max_tokens=4), arrival_s=0.0), 0.0)
    cap_s, now, chunks = 0.050, 0.0, []
    while sum(chunks) < 24000:
        plan = b.schedule(now, step_cap_s=cap_s)
        result = executor.execute(plan, b)
        assert result.step_time_s <= cap_s, (len(chunks), plan.num_batched_tokens, result.step_time_s)
        chunks.append(plan.num_batched_tokens)
        now += result.step_time_s
        b.update(plan, result, now)
    assert sum(chunks) == 24000 and len(chunks) > 2
    assert chunks[-2] < chunks[0]  # the later chunks attend over more context: fewer tokens fit the cap


@pytest.mark.parametrize("cost_profile", ["default", "pessimistic"])
def test_a_capped_step_counts_the_read_of_a_new_prompts_cached_context(cost_profile):
    """A gang SM with 48 streams decoding and a prompt whose first 1,024 tokens are cached: the prompt's two new
    tokens read those 1,024 tokens' KV, which the step model's per-token prefill time leaves out. A cap whose spare
    time holds the two tokens but not that read (by the step model) keeps the prompt waiting; one that holds both
    takes it. Each step, timed by the cost model, ends within its cap (under the pessimistic profile the first step
    overran when the read went uncounted)."""
    from octoserve.services.core.sim_executor import SimExecutor

    node = _node(cost_profile)
    rep = _reporter(node, "sm-0")
    b, cfg = rep.batcher, rep.batcher.config
    executor = SimExecutor(rep.cost, node.instance("sm-0").block_size)
    system = tuple(100 + i for i in range(1024))
    for i in range(48):  # 1,200-token prompts (the step model's sized context), the first one the system prompt's
        prompt = system + tuple(3000 + i * 200 + j for j in range(176))
        b.add_request(RequestSpec(f"d{i}", "llama-3-8b", prompt, SamplingParams(max_tokens=50), arrival_s=0.0), 0.0)
    now = 0.0
    while b.num_running < 48 or b.num_waiting or any(r.num_output_tokens == 0 for r in b._running):
        plan = b.schedule(now)
        result = executor.execute(plan, b)
        now += result.step_time_s
        b.update(plan, result, now)
    b.add_request(RequestSpec("new", "llama-3-8b", system + (7, 8), SamplingParams(max_tokens=4), arrival_s=now), now)
    per_token, read_s = cfg.prefill_s_per_token, 1024 * cfg.kv_s_per_context_token
    assert read_s > per_token  # the read costs more than a token: it decides whether the prompt fits
    # spare time: room for the two tokens within the cap's margin, but not for the read beside them; then for both
    for spare_s, takes_it in ((2.5 * per_token, False), (3 * per_token + read_s, True)):
        cap_s = b.step_floor_s() + spare_s
        plan = b.schedule(now, step_cap_s=cap_s)
        assert ("new" in {c.request_id for c in plan.chunks}) is takes_it
        result = executor.execute(plan, b)
        assert result.step_time_s <= cap_s, (spare_s, result.step_time_s - cap_s)
        now += result.step_time_s
        b.update(plan, result, now)


def test_a_member_reports_the_step_its_due_prompts_need():
    """`Batcher.due_prefill_s`: the step carrying every prompt whose first token is due within the horizon (the
    deadline shapes keep room for it), and the live member's report carries it to the scheduler's arbiter."""
    from octoserve.services.core.types import Priority
    from octoserve.services.scheduler.gang_live import _view_pb

    node = _node()
    rep = _reporter(node, "lm-0")
    b = rep.batcher
    per_token, attn = b.config.prefill_s_per_token, b.config.attn_s_per_pair
    fixed = b.config.decode_step_s_by_num_decodes[1]  # a step with no decodes still pays one decode's fixed cost
    assert attn > 0
    for rid, n, tier in (("now", 1000, Priority.INTERACTIVE), ("later", 1500, Priority.BATCH)):
        b.add_request(RequestSpec(rid, "dense-180b", tuple(10 + i for i in range(n)), SamplingParams(max_tokens=4),
                                  arrival_s=0.0, priority=tier), 0.0)
    # No decodes yet. The INTERACTIVE prompt is due by 200 ms, the BATCH one by 10 s.
    assert b.due_prefill_s(0.0, 0.1) == 0.0
    # Each chunk attends over itself (n x n / 2 pairs: nothing of these prompts is computed yet).
    one = fixed + 1000 * per_token + attn * 1000 * 500
    assert b.due_prefill_s(0.0, 1.0) == pytest.approx(one)
    # both, up to the step's 2,048-token ceiling: the whole first prompt, then 1,048 tokens of the second
    assert b.due_prefill_s(9.5, 1.0) == pytest.approx(fixed + 2048 * per_token + attn * (1000 * 500 + 1048 * 524))
    share = rep.gang.prefill_share
    view = _view_pb(b, 0.1, 0.0, 1.0, True, share)
    assert view["has_work"] and view["due_prefill_s"] == pytest.approx(one)
    assert view["lends_tail"] is False  # prompts of its own: it lends nothing
    # Its latest start: the INTERACTIVE prompt's deadline less its prefill (its tokens, each attending over those
    # before it) at the share of the GPUs' time the LM's steps get beside the SMs (0.445), less a step floor;
    # reckoned alone, it would start 134 ms later.
    floor = b.step_floor_s()
    prefill_s = 1000 * per_token + attn * 1000 * 500
    assert view["deadline_s"] == pytest.approx(0.2 - prefill_s / share - floor)
    assert b.earliest_deadline_s(0.1) - view["deadline_s"] == pytest.approx(prefill_s * (1 / share - 1))


def test_a_member_lends_its_tail_while_its_budget_affords_a_slow_gap_on_each_decode():
    """An SM with three decodes running lends its ITL tail until its budget (4 % of the last 4,000 gaps, a gang
    member's window: 160 slow gaps) could not take one more slow gap on each of the three."""
    from octoserve.services.scheduler.gang_live import _view_pb

    node = _node()
    rep = _reporter(node, "sm-0")
    b = rep.batcher
    for i in range(3):
        b.add_request(RequestSpec(f"r{i}", "llama-3-8b", tuple(range(10, 40)), SamplingParams(max_tokens=64),
                                  arrival_s=0.0), 0.0)
    plan = b.schedule(0.0)  # the three prompts in one step: each then decodes
    b.update(plan, StepResult({c.request_id: 7 for c in plan.chunks if c.samples}), 0.02)
    assert b.step_floor_s() > 0 and b.lends_tail()
    # on the stream only where the policy reads it (the deadline shapes)
    assert _view_pb(b, 0.065, 0.02, 1.0, True, 1.0)["lends_tail"]
    assert not _view_pb(b, 0.065, 0.02, 1.0, False, 1.0)["lends_tail"]
    tail = b.budget.tail
    assert tail.fraction * tail.window_gaps == pytest.approx(160)
    tail.observe(3000, 157)
    assert b.lends_tail()  # 157 + 3 = 160
    tail.observe(1, 1)
    assert not b.lends_tail()  # 158 + 3 > 160


@pytest.mark.parametrize("cost_profile", ["default", "pessimistic"])
@pytest.mark.parametrize("gap_s", [0.3, 0.9, 1.5])
def test_a_lone_large_model_prompt_after_the_sms_went_idle_is_served_in_time(cost_profile, gap_s):
    """A 1,000-token 180B prompt (~130 ms alone; 165 pessimistic) on seed 003's node, `gap_s` after an 8B request that
    finished within 0.1 s: the SMs have no work, so none has a deadline to keep, and the LM, still shared for
    SHARING_HOLD_S, is lent their tail. It used to be told shared and not lent (the SMs lent only while one had
    work), reported the rate of steps cut to an SM's latest start (~800 tokens/s), and was refused."""
    from octoserve.services.core.types import Priority
    from octoserve.services.sim.driver import run_simulation
    from octoserve.services.workload import TraceRequest

    def req(rid, arrival_s, model, n):
        return TraceRequest(rid, arrival_s, model, tuple(100 + i % 3000 for i in range(n)), 8, 8,
                            Priority.INTERACTIVE, 200.0)

    node = _node(cost_profile)
    recs = {r.request_id: r for r in run_simulation(
        node, [req("sm", 0.0, "llama-3-8b", 200), req("lm", gap_s, "dense-180b", 1000)], drain_s=10.0).records}
    assert recs["sm"].finish_s < 0.1
    assert not recs["lm"].refused
    # Served as on the GPUs alone: the whole prompt in one step, its first token at its prefill time.
    assert recs["lm"].ttft_s == pytest.approx(node.cost_model(node.instance("lm-0")).prefill_time_s(1000, 0), rel=1e-9)


def test_a_members_cached_snapshot_follows_the_lending_notice():
    """The simulator reuses an instance's load snapshot while nothing it reads changed; the lending notice is one of
    those inputs (an idle LM lent the SMs' tail must report the lent rate at once, not the one it had)."""
    from octoserve.services.sim.driver import _Instance

    node = _node()
    inst = _Instance(node, node.instance("lm-0"))
    inst.batcher.add_request(RequestSpec("r", "dense-180b", tuple(range(10, 910)), SamplingParams(max_tokens=8),
                                         arrival_s=0.0), 0.0)
    inst.reporter.shared = True
    cut = inst.cached_load()
    assert inst.cached_load() is cut  # nothing changed: reused
    inst.reporter.tail_lent = True
    lent = inst.cached_load()
    assert lent.prefill_tokens_per_s == inst.reporter.load().prefill_tokens_per_s
    assert lent.prefill_tokens_per_s > 3 * cut.prefill_tokens_per_s
