"""Faults in the simulator (services/sim/driver.py, services/sim/faults.py): an instance lost at time t and back
after its restart time. Requests with no token move; those with tokens are continued on another instance (prompt
plus the tokens streamed) at most `policies.max_continuations` times, or fail with a stated error (continuations
spent, or refused); the instance gets nothing while down and comes back empty, no KV stays held anywhere, and the
report gives the dip, recovery, and the requests moved, continued and failed. Expected counts are read from the
lost instance's requests just before the fault, never taken from a run's output."""

from __future__ import annotations

import argparse

import pytest

from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.core.types import Priority
from octoserve.services.metrics import SloSpec
from octoserve.services.sim.driver import NodeSimulator
from octoserve.services.sim.faults import (
    InstanceFault, attainment_by_outcome_time, fault_report, outcome_time_s, parse_fault,
)
from octoserve.services.workload import TraceRequest
from tests.fault_fixtures import disagg_config, two_replica_config
from tests.service_fixtures import COLOCATED_MODEL, DISAGG_MODEL


def _trace(model: str, rate: float, duration_s: float, prompt_len: int = 1000, output_len: int = 200):
    n = int(rate * duration_s)
    return [TraceRequest(f"r{i}", i / rate, model, tuple(1000 + (i * 7919 + j * 31) % 30000 for j in range(prompt_len)),
                         output_len, output_len, Priority.STANDARD, 250.0) for i in range(n)]


def _with_policies(config: dict, **policies) -> dict:
    return {**config, "policies": {**config.get("policies", {}), **policies}}


def _watch(sim: NodeSimulator, faults) -> list[dict[str, list[str]]]:
    """What each fault's instance holds at the fault, read just before it (an event at the same time, pushed
    first; so no fault may fall on an arrival, which would come between): request ids by what the rule does with
    them, one dict per fault, filled as the run goes."""
    seen: list[dict[str, list[str]]] = [{"tokens": [], "no_token": [], "tokens_continued_before": []} for _ in faults]

    def look(fault, held) -> None:
        for t in sim._trackers.values():
            route = t.route
            if route is None or t.finish_s is not None or t.error or t.refused:
                continue
            if fault.instance_id != route.decode_instance_id and (fault.instance_id != route.instance_id
                                                                  or t.committed):
                continue
            if t.first_token_s is None:
                held["no_token"].append(t.trace.request_id)
            else:
                held["tokens_continued_before" if t.continuations else "tokens"].append(t.trace.request_id)

    for fault, held in zip(faults, seen):
        sim.call_at(fault.at_s, lambda fault=fault, held=held: look(fault, held))
    return seen


def _roomy(config: dict) -> dict:
    """`config` with 0.5 of each GPU's memory for its instance (not 0.22): room on the survivors to take the lost
    instance's requests, so every one is placed again (with 0.22 a survivor may have no KV for one: refused, which
    `test_a_continuation_with_no_instance_left_is_refused` covers where no instance is up at all)."""
    return {**config, "instances": [{**i, "gpu_memory_utilization": 0.5} for i in config["instances"]]}


def _counts(rerouted=0, reroute_refused=0, continued=0, failed_bound=0, failed_refused=0) -> dict[str, int]:
    return {"rerouted": rerouted, "reroute_refused": reroute_refused, "continued": continued,
            "failed_bound": failed_bound, "failed_refused": failed_refused, "lost": failed_bound + failed_refused}


def _nothing_held(sim: NodeSimulator) -> None:
    for inst in sim.instances.values():
        load = inst.load()
        assert (load.num_running, load.num_waiting, load.num_free_blocks) == (0, 0, load.num_total_blocks), load


def _gaps(r) -> list[float]:
    return [b - a for a, b in zip(r.token_times_s, r.token_times_s[1:])]


def test_parse_fault():
    assert parse_fault("sm-0@30") == InstanceFault("sm-0", 30.0, 5.0)
    assert parse_fault("sm-0@30s+12.5") == InstanceFault("sm-0", 30.0, 12.5)
    for bad in ("sm-0", "@30", "sm-0@soon", "sm-0@30+-1"):
        with pytest.raises(ValueError, match="sm-0@30"):
            parse_fault(bad)


def test_unknown_instance_is_named():
    with pytest.raises(ValueError, match="instance 'x9'; the node has c0, c1"):
        NodeSimulator(node_config_from_dict(two_replica_config()), faults=[InstanceFault("x9", 1.0)])


def test_colocated_replica_lost_continues_streams_and_moves_unstarted_requests():
    # Short, frequent requests: at the fault c0 has prompts in prefill (moved) and streams (continued on c1).
    fault = InstanceFault("c0", 15.01, 5.0)
    node = node_config_from_dict(_roomy(two_replica_config()))
    sim = NodeSimulator(node, seed=0, faults=[fault])
    [held] = _watch(sim, [fault])
    result = sim.run(_trace(COLOCATED_MODEL, 100.0, 40.0, 1000, 20), drain_s=120.0)
    assert len(held["tokens"]) >= 1 and len(held["no_token"]) >= 1, held
    assert result.fault_counts == _counts(rerouted=len(held["no_token"]), continued=len(held["tokens"]))
    assert result.fault_counts_by_fault == (result.fault_counts,)
    records = {r.request_id: r for r in result.records}
    assert {r.request_id: r.num_continuations for r in result.records if r.num_continuations} == dict.fromkeys(
        held["tokens"], 1)
    for rid in held["tokens"]:
        r = records[rid]
        # The stream went on: every token, its TTFT its original first token (before the fault), and one longer
        # gap, across the fault, counted in its ITL like any other.
        assert not r.error and r.finish_s is not None and r.num_output_tokens == 20, r
        assert r.first_token_s < 15.01 < r.finish_s
        before = [t for t in r.token_times_s if t <= 15.01]
        seam = r.token_times_s[len(before)] - before[-1]
        assert seam == max(_gaps(r)) and r.tpot_s == pytest.approx(sum(_gaps(r)) / 19)
    for r in result.records:  # everything ended: refused, or completed with all its tokens
        assert r.refused or (not r.error and r.finish_s is not None and r.num_output_tokens == 20), r
    kv_c0 = result.timeseries["kv:c0"]  # c0 held no KV while down (fresh and unroutable), and serves again after
    assert all(v == 0.0 for t, v in kv_c0 if 15.0 < t < 20.0)
    assert any(v > 0.0 for t, v in kv_c0 if t > 20.0)
    _nothing_held(sim)
    report = fault_report(result.records, SloSpec(node.slo.ttft_ms, node.slo.itl_ms), fault, COLOCATED_MODEL,
                          counts=result.fault_counts_by_fault[0])
    assert (report.rerouted, report.continued, report.failed_bound, report.failed_refused) == (
        len(held["no_token"]), len(held["tokens"]), 0, 0)


def test_colocated_replica_lost_fails_started_streams_with_continuations_off():
    # policies.max_continuations 0: the streams on c0 fail with it, as before continuations.
    fault = InstanceFault("c0", 15.01, 5.0)
    node = node_config_from_dict(_with_policies(_roomy(two_replica_config()), max_continuations=0))
    sim = NodeSimulator(node, seed=0, faults=[fault])
    [held] = _watch(sim, [fault])
    result = sim.run(_trace(COLOCATED_MODEL, 100.0, 40.0, 1000, 20), drain_s=120.0)
    counts = result.fault_counts
    assert len(held["tokens"]) >= 1 and counts == _counts(rerouted=len(held["no_token"]),
                                                          failed_bound=len(held["tokens"]))
    failed = [r for r in result.records if r.error]
    assert sorted(r.request_id for r in failed) == sorted(held["tokens"])
    assert all(r.error == "instance c0 was lost after the request's first token; its continuations are spent (0 of "
               "policies.max_continuations = 0)" for r in failed)
    assert all(r.arrival_s < 15.0 and r.first_token_s is not None for r in failed)
    for r in result.records:  # everything else ended: refused, or completed with all its tokens
        if not r.refused and not r.error:
            assert r.finish_s is not None and r.num_output_tokens == 20
    _nothing_held(sim)
    slo = SloSpec(node.slo.ttft_ms, node.slo.itl_ms)
    report = fault_report(result.records, slo, fault, COLOCATED_MODEL, counts=result.fault_counts_by_fault[0])
    assert (report.continued, report.failed, report.failed_bound) == (0, len(failed), len(failed))
    # A request lost with c0 is dated by the fault (not by its last token, a step before it): the dip is from the
    # fault on, and the bin holding the fault holds every lost request.
    assert {outcome_time_s(r, (fault,)) for r in failed} == {15.01}
    assert all(outcome_time_s(r) < 15.01 for r in failed)  # without the fault: each one's last token, before it
    assert report.dip < report.before and report.dip_at_s >= 15.01
    bins = {round(b.start_s): b for b in attainment_by_outcome_time(
        [r for r in result.records if r.model == COLOCATED_MODEL], slo, 1.0, (fault,))}
    assert bins[15].num_offered - bins[15].num_good >= len(failed)
    assert report.dip <= bins[15].attainment_offered
    # Recovery: from the fault to the end of the first 10 s window (on whole seconds of outcome time, from the bin
    # holding the fault on) that ends once c0 is back (20.01 s) and is within 5 points of the attainment before.
    # Checked against the records' own per-second attainment, not against a number the simulator happens to give.
    assert report.recovery_s is not None and report.recovery_s >= 5.0
    recovered_from = 15.01 + report.recovery_s - 10.0
    assert recovered_from == pytest.approx(round(recovered_from), abs=1e-9)

    def attainment(start: int) -> float:
        window = [bins[start + k] for k in range(10)]
        assert all(b.num_offered > 0 for b in window)
        return sum(b.num_good for b in window) / sum(b.num_offered for b in window)

    floor = report.before - 0.05
    assert attainment(round(recovered_from)) >= floor
    assert all(attainment(start) < floor for start in range(15, round(recovered_from))), "recovered earlier"


def test_a_stream_lost_again_is_continued_up_to_the_bound():
    # max_continuations 1: c0 lost at 15.01 s and back at 15.31 s (its streams continue on c1), then c1 lost at
    # 15.51 s: its streams continued once already fail (bound), its own streams continue on c0. Replicas with KV
    # to spare: a full c1 would refuse c0's streams (the next test).
    faults = [InstanceFault("c0", 15.01, 0.3), InstanceFault("c1", 15.51, 5.0)]
    sim = NodeSimulator(node_config_from_dict(_with_policies(_roomy(two_replica_config()), max_continuations=1)),
                        seed=0, faults=faults)
    first, second = _watch(sim, faults)
    result = sim.run(_trace(COLOCATED_MODEL, 50.0, 30.0, 1000, 100), drain_s=120.0)
    assert len(second["tokens_continued_before"]) >= 1 and len(second["tokens"]) >= 1, second
    assert result.fault_counts_by_fault == (
        _counts(rerouted=len(first["no_token"]), continued=len(first["tokens"])),
        _counts(rerouted=len(second["no_token"]), continued=len(second["tokens"]),
                failed_bound=len(second["tokens_continued_before"])))
    records = {r.request_id: r for r in result.records}
    for rid in second["tokens_continued_before"]:
        assert records[rid].error == ("instance c1 was lost after the request's first token; its continuations are "
                                      "spent (1 of policies.max_continuations = 1)")
    for r in result.records:
        if r.request_id not in second["tokens_continued_before"]:
            assert r.refused or (not r.error and r.finish_s is not None and r.num_output_tokens == 100), r
    _nothing_held(sim)


def test_a_continuation_with_no_instance_left_is_refused():
    # Both replicas down at once: c1's streams have nowhere to go, its unstarted requests neither. (c0's own streams
    # at 15.005 s may find c1 without KV for them: refused too, counted by the first fault.)
    faults = [InstanceFault("c0", 15.005, 5.0), InstanceFault("c1", 16.005, 5.0)]
    sim = NodeSimulator(node_config_from_dict(two_replica_config()), seed=0, faults=faults)
    first, second = _watch(sim, faults)
    result = sim.run(_trace(COLOCATED_MODEL, 100.0, 30.0, 1000, 20), drain_s=120.0)
    assert len(second["tokens"]) + len(second["tokens_continued_before"]) >= 1, second
    streams = second["tokens"] + second["tokens_continued_before"]
    assert result.fault_counts_by_fault[1] == _counts(rerouted=len(second["no_token"]),
                                                      reroute_refused=len(second["no_token"]),
                                                      failed_refused=len(streams))
    records = {r.request_id: r for r in result.records}
    for rid in streams:
        r = records[rid]
        assert r.error == "instance c1 was lost after the request's first token; its continuation was refused"
        assert r.retry_after_ms is not None
        assert outcome_time_s(r, faults) == 16.005
    for rid in second["no_token"]:  # moved with nothing seen: refused, as on arrival
        assert records[rid].refused and not records[rid].error
    _nothing_held(sim)


@pytest.mark.parametrize("lost", ["p0", "d0"])
def test_disaggregated_instance_lost_frees_what_the_other_side_held(lost):
    fault = InstanceFault(lost, 10.03, 5.0)
    sim = NodeSimulator(node_config_from_dict(_roomy(disagg_config())), seed=0, faults=[fault])
    [held] = _watch(sim, [fault])
    result = sim.run(_trace(DISAGG_MODEL, 40.0, 25.0, 3000, 200), drain_s=120.0)
    # Decode lost: its streams continue (a new prefill elsewhere, then a new decode side); prefill lost: its
    # prompts move, and the requests whose KV a decode instance already took are not its any more.
    assert len(held["tokens"] if lost == "d0" else held["no_token"]) >= 1, held
    assert result.fault_counts == _counts(rerouted=len(held["no_token"]), continued=len(held["tokens"]))
    _nothing_held(sim)
    for r in result.records:
        assert r.refused or (not r.error and r.finish_s is not None and r.num_output_tokens == 200), r


def _simulate(*argv: str):
    """`octoserve simulate ARGV` as the command runs it, up to its result."""
    from octoserve.services import config
    from octoserve.services.sim import cli_simulate
    from octoserve.services.workload import generate_trace
    from octoserve.services.workload_io import node_workload, with_workload_slos

    parser = argparse.ArgumentParser()
    cli_simulate.add_arguments(parser)
    args = parser.parse_args(argv)
    node = config.load_with_overrides(args.config, args.overrides, args.cost_profile)
    profile, _ = node_workload(args, node)
    node = with_workload_slos(node, profile)
    trace = generate_trace(profile, args.seed)
    faults = [parse_fault(f) for f in args.faults]
    sim = NodeSimulator(node, seed=args.seed, faults=faults)  # as run_simulation builds and runs it
    watched = _watch(sim, faults)
    result = sim.run(trace, drain_s=120.0)
    return trace, result, watched


@pytest.mark.parametrize("bound", [None, 0])
def test_seed_000_minute_with_an_8b_replica_lost_for_5_s_loses_only_by_the_bound(bound):
    """`octoserve simulate --duration 60s --fault sm-0@30+5` (at the seed-000 peak): no request the node admitted
    is lost, every stream on sm-0 is continued; with `--set policies.max_continuations=0` they all fail, as before."""
    argv = ["--duration", "60s", "--fault", "sm-0@30+5"] + ([] if bound is None else
                                                           ["--set", f"policies.max_continuations={bound}"])
    trace, result, [held] = _simulate(*argv)
    streams = held["tokens"]
    assert len(streams) >= 100, len(streams)  # a replica's share of the peak's streams
    if bound is None:
        assert result.fault_counts == _counts(rerouted=len(held["no_token"]), continued=len(streams))
    else:
        assert result.fault_counts == _counts(rerouted=len(held["no_token"]), failed_bound=len(streams))
    lengths = {t.request_id: min(t.output_len, t.max_tokens) for t in trace}
    for r in result.records:
        if r.refused:
            assert r.request_id not in held["no_token"]  # refused on arrival, never after a move
        elif bound == 0 and r.request_id in streams:
            assert r.error.startswith("instance sm-0 was lost after the request's first token; its continuations")
        else:
            assert not r.error and r.num_output_tokens == lengths[r.request_id], r

