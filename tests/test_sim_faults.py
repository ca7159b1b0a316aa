"""Faults in the simulator (services/sim/driver.py, services/sim/faults.py): an instance lost at time t and back
after its restart time. Requests with no token move, those with tokens fail with a stated error, the instance gets
nothing while down and comes back empty, no KV stays held anywhere, and the report gives the dip and recovery."""

from __future__ import annotations

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


def _run(config: dict, model: str, fault: InstanceFault, rate: float = 20.0, duration_s: float = 40.0,
         prompt_len: int = 3000, output_len: int = 200):
    node = node_config_from_dict(config)
    sim = NodeSimulator(node, seed=0, faults=[fault])
    result = sim.run(_trace(model, rate, duration_s, prompt_len, output_len), drain_s=120.0)
    return node, sim, result


def test_parse_fault():
    assert parse_fault("sm-0@30") == InstanceFault("sm-0", 30.0, 5.0)
    assert parse_fault("sm-0@30s+12.5") == InstanceFault("sm-0", 30.0, 12.5)
    for bad in ("sm-0", "@30", "sm-0@soon", "sm-0@30+-1"):
        with pytest.raises(ValueError, match="sm-0@30"):
            parse_fault(bad)


def test_unknown_instance_is_named():
    with pytest.raises(ValueError, match="instance 'x9'; the node has c0, c1"):
        NodeSimulator(node_config_from_dict(two_replica_config()), faults=[InstanceFault("x9", 1.0)])


def test_colocated_replica_lost_moves_unstarted_requests_and_fails_started_ones():
    # Short, frequent requests: at the fault c0 has prompts in prefill (moved) and streams (failed).
    node, sim, result = _run(two_replica_config(), COLOCATED_MODEL, InstanceFault("c0", 15.01, 5.0), rate=100.0,
                             prompt_len=1000, output_len=20)
    counts = result.fault_counts
    assert counts["rerouted"] >= 1 and counts["lost"] >= 1, counts
    failed = [r for r in result.records if r.error]
    assert len(failed) == counts["lost"]
    assert all(r.error == "instance c0 was lost after the request's first token" for r in failed)
    assert all(r.arrival_s < 15.0 and r.first_token_s is not None for r in failed)
    # Everything else ended: refused, or completed with all its tokens.
    for r in result.records:
        if not r.refused and not r.error:
            assert r.finish_s is not None and r.num_output_tokens == 20
    # c0 held no KV while down (fresh and unroutable), and serves again after it.
    kv_c0 = result.timeseries["kv:c0"]
    assert all(v == 0.0 for t, v in kv_c0 if 15.0 < t < 20.0)
    assert any(v > 0.0 for t, v in kv_c0 if t > 20.0)
    for inst in sim.instances.values():  # nothing left held anywhere
        load = inst.load()
        assert (load.num_running, load.num_waiting, load.num_free_blocks) == (0, 0, load.num_total_blocks)
    slo = SloSpec(node.slo.ttft_ms, node.slo.itl_ms)
    report = fault_report(result.records, slo, InstanceFault("c0", 15.01, 5.0), COLOCATED_MODEL,
                          rerouted=counts["rerouted"], lost=counts["lost"])
    # A request lost with c0 is dated by the fault (not by its last token, a step before it): the dip is from the
    # fault on, and the bin holding the fault holds every lost request.
    fault = InstanceFault("c0", 15.01, 5.0)
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


@pytest.mark.parametrize("lost", ["p0", "d0"])
def test_disaggregated_instance_lost_frees_what_the_other_side_held(lost):
    node, sim, result = _run(disagg_config(), DISAGG_MODEL, InstanceFault(lost, 10.0, 5.0), rate=10.0, duration_s=25.0)
    assert result.fault_counts["rerouted"] + result.fault_counts["lost"] >= 1, result.fault_counts
    for inst in sim.instances.values():
        load = inst.load()
        assert (load.num_running, load.num_waiting, load.num_free_blocks) == (0, 0, load.num_total_blocks), load
    for r in result.records:
        assert r.refused or r.error or (r.finish_s is not None and r.num_output_tokens == 200)
