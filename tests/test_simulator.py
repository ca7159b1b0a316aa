"""The discrete-event simulator: exact event timing against the cost model, hand-offs, determinism, conservation."""

from __future__ import annotations

import dataclasses

import pytest

from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.core.sim_executor import sim_token_id
from octoserve.services.core.types import Priority, ScheduledChunk, StepPlan
from octoserve.services.sim.driver import NodeSimulator, run_simulation
from octoserve.services.workload import PROFILES, TraceRequest, generate_trace, scaled

MODELS = {"llama-3-8b": {"preset": "llama-3-8b"}}


def node(instances, **policies):
    return node_config_from_dict(
        {"gpu": "h100-sxm-80gb", "num_gpus": 8, "models": MODELS, "instances": instances, "policies": policies}
    )


COLOCATED_8B = {"id": "sm-0", "model": "llama-3-8b", "role": "colocated", "tp": 1, "gpu_ids": [0]}
DISAGG_8B = [
    {"id": "sm-p", "model": "llama-3-8b", "role": "prefill", "tp": 1, "gpu_ids": [0]},
    {"id": "sm-d", "model": "llama-3-8b", "role": "decode", "tp": 1, "gpu_ids": [1]},
]


def one_request(prompt_len=1000, output_len=4, max_tokens=16) -> TraceRequest:
    return TraceRequest(
        request_id="r0000000",
        arrival_s=0.5,
        model="llama-3-8b",
        prompt_token_ids=tuple(range(1000, 1000 + prompt_len)),
        output_len=output_len,
        max_tokens=max_tokens,
        priority=Priority.STANDARD,
        ttft_slo_ms=250.0,
    )


def test_single_request_token_times_are_the_cost_models_step_times():
    config = node([COLOCATED_8B], slo_sizing=False)  # one whole-prompt chunk: the unsized 2,048-token budget
    req = one_request()
    result = run_simulation(config, [req])
    rec = result.records[0]
    from octoserve.services.sim.driver import NodeSimulator

    cost = NodeSimulator(config).instances["sm-0"].cost
    budget = config.instances[0].max_num_batched_tokens
    assert budget >= 1000
    prefill = cost.plan_time_s(StepPlan(1, (ScheduledChunk("r", 1000, 0, True),)), 16)
    decodes = [cost.plan_time_s(StepPlan(i, (ScheduledChunk("r", 1, 1000 + i, True),)), 16) for i in range(3)]
    expected = [0.5 + prefill]
    for d in decodes:
        expected.append(expected[-1] + d)
    assert rec.first_token_s == pytest.approx(expected[0], abs=1e-12)
    assert rec.token_times_s == pytest.approx(tuple(expected), abs=1e-12)
    assert rec.num_output_tokens == 4 and rec.finish_s == pytest.approx(expected[-1], abs=1e-12)
    assert not rec.refused and rec.error == ""


def test_disaggregated_request_pays_prefill_transfer_then_decode():
    config = node(DISAGG_8B, slo_sizing=False)
    result = run_simulation(config, [one_request(output_len=3)])
    rec = result.records[0]
    from octoserve.services.sim.driver import NodeSimulator

    sim = NodeSimulator(config)
    p_cost, d_cost = sim.instances["sm-p"].cost, sim.instances["sm-d"].cost
    prefill = p_cost.plan_time_s(StepPlan(1, (ScheduledChunk("r", 1000, 0, True),)), 16)
    transfer = p_cost.kv_transfer_time_s(1000)
    d1 = d_cost.plan_time_s(StepPlan(1, (ScheduledChunk("r", 1, 1000, True),)), 16)
    d2 = d_cost.plan_time_s(StepPlan(2, (ScheduledChunk("r", 1, 1001, True),)), 16)
    t_first = 0.5 + prefill
    assert rec.token_times_s == pytest.approx((t_first, t_first + transfer + d1, t_first + transfer + d1 + d2))
    stats = {s.instance_id: s for s in result.instances}
    assert stats["sm-p"].num_steps == 1 and stats["sm-d"].num_steps == 2


def test_runs_are_deterministic_and_every_request_is_accounted_for():
    config = node([COLOCATED_8B, {**COLOCATED_8B, "id": "sm-1", "gpu_ids": [1]}])
    profile = scaled(PROFILES["seed-000"], rate_rps=40.0, duration_s=5.0)
    trace = [t for t in generate_trace(profile, 3) if t.model == "llama-3-8b"]
    a = run_simulation(config, trace, seed=1)
    b = run_simulation(config, trace, seed=1)
    assert a.records == b.records
    refused = sum(r.refused for r in a.records)
    finished = sum(r.finish_s is not None for r in a.records)
    assert refused + finished == len(trace)
    assert all(r.error == "" for r in a.records)


def test_overload_is_refused_early_with_a_retry_hint_and_never_runs_out_of_kv():
    config = node([COLOCATED_8B])
    profile = scaled(PROFILES["seed-000"], rate_rps=400.0, duration_s=3.0)
    trace = [t for t in generate_trace(profile, 0) if t.model == "llama-3-8b"]
    result = run_simulation(config, trace)
    refused = [r for r in result.records if r.refused]
    assert refused, "400 req/s on one 8B GPU must shed load"
    assert all(r.retry_after_ms is not None and r.retry_after_ms > 0 for r in refused)
    assert all(r.error == "" for r in result.records)


def test_sim_tokens_are_deterministic_and_never_eos():
    assert sim_token_id(1000, 5, 0) == sim_token_id(1000, 5, 0)
    assert all(sim_token_id(n, f, p) >= 1000 for n in (1, 999) for f in (0, 7) for p in range(50))


def test_sim_tokens_continue_exactly_from_a_prompt_extended_by_the_tokens_already_produced():
    """A stream resumed with its prompt plus the k tokens it had (SDK resume, in-node continuation) samples the
    uninterrupted stream's tokens: the sim model, like a real greedy one, sees only the sequence."""
    from octoserve.services.core.sim_executor import SIM_TOKEN_LO, SIM_TOKEN_SPAN, SIM_TOKEN_STEP, token_key
    from octoserve.services.core.types import RequestSpec, SamplingParams

    prompt = (4321, 17, 99, 5)
    whole = [sim_token_id(len(prompt), prompt[0], p) for p in range(40)]
    for k in (1, 7, 39):
        resumed = [sim_token_id(len(prompt) + k, prompt[0], p) for p in range(40 - k)]
        assert whole[:k] + resumed == whole
        # The compact path's key gives the same tokens (what the live sim engine and the simulator sample).
        spec = RequestSpec("r", "m", prompt + tuple(whole[:k]), SamplingParams(max_tokens=40 - k), 0.0)
        _, offset = token_key(spec, len(spec.prompt_token_ids))
        keyed = [SIM_TOKEN_LO + (n * SIM_TOKEN_STEP + offset) % SIM_TOKEN_SPAN
                 for n in range(len(prompt) + k, len(prompt) + 40)]
        assert keyed == whole[k:]


def test_slo_sizing_chunks_a_long_prompt_so_no_step_exceeds_the_itl_target():
    config = node([COLOCATED_8B], slack_chunking=False)
    from octoserve.services.sim.driver import NodeSimulator

    sim = NodeSimulator(config)
    budget = sim.instances["sm-0"].batcher.config.max_num_batched_tokens
    assert budget < 1000  # the 8B's ITL-sized budget (437 on H100 at a 30 ms SLO)
    rec = sim.run([one_request(prompt_len=1000, output_len=2)]).records[0]
    steps = -(-1000 // budget)
    assert rec.num_output_tokens == 2
    assert rec.first_token_s - 0.5 <= steps * 0.030  # every prefill chunk fits the ITL SLO


def test_slack_chunking_prefills_a_lone_prompt_in_one_step_no_decode_waits_on():
    config = node([COLOCATED_8B])
    from octoserve.services.sim.driver import NodeSimulator

    sim = NodeSimulator(config)
    cost = sim.instances["sm-0"].cost
    rec = sim.run([one_request(prompt_len=1000, output_len=2)]).records[0]
    one_step = cost.plan_time_s(StepPlan(1, (ScheduledChunk("r", 1000, 0, True),)), 16)
    assert one_step < 3 * 0.0255  # within max_step_factor x the ITL target
    assert rec.first_token_s == pytest.approx(0.5 + one_step, abs=1e-12)


def test_a_request_larger_than_every_kv_pool_is_an_error_record_not_a_crash():
    # With admission off nothing stops a request whose full reservation (prompt + max_tokens) exceeds the
    # instance's whole KV pool from being routed there: it must end as an error record, not kill the run.
    config = node(
        [{**COLOCATED_8B, "gpu_memory_utilization": 0.2, "max_num_batched_tokens": 256}], admission=False, reservation="full", slo_sizing=False
    )
    from octoserve.services.sim.driver import NodeSimulator

    pool_tokens = NodeSimulator(config).instances["sm-0"].batcher.kv.num_total_blocks * 16
    assert pool_tokens < 8000  # smaller than the context window, so a full reservation can outgrow it
    huge = one_request(prompt_len=1000, output_len=8, max_tokens=7000)
    rec = run_simulation(config, [huge]).records[0]
    assert not rec.refused and rec.finish_s is None
    assert "KV blocks at admission" in rec.error


def test_the_summary_covers_the_window_after_the_warmup_and_the_run_records_occupancy():
    config = node([COLOCATED_8B])
    profile = scaled(PROFILES["seed-000"], rate_rps=40.0, duration_s=5.0)
    trace = [t for t in generate_trace(profile, 3) if t.model == "llama-3-8b"]
    stated = run_simulation(config, trace, warmup_s=2.0)
    last = trace[-1].arrival_s
    assert (stated.window.start_s, stated.window.end_s, stated.window.warmup_rule) == (2.0, last, "stated")
    assert stated.summary.overall.num_offered == sum(t.arrival_s >= 2.0 for t in trace)
    assert stated.summary.num_warmup == sum(t.arrival_s < 2.0 for t in trace)
    assert stated.summary.duration_s == pytest.approx(last - 2.0)
    assert len(stated.records) == len(trace)  # records and series keep the whole run
    occupancy = stated.timeseries["occupancy"]
    assert occupancy[0] == (0.0, 0.0) and occupancy[-1][1] == 0.0  # drained: nothing left in flight
    assert max(v for _, v in occupancy) > 0
    detected = run_simulation(config, trace)  # default: detected, floor cut to half the 5 s window
    assert detected.window.warmup_rule in ("floor", "MSER-5") and detected.window.start_s >= last / 2 - 1e-9
    assert 0.0 <= detected.instances[0].busy_fraction <= 1.0 and detected.instances[0].kv_max <= 1.0


def test_a_prompt_slower_than_its_slo_even_idle_is_refused_in_the_simulator_and_counted_as_a_miss():
    import dataclasses

    # 9,000 tokens of 8B prefill take ~285 ms on an idle H100 (cost model), over the 250 ms SLO; as BATCH it is served.
    slow = one_request(prompt_len=9000)
    batch = dataclasses.replace(slow, request_id="r0000001", arrival_s=5.0, priority=Priority.BATCH, ttft_slo_ms=10_000.0)
    result = run_simulation(node([COLOCATED_8B]), [slow, batch], warmup_s=0.0)
    refused, served = result.records
    assert (refused.refused, refused.retry_after_ms, refused.first_token_s) == (True, 0, None)
    assert served.completed and not served.refused
    s = result.summary
    assert (s.overall.num_offered, s.overall.num_refused, s.overall.num_good) == (2, 1, 1)
    assert s.overall.attainment_offered == 0.5


class _ArrivalLog(NodeSimulator):
    """Logs each arrival with the virtual time it was handled at."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.log: list[tuple[str, float]] = []

    def _on_arrival(self, req):
        self.log.append((req.request_id, self.now))
        super()._on_arrival(req)


def test_arrivals_run_in_the_order_a_heap_holding_them_would_pop_them():
    # Arrivals are merged with the event heap rather than pushed: (time, push order) must decide as before. An
    # event pushed before the run precedes an arrival at the same time; arrivals at one time keep trace order
    # (the trace need not be sorted); an event pushed during the run at an arrival's time comes after it.
    def arrival(rid, t):
        return dataclasses.replace(one_request(), request_id=rid, arrival_s=t)

    sim = _ArrivalLog(node([COLOCATED_8B]))
    log = sim.log

    def at_b():
        log.append(("call at 0.3", sim.now))
        sim.call_at(0.5, lambda: log.append(("pushed during the run", sim.now)))

    sim.call_at(0.5, lambda: log.append(("pushed before the run", sim.now)))
    sim.call_at(0.3, at_b)
    result = sim.run([arrival("a", 0.5), arrival("b", 0.3), arrival("c", 0.5)])
    assert log == [("call at 0.3", 0.3), ("b", 0.3), ("pushed before the run", 0.5), ("a", 0.5), ("c", 0.5),
                   ("pushed during the run", 0.5)]
    assert [r.request_id for r in result.records] == ["a", "b", "c"]  # the trace's order
    assert all(r.finish_s is not None for r in result.records)


def test_a_trackers_record_puts_every_value_in_its_named_field():
    # `_Tracker.record` builds the record positionally (cheaper from compiled code): each field by name.
    from octoserve.services.sim.driver import _Tracker

    trace = dataclasses.replace(one_request(prompt_len=37), priority=Priority.BATCH, ttft_slo_ms=321.0)
    t = _Tracker(trace)
    t.num_cached, t.first_token_s, t.token_times_s, t.finish_s = 16, 0.75, [0.75, 0.8, 0.9], 0.95
    t.refused, t.retry_after_ms, t.error, t.preemptions, t.continuations = True, 12.5, "boom", 2, 1
    assert dataclasses.asdict(t.record()) == {
        "request_id": "r0000000", "model": "llama-3-8b", "priority": Priority.BATCH, "arrival_s": 0.5,
        "ttft_slo_ms": 321.0, "num_prompt_tokens": 37, "num_cached_prompt_tokens": 16, "num_output_tokens": 3,
        "first_token_s": 0.75, "token_times_s": (0.75, 0.8, 0.9), "finish_s": 0.95, "refused": True,
        "retry_after_ms": 12.5, "error": "boom", "num_preemptions": 2, "num_continuations": 1,
    }
