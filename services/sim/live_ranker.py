"""The balancer's forward ranker on the live node: candidate moves played forward from a twin of the node.

The elastic simulator's ranker (services/sim/forward_ranker.py) forks the simulator's own state. The live scheduler
has no such state: it has the workers' load reports and the routers' one-second demand reports. `node_twin` builds
an elastic queueing model (services/sim/elastic_sim.py) of the node as the scheduler sees it now, and
`LiveForwardRanker` hands it to the simulator's ranker, which plays hold and each candidate move forward on it
exactly as in the simulated day. What the twin takes from the view, and what it has to assume:
- the placement, and which instances take requests (a draining one serves what it holds and takes nothing new;
  the reconfiguration it is part of is not modelled further: the balancer does not rank while its own move is
  under way);
- per instance, its prefill backlog (`queued_prefill_tokens`: the prefill server is busy for that many tokens at the
  instance's prefill rate) and its running decodes and decode reservations, each holding a decode slot; a load
  report gives their number, not their progress, so their remaining outputs are spread evenly over the instance's
  mean output (`mean_output_tokens`, else the window's mean): the k-th of n has (k + 0.5) / n of it left;
- the recent arrivals (`DemandWindow.arrivals`): each one-second report's arrivals spread evenly over its interval,
  each with that report's mean prompt and output lengths (a report gives sums, not each request) and the node's
  TTFT SLO; the ranker replays them in order, as in the simulator.
A twin is built per ranking, from the view the balancer was handed that period. Clock-free: the caller's modelled
seconds throughout.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from dataclasses import fields

from octoserve.services.core.balancer import RANKERS, BalancerPolicy, MoveCandidate
from octoserve.services.core.live_balancer import DEFAULT_WINDOW_S, LiveElasticBalancer
from octoserve.services.core.day_request import DayRequest
from octoserve.services.core.placement import NodeConfig
from octoserve.services.core.types import EngineLoad
from octoserve.services.sim.elastic_sim import ElasticSim, SimInstance, SimRequest
from octoserve.services.sim.forward_ranker import ForwardSimRanker
from octoserve.services.workload_day import DayProfile


def node_twin(node: NodeConfig, policy: BalancerPolicy, view, now_s: float, window_s: float) -> ElasticSim:
    """An elastic queueing model of the node at `now_s` as `view` (a `live_balancer.LiveView`) shows it (module
    doc): its placement and instance states, and `view.arrivals` as the past it replays."""
    profile = DayProfile("live", now_s, _nothing, ttft_slo_ms=node.slo.ttft_ms, itl_slo_ms=node.slo.itl_ms)
    placement = tuple(view.placement)
    twin = ElasticSim(node, profile, view.arrivals, placement, mode="static", policy=policy, layouts=[placement],
                      window_s=window_s)
    twin.now_s = now_s
    mean = twin._mean_lengths(now_s)
    for cfg in placement:
        inst = SimInstance(node, cfg, now_s, mean[cfg.model], twin.itl_target_s)
        load = view.engine_loads.get(cfg.id)
        inst.accepting = bool(view.accepting.get(cfg.id, False)) and (load is None or load.healthy)
        if load is not None:
            _seed(inst, load, now_s, mean[cfg.model], node.slo.ttft_ms)
        twin.instances[cfg.id] = inst
    return twin


def _nothing(t_s: float):  # a twin has no schedule of its own: its arrivals are given
    raise AssertionError("the twin's arrivals come from the view")


def _seed(inst: SimInstance, load: EngineLoad, now_s: float, mean: tuple[float, float], ttft_slo_ms: float) -> None:
    """The instance's queues from its load report (module doc)."""
    if inst.prefills and load.queued_prefill_tokens > 0:
        inst.prefill_free_s = now_s + load.queued_prefill_tokens / inst.prefill_rate
    if not inst.decodes:
        return
    n = min(len(inst.heap), load.num_running + load.num_reserved)
    output = load.mean_output_tokens or mean[1]
    for k in range(n):
        left = max(1, round(output * (k + 0.5) / n))
        req = DayRequest(f"live-{inst.cfg.id}-{k}", now_s, inst.cfg.model, round(mean[0]), left + 1, ttft_slo_ms,
                         "live")
        tr = SimRequest(req)
        tr.prefill_begin_s = tr.busy_until_s = tr.first_s = tr.decode_start_s = now_s
        tr.finish_s = now_s + left * inst.tau_s
        tr.entry = tr.decoder = inst.cfg.id
        tr.entry_inst = tr.decoder_inst = inst
        tr.tau_s = inst.tau_s
        heapq.heapreplace(inst.heap, tr.finish_s)
        inst.running.append(tr)


class LiveForwardRanker:
    """The `ForwardRanker` (services/core/balancer.py) of the live balancer: `view` is set to the period's
    `LiveView` before the balancer plans (`LiveElasticBalancer.plan`); each forecast builds a twin from it and plays
    the moves forward there. Until the view holds `window_s` of arrivals every move scores 0 (no evidence: the
    balancer holds)."""

    name = "forward"

    def __init__(self, node: NodeConfig, policy: BalancerPolicy, window_s: float, seed: int = 0) -> None:
        self.node, self.policy, self.window_s, self.seed = node, policy, window_s, seed
        self.view = None
        self.calls = 0  # forecasts played
        self.simulated = 0  # candidate moves played forward

    def forecast(self, now_s: float, moves: Sequence[MoveCandidate], rates_rps: Mapping[str, float],
                 horizons_s: Sequence[float]) -> list[list[float]]:
        view = self.view
        if view is None or not view.arrivals or view.arrivals[0].arrival_s > now_s - self.window_s:
            return [[0.0] * len(horizons_s) for _ in moves]
        twin = node_twin(self.node, self.policy, view, now_s, self.window_s)
        inner = ForwardSimRanker(twin, self.seed, self.policy.forward_window_s)
        out = inner.forecast(now_s, moves, rates_rps, horizons_s)
        self.calls += inner.calls
        self.simulated += inner.simulated
        return out


def balancer_with_ranker(config: NodeConfig, policy: BalancerPolicy = BalancerPolicy(),
                         window_s: float = DEFAULT_WINDOW_S, ranker: str = "none") -> LiveElasticBalancer:
    """The live balancer with the ranker `ranker` names: "none" (the capacity estimate decides alone) or "forward"
    (`LiveForwardRanker`)."""
    if ranker not in RANKERS:
        raise ValueError(f"elastic.ranker must be one of {', '.join(RANKERS)}, got {ranker!r}")
    forward = LiveForwardRanker(config, policy, window_s) if ranker == "forward" else None
    return LiveElasticBalancer(config, policy, window_s, forward)


def elastic_balancer(config: NodeConfig, section: Mapping) -> LiveElasticBalancer:
    """From the `elastic` section: every BalancerPolicy field may be given (forecast_window_s, min_dwell_s, ...),
    `window_s` (the demand window, modelled seconds) and `ranker` (forward, the default, or none)."""
    names = {f.name for f in fields(BalancerPolicy)}
    unknown = sorted(set(section) - names - {"balancer", "period_s", "window_s", "ranker"})
    if unknown:
        raise ValueError(f"elastic: unknown keys {unknown}; use balancer, period_s, window_s, ranker or "
                         f"BalancerPolicy fields ({', '.join(sorted(names))})")
    policy = BalancerPolicy(**{k: v for k, v in section.items() if k in names})
    return balancer_with_ranker(config, policy, float(section.get("window_s", DEFAULT_WINDOW_S)),
                                str(section.get("ranker", "forward")))
