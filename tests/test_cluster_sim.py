"""The simulator at cluster scale (services/cluster/sim.py): accounting, determinism, spill, the ideal pool."""

from __future__ import annotations

import yaml

from octoserve.services.cluster.sim import ClusterSimulator, Squeeze, single_pool_config
from octoserve.services.config import default_config_text, load_node_config
from octoserve.services.workload import PROFILES, generate_trace, scaled

SM = "llama-3-8b"
CONFIG = load_node_config(None)


def _trace(rate=60.0, duration=4.0):
    return generate_trace(scaled(PROFILES["seed-000"], rate_rps=rate, duration_s=duration), 0)


def _sm_share(result, node):
    routed = [r for r in result.records if r.model == SM and not r.refused]
    mine = {r.request_id for r in routed} & {r.request_id for r in result.records_by_node[node]}
    return len(mine) / len(routed)


def test_every_request_is_refused_or_served_by_exactly_one_node_and_runs_repeat():
    trace = _trace()
    first = ClusterSimulator(CONFIG, 2, seed=3).run(trace)
    assert [r.request_id for r in first.records] == [t.request_id for t in trace]
    on_nodes = [r.request_id for rs in first.records_by_node for r in rs]
    assert len(on_nodes) == len(set(on_nodes)) == len(trace) - first.num_cluster_refused
    assert all(r.refused or r.finish_s is not None for r in first.records)
    assert all(len(rs) > 0 for rs in first.records_by_node)
    again = ClusterSimulator(CONFIG, 2, seed=3).run(trace)
    assert again.records == first.records


def test_round_robin_alternates_nodes():
    result = ClusterSimulator(CONFIG, 2, picker="round_robin").run(_trace(duration=2.0))
    ids = [r.request_id for r in result.records]
    assert [r.request_id for r in result.records_by_node[0]] == ids[0::2]
    assert [r.request_id for r in result.records_by_node[1]] == ids[1::2]
    assert result.num_cluster_refused == 0 and result.num_spilled == 0


def test_a_gang_lease_on_one_node_spills_its_sm_work_to_the_other():
    trace = _trace(rate=120.0)
    squeeze = [Squeeze(node=0, model=SM, start_s=0.0, end_s=100.0, capacity_fraction=0.25)]
    plain = ClusterSimulator(CONFIG, 2).run(trace)
    leased = ClusterSimulator(CONFIG, 2, squeezes=squeeze).run(trace)
    assert plain.num_spilled == 0 and leased.num_spilled > 0
    assert _sm_share(leased, 0) < _sm_share(plain, 0) - 0.1


def test_single_pool_holds_every_nodes_instances_on_distinct_gpus():
    raw = yaml.safe_load(default_config_text())
    pool = single_pool_config(CONFIG, 3, raw)
    assert pool.num_gpus == 24 and len(pool.instances) == 3 * len(CONFIG.instances)
    assert sorted(g for i in pool.instances for g in i.gpu_ids) == list(range(24))
    assert [i.id for i in pool.instances][:6] == ["lm-0@0", "sm-0@0", "sm-1@0", "sm-2@0", "sm-3@0", "lm-0@1"]


def test_a_node_refusal_goes_on_to_the_picks_fallback():
    trace = _trace(rate=600.0, duration=2.0)  # twice what two nodes serve: their own admission refuses some picks
    single = ClusterSimulator(CONFIG, 2, max_node_tries=1).run(trace)
    tried = ClusterSimulator(CONFIG, 2).run(trace)
    assert single.num_node_refusals == 0 and tried.num_node_refusals > 0
    on_nodes = [r.request_id for rs in tried.records_by_node for r in rs]
    assert len(on_nodes) == len(set(on_nodes)) == len(trace) - tried.num_cluster_refused
    # Whatever a node refused and a fallback then took is recorded on that fallback alone.
    assert all(not r.refused or r.retry_after_ms is not None for r in tried.records)
