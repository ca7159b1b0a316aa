"""The iteration-level batcher, driven directly: exact plans, block ids, victims, roles, reservation policies."""

from __future__ import annotations

import pytest

from octoserve.services.core.batch_state import BatcherConfig, RequestStatus
from octoserve.services.core.batcher import Batcher
from octoserve.services.core.kv_cache import KVCacheManager
from octoserve.services.core.types import (
    FinishReason,
    Priority,
    RequestSpec,
    Role,
    SamplingParams,
    ScheduledChunk,
    StepResult,
)


def make_batcher(num_blocks=64, block_size=4, **overrides) -> Batcher:
    overrides.setdefault("reservation_policy", "watermark")
    return Batcher(BatcherConfig(**overrides), KVCacheManager(num_blocks, block_size, extra_key="m"))


def spec(rid, prompt_len=8, max_tokens=4, arrival=0.0, priority=Priority.STANDARD, first=100, **kw) -> RequestSpec:
    return RequestSpec(
        request_id=rid,
        model="m",
        prompt_token_ids=tuple(range(first, first + prompt_len)),
        sampling=SamplingParams(max_tokens=max_tokens),
        arrival_s=arrival,
        priority=priority,
        **kw,
    )


def step(b: Batcher, now: float = 0.0, token: int = 7, tokens: dict[str, int] | None = None):
    plan = b.schedule(now)
    sampled = {c.request_id: (tokens or {}).get(c.request_id, token) for c in plan.chunks if c.samples}
    return plan, b.update(plan, StepResult(sampled), now)


def test_chunked_prefill_then_decode_exact_plans():
    b = make_batcher(max_num_batched_tokens=6)
    b.add_request(spec("a", prompt_len=10, max_tokens=3), 0.0)
    plan, out = step(b)
    assert plan.chunks == (ScheduledChunk("a", 6, 0, False),)
    assert out.outputs == ()
    plan, out = step(b)
    assert plan.chunks == (ScheduledChunk("a", 4, 6, True),)
    assert [o.new_token_ids for o in out.outputs] == [(7,)]
    plan, out = step(b)
    assert plan.chunks == (ScheduledChunk("a", 1, 10, True),)
    plan, out = step(b)
    assert out.outputs[0].finish_reason is FinishReason.LENGTH
    assert out.outputs[0].num_output_tokens == 3
    assert not b.has_work
    assert b.kv.num_free_blocks == 64


def test_decodes_are_scheduled_before_new_prefills():
    b = make_batcher(max_num_batched_tokens=8)
    b.add_request(spec("a", prompt_len=4, max_tokens=10), 0.0)
    step(b)  # a: prefill, samples its first token
    b.add_request(spec("b", prompt_len=12, max_tokens=10, first=500), 0.0)
    plan, _ = step(b)
    assert plan.chunks == (ScheduledChunk("a", 1, 4, True), ScheduledChunk("b", 7, 0, False))


def test_eos_stops_unless_ignore_eos():
    b = make_batcher()
    b.add_request(spec("a", max_tokens=10), 0.0)
    _, out = step(b, token=2)
    assert out.outputs[0].finish_reason is FinishReason.STOP
    b.add_request(
        RequestSpec("b", "m", (1, 2, 3), SamplingParams(max_tokens=2, ignore_eos=True), arrival_s=0.0), 0.0
    )
    _, out = step(b, token=2)
    assert out.outputs[0].finish_reason is None


def test_prefix_hit_skips_cached_blocks_and_reports_them():
    b = make_batcher(block_size=4)
    b.add_request(spec("a", prompt_len=10, max_tokens=1), 0.0)
    step(b)  # a finishes after one token; its two full prompt blocks stay cached
    b.add_request(spec("b", prompt_len=10, max_tokens=1), 0.0)
    plan, out = step(b)
    assert plan.chunks == (ScheduledChunk("b", 2, 8, True),)
    assert out.outputs[0].num_cached_prompt_tokens == 8


def test_max_num_seqs_bounds_running():
    b = make_batcher(max_num_seqs=2)
    for i in range(3):
        b.add_request(spec(f"r{i}", first=100 * (i + 1)), 0.0)
    plan, _ = step(b)
    assert [c.request_id for c in plan.chunks] == ["r0", "r1"]
    assert b.num_running == 2 and b.num_waiting == 1


def slot_batcher(prompt_len: int, num_requests: int = 8) -> Batcher:
    """Context-aware decode slots: a decode step is 10 ms + 1 ms a decode at the sized context of 4 tokens, plus
    0.1 ms a context token beyond it; decodes may fill 16 ms; the ceiling is 8 sequences."""
    b = make_batcher(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=1000,
                     decode_step_s_by_num_decodes=tuple(0.010 + 0.001 * d for d in range(9)),
                     sized_context_tokens=4, kv_s_per_context_token=0.0001, decode_slot_target_s=0.016)
    for i in range(num_requests):
        b.add_request(spec(f"r{i}", prompt_len=prompt_len, max_tokens=50, first=1000 * (i + 1)), 0.0)
    return b


def test_decode_slots_admit_by_the_running_requests_actual_context():
    # 4-token prompts: the k-th joins while 10 + k ms <= 16 ms, so six run
    short = slot_batcher(4)
    assert short.decode_slots() == 8  # nothing running yet: the ceiling
    plan, _ = step(short)
    assert [c.request_id for c in plan.chunks] == [f"r{i}" for i in range(6)]
    assert short.num_running == 6 and short.num_waiting == 2
    # 24-token prompts: each adds 20 tokens past the sized context (2 ms), so 10 + 3k <= 16: two run
    long = slot_batcher(24)
    plan, _ = step(long)
    assert [c.request_id for c in plan.chunks] == ["r0", "r1"]
    assert long.num_running == 2 and long.num_waiting == 6
    # The load report's slots: decodes of the running mean context (25 tokens after the first token) that fit,
    # 10 + 3.1 n <= 16 gives one, never fewer than are running
    assert long.decode_slots() == 2
    assert long.load("i", "m", 1000.0, 0.01).max_num_seqs == 2
    # With the slots off, max_num_seqs alone bounds the batch
    plain = make_batcher(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=1000)
    for i in range(8):
        plain.add_request(spec(f"r{i}", prompt_len=24, max_tokens=50, first=1000 * (i + 1)), 0.0)
    plan, _ = step(plain)
    assert len(plan.chunks) == 8 and plain.decode_slots() == 8


def test_a_tier_preemption_frees_the_victims_context_for_the_decode_slots():
    """Two BATCH decodes of 25 tokens fill the slots (a third decode of context 70 would take 18.8 ms of 16); an
    INTERACTIVE 20-token prompt preempts the later one, and with that victim's tokens gone the step of the two
    left (45 tokens) is 15.7 ms: it joins. Counting the victim's tokens still would preempt the other as well."""
    b = make_batcher(num_blocks=512, max_num_seqs=8, max_num_batched_tokens=1000, queue_policy="priority",
                     batch_min_share=0.0, decode_step_s_by_num_decodes=tuple(0.010 + 0.001 * d for d in range(9)),
                     sized_context_tokens=4, kv_s_per_context_token=0.0001, decode_slot_target_s=0.016)
    for i, arrival in enumerate((0.0, 0.1)):
        b.add_request(spec(f"b{i}", prompt_len=24, max_tokens=50, arrival=arrival, priority=Priority.BATCH,
                           first=1000 * (i + 1)), arrival)
    plan, _ = step(b, 0.1)
    assert [c.request_id for c in plan.chunks] == ["b0", "b1"]
    b.add_request(spec("i", prompt_len=20, max_tokens=50, arrival=0.2, priority=Priority.INTERACTIVE, first=5000), 0.2)
    plan, _ = step(b, 0.2)
    assert plan.preempted_ids == ("b1",)
    assert sorted(c.request_id for c in plan.chunks) == ["b0", "i"]


def test_edf_orders_by_tier_deadline_and_ages_batch_requests():
    b = make_batcher(max_num_seqs=1, queue_policy="edf")
    b.add_request(spec("batch-old", arrival=0.0, priority=Priority.BATCH, first=100), 0.0)
    b.add_request(spec("std", arrival=1.0, priority=Priority.STANDARD, first=200), 1.0)
    b.add_request(spec("inter", arrival=1.0, priority=Priority.INTERACTIVE, first=300), 1.0)
    b.add_request(spec("inter-late", arrival=20.0, priority=Priority.INTERACTIVE, first=400), 20.0)
    order = []
    while b.has_work:
        plan, out = step(b)
        order += [o.request_id for o in out.outputs if o.finish_reason is not None]
    # deadlines: inter 1.2, std 1.25, batch-old 10.0, inter-late 20.2
    assert order == ["inter", "std", "batch-old", "inter-late"]


def test_fcfs_and_priority_orders():
    for policy, expected in (("fcfs", ["b1", "i1"]), ("priority", ["i1", "b1"])):
        b = make_batcher(max_num_seqs=1, queue_policy=policy)
        b.add_request(spec("b1", arrival=0.0, priority=Priority.BATCH, first=100), 0.0)
        b.add_request(spec("i1", arrival=0.5, priority=Priority.INTERACTIVE, first=200), 0.5)
        order = []
        while b.has_work:
            _, out = step(b)
            order += [o.request_id for o in out.outputs if o.finish_reason is not None]
        assert order == expected, policy


def test_preemption_takes_lowest_tier_latest_and_recomputes():
    # 6 blocks of 4 tokens. Three 8-token prompts take 2 blocks each; the first decode that crosses into a
    # new block finds the pool dry and must preempt the least important running request.
    b = make_batcher(num_blocks=6, block_size=4, max_num_batched_tokens=64, reservation_policy="watermark")
    b.add_request(spec("hi", arrival=0.0, priority=Priority.INTERACTIVE, max_tokens=8, first=100), 0.0)
    b.add_request(spec("std", arrival=0.1, priority=Priority.STANDARD, max_tokens=8, first=200), 0.0)
    b.add_request(spec("bat", arrival=0.05, priority=Priority.BATCH, max_tokens=8, first=300), 0.0)
    # The watermark keeps 1 % of 6 blocks (0.06) free: a third request would take the last 2 blocks, so it waits.
    plan, _ = step(b)
    running = sorted(c.request_id for c in plan.chunks)
    assert running == ["hi", "std"]  # bat would leave 0 free blocks < watermark 0.06 -> waits
    assert b.kv.num_free_blocks == 2
    plan, _ = step(b)  # both decode token 9 -> each needs a third block: 2 free, fits
    assert b.kv.num_free_blocks == 0
    for _ in range(3):
        step(b)
    plan, _ = step(b)  # token 13 needs a 4th block each: pool dry -> std (lower tier) is preempted
    assert plan.preempted_ids == ("std",)
    assert [c.request_id for c in plan.chunks] == ["hi"]
    req = b.request("std")
    assert req.status is RequestStatus.WAITING and req.num_computed_tokens == 0 and req.num_preemptions == 1


def test_swap_preemption_moves_blocks_to_host_and_back():
    b = make_batcher(
        num_blocks=4, block_size=4, preemption_mode="swap", num_swap_blocks=8, reservation_policy="watermark"
    )
    b.add_request(spec("a", prompt_len=4, arrival=0.0, max_tokens=8, first=100), 0.0)
    b.add_request(spec("b", prompt_len=4, arrival=1.0, max_tokens=8, first=200), 0.0)
    step(b)  # a, b: 1 block each, token 5 sampled
    step(b)  # decode token 5 -> 2 blocks each, pool dry
    for _ in range(3):
        step(b)
    plan, _ = step(b)  # token 9 needs a third block: b (latest) swapped out
    assert plan.preempted_ids == ("b",) and plan.swap_out_blocks == 2
    assert b.request("b").status is RequestStatus.SWAPPED
    while b.request("a") is not None:
        step(b)
    plan, _ = step(b)
    assert plan.swap_in_blocks == 2
    assert b.request("b").status is RequestStatus.RUNNING
    # b resumes where it stopped: its next chunk is a single decode token, not a recompute.
    plan, _ = step(b)
    assert plan.chunks == (ScheduledChunk("b", 1, 8, True),)


def test_full_reservation_never_preempts_and_holds_prompt_plus_max_tokens():
    b = make_batcher(num_blocks=8, block_size=4, reservation_policy="full")
    b.add_request(spec("a", prompt_len=4, max_tokens=12), 0.0)  # 16 tokens = 4 blocks
    b.add_request(spec("b", prompt_len=4, max_tokens=12, first=200), 0.0)
    b.add_request(spec("c", prompt_len=4, max_tokens=12, first=300), 0.0)
    plan, _ = step(b)
    assert [c.request_id for c in plan.chunks] == ["a", "b"]
    assert b.kv.block_ids("a") == (0, 1, 2, 3) and b.kv.block_ids("b") == (4, 5, 6, 7)
    while b.request("a") is not None:
        plan, _ = step(b)
        assert plan.preempted_ids == ()


def test_predicted_reservation_uses_observed_output_lengths():
    b = make_batcher(num_blocks=256, block_size=4, reservation_policy="predicted", predictor_prior_tokens=8)
    b.add_request(spec("a", prompt_len=4, max_tokens=100), 0.0)
    step(b)
    assert len(b.kv.block_ids("a")) == 3  # 4 prompt + 8 predicted = 12 tokens
    b.abort("a")
    for i in range(16):
        b.predictor.observe(20)
    b.add_request(spec("b", prompt_len=4, max_tokens=100, first=300), 0.0)
    step(b)
    assert len(b.kv.block_ids("b")) == 6  # 4 + 20 = 24 tokens


def test_prefill_role_hands_off_after_first_token_and_holds_kv():
    b = make_batcher(role=Role.PREFILL)
    b.add_request(spec("a", prompt_len=8, max_tokens=50), 0.0)
    _, out = step(b, token=42)
    assert out.outputs[0].finish_reason is FinishReason.HANDOFF
    assert out.handoffs[0].block_ids == (0, 1) and out.handoffs[0].first_token_id == 42
    assert b.kv.num_free_blocks == 62 and not b.has_work
    assert b.release_handoff("a")
    assert b.kv.num_free_blocks == 64


def test_decode_role_reserve_commit_and_continue():
    b = make_batcher(role=Role.DECODE)
    s = spec("a", prompt_len=8, max_tokens=3)
    assert b.reserve(s, 0.0)
    held = b.kv.block_ids("a")
    assert len(held) == 3  # 8 prompt + 1 first token -> 9 tokens -> 3 blocks
    load = b.load("d", "m", 1.0, 0.01)
    assert (load.num_reserved, load.num_running, load.num_waiting) == (1, 0, 0)  # it decodes here once the KV is in
    assert b.commit_handoff("a", 42, 0.0) is None
    assert (b.load("d", "m", 1.0, 0.01).num_reserved, b.num_running) == (0, 1)
    plan, out = step(b, token=43)
    assert plan.chunks == (ScheduledChunk("a", 1, 8, True),)
    assert out.outputs[0].new_token_ids == (43,) and out.outputs[0].num_output_tokens == 2
    _, out = step(b, token=44)
    assert out.outputs[0].finish_reason is FinishReason.LENGTH
    assert b.kv.num_free_blocks == 64


def test_decode_role_release_reservation_frees_kv():
    b = make_batcher(role=Role.DECODE)
    assert b.reserve(spec("a"), 0.0)
    assert b.kv.num_free_blocks < 64
    assert b.release_reservation("a")
    assert b.kv.num_free_blocks == 64


def test_abort_frees_kv_everywhere():
    b = make_batcher()
    b.add_request(spec("run"), 0.0)
    step(b)
    b.add_request(spec("wait", first=900), 0.0)
    assert b.abort("run") and b.abort("wait") and not b.abort("nope")
    assert b.kv.num_free_blocks == 64 and not b.has_work


def test_token_budget_is_never_exceeded_and_config_is_validated():
    b = make_batcher(max_num_batched_tokens=5)
    for i in range(4):
        b.add_request(spec(f"r{i}", prompt_len=7, first=100 * (i + 1)), 0.0)
    for _ in range(10):
        plan, _ = step(b)
        assert plan.num_batched_tokens <= 5
    with pytest.raises(KeyError, match="unknown queue policy"):
        BatcherConfig(queue_policy="lifo")
    with pytest.raises(ValueError, match="preemption_mode"):
        BatcherConfig(preemption_mode="drop")


def test_a_sequence_the_pool_cannot_hold_stops_with_length_instead_of_thrashing():
    b = make_batcher(num_blocks=3, block_size=4, reservation_policy="watermark")
    b.add_request(spec("a", prompt_len=8, max_tokens=50), 0.0)
    outs = []
    for _ in range(10):
        plan, out = step(b)
        outs += out.outputs
        if not b.has_work:
            break
    assert outs[-1].finish_reason is FinishReason.LENGTH and outs[-1].num_output_tokens == 5  # 12 tokens = 3 blocks
    assert b.num_preemptions_total == 0 and b.kv.num_free_blocks == 3


def test_a_request_that_can_never_be_admitted_is_rejected_at_once():
    b = make_batcher(num_blocks=3, block_size=4, reservation_policy="full")
    with pytest.raises(ValueError, match="needs 4 KV blocks at admission"):
        b.add_request(spec("a", prompt_len=8, max_tokens=8), 0.0)


def test_slack_budget_lets_a_step_run_long_only_while_every_decode_keeps_its_mean_on_target():
    # Linear step model: d decodes alone take 10 ms + 1 ms each; every prefill token adds 0.1 ms.
    b = make_batcher(
        num_blocks=1024,
        max_num_batched_tokens=1000,
        budget_by_num_decodes=(64, 64, 64),
        tpot_target_s=0.020,
        max_step_s=0.060,
        decode_step_s_by_num_decodes=(0.010, 0.011, 0.012),
        prefill_s_per_token=0.0001,
        itl_slo_s=0.1,  # every step here ends within the free share of the ITL SLO: no tail budget spent
    )
    b.add_request(spec("a", prompt_len=4, max_tokens=100), 0.0)
    step(b, now=0.0)  # a's first token at t=0.0
    b.add_request(spec("big", prompt_len=2000, max_tokens=4, first=500), 0.0)
    # At t=0.005, a has 0 tokens after its first: the step must end by 0.0 + 1 x 20 ms -> 15 ms left
    # -> (0.015 - 0.011) / 0.0001 = 40 extra tokens; the sized floor (64) is larger, so 64.
    plan, _ = step(b, now=0.005)
    assert plan.num_batched_tokens == 64
    # a has now banked slack: 1 token after its first, at t=0.005 -> next token due by 0.040; at t=0.006 the
    # step may take 34 ms -> (0.034 - 0.011) / 0.0001 = 230 extra tokens, +1 decode = 231.
    plan, _ = step(b, now=0.006)
    assert plan.num_batched_tokens == 231
    # No decodes at all: nobody waits on the step but its prompts, so the STANDARD tier's TTFT SLO (250 ms, longer
    # than max_step_s) bounds it: (0.250 - 0.010) / 0.0001 = 2,400 tokens, so the 1,000-token ceiling.
    b.abort("a")
    plan, _ = step(b, now=1.0)
    assert plan.num_batched_tokens == 1000


def test_edf_demotes_a_request_whose_own_prefill_already_misses_its_deadline():
    # 0.1 ms per prompt token: a 3,000-token prompt needs 300 ms > its 250 ms STANDARD SLO -> BATCH deadline.
    b = make_batcher(num_blocks=2048, max_num_seqs=1, max_num_batched_tokens=4096, prefill_s_per_token=0.0001)
    b.add_request(spec("long", prompt_len=3000, arrival=0.0, max_tokens=1, first=100), 0.0)
    b.add_request(spec("short", prompt_len=100, arrival=0.1, max_tokens=1, first=5000), 0.1)
    assert b.request("long").queue_key == (10.0, int(Priority.BATCH))
    assert b.request("short").queue_key == (0.35, int(Priority.STANDARD))
    plan, _ = step(b, now=0.1)
    assert [c.request_id for c in plan.chunks] == ["short"]


def slot_bound_batcher(late_max_tokens: int = 1) -> Batcher:
    """One decode slot, held by "a" (first token at t=0.0, last at t=0.30); "late" (arrived at 0.0, deadline 0.25)
    waits for it. 10 ms a decode step, 0.1 ms a prompt token."""
    b = make_batcher(num_blocks=2048, max_num_seqs=1, max_num_batched_tokens=4096, prefill_s_per_token=0.0001,
                     decode_step_s_by_num_decodes=(0.010, 0.010))
    b.add_request(spec("a", prompt_len=4, max_tokens=2, arrival=0.0, first=900), 0.0)
    b.add_request(spec("late", prompt_len=100, arrival=0.0, max_tokens=late_max_tokens, first=100), 0.0)
    return b


def test_edf_demotes_a_waiting_head_that_became_lost_behind_a_full_batch():
    # "late" waited for the slot past its deadline; "fresh" (arrived at 0.2, deadline 0.45) can still make its
    # own. The freed slot goes to "fresh"; "late" is still served, after it, with the BATCH tier's deadline from
    # its arrival.
    b = slot_bound_batcher()
    b.add_request(spec("fresh", prompt_len=100, arrival=0.2, max_tokens=1, first=5000), 0.2)
    plan, _ = step(b, now=0.0)
    assert [c.request_id for c in plan.chunks] == ["a"]
    assert b.request("late").queue_key == (0.25, int(Priority.STANDARD))
    plan, out = step(b, now=0.3)  # a's last token; the waiting head is judged before the step is planned
    assert [c.request_id for c in plan.chunks] == ["a"]
    assert out.outputs[0].finish_reason is FinishReason.LENGTH
    # At 0.31: 0.31 + 10 ms + 100 x 0.1 ms = 0.33 > 0.25: "late" is lost; "fresh" makes 0.45 easily.
    plan, _ = step(b, now=0.31)
    assert [c.request_id for c in plan.chunks] == ["fresh"]
    assert b.request("late").queue_key == (10.0, int(Priority.BATCH))
    plan, _ = step(b, now=0.33)
    assert [c.request_id for c in plan.chunks] == ["late"]


def test_a_lost_head_keeps_its_place_when_nobody_behind_it_would_be_made_late():
    # As above, but behind "late" waits only a BATCH prompt (10 s of slack: not what a late head delays) and a
    # STANDARD one already lost too: "late" keeps its place and its key.
    b = slot_bound_batcher(late_max_tokens=2)
    b.add_request(spec("later", prompt_len=100, arrival=0.01, max_tokens=1, first=3000), 0.01)
    b.add_request(spec("bg", prompt_len=100, arrival=0.2, max_tokens=1, first=5000, priority=Priority.BATCH), 0.2)
    step(b, now=0.0)
    step(b, now=0.3)  # a's last token
    plan, _ = step(b, now=0.31)
    assert [c.request_id for c in plan.chunks] == ["late"]
    assert b.request("late").queue_key == (0.25, int(Priority.STANDARD))
    assert b.request("later").queue_key == (0.26, int(Priority.STANDARD))


def overloaded_first_tokens(queue_policy: str) -> tuple[dict[str, float], dict[str, float], set[str]]:
    """40 STANDARD prompts 20 ms apart into three decode slots (each request holds one for 21 steps of 10 ms: about
    15 req/s served against 50 offered), stepped until empty: (first-token time, finish time, demoted ids)."""
    b = make_batcher(num_blocks=4096, max_num_seqs=3, max_num_batched_tokens=4096, prefill_s_per_token=0.0001,
                     decode_step_s_by_num_decodes=(0.010,) * 4, queue_policy=queue_policy)
    arrivals = [(0.02 * i, f"r{i:02d}") for i in range(40)]
    first: dict[str, float] = {}
    finished: dict[str, float] = {}
    demoted: set[str] = set()
    now, i = 0.0, 0
    while i < len(arrivals) or b.has_work:
        assert now < 10.0
        while i < len(arrivals) and arrivals[i][0] <= now:
            t, rid = arrivals[i]
            b.add_request(spec(rid, prompt_len=50, max_tokens=20, arrival=t, first=100 + 97 * i), t)
            i += 1
        plan = b.schedule(now)
        demoted.update(r.request_id for r in b._waiting if r.queue_key[-1] == int(Priority.BATCH))
        out = b.update(plan, StepResult({c.request_id: 7 for c in plan.chunks if c.samples}), now)
        for o in out.outputs:
            first.setdefault(o.request_id, now)
            if o.finish_reason is not None:
                finished[o.request_id] = now
        now = round(now + 0.01, 6)
    return first, finished, demoted


def test_under_sustained_overload_lost_heads_make_way_and_every_request_still_finishes():
    in_time = {}
    for policy in ("edf", "fcfs"):  # one tier: the same order, but only EDF demotes
        first, finished, demoted = overloaded_first_tokens(policy)
        assert len(finished) == 40 and max(finished.values()) == pytest.approx(2.79)  # the same work, never starved
        in_time[policy] = sum(first[r] <= int(r[1:]) * 0.02 + 0.25 for r in first)
        if policy == "edf":
            assert len(demoted) == 24
            assert all(first[r] > int(r[1:]) * 0.02 + 0.25 for r in demoted)  # only lost ones were demoted
        else:
            assert not demoted
    assert in_time == {"edf": 16, "fcfs": 6}


def timed_step(b: Batcher, now: float, step_s: float):
    """One step planned at `now` whose tokens arrive `step_s` later (the gaps the tail budget judges)."""
    plan = b.schedule(now)
    sampled = {c.request_id: 7 for c in plan.chunks if c.samples}
    return plan, b.update(plan, StepResult(sampled), now + step_s)


def tail_batcher() -> Batcher:
    """The tail-budget batcher of the tests below, after decode "a" has run 41 fast steps 1 ms apart (its prefill,
    then 40 fast gaps banking TPOT slack). Linear model: 11 ms for one decode + 0.1 ms a prefill token. ITL SLO
    25 ms: a step ends free (no slow gap) up to 0.95 x 25 = 23.75 ms = 1 decode + 127 tokens; the TPOT slack allows
    1 + (60 - 11) / 0.1 = 491. Tail: 5 % of a 60-gap window = 3 slow gaps in any 60."""
    b = make_batcher(num_blocks=4096, max_num_batched_tokens=1000, budget_by_num_decodes=(64, 64, 64),
                     tpot_target_s=0.020, max_step_s=0.060, decode_step_s_by_num_decodes=(0.010, 0.011, 0.012),
                     prefill_s_per_token=0.0001, itl_slo_s=0.025, tail_budget_fraction=0.05, tail_window_gaps=60)
    b.add_request(spec("a", prompt_len=4, max_tokens=500), 0.0)
    for i in range(41):
        timed_step(b, 0.001 * (i + 1), 0.001)
    return b


def test_slow_steps_spend_the_itl_tail_budget_and_stop_when_it_is_spent():
    b = tail_batcher()
    now = 0.041
    assert (b.budget.tail.num_gaps, b.budget.tail.num_slow) == (40, 0)
    # 1,800 tokens due in 250 ms: 15 free steps (23.75 ms, 127 tokens each) would miss; four long steps of 490
    # tokens (4 x 11 ms + 180 ms = 224 ms) save it
    b.add_request(spec("big", prompt_len=1800, max_tokens=4, first=500, arrival=now), now)
    budgets = []
    for _ in range(5):
        plan = b.schedule(now)
        long = plan.num_batched_tokens > 128
        b.update(plan, StepResult({c.request_id: 7 for c in plan.chunks if c.samples}), now + (0.050 if long else 0.020))
        budgets.append(plan.num_batched_tokens)
        now += 0.060
    # slow steps while the window holds at most 3 slow gaps, then steps that end within the free share
    assert budgets[:3] == [491, 491, 491] and budgets[3:] == [128, 128]
    assert (b.budget.tail.num_slow, b.budget.tail.num_gaps) == (3, 45)


def test_a_capped_steps_gaps_run_from_the_previous_tokens_so_a_wait_for_the_grant_counts():
    # A gang member's step is granted after the other side's: 10 ms steps, 30 ms waits between them. The decode's
    # gaps are 40 ms, past the 25 ms SLO, though each step alone is short; the same steps back to back are not.
    b = tail_batcher()  # its last tokens came at 42 ms
    now = 0.072
    for _ in range(3):
        plan = b.schedule(now, step_cap_s=0.020)
        b.update(plan, StepResult({c.request_id: 7 for c in plan.chunks if c.samples}), now + 0.010)
        now += 0.040
    assert (b.budget.tail.num_slow, b.budget.tail.num_gaps) == (3, 43)
    b = tail_batcher()
    for i in range(3):
        timed_step(b, 0.042 + 0.010 * i, 0.010)
    assert (b.budget.tail.num_slow, b.budget.tail.num_gaps) == (0, 43)


def test_a_capped_step_with_no_tail_left_ends_within_the_free_share_counted_from_the_previous_tokens():
    # Three granted steps after 30 ms waits spend the whole tail (3 slow gaps of 60). A prompt then waits beside the
    # decode: granted 10 ms after the decode's last token, the step carries 27 prefill tokens (10 ms + 11 ms + 27 x
    # 0.1 ms = 23.7 ms <= 0.95 x 25 ms from that token), not the 127 of a step that ends free counted from its grant,
    # and its gap is fast.
    def spent() -> Batcher:
        b = tail_batcher()
        now = 0.072
        for _ in range(3):
            plan = b.schedule(now, step_cap_s=0.020)
            b.update(plan, StepResult({c.request_id: 7 for c in plan.chunks if c.samples}), now + 0.010)
            now += 0.040
        return b  # the decode's last token at 162 ms

    b = spent()
    assert not b.budget.tail.affordable(1)
    b.add_request(spec("p", prompt_len=400, max_tokens=4, first=500, arrival=0.170), 0.170)
    plan = b.schedule(0.172, step_cap_s=0.050)
    assert plan.num_batched_tokens == 1 + 27
    b.update(plan, StepResult({c.request_id: 7 for c in plan.chunks if c.samples}), 0.172 + 0.011 + 27 * 0.0001)
    assert (b.budget.tail.num_slow, b.budget.tail.num_gaps) == (3, 44)
    # Granted 30 ms after it, nothing but the decode fits.
    b = spent()
    b.add_request(spec("p", prompt_len=400, max_tokens=4, first=500, arrival=0.170), 0.170)
    assert b.schedule(0.192, step_cap_s=0.050).num_batched_tokens == 1
    # While the tail affords a slow gap, the 30 ms wait cuts nothing.
    b = tail_batcher()
    b.add_request(spec("p", prompt_len=400, max_tokens=4, first=500, arrival=0.045), 0.045)
    assert b.schedule(0.072, step_cap_s=0.050).num_batched_tokens == 1 + 127


def test_the_tail_is_spent_only_on_a_prompt_that_steps_within_the_slo_would_bring_in_late():
    # 500 tokens: 4 free steps of 127 tokens (+1 kept for error) = 119 ms, inside its 250 ms: no slow step
    b = tail_batcher()
    b.add_request(spec("small", prompt_len=500, max_tokens=4, first=500, arrival=0.05), 0.05)
    assert b.schedule(0.05).num_batched_tokens == 128 and b.budget.tail.affordable(1)
    # 3,000 tokens: lost even in one step (0.011 + 0.3 s > 250 ms): no slow step either
    b = tail_batcher()
    b.add_request(spec("lost", prompt_len=3000, max_tokens=4, first=500, arrival=0.05), 0.05)
    assert b.schedule(0.05).num_batched_tokens == 128
    # 2,000 tokens: free steps miss, and so do long steps under the 491-token ceiling (5 x 11 ms + 200 ms > 250 ms):
    # lost either way, no slow step
    b = tail_batcher()
    b.add_request(spec("big", prompt_len=2000, max_tokens=4, first=500, arrival=0.05), 0.05)
    assert b.schedule(0.05).num_batched_tokens == 128
    # 1,800 tokens: free steps miss, long ones (4 x 11 ms + 180 ms) save it
    b = tail_batcher()
    b.add_request(spec("big", prompt_len=1800, max_tokens=4, first=500, arrival=0.05), 0.05)
    assert b.schedule(0.05).num_batched_tokens == 491
    # a lost prompt at the head (already past its deadline) spends nothing itself, but one behind it that a long
    # step (taking both, in queue order) can still save does
    b = tail_batcher()
    b.add_request(spec("late", prompt_len=100, max_tokens=4, first=500, arrival=-0.3), 0.05)
    b.add_request(spec("next", prompt_len=1500, max_tokens=4, first=900, arrival=0.05), 0.05)
    assert b.schedule(0.05).num_batched_tokens == 491


def test_a_waiting_prompt_is_judged_by_the_tokens_it_computes_past_its_cached_prefix():
    # 2,600 tokens counted whole are lost even in long steps; with its first 800 tokens in the prefix cache it
    # computes 1,800, which long steps save (as the 1,800-token prompt above), as the router predicted.
    def with_warm_prefix() -> tuple[Batcher, float]:
        b = tail_batcher()
        b.add_request(spec("warm", prompt_len=800, max_tokens=1, first=500, arrival=0.041), 0.041)
        now = 0.041
        while b.request("warm") is not None:
            timed_step(b, now, 0.001)
            now += 0.001
        return b, now

    b, now = with_warm_prefix()
    b.add_request(spec("big", prompt_len=2600, max_tokens=4, first=500, arrival=now), now)
    assert b.kv.find_cached_prefix(b.request("big").token_ids) == 800
    assert b.schedule(now).num_batched_tokens == 491
    b, now = with_warm_prefix()
    b.add_request(spec("cold", prompt_len=2600, max_tokens=4, first=5000, arrival=now), now)
    assert b.schedule(now).num_batched_tokens == 128


def test_a_long_step_that_can_wait_lets_the_next_free_step_finish_the_prompt_ahead():
    # "ahead" (100 tokens, in time) finishes in the next free step; "big" (1,200 tokens due at 0.30) needs long
    # steps, which still save it after that free step (0.05 + 2 x 23.7 ms + 3 x 11 ms + 117 ms < 0.30): one free
    # step first, so "ahead" gets its first token 23.7 ms in rather than after a 60 ms step.
    b = tail_batcher()
    b.add_request(spec("ahead", prompt_len=100, max_tokens=4, first=500, arrival=0.05), 0.05)
    b.add_request(spec("big", prompt_len=1200, max_tokens=4, first=900, arrival=0.05), 0.05)
    plan = b.schedule(0.05)
    assert plan.num_batched_tokens == 128
    assert [(c.request_id, c.num_new_tokens) for c in plan.chunks] == [("a", 1), ("ahead", 100), ("big", 27)]
    # the same with "big" due 60 ms sooner: waiting a step would lose it, so the long step runs now, "ahead" in it
    b = tail_batcher()
    b.add_request(spec("ahead", prompt_len=100, max_tokens=4, first=500, arrival=0.05), 0.05)
    b.add_request(spec("big", prompt_len=1200, max_tokens=4, first=900, arrival=-0.01), 0.05)
    assert b.schedule(0.05).num_batched_tokens == 491


def long_step_batcher() -> Batcher:
    """`tail_batcher` with long steps of up to 300 ms (2,890 prompt tokens beside one decode) and a 256-token TPOT
    payback horizon, so that one long step can carry a whole prompt of 1,800 tokens (11 ms + 180 ms)."""
    b = make_batcher(num_blocks=8192, max_num_batched_tokens=4000, budget_by_num_decodes=(64, 64, 64),
                     tpot_target_s=0.020, max_step_s=0.300, decode_step_s_by_num_decodes=(0.010, 0.011, 0.012),
                     prefill_s_per_token=0.0001, itl_slo_s=0.025, tail_budget_fraction=0.05, tail_window_gaps=60,
                     tpot_horizon_tokens=256)
    b.add_request(spec("a", prompt_len=4, max_tokens=500), 0.0)
    for i in range(41):
        timed_step(b, 0.001 * (i + 1), 0.001)
    return b


def run_steps(b: Batcher, now: float, n: int) -> tuple[list[list[tuple[str, int]]], dict[str, float]]:
    """`n` steps, each ending when the step model says (`busy_until_s`): their chunks, and each request's first
    token time."""
    plans, first = [], {}
    for _ in range(n):
        plan = b.schedule(now)
        plans.append([(c.request_id, c.num_new_tokens) for c in plan.chunks])
        now = b.budget.busy_until_s
        for c in plan.chunks:
            if c.samples:
                first.setdefault(c.request_id, now)
        b.update(plan, StepResult({c.request_id: 7 for c in plan.chunks if c.samples}), now)
    return plans, first


def test_a_long_step_does_not_carry_a_prompt_ahead_past_the_deadline_its_free_steps_keep():
    # "ahead" (300 tokens, due at 0.15) makes it in three free steps of 127 tokens (23.7 ms each, one more to spare);
    # "late" (1,500 tokens) needs a long step. One long step of both (11 ms + 180 ms) would give "ahead" its first
    # token at 0.241, past its deadline, though it saves "late".
    # "late" due at 0.30 can wait for those three free steps (then 11 ms + 142 ms): they run first.
    b = long_step_batcher()
    b.add_request(spec("ahead", prompt_len=300, max_tokens=4, first=500, arrival=-0.10), 0.05)
    b.add_request(spec("late", prompt_len=1500, max_tokens=4, first=900, arrival=0.05), 0.05)
    plans, first = run_steps(b, 0.05, 4)
    assert plans == [[("a", 1), ("ahead", 127)], [("a", 1), ("ahead", 127)], [("a", 1), ("ahead", 46), ("late", 81)],
                     [("ahead", 1), ("a", 1), ("late", 1419)]]
    assert first["ahead"] == pytest.approx(0.05 + 3 * (0.011 + 127 * 0.0001)) and first["late"] == pytest.approx(0.275)
    # "late" due at 0.28 cannot wait for them: the long step ends with "ahead" (11 ms + 30 ms) and a second takes
    # "late" (12 ms + 150 ms), both in time; the tail affords their three slow gaps ("a" twice, then "ahead").
    b = long_step_batcher()
    b.add_request(spec("ahead", prompt_len=300, max_tokens=4, first=500, arrival=-0.10), 0.05)
    b.add_request(spec("late", prompt_len=1500, max_tokens=4, first=900, arrival=0.03), 0.05)
    plans, first = run_steps(b, 0.05, 2)
    assert plans == [[("a", 1), ("ahead", 300)], [("ahead", 1), ("a", 1), ("late", 1500)]]
    assert first["ahead"] == pytest.approx(0.091) and first["late"] == pytest.approx(0.253)
    assert first["ahead"] <= 0.15 and first["late"] <= 0.28
    assert b.budget.tail.num_slow == 3
    # With no prompt ahead to protect, the long step takes "late" at once.
    b = long_step_batcher()
    b.add_request(spec("late", prompt_len=1800, max_tokens=4, first=900, arrival=0.05), 0.05)
    plans, first = run_steps(b, 0.05, 1)
    assert plans == [[("a", 1), ("late", 1800)]] and first["late"] == pytest.approx(0.05 + 0.011 + 0.18)


def test_a_long_step_in_flight_counts_against_the_tail_when_the_next_is_promised():
    # Two slow gaps of the 3 the 60-gap window holds are spent; a long step for "big" spends the third. Its slow gap
    # reaches the window only at its end, but the next long step can come only once the first slow gap has slid
    # out: the load report says so while the step is in flight (it said 0 before, and a prompt that arrived during
    # the step was promised a long step at its end).
    b = tail_batcher()
    for _ in range(2):
        b.budget.tail.observe(1, 1)
    b.add_request(spec("big", prompt_len=1800, max_tokens=4, first=500, arrival=0.05), 0.05)
    assert b.schedule(0.05).num_batched_tokens == 491 and b.budget.inflight_slow == 1
    gaps = b.budget.tail.gaps_until_affordable(2)
    assert gaps == 59 and b.budget.tail.gaps_until_affordable(1) == 0
    assert b.budget.long_step_wait_s() == pytest.approx(gaps * (0.011 + 127 * 0.0001))


def test_a_long_step_in_flight_that_fills_the_tail_defers_the_next_until_it_has_left_the_window():
    # Two decodes, and a long step in flight over both: its two slow gaps and the next step's two are over the 3 the
    # 60-gap window holds, though the next alone would fit. The next long step comes once the step in flight has
    # slid out of the window: 60 fast gaps, 30 free steps of two decodes (not "never").
    b = tail_batcher()
    b.budget.num_decodes, b.budget.inflight_slow = 2, 2
    assert b.budget.tail.gaps_until_affordable(4) == -1 and b.budget.tail.gaps_until_affordable(2) == 0
    assert b.budget.long_step_wait_s() == pytest.approx(30 * b.budget.free_step(2)[1])


def test_the_load_snapshot_leaves_the_step_in_flight_out_of_the_queue_and_says_when_a_long_step_is_affordable():
    b = tail_batcher()
    b.add_request(spec("p", prompt_len=1000, max_tokens=4, first=500, arrival=0.05), 0.05)
    assert b.queued_prefill_tokens() == 1000
    plan = b.schedule(0.05)  # a free step: 127 of its tokens in flight, their time in busy_until_s
    assert plan.num_batched_tokens == 128
    assert b.queued_prefill_tokens() == 873 and b.budget.busy_until_s == pytest.approx(0.05 + 0.011 + 127 * 0.0001)
    b.update(plan, StepResult({"a": 7}), 0.07)
    assert b.queued_prefill_tokens() == 873 and b.budget.busy_until_s == 0.07
    # 3 slow gaps of the 60-gap window spent: the next long step waits until the oldest slides out
    assert b.budget.long_step_wait_s() == 0.0
    for _ in range(3):
        b.budget.tail.observe(1, 1)
    gaps = b.budget.tail.gaps_until_affordable(1)
    assert gaps > 0 and not b.budget.tail.affordable(1)
    free_step_s = 0.011 + 127 * 0.0001
    assert b.budget.long_step_wait_s() == pytest.approx(gaps * free_step_s)


def test_the_load_snapshot_affords_long_steps_as_if_the_prompt_they_rescue_had_joined_the_decodes():
    # One decode with 20 ms of slack banked and a 20-token payback horizon: at its pace (11 ms steps) it pays a
    # delay back at 9 ms a token, 180 ms in all. A rescued prompt joins the decodes and steps take 16 ms: 4 ms a
    # token, 100 ms less. Long steps take 490 tokens each (max_step_s); the window affords three.
    b = make_batcher(num_blocks=4096, max_num_batched_tokens=20000, budget_by_num_decodes=(64, 64, 64),
                     tpot_target_s=0.020, max_step_s=0.060, decode_step_s_by_num_decodes=(0.010, 0.011, 0.016),
                     prefill_s_per_token=0.0001, itl_slo_s=0.025, tail_budget_fraction=0.05, tail_window_gaps=60,
                     tpot_horizon_tokens=20)
    b.add_request(spec("a", prompt_len=4, max_tokens=500), 0.0)
    for i in range(4):  # its prefill (first token at 0.02), then three more tokens 20 ms apart
        timed_step(b, 0.02 * i, 0.02)
    b.schedule(0.08)  # the report's figures come from the latest plan (a decode-only step, nothing to prefill)
    assert b.budget.long_prefill_tokens_per_s() == pytest.approx(490 / (0.011 + 490 * 0.0001))
    # slack: 20 ms + 180 ms payback, less 100 ms for the joining decode and the 11 ms step itself: 890 tokens,
    # where the three long steps (1,470 tokens) and the slack counted without the joining decode (1,890) allow more
    assert b.budget.long_burst_tokens() == 890


def test_long_decode_contexts_take_their_kv_read_time_out_of_the_prefill_chunk():
    b = make_batcher(
        num_blocks=4096,
        max_num_batched_tokens=64,
        budget_by_num_decodes=(64, 64),
        prefill_s_per_token=0.0001,
        sized_context_tokens=100,
        kv_s_per_context_token=0.000005,
    )
    b.add_request(spec("a", prompt_len=600, max_tokens=50), 0.0)
    while b.request("a").num_output_tokens == 0:
        step(b)
    b.add_request(spec("p", prompt_len=500, max_tokens=4, first=5000), 0.0)
    plan, _ = step(b)
    # a decodes with 601 tokens of context: 501 beyond the sized 100 -> 2.505 ms -> 25 prefill tokens fewer
    assert [(c.request_id, c.num_new_tokens) for c in plan.chunks] == [("a", 1), ("p", 38)]
    # Longer still: the cut stops at a floor of 16 prefill tokens so prompts keep moving.
    b2 = make_batcher(num_blocks=4096, max_num_batched_tokens=64, budget_by_num_decodes=(64, 64),
                      prefill_s_per_token=0.0001, sized_context_tokens=100, kv_s_per_context_token=0.0001)
    b2.add_request(spec("a", prompt_len=600, max_tokens=50), 0.0)
    while b2.request("a").num_output_tokens == 0:
        step(b2)
    b2.add_request(spec("p", prompt_len=500, max_tokens=4, first=5000), 0.0)
    plan, _ = step(b2)
    assert [(c.request_id, c.num_new_tokens) for c in plan.chunks] == [("a", 1), ("p", 16)]


def test_output_length_predictor_matches_sorting_its_window_at_every_completion():
    # The predictor keeps its window sorted as lengths come and go, and its mean cached between completions:
    # the same prediction and mean as sorting and summing the window each time.
    import random as _random

    from octoserve.services.core.reservation import OutputLengthPredictor

    rng = _random.Random(3)
    for window, quantile, min_samples in ((1, 0.5, 1), (7, 0.9, 3), (64, 0.97, 16)):
        p = OutputLengthPredictor(quantile, window, prior_tokens=100, min_samples=min_samples)
        seen: list[int] = []
        for _ in range(400):
            n = rng.choice([1, 5, 5, 17, rng.randint(1, 3000)])
            p.observe(n)
            seen.append(n)
            recent = sorted(seen[-window:])
            if len(recent) < min_samples:
                assert p.predict() == 100 and p.mean() == 100.0
                continue
            assert p.predict() == recent[min(len(recent) - 1, int(quantile * len(recent)))]
            mean = sum(seen[-window:]) / len(recent)
            assert p.mean() == mean and p.mean() == mean  # twice: the cached one too


def test_the_load_snapshot_counts_the_long_step_in_flight_against_the_tail_and_the_tpot_slack():
    # One decode, so three long steps back to back, 490 prompt tokens each (max_step_s).
    b = tail_batcher()
    assert b.budget.long_prefill_tokens_per_s() == pytest.approx(490 / (0.011 + 490 * 0.0001))
    assert b.budget.long_burst_tokens() == 3 * 490
    # Once spent: one step in 20 may be long, and free steps (23.7 ms, 127 tokens) already run past the 20 ms TPOT
    # target, so the decodes regain no slack: the free steps' rate is what lasts.
    assert b.budget.long_sustained_tokens_per_s() == pytest.approx(127 / (0.011 + 127 * 0.0001))
    b.add_request(spec("big", prompt_len=1800, max_tokens=4, first=500, arrival=0.05), 0.05)
    assert b.schedule(0.05).num_batched_tokens == 491  # a long step, in flight
    assert b.queued_prefill_tokens() == 1800 - 490
    assert b.budget.long_burst_tokens() == 2 * 490  # its slow gap is not in the window yet, but spent
