"""The elastic balancer (services/core/balancer.py) on the live node: the scheduler's view turned into its input (pure and
clock-free, so the step-level simulator replays the same loop).

- Demand: routers report their arrivals and admission refusals (by reason) per model every second
  (`Scheduler.ReportDemand`); `DemandWindow` keeps them, on the modelled clock (wall / time scale), and gives each
  model's rate, trend and mean lengths over the last `window_s`, its refused rate (refusals in the window / the
  window, as the simulator's balancer input counts them: what measured corrections and saturation read), and its
  recent rate with the step score (`step_score` over `STEP_BINS` bins of the window), so a step in the live demand
  takes the balancer's step path as in the simulator.
- Instances: from the workers' load streams (`EngineLoad`): prefill backlog, running decodes against the slot
  limit, KV use, whether the instance takes requests (SERVING in the live placement), and an estimate of its drain:
  its mean output x its recent step time; with migration on (`LiveView.migrate`, the `elastic.migrate` setting),
  for a decoding instance, what the migration rule (services/core/migration.py) makes of its running decodes
  against the other instances of its model (`migration_drain_s`): the hand-off of those it would move, the decode
  left of those it would keep.
- `LiveElasticBalancer.plan(now_s, view, in_flight)` builds the `NodeLoad` and asks `ElasticBalancer`; every
  decision is logged with its reason (`octoserve.scheduler.balancer`).
Configured by the `elastic` section: `balancer: elastic` plus the `BalancerPolicy` fields to override.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from octoserve.services.core import migration
from octoserve.services.core.balancer import BalancerPolicy, ElasticBalancer
from octoserve.services.core.day_request import DayRequest
from octoserve.services.core.elastic_load import InstanceLoad, ModelDemand, NodeLoad, demand_trend, step_score
from octoserve.services.core.placement import InstanceConfig, NodeConfig
from octoserve.services.core.reconfig import Reconfiguration
from octoserve.services.core.types import EngineLoad, Role

log = logging.getLogger("octoserve.scheduler.balancer")

DEFAULT_WINDOW_S = 10.0
STEP_BINS = 5  # the window's arrivals in this many bins for `step_score` (the last two against the rest)


class DemandWindow:
    """Arrival samples (modelled time, model, arrivals, prompt tokens, output tokens, refusals by reason) over the
    last `window_s`, kept for `history_s` (at least the window) when a forward ranker replays them (`arrivals`)."""

    def __init__(self, window_s: float = DEFAULT_WINDOW_S, history_s: float = 0.0) -> None:
        self.window_s = window_s
        self.history_s = max(window_s, history_s)
        self.samples: deque[tuple[float, str, int, int, int, tuple[tuple[str, int], ...]]] = deque()
        self._pruned_s: dict[str, float] = {}  # per model, its last report no longer kept: where the next one began

    def add(self, t_s: float, model: str, arrivals: int, prompt_tokens: int, output_tokens: int,
            refused: Mapping[str, int] | None = None) -> None:
        """`refused`: how many of the `arrivals` admission refused, by reason (`routing.REFUSAL_REASONS`)."""
        self.samples.append((t_s, model, arrivals, prompt_tokens, output_tokens,
                             tuple(sorted((refused or {}).items()))))
        self._prune(t_s)  # bounded without a balancer reading it

    def refusals(self, now_s: float, model: str) -> dict[str, int]:
        """The window's refusals of `model` by reason."""
        self._prune(now_s)
        out: dict[str, int] = {}
        for s in self._in_window(now_s):
            if s[1] == model:
                for reason, n in s[5]:
                    out[reason] = out.get(reason, 0) + n
        return out

    def _in_window(self, now_s: float) -> list:
        """The samples of the last `window_s` (the history kept for a ranker may reach further back)."""
        return [s for s in self.samples if s[0] >= now_s - self.window_s]

    def _prune(self, now_s: float) -> None:
        while self.samples and self.samples[0][0] < now_s - self.history_s:
            t, model = self.samples.popleft()[:2]
            self._pruned_s[model] = t

    def arrivals(self, now_s: float, ttft_slo_ms: float) -> tuple[DayRequest, ...]:
        """The kept history as requests, for a forward ranker to replay (services/sim/live_ranker.py): each report's arrivals
        spread evenly over the interval since the model's previous report (its first report: one second), each
        with the report's mean prompt and output lengths and `ttft_slo_ms`; in arrival order."""
        self._prune(now_s)
        out: list[DayRequest] = []
        last = dict(self._pruned_s)
        for t, model, n, prompt, output, _ in self.samples:
            start = last.get(model, t - 1.0)
            last[model] = t
            if n <= 0:
                continue
            span = max(0.0, t - start)
            for k in range(n):
                out.append(DayRequest(f"seen-{model}-{len(out)}", start + span * (k + 0.5) / n, model,
                                      max(1, round(prompt / n)), max(1, round(output / n)), ttft_slo_ms, "seen"))
        out.sort(key=lambda r: r.arrival_s)
        return tuple(out)

    def demand(self, now_s: float, models: Sequence[str]) -> tuple[ModelDemand, ...]:
        self._prune(now_s)
        out = []
        for m in models:
            mine = [s for s in self._in_window(now_s) if s[1] == m]
            n = sum(s[2] for s in mine)
            # The rate per second of each reporting interval, for the trend (least squares over the window).
            per_t: dict[float, int] = {}
            for s in mine:
                per_t[round(s[0], 3)] = per_t.get(round(s[0], 3), 0) + s[2]
            times = sorted(per_t)
            step = (times[-1] - times[0]) / (len(times) - 1) if len(times) > 1 else 1.0
            trend = demand_trend([(t, per_t[t] / step) for t in times]) if len(times) > 2 else 0.0
            # The recent rate and its step score: the window's reports in STEP_BINS bins by time (a report at t
            # counts the arrivals up to t, so a bin is closed on its right: a report on a boundary is the earlier
            # bin's).
            bin_s = self.window_s / STEP_BINS
            counts = [0] * STEP_BINS
            for s in mine:
                k = math.ceil((s[0] - (now_s - self.window_s)) / bin_s - 1e-9) - 1
                counts[min(STEP_BINS - 1, max(0, k))] += s[2]
            recent, z = step_score(counts, bin_s)
            refused = sum(k for s in mine for _, k in s[5])
            out.append(ModelDemand(
                m, n / self.window_s, trend,
                mean_prompt_tokens=sum(s[3] for s in mine) / n if n else 1000.0,
                mean_output_tokens=sum(s[4] for s in mine) / n if n else 250.0,
                refused_rps=refused / self.window_s, recent_rps=recent, step_z=z))
        return tuple(out)


@dataclass(frozen=True, slots=True)
class LiveView:
    """What the scheduler knows each balancing period (handed to a configured balancer's `plan`)."""

    placement: tuple[InstanceConfig, ...]
    accepting: Mapping[str, bool]  # SERVING in the live placement
    engine_loads: Mapping[str, EngineLoad]
    demand: tuple[ModelDemand, ...]
    window_s: float
    migrate: bool = False  # a retired instance's running decodes migrate (`elastic.migrate`)
    max_migration_pause_s: float = migration.DEFAULT_MAX_PAUSE_S
    arrivals: tuple[DayRequest, ...] = ()  # the recent arrivals a forward ranker replays (`DemandWindow.arrivals`)


MEAN_OUTPUT_TOKENS = 250.0  # an instance's remaining decode when it reports no mean output yet


def drain_only_s(load: EngineLoad) -> float:
    """Until an instance's requests finish there (running, waiting, and reserved: a decode reservation whose KV is
    still on its way decodes here): its mean output x its recent step (the longest one's remainder, at most a whole
    output)."""
    if not load.num_running + load.num_waiting + load.num_reserved:
        return 0.0
    return (load.mean_output_tokens or MEAN_OUTPUT_TOKENS) * load.decode_step_time_s


def migration_drain_s(node: NodeConfig, inst: InstanceConfig, load: EngineLoad,
                      targets: Sequence[tuple[InstanceConfig, EngineLoad]],
                      max_pause_s: float = migration.DEFAULT_MAX_PAUSE_S) -> float:
    """An instance's drain if it retired now with migration on, by the rule the draining worker applies
    (`migration.plan`, targets' load included): each running decode, with the instance's mean context (KV in use /
    its running and reserved requests) and a whole mean output left, either moves (the hand-off: the transfer of its
    context + one decode step; the moves run in parallel) or stays (its decode left); the drain ends with the
    slowest. Requests not decoding yet (waiting, or reserved: their KV still on its way) finish there."""
    running = load.num_running
    if not running + load.num_waiting + load.num_reserved:
        return 0.0
    step_s = load.decode_step_time_s
    remaining = round(load.mean_output_tokens or MEAN_OUTPUT_TOKENS)
    context = migration.kv_tokens_in_use(load) // max(1, running + load.num_reserved)
    cost = node.cost_model(inst)
    costs = {t.id: node.cost_model(t) for t, _ in targets}
    decisions = migration.plan(
        [migration.RunningDecode(f"r{k}", context, remaining) for k in range(running)],
        [migration.Target(t.id, tl.num_free_blocks, tl.block_size,
                          max(0, tl.max_num_seqs - tl.num_running) if tl.max_num_seqs else 1 << 16,
                          tl.num_running, migration.kv_tokens_in_use(tl)) for t, tl in targets],
        step_s=step_s, transfer_s=cost.kv_transfer_time_s, max_pause_s=max_pause_s,
        target_step_s=lambda tid, batch, kv: migration.batch_step_s(costs[tid], batch, kv),
        itl_budget_s=node.slo.itl_ms / 1000.0)
    waiting_s = drain_only_s(load) if load.num_waiting + load.num_reserved else 0.0
    return max([waiting_s] + [d.transfer_s + step_s if d.migrate else d.remaining_s for d in decisions])


def instance_load(inst: InstanceConfig, load: EngineLoad | None, accepting: bool,
                  est_drain_s: float | None = None) -> InstanceLoad:
    """`est_drain_s`: the drain estimate when migration is on (`migration_drain_s`); None: `drain_only_s`."""
    if load is None:
        return InstanceLoad(inst.id, accepting=accepting)
    return InstanceLoad(
        inst.id, prefill_backlog_tokens=float(load.queued_prefill_tokens), decode_batch=load.num_running,
        decode_batch_limit=load.max_num_seqs or inst.max_num_seqs, kv_used=load.kv_usage, accepting=accepting,
        running=load.num_running + load.num_waiting,
        est_drain_s=drain_only_s(load) if est_drain_s is None else est_drain_s)


def drain_estimates(node: NodeConfig, placement: Sequence[InstanceConfig], loads: Mapping[str, EngineLoad],
                    accepting: Mapping[str, bool], max_pause_s: float) -> dict[str, float]:
    """With migration on: each decoding instance's `migration_drain_s`, its targets the other decoding instances of
    its model that take requests (each instance alone: instances retired together would not take each other's)."""
    out = {}
    for inst in placement:
        load = loads.get(inst.id)
        if load is None or inst.role is Role.PREFILL:  # a prefill instance has no decodes to move
            continue
        targets = [(o, loads[o.id]) for o in placement
                   if o.id != inst.id and o.model == inst.model and o.role is not Role.PREFILL
                   and accepting.get(o.id, False) and o.id in loads and loads[o.id].healthy]
        out[inst.id] = migration_drain_s(node, inst, load, targets, max_pause_s)
    return out


def node_load(view: LiveView, node: NodeConfig | None = None) -> NodeLoad:
    """The balancer's input; `node` (the node config: cost models, SLO) is needed for the migration drain estimate
    when `view.migrate`."""
    drains = (drain_estimates(node, view.placement, view.engine_loads, view.accepting, view.max_migration_pause_s)
              if view.migrate and node is not None else {})
    return NodeLoad(view.window_s, view.placement,
                    tuple(instance_load(i, view.engine_loads.get(i.id), view.accepting.get(i.id, False),
                                        drains.get(i.id))
                          for i in view.placement),
                    view.demand)


class LiveElasticBalancer:
    """The `Balancer` the scheduler's loop calls when the elastic section says `balancer: elastic`. `ranker`: None
    (the capacity estimate decides alone) or a forward ranker whose `view` is set to each period's `LiveView` before
    the balancer plans (services/sim/live_ranker.py: candidate moves played forward from a twin of the node; the
    demand window then keeps `history_s` of arrivals for it). `sim/live_ranker.elastic_balancer` builds both from
    the config's `elastic` section."""

    def __init__(self, config: NodeConfig, policy: BalancerPolicy = BalancerPolicy(),
                 window_s: float = DEFAULT_WINDOW_S, ranker=None) -> None:
        self.ranker = ranker
        self.inner = ElasticBalancer(config, policy, ranker=self.ranker)
        self.window_s = window_s
        self.history_s = max(window_s, policy.forward_window_s) if self.ranker else window_s
        self._logged = 0

    def plan(self, now_s: float, view: LiveView, in_flight: Sequence[Reconfiguration]) -> list[Reconfiguration]:
        if self.ranker is not None:
            self.ranker.view = view
        planned = self.inner.plan(now_s, node_load(view, self.inner.node), in_flight)
        for d in self.inner.log[self._logged:]:
            log.info("balancer decision", extra={"fields": {"reason": d.reason, "detail": d.detail}})
        self._logged = len(self.inner.log)
        return planned
