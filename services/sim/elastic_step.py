"""The elastic balancer on the step-level simulator: `NodeSimulator` (services/sim/driver.py) with an
`ElasticBalancer` (services/core/balancer.py) re-planning every balancing period, its reconfigurations carried out
in simulated time.

Each period (from the first full demand window on) the balancer reads the same input the live scheduler builds
(services/core/live_balancer.py): each instance's load snapshot (`EngineLoad`, from its `LoadReporter`) through
`instance_load`, and the demand of the last `window_s` through a `DemandWindow` fed once per period with the
arrivals of that period and the router's admission refusals among them by reason, as the routers report theirs.

A reconfiguration runs as on the live node (services/core/reconfig.py):
- DRAINING: its retired instances leave the router's placement at once (no new request reaches them); their
  running decodes migrate by KV hand-off to the other instances of the model (`migrate`, on by default), decided
  by the rule the live node applies (services/core/migration.py: remaining decode vs the modelled transfer of the
  context, the targets' free slots and KV from their load snapshots, and each target's decode step by the cost
  model with the moved requests added, within the ITL SLO) and carried out as it does (the request
  leaves the source's batch at a step boundary, the target reserves room or it stays, the target decodes on from
  its last token after the transfer: `NodeSimulator.migrate`); the other requests finish there. Polled every
  `poll_s`.
- SWITCHING: once none holds a request, the retired instances leave the node; after the switch time (the role
  switch, or the weight load + engine init the plan states as `load_s`) the started instances join it empty and the
  router's placement names them.
- DONE.
A decode <-> colocated change in place (`Reconfiguration.in_place`) skips DRAINING: the instance keeps serving in its
old role until the switch time, then in the new one, holding everything it held.
Requests lost: those still held by an instance when it left the node (the drain waits, so 0), plus any request that
ended with an error.

    python -m octoserve.services.sim.elastic_step   (see `main`: the shortened mix-shift day, step level)
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from octoserve.services.core import migration
from octoserve.services.core.balancer import BalancerPolicy, ElasticBalancer
from octoserve.services.core.elastic_load import NodeLoad
from octoserve.services.core.placement import InstanceConfig, NodeConfig
from octoserve.services.core.reconfig import IN_FLIGHT, Phase, ReconfigKind, Reconfiguration, advance
from octoserve.services.core.types import Role
from octoserve.services.core.live_balancer import (
    DemandWindow,
    LiveView,
    node_load,
)
from octoserve.services.sim.driver import NodeSimulator, SimResult
from octoserve.services.sim.live_ranker import balancer_with_ranker
from octoserve.services.workload import TraceRequest


@dataclass
class StepReconfig:
    """One reconfiguration's life on the step-level simulator (virtual seconds)."""

    reconfig: Reconfiguration
    planned_s: float
    phase: Phase = Phase.DRAINING
    drain_end_s: float = math.nan
    done_s: float = math.nan
    held: int = 0  # requests on the retired instances when the drain began
    lost: int = 0  # requests still on a retired instance when it left the node: must be 0
    migrated: int = 0  # running decodes handed to another instance by KV hand-off
    kept: dict[str, int] = field(default_factory=dict)  # running decodes that stayed, by the decision's reason


@dataclass
class ElasticStepResult:
    sim: SimResult
    reconfigs: list[StepReconfig]
    placements: list[tuple[float, tuple[str, ...]]]  # (time, instance ids) each time the node changed
    counters: dict[str, int] = field(default_factory=dict)  # the balancer's decisions by reason
    wall_s: float = 0.0

    @property
    def lost(self) -> int:
        """Requests lost: held by a removed instance, or ended with an error (refusals are not losses)."""
        return sum(r.lost for r in self.reconfigs) + sum(1 for r in self.sim.records if r.error and not r.refused)

    @property
    def done(self) -> list[StepReconfig]:
        return [r for r in self.reconfigs if r.phase is Phase.DONE]


class ElasticStepSim:
    """`NodeSimulator` plus an `ElasticBalancer` each `period_s`. `plan_at` (tests): reconfigurations to start at
    given times instead of (or besides) the balancer's, as (time, Reconfiguration)."""

    def __init__(self, node: NodeConfig, *, policy: BalancerPolicy = BalancerPolicy(), period_s: float = 1.0,
                 window_s: float = 10.0, seed: int = 0, balance: bool = True,
                 plan_at: Sequence[tuple[float, Reconfiguration]] = (), poll_s: float = 0.05,
                 migrate: bool = True, max_migration_pause_s: float = migration.DEFAULT_MAX_PAUSE_S,
                 drain_by_rule: bool = True, ranker: str = "none") -> None:
        if node.gang is not None:
            raise ValueError("elastic_step: gang groups are not supported; drop the `gang` section")
        if period_s <= 0 or window_s <= 0 or poll_s <= 0:
            raise ValueError("elastic_step: period_s, window_s and poll_s must be > 0")
        self.node = node
        self.policy = policy
        self.period_s, self.window_s, self.poll_s = period_s, window_s, poll_s
        self.migrate, self.max_migration_pause_s = migrate, max_migration_pause_s
        # With migration on, the balancer's drain estimate by the migration rule (as the live scheduler's); False:
        # the drain-only estimate (remaining decode) even when requests migrate (for comparison).
        self.drain_by_rule = drain_by_rule
        self.reported_refusals: dict[str, int] = {}  # refusals reported into the demand window, by reason
        self.last_report_s = 0.0  # when the demand window got its last report
        self.sim = NodeSimulator(node, seed=seed)
        # With a forward ranker the live scheduler's own balancer runs here (`LiveElasticBalancer`: a twin of the
        # node built from the load snapshots and the reported arrivals, played forward), on the view it would build.
        self.live = balancer_with_ranker(node, policy, window_s, ranker) if balance and ranker != "none" else None
        self.balancer = (self.live.inner if self.live is not None else ElasticBalancer(node, policy)) if balance else None
        self.demand = DemandWindow(window_s, self.live.history_s if self.live is not None else 0.0)
        self._refused: dict[str, dict[str, int]] = {}  # model -> reason -> refusals since the last report
        self.sim.router.refusal_observers.append(self._observe_refusal)
        self.plan_at = sorted(plan_at, key=lambda p: p[0])
        self.reconfigs: list[StepReconfig] = []
        self.starting: dict[str, InstanceConfig] = {}  # started instances of SWITCHING reconfigurations
        self.placements: list[tuple[float, tuple[str, ...]]] = []
        self._trace: list[TraceRequest] = []
        self._next_arrival = 0  # index of the first arrival not yet reported to the demand window
        self._end_s = 0.0

    # - the placement -

    def _draining(self) -> set[str]:
        return {i for r in self.reconfigs if r.phase is Phase.DRAINING for i in r.reconfig.retire}

    def _publish(self) -> None:
        draining = self._draining()
        self.sim.route_only_to([inst.cfg for iid, inst in self.sim.instances.items() if iid not in draining])
        self.placements.append((self.sim.now, tuple(self.sim.instances)))

    def _in_flight(self) -> list[Reconfiguration]:
        return [r.reconfig for r in self.reconfigs if r.phase in IN_FLIGHT]

    def node_load(self, now_s: float) -> NodeLoad:
        """The balancer's input, built as the live scheduler builds it (`live_balancer.node_load`: with migration
        on, each decoding instance's drain estimate by the migration rule)."""
        return node_load(self.live_view(now_s, replay=False), self.node)

    def live_view(self, now_s: float, replay: bool = True) -> LiveView:
        """What the live scheduler would hand its balancer now (services/scheduler/service.py `live_view`): the
        placement with the starting instances, which take requests, each instance's load snapshot, the demand and
        (`replay`) the reported arrivals a forward ranker replays."""
        draining = self._draining()
        placement = tuple([inst.cfg for inst in self.sim.instances.values()] + list(self.starting.values()))
        accepting = {**{iid: iid not in draining for iid in self.sim.instances}, **{iid: False for iid in self.starting}}
        loads = {iid: inst.load() for iid, inst in self.sim.instances.items()}
        return LiveView(placement, accepting, loads, self.demand.demand(now_s, sorted(self.node.models)), self.window_s,
                        self.migrate and self.drain_by_rule, self.max_migration_pause_s,
                        self.demand.arrivals(now_s, self.node.slo.ttft_ms) if replay else ())

    # - the balancing period -

    def _observe_refusal(self, spec, refusal) -> None:
        mine = self._refused.setdefault(spec.model, {})
        mine[refusal.reason] = mine.get(refusal.reason, 0) + 1

    def _report_arrivals(self, now_s: float) -> None:
        """The period's arrivals per model and the router's refusals into the demand window (the routers'
        `ReportDemand`)."""
        per: dict[str, list[int]] = {}
        while self._next_arrival < len(self._trace) and self._trace[self._next_arrival].arrival_s <= now_s:
            req = self._trace[self._next_arrival]
            acc = per.setdefault(req.model, [0, 0, 0])
            acc[0] += 1
            acc[1] += len(req.prompt_token_ids)
            acc[2] += req.max_tokens
            self._next_arrival += 1
        refused, self._refused = self._refused, {}
        self.last_report_s = now_s
        for reasons in refused.values():
            for reason, n in reasons.items():
                self.reported_refusals[reason] = self.reported_refusals.get(reason, 0) + n
        for model in sorted(set(per) | set(refused)):  # an arrival at a tick's instant may be routed after it
            n, prompt, output = per.get(model, (0, 0, 0))
            self.demand.add(now_s, model, n, prompt, output, refused.get(model))

    def _tick(self) -> None:
        now = self.sim.now
        self._report_arrivals(now)
        while self.plan_at and self.plan_at[0][0] <= now + 1e-12:
            self.start(self.plan_at.pop(0)[1])
        if self.balancer is not None and now >= self.window_s:
            planned = (self.live.plan(now, self.live_view(now), self._in_flight()) if self.live is not None
                       else self.balancer.plan(now, self.node_load(now), self._in_flight()))
            for r in planned:
                self.start(r)
        if now + self.period_s <= self._end_s or self._in_flight() or self.plan_at:
            self.sim.call_at(now + self.period_s, self._tick)

    # - carrying out a reconfiguration -

    def start(self, r: Reconfiguration) -> StepReconfig:
        unknown = [i for i in r.retire if i not in self.sim.instances or i in self._draining()]
        if unknown:
            raise ValueError(f"{r.reconfig_id}: retires {unknown}, not serving on the node")
        if r.in_place:
            return self._start_in_place(r)
        ev = StepReconfig(r, self.sim.now, held=sum(self.sim.requests_on(i) for i in r.retire))
        self.reconfigs.append(ev)
        self._publish()  # the retired instances take no new request from now on
        if self.migrate:
            for iid in r.retire:
                self._migrate_out(ev, iid, set(r.retire))
        self.sim.call_at(self.sim.now, lambda: self._poll(ev))
        return ev

    def _start_in_place(self, r: Reconfiguration) -> StepReconfig:
        """Decode <-> colocated in place: the instance keeps serving (and routing) in its old role until the switch
        time, then in the new one, with everything it holds (`NodeSimulator.set_role_in_place`)."""
        now = self.sim.now
        ev = StepReconfig(r, now, phase=Phase.SWITCHING, drain_end_s=now, done_s=now + self.policy.role_switch_s)
        self.reconfigs.append(ev)

        def finish() -> None:
            self.sim.set_role_in_place(r.retire[0], r.start[0].role)
            ev.phase = advance(ev.phase, Phase.DONE)
            self._publish()
        self.sim.call_at(ev.done_s, finish)
        return ev

    def _migrate_out(self, ev: StepReconfig, iid: str, retiring: set[str]) -> None:
        inst = self.sim.instances[iid]
        running = [migration.RunningDecode(req.request_id, req.num_tokens,
                                           migration.expected_remaining_tokens(req.spec, req.num_output_tokens))
                   for req in self.sim.running_decodes(iid)]
        if not running:
            return
        targets = []
        for tid, other in self.sim.instances.items():
            if tid in retiring or tid in self._draining() or other.cfg.model != inst.cfg.model \
                    or other.cfg.role is Role.PREFILL:
                continue
            load = other.load()
            slots = max(0, load.max_num_seqs - load.num_running) if load.max_num_seqs else 1 << 16
            targets.append(migration.Target(tid, load.num_free_blocks, load.block_size, slots, load.num_running,
                                            migration.kv_tokens_in_use(load)))
        decisions = migration.plan(
            running, targets, step_s=inst.load().decode_step_time_s, transfer_s=inst.cost.kv_transfer_time_s,
            max_pause_s=self.max_migration_pause_s,
            target_step_s=lambda tid, batch, kv: migration.batch_step_s(self.sim.instances[tid].cost, batch, kv),
            itl_budget_s=self.node.slo.itl_ms / 1000.0)

        def done(outcome: str) -> None:
            if outcome == migration.MIGRATE:
                ev.migrated += 1
            elif outcome == migration.TARGET_REFUSED:
                ev.kept[outcome] = ev.kept.get(outcome, 0) + 1
        for d in decisions:
            if d.migrate:
                self.sim.migrate(d.request_id, iid, d.target, done)
            else:
                ev.kept[d.reason] = ev.kept.get(d.reason, 0) + 1

    def _poll(self, ev: StepReconfig) -> None:
        r = ev.reconfig
        if any(self.sim.requests_on(i) or self.sim.instances[i].busy for i in r.retire):
            self.sim.call_at(self.sim.now + self.poll_s, lambda: self._poll(ev))
            return
        ev.drain_end_s = self.sim.now
        ev.phase = advance(ev.phase, Phase.SWITCHING)
        for iid in r.retire:
            ev.lost += self.sim.remove_instance(iid)
        for cfg in r.start:
            self.starting[cfg.id] = cfg
        self._publish()
        switch_s = r.load_s if r.kind is ReconfigKind.MODEL else self.policy.role_switch_s
        ev.done_s = self.sim.now + switch_s
        self.sim.call_at(ev.done_s, lambda: self._finish(ev))

    def _finish(self, ev: StepReconfig) -> None:
        for cfg in ev.reconfig.start:
            self.starting.pop(cfg.id, None)
            self.sim.add_instance(cfg)
        ev.phase = advance(ev.phase, Phase.DONE)
        self._publish()

    # - the run -

    def run(self, trace: Sequence[TraceRequest], *, drain_s: float = 120.0, warmup_s: float | None = None
            ) -> ElasticStepResult:
        wall0 = time.perf_counter()
        self._trace = sorted(trace, key=lambda t: t.arrival_s)
        self._end_s = self._trace[-1].arrival_s if self._trace else 0.0
        self.placements.append((0.0, tuple(self.sim.instances)))
        self.sim.call_at(0.0, self._tick)
        result = self.sim.run(self._trace, drain_s=drain_s, warmup_s=warmup_s)
        counters = dict(self.balancer.counters) if self.balancer else {}
        return ElasticStepResult(result, self.reconfigs, self.placements, counters, time.perf_counter() - wall0)


def run_elastic_step(node: NodeConfig, trace: Sequence[TraceRequest], **kwargs) -> ElasticStepResult:
    """`ElasticStepSim(node, **kwargs).run(trace)`; `drain_s` and `warmup_s` go to the run."""
    run_kwargs = {k: kwargs.pop(k) for k in ("drain_s", "warmup_s") if k in kwargs}
    return ElasticStepSim(node, **kwargs).run(trace, **run_kwargs)


# --- the shortened mix-shift day at step level (`python -m octoserve.services.sim.elastic_step`) -----------------


def day_rows(cost_profile: str, *, hour_s: float, load: float, gpu: str, seed: int = 0,
             policy: BalancerPolicy = BalancerPolicy(), window_s: float = 10.0,
             migrate: bool = True, ranker: str = "forward", hourly: list[str] | None = None
             ) -> list[tuple[str, object, int, int]]:
    """The mix-shift day (offered `load` x each model's capacity alone, `hour_s` per hour): the best static
    placement and the elastic balancer (with `ranker`: the forward ranker by default, as the node's, played on the
    queueing model's state there and on a twin built from the load snapshots here), each on the queueing-level
    simulator (services/sim/elastic_sim.py) and on this step-level one, from the same start placement. Rows: (name,
    Summary over the arrivals, reconfigurations done, requests lost). `hourly`, when given, receives the step-level
    goodput of both hour by hour and the elastic run's reconfigurations, as text lines."""
    import dataclasses

    from octoserve.services.core.elastic_layouts import candidate_layouts
    from octoserve.services.workload_day import day_trace
    from octoserve.services.metrics import summarize
    from octoserve.services.sim.driver import run_simulation
    from octoserve.services.sim.elastic_day import best_static, day_node
    from octoserve.services.sim.elastic_sim import model_alone_rps, run_day
    from octoserve.services.workload_day import BASE_OUTPUT, BASE_PROMPT, LARGE, SMALL, generate_day, mix_shift_day

    node = day_node(cost_profile, gpu)
    alone = [model_alone_rps(node, m, BASE_PROMPT.mean, BASE_OUTPUT.mean) for m in (SMALL, LARGE)]
    day = mix_shift_day(hours=24.0, hour_s=hour_s, load_rps=(load * alone[0], load * alone[1]))
    requests = generate_day(day, seed)
    layouts = candidate_layouts(node)
    static, _ = best_static(node, day, requests, layouts, "day")
    elastic = run_day(node, day, requests, static.initial, "elastic", layouts=layouts, policy=policy, ranker=ranker,
                      seed=seed)
    start = dataclasses.replace(node, instances=tuple(static.initial))
    trace = day_trace(requests)
    step_static = run_simulation(start, trace)
    step_elastic = ElasticStepSim(start, policy=policy, window_s=window_s, migrate=migrate, ranker=ranker).run(trace)

    def summary(records):
        return summarize(records, day.slo, day.duration_s)

    step_static_lost = sum(1 for r in step_static.records if r.error and not r.refused)
    if hourly is not None:
        hourly += hourly_lines(step_static.records, step_elastic, day.slo, hour_s)
    return [("best static, queueing", summary(static.records), 0, static.lost),
            ("elastic, queueing", summary(elastic.records), len(elastic.reconfigs), elastic.lost),
            ("best static, step level", summary(step_static.records), 0, step_static_lost),
            ("elastic, step level", summary(step_elastic.sim.records), len(step_elastic.done), step_elastic.lost)]


def hourly_lines(static_records, elastic: ElasticStepResult, slo, hour_s: float) -> list[str]:
    """Step-level goodput per hour of the day, static placement against elastic, then each reconfiguration."""
    from octoserve.services.metrics import attainment_over_time

    static_bins = attainment_over_time(static_records, slo, hour_s)
    elastic_bins = attainment_over_time(elastic.sim.records, slo, hour_s)
    lines = ["| hour | static req/s | elastic req/s | elastic - static |", "|---|---|---|---|"]
    for s, e in zip(static_bins, elastic_bins):
        lines.append(f"| {s.start_s / hour_s:.0f} | {s.num_good / hour_s:.2f} | {e.num_good / hour_s:.2f} | "
                     f"{(e.num_good - s.num_good) / hour_s:+.2f} |")
    for ev in elastic.reconfigs:
        r = ev.reconfig
        started = ", ".join(f"{i.model} TP{i.tp} {i.role.value}" for i in r.start)
        lines.append(f"- {ev.planned_s:.1f} s (hour {ev.planned_s / hour_s:.1f}) -> done {ev.done_s:.1f} s: "
                     f"{r.kind.value}{' in place' if r.in_place else ''}, {' + '.join(r.retire)} -> {started}")
    return lines


def main(argv: list[str] | None = None) -> int:
    import argparse

    from octoserve.services.core.specs import GPU_PRESETS

    parser = argparse.ArgumentParser(description="the shortened mix-shift day: queueing-level vs step-level "
                                                 "simulator, best static placement and the elastic balancer")
    parser.add_argument("--cost-profile", choices=("default", "pessimistic", "both"), default="both")
    parser.add_argument("--hour-s", type=float, default=5.0, help="simulated seconds per hour of the day")
    parser.add_argument("--load", type=float, default=0.9, help="offered load / each model's capacity alone")
    parser.add_argument("--gpu", default="h100-sxm-80gb", choices=sorted(GPU_PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--drain-only", action="store_true",
                        help="the step-level elastic run drains retired instances, migrating no running decode")
    parser.add_argument("--ranker", choices=("forward", "none"), default="forward",
                        help="the balancer's ranker on both simulators (default: forward, as the node's)")
    parser.add_argument("--hourly", action="store_true",
                        help="also print the step-level goodput hour by hour (static vs elastic) and every "
                             "reconfiguration of the elastic run")
    args = parser.parse_args(argv)
    if args.hour_s <= 0 or args.load <= 0:
        parser.error("--hour-s and --load must be > 0")
    profiles = ("default", "pessimistic") if args.cost_profile == "both" else (args.cost_profile,)
    print("| cost profile | configuration | goodput req/s | attainment | refused | reconfigurations | lost |\n"
          "|---|---|---|---|---|---|---|")
    hourly: dict[str, list[str] | None] = {}
    for profile in profiles:
        t0 = time.perf_counter()
        hourly[profile] = [] if args.hourly else None
        for name, s, n, lost in day_rows(profile, hour_s=args.hour_s, load=args.load, gpu=args.gpu, seed=args.seed,
                                         migrate=not args.drain_only, ranker=args.ranker, hourly=hourly[profile]):
            g = s.overall
            print(f"| {profile} | {name} | {g.goodput_rps:.2f} | {g.attainment_offered:.3f} | "
                  f"{g.refused_fraction:.3f} | {n} | {lost} |", flush=True)
        print(f"({profile}: {time.perf_counter() - t0:.0f} s)", file=sys.stderr, flush=True)
    for profile, lines in hourly.items():
        if lines:
            print(f"\nStep level, {profile} cost profile, hour by hour:\n" + "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
