"""The simulator at cluster scale: N nodes, each the unchanged node simulator, behind a cluster picker.

One event heap and one virtual clock for all nodes. Every node is an `octoserve.services.sim.driver.NodeSimulator`
(its own router policy, instances, batchers, KV) whose events go onto the shared heap tagged with the node; the
cluster adds two events of its own: an arrival (the picker chooses a node, then that node's router admits or
refuses it as it would alone; one it refuses goes on to the pick's fallbacks in order) and a publication (every `publish_interval_s` each node's `HeadroomPublisher`
builds a summary and the picker reads it, so the picker always works from summaries up to one interval old).

Pickers: "cluster" (services/cluster/picker.py) or "round_robin" (independent nodes, each request to the next
node in turn, no cross-node admission). `single_pool_config` builds the ideal comparison: one node holding every
node's instances behind one router.

A gang lease is modelled as a `Squeeze`: from `start_s` to `end_s` the given model's instances on one node get only
`capacity_fraction` of their GPU time (the LM holds the rest), so each of their steps lasts 1 / fraction as long;
the node's headroom summary carries the fraction, which is how the picker learns of it.

Measurement as for one node (services/metrics.py): the occupancy series summed over the nodes gives the warm-up
and the window; every figure covers that window. `home` of a request is the node round-robin would send it to
(index mod N): "a node's traffic" in the spill target.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from octoserve.services.cluster.headroom import HeadroomPublisher
from octoserve.services.cluster.picker import ClusterPicker, ClusterRefuse, RoundRobinPicker, policy_from_node
from octoserve.services.core.placement import NodeConfig, node_config_from_dict
from octoserve.services.metrics import (MIN_WARMUP_S, RequestRecord, Summary, detect_window, slo_spec_of,
                                        summarize)
from octoserve.services.sim import driver
from octoserve.services.workload import TraceRequest

_CL_ARRIVAL, _CL_PUBLISH = "arrival", "publish"


@dataclass(frozen=True, slots=True)
class Squeeze:
    node: int
    model: str
    start_s: float
    end_s: float
    capacity_fraction: float  # of GPU time left to the model's instances on that node

    def fraction(self, node: int, model: str, now: float) -> float:
        live = node == self.node and model == self.model and self.start_s <= now < self.end_s
        return self.capacity_fraction if live else 1.0


class _SqueezedExecutor:
    """Stretches a step of a squeezed instance by 1 / fraction (the GPU time the gang lease takes)."""

    __slots__ = ("inner", "node", "model")

    def __init__(self, inner, node: _Node, model: str) -> None:
        self.inner, self.node, self.model = inner, node, model

    def execute(self, plan, batcher):
        result = self.inner.execute(plan, batcher)
        f = self.node.capacity(self.model)
        return result if f >= 1.0 else dataclasses.replace(result, step_time_s=result.step_time_s / f)


class _Node(driver.NodeSimulator):
    """One node on the cluster's heap: its events are pushed there, tagged with it."""

    def __init__(self, cluster: ClusterSimulator, index: int, config: NodeConfig, seed: int) -> None:
        super().__init__(config, seed=seed)
        self.cluster = cluster
        self.index = index
        self.node_id = f"node-{index}"
        typical = {m: 1024 for m in config.models}
        self.publisher = HeadroomPublisher(self.node_id, self.router, reference_prompt_tokens=typical)
        for inst in self.instances.values():
            inst.executor = _SqueezedExecutor(inst.executor, self, inst.cfg.model)

    def _push(self, t: float, kind: int, payload) -> None:
        self.cluster._push(t, self, kind, payload)
        if kind != driver._SAMPLE:
            self._num_pending += 1

    def capacity(self, model: str) -> float:
        f = 1.0
        for s in self.cluster.squeezes:
            f = min(f, s.fraction(self.index, model, self.now))
        return f

    def summary(self):
        loads = {iid: inst.load() for iid, inst in self.instances.items()}
        for load in loads.values():
            self.router.ledger.observe_load(load)
        fractions = {m: self.capacity(m) for m in self.config.models}
        return self.publisher.summary(loads, self.now, capacity_fraction=fractions)


@dataclass(frozen=True, slots=True)
class ClusterResult:
    summary: Summary  # the whole cluster over its measurement window
    node_summaries: tuple[Summary, ...]  # each node's requests (routed there), same window
    home_records: tuple[tuple[RequestRecord, ...], ...]  # records by home node (index mod N)
    records_by_node: tuple[tuple[RequestRecord, ...], ...]  # records of the requests each node received
    records: tuple[RequestRecord, ...]
    num_spilled: int
    num_cluster_refused: int  # refused by the picker before reaching a node
    num_node_refusals: int  # offers a node's own admission refused before a fallback took the request
    node_share: tuple[float, ...]  # share of admitted requests each node served (window)
    virtual_s: float
    wall_s: float


class ClusterSimulator:
    def __init__(self, config: NodeConfig, num_nodes: int, *, picker: str = "cluster", seed: int = 0,
                 squeezes: Sequence[Squeeze] = (), publish_interval_s: float = 0.05, max_node_tries: int = 4) -> None:
        self.num_node_refusals = 0  # offers a node's own admission refused (the request went on to a fallback)
        self.squeezes = tuple(squeezes)
        self.publish_interval_s = publish_interval_s
        self._events: list = []
        self._seq = itertools.count()
        self.now = 0.0
        self.nodes = [_Node(self, i, config, seed + 1000 * i) for i in range(num_nodes)]
        self.slo = slo_spec_of(config.slo)
        if picker == "cluster":
            policy = policy_from_node(config.policies, config.slo.tier_ttft_ms, config.slo.itl_ms,
                                      max_node_tries=max_node_tries)
            self.picker = ClusterPicker(policy, random.Random(seed))
        elif picker == "round_robin":
            self.picker = RoundRobinPicker([n.node_id for n in self.nodes])
        else:
            raise ValueError(f"picker must be 'cluster' or 'round_robin', got {picker!r}")
        self._by_id = {n.node_id: n for n in self.nodes}
        self._refused: dict[str, RequestRecord] = {}
        self._node_of: dict[str, _Node] = {}

    def _push(self, t: float, node, kind, payload) -> None:
        heapq.heappush(self._events, (t, next(self._seq), node, kind, payload))

    def run(self, trace: Sequence[TraceRequest], *, drain_s: float = 60.0, warmup_s: float | None = None,
            progress: Callable[[float], None] | None = None) -> ClusterResult:
        wall_start = time.perf_counter()
        for req in trace:
            self._push(req.arrival_s, None, _CL_ARRIVAL, req)
        last_arrival = trace[-1].arrival_s if trace else 0.0
        end_s = last_arrival + drain_s
        for node in self.nodes:
            node._push(0.0, driver._SAMPLE, None)
        self._push(0.0, None, _CL_PUBLISH, None)
        arrivals_left = len(trace)
        next_progress = 0.0
        while self._events:
            t, _, node, kind, payload = heapq.heappop(self._events)
            if t > end_s:
                break
            self.now = t
            if node is None:
                if kind == _CL_ARRIVAL:
                    arrivals_left -= 1
                    self._on_arrival(payload)
                else:
                    self._publish()
                continue
            if kind != driver._SAMPLE:
                node._num_pending -= 1
            node.now = t
            handler = {driver._ARRIVAL: node._on_arrival, driver._STEP_DONE: node._on_step_done,
                       driver._TRANSFER_DONE: node._on_transfer_done, driver._SAMPLE: node._on_sample}[kind]
            handler(payload)
            if progress is not None and t >= next_progress:
                progress(t)
                next_progress = t + 1.0
            if kind == driver._SAMPLE and arrivals_left == 0 and not any(n._work_left() for n in self.nodes):
                break
        return self._result(trace, last_arrival, time.perf_counter() - wall_start, warmup_s)

    def _publish(self) -> None:
        for node in self.nodes:
            node.now = self.now
            self.picker.on_summary(node.summary())
        self._push(self.now + self.publish_interval_s, None, _CL_PUBLISH, None)

    def _on_arrival(self, req: TraceRequest) -> None:
        spec = req.to_request_spec()
        decision = self.picker.pick(spec, self.now)
        if isinstance(decision, ClusterRefuse):
            self._refused[req.request_id] = req.record(refused=True, retry_after_ms=decision.retry_after_ms)
            return
        offers = (decision, *decision.fallbacks)
        retries = []
        for k, offer in enumerate(offers):
            node = self._by_id[offer.node_id]
            node.now = self.now
            node._on_arrival(req)
            tracker = node._trackers[req.request_id]
            if not tracker.refused:
                self._node_of[req.request_id] = node
                self.picker.on_dispatched(node.node_id, spec, offer)
                return
            retries.append(tracker.retry_after_ms)
            if k == len(offers) - 1:  # the last node's refusal is the answer, with the soonest delay of all
                tracker.retry_after_ms = min(retries)
                self._node_of[req.request_id] = node
                return
            # The node's own admission refused what the picker predicted it would take: the next-best node, as a
            # gateway going down the endpoint list would.
            self.num_node_refusals += 1
            del node._trackers[req.request_id]

    def _result(self, trace, last_arrival: float, wall_s: float, warmup_s: float | None) -> ClusterResult:
        n = len(self.nodes)
        for node in self.nodes:  # every request explicit, its token times with its tracker (as a node's own result)
            for inst in node.instances.values():
                node._write_out(inst)
        series = [n_._series.get("occupancy", []) for n_ in self.nodes]
        occupancy = [(pts[0][0], sum(s[k][1] for s in series)) for k, pts in enumerate(zip(*series))]
        window = detect_window(occupancy, max(last_arrival, 1e-9), warmup_s=warmup_s, min_warmup_s=MIN_WARMUP_S)
        records, per_node, per_home = [], [[] for _ in range(n)], [[] for _ in range(n)]
        for index, req in enumerate(trace):
            if req.request_id in self._refused:
                record = self._refused[req.request_id]
            else:
                node = self._node_of[req.request_id]
                tracker = node._trackers[req.request_id]
                if not tracker.refused and tracker.finish_s is None and not tracker.error:
                    tracker.error = "unfinished when the simulation stopped"
                record = tracker.record()
                per_node[node.index].append(record)
            records.append(record)
            per_home[index % n].append(record)
        in_window = [r for nodes in per_node for r in nodes if window.contains(r) and not r.refused]
        share = tuple(sum(window.contains(r) and not r.refused for r in rs) / max(1, len(in_window)) for rs in per_node)
        return ClusterResult(
            summary=summarize(records, self.slo, window),
            node_summaries=tuple(summarize(rs, self.slo, window) for rs in per_node),
            home_records=tuple(tuple(rs) for rs in per_home),
            records_by_node=tuple(tuple(rs) for rs in per_node),
            records=tuple(records),
            num_spilled=self.picker.num_spilled,
            num_cluster_refused=len(self._refused),
            num_node_refusals=self.num_node_refusals,
            node_share=share,
            virtual_s=self.now,
            wall_s=wall_s,
        )


def single_pool_config(config: NodeConfig, num_nodes: int, raw: dict) -> NodeConfig:
    """The ideal comparison: one node with every node's instances (GPU ids offset per node) behind one router."""
    instances = []
    for k in range(num_nodes):
        for inst in raw["instances"]:
            instances.append({**inst, "id": f"{inst['id']}@{k}",
                              "gpu_ids": [g + k * config.num_gpus for g in inst["gpu_ids"]]})
    return node_config_from_dict({**raw, "num_gpus": config.num_gpus * num_nodes, "instances": instances})
