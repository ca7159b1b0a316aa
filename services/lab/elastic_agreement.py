"""The mix-shift day, shortened, live and simulated: the sim-engine node (separate processes, dilated by K) with the
elastic balancer on in its scheduler, against the elastic simulator (services/sim/elastic_sim.py) in "elastic" mode
on the same trace with the same balancer policy.

    python -m octoserve.services.lab.elastic_agreement [--rate 8] [--hour-s 1.0] [--time-scale 8] [--max-output 64]
        [--cost-profile default|pessimistic]

The day (services/workload_day.py, "mix-shift-day") is compressed further: one hour of the day is `--hour-s`
simulated seconds (the named day uses 15 s), and true output lengths are capped at `--max-output` on both sides, so
the live run takes minutes. Reported side by side: goodput, SLO attainment, refused share, requests lost (sent
without a final status, or failed other than by an admission refusal), and reconfigurations carried out. Agreement:
goodput and attainment within ±15 % of the step-level elastic simulator (services/sim/elastic_step.py: the
step-level simulator with the same balancer, fed the same load figures as the live scheduler builds, carrying out
its reconfigurations in simulated time). Two diagnostic columns: the queueing-level elastic simulator
(services/sim/elastic_sim.py, per-instance prefill server and decode slots, exact queues as the balancer's input),
and the step-level simulator with the start placement and no balancer.

A scripted model change instead of the balancer (`--model-change`):

    python -m octoserve.services.lab.elastic_agreement --model-change [--change-at-h 8] [--back-at-h 20] ...

The same shortened day on the node without a balancer; at hour `--change-at-h` the scheduler's `Reconfigure` moves
two 8B GPUs (`sm-2`, `sm-3`) to the 70B as one TP-2 instance, and at hour `--back-at-h` (0: never) that instance goes
back to two 8B instances. The step-level elastic simulator carries out the same two reconfigurations at the same
simulated times (the same `Reconfiguration`s: the scheduler's `reconfiguration_from_pb` builds both sides' plans,
weight-load time included). Reported per model: goodput (agreement within ±15 %), and per change the downtime of
the moved instance: its drain (it takes no new request but still serves its running ones) and its switch (its GPUs
serve nothing: stop, start, weight load), in simulated seconds on both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
import time

from octoserve.services.config import config_file
from octoserve.services.core.balancer import BalancerPolicy
from octoserve.services.metrics import summarize
from octoserve.services.workload_day import LARGE, SMALL, day_trace, generate_day, mix_shift_day

TOLERANCE = 0.15
# The balancer's policy on both sides, sized for a shortened day (a move must pay for itself over 30 s). With
# `--ranker none` (the default here) the estimate decides alone and every role change drains, as when this comparison
# was first measured; `--ranker forward` runs the node's default balancer on every side (`policy_for`).
POLICY = {"forecast_window_s": 30.0, "min_dwell_s": 5.0, "confirm_periods": 1, "min_gain_fraction": 0.03,
          "engine_init_s": 0.5, "role_in_place": False}
PERIOD_S, WINDOW_S = 1.0, 6.0


def policy_for(ranker: str) -> dict:
    """POLICY for `ranker`: the forward ranker with decode <-> colocated role changes in place (the default pair)."""
    return POLICY if ranker == "none" else {**POLICY, "role_in_place": None}


def node_config(base_path: str | None, cost_profile: str | None = None, ranker: str = "none") -> dict:
    from octoserve.services.config import raw_config_with_overrides

    config = raw_config_with_overrides(base_path, [], cost_profile or None)
    config["elastic"] = {"balancer": "elastic", "ranker": ranker, "period_s": PERIOD_S, "window_s": WINDOW_S,
                         **policy_for(ranker)}
    return config


def run(args) -> int:
    from octoserve.services.config import node_config_from_raw
    from octoserve.services.node.launcher import start_node
    from octoserve.services.loadgen import BenchOptions, run_bench
    from octoserve.services.sim.driver import run_simulation
    from octoserve.services.sim.elastic_sim import run_day
    from octoserve.services.sim.elastic_step import ElasticStepSim

    profile = mix_shift_day(rate_rps=args.rate, hours=24.0, hour_s=args.hour_s)
    requests = [dataclasses.replace(r, output_tokens=min(r.output_tokens, args.max_output))
                for r in generate_day(profile, args.seed)]
    config = node_config(args.config, args.cost_profile, args.ranker)
    node_cfg = node_config_from_raw(config)
    policy = BalancerPolicy(**policy_for(args.ranker))
    t0 = time.perf_counter()
    sim = run_day(node_cfg, profile, requests, node_cfg.instances, "elastic", policy=policy,
                  period_s=PERIOD_S, window_s=WINDOW_S, ranker=args.ranker, seed=args.seed)
    print(f"simulated {len(requests)} requests over {profile.duration_s:g} s in {time.perf_counter() - t0:.1f} s; "
          f"{len(sim.reconfigs)} reconfigurations", flush=True)
    print(f"live: {profile.duration_s * args.time_scale:.0f} s of arrivals at time scale {args.time_scale:g} ...",
          flush=True)
    node = start_node(config, args.time_scale, startup_timeout_s=180, grace_s=5)
    try:
        records = asyncio.run(run_bench(node.router_address, day_trace(requests), time_scale=args.time_scale,
                                        options=BenchOptions(drain_timeout_s=120.0)))
        scheduler_log = node.scheduler.log_file.read_text()
    finally:
        node.stop()
    live_reconfigs = scheduler_log.count('"msg": "reconfiguration done"')
    t0 = time.perf_counter()
    estep = ElasticStepSim(node_cfg, policy=policy, period_s=PERIOD_S, window_s=WINDOW_S,
                           ranker=args.ranker).run(day_trace(requests))
    print(f"step-level elastic simulator: {time.perf_counter() - t0:.1f} s; {len(estep.done)} reconfigurations",
          flush=True)
    live = summarize(records, profile.slo, profile.duration_s)
    stepel = summarize(estep.sim.records, profile.slo, profile.duration_s)
    virt = summarize(sim.records, profile.slo, profile.duration_s)
    # The step-level simulator on the same trace and the start placement (a diagnostic: where the gap comes from).
    step = summarize(run_simulation(node_cfg, day_trace(requests)).records, profile.slo, profile.duration_s)
    lost = live.overall.num_unfinished  # admitted and never finished (the failed ones are among them)
    o = (live.overall, stepel.overall, virt.overall, step.overall)
    rows = [("goodput req/s", *(g.goodput_rps for g in o), True),
            ("SLO attainment %", *(100 * g.attainment_offered for g in o), True),
            ("refused %", *(100 * g.refused_fraction for g in o), False),
            ("reconfigurations", live_reconfigs, len(estep.done), len(sim.reconfigs), 0, False),
            ("errors or unfinished", lost, estep.lost + stepel.overall.num_unfinished, sim.lost,
             step.overall.num_unfinished, False)]
    for m in sorted({r.model for r in requests}):
        per = [next(g for g in s.per_model if g.name == m) for s in (live, stepel, virt, step)]
        rows.append((f"goodput {m} req/s", *(g.goodput_rps for g in per), False))
    print("\n| metric | live (dilated) | step-level elastic sim | live vs step-level elastic | "
          "queueing elastic sim (diagnostic) | live vs queueing | step-level static (diagnostic) | live vs static |"
          "\n|---|---|---|---|---|---|---|---|")
    ok = True
    for name, lv, ev, vv, sv, checked in rows:
        ediff, diff, sdiff = _rel(lv, ev), _rel(lv, vv), _rel(lv, sv)
        ok &= (abs(ediff) <= TOLERANCE) if checked else True
        print(f"| {name} | {lv:.2f} | {ev:.2f} | {ediff:+.1%} | {vv:.2f} | {diff:+.1%} | {sv:.2f} | {sdiff:+.1%} |")
    print("\nstep-level elastic reconfigurations: " + ("; ".join(
        f"{ev.reconfig.kind.value} {'+'.join(ev.reconfig.retire)} -> {'+'.join(c.id for c in ev.reconfig.start)} "
        f"planned {ev.planned_s:.1f} s, drained {ev.drain_end_s:.1f} s, done {ev.done_s:.1f} s"
        for ev in estep.reconfigs) or "none") + f"; balancer decisions {dict(sorted(estep.counters.items()))}")
    errors = sorted({r.error[:120] for r in records if r.error and not r.refused})
    if errors:
        print("\nlive errors (not refusals): " + "; ".join(errors[:3]))
    print(f"\nagreement with the step-level elastic simulator (goodput, attainment) within ±{TOLERANCE:.0%}: "
          f"{'yes' if ok else 'NO'}; lost live: {lost}")
    return 0 if ok and lost == 0 else 1


# --- the scripted model change (--model-change) ------------------------------------------------------------------

MOVED = ("sm-2", "sm-3")  # the 8B instances whose GPUs (6, 7) move to the 70B


def change_script(change_at_h: float, back_at_h: float) -> list[tuple[float, tuple[str, ...] | None, str, int]]:
    """Two 8B GPUs join the 70B as one TP-2 instance at `change_at_h`, and go back to two 8B at `back_at_h` (0: not).
    Entries: (hour of the day, instances retired (None: those the previous change started), model started, its TP)."""
    if not 0 <= change_at_h < 24:
        raise ValueError(f"--change-at-h {change_at_h:g} must be an hour of the day, in [0, 24)")
    if back_at_h >= 24:
        raise ValueError(f"--back-at-h {back_at_h:g} must be an hour of the day, under 24 (or 0: no move back)")
    script = [(change_at_h, MOVED, LARGE, 2)]
    if back_at_h:
        if back_at_h <= change_at_h:
            raise ValueError(f"--back-at-h {back_at_h:g} must be after --change-at-h {change_at_h:g} "
                             "(or 0: no move back)")
        script.append((back_at_h, None, SMALL, 1))
    return script


def change_request(retire: tuple[str, ...], model: str, tp: int, reason: str):
    from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
    from octoserve.services.rpc.gen import worker_pb2 as w_pb

    return s_pb.ReconfigureRequest(reason=reason, model_change=s_pb.ModelChange(
        retire=list(retire), model=model, role=w_pb.COLOCATED, tensor_parallel=tp))


@dataclasses.dataclass(frozen=True)
class ChangeTiming:
    """One model change as carried out, simulated seconds: when it began (the retired instances stop taking new
    requests), its drain (they finish their running ones) and its switch (their GPUs serve nothing until the
    started instances serve)."""

    label: str
    at_s: float
    drain_s: float
    switch_s: float
    drained: int
    migrated: int = 0  # running decodes handed to another instance of the model by KV hand-off in the drain

    @property
    def downtime_s(self) -> float:
        return self.switch_s


def sim_plan(node_cfg, script, hour_s: float):
    """The script as (time, Reconfiguration) for the step-level simulator, built by the scheduler's own parser."""
    from octoserve.services.scheduler.elastic import reconfiguration_from_pb

    current = {i.id: i for i in node_cfg.instances}
    plan, previous = [], ()
    for at_h, retire, model, tp in script:
        request = change_request(retire or previous, model, tp, f"scripted at hour {at_h:g}")
        r = reconfiguration_from_pb(request, current, node_cfg)
        for i in r.retire:
            current.pop(i)
        current.update({i.id: i for i in r.start})
        previous = tuple(i.id for i in r.start)
        plan.append((at_h * hour_s, r))
    return plan


async def scripted_changes(scheduler_address: str, script, hour_s: float, time_scale: float, t0: float
                           ) -> list[ChangeTiming]:
    """The script on the live node through `Scheduler.Reconfigure`, each at its hour after `t0` (monotonic, the
    load harness's start); times reported in simulated seconds (wall / time scale)."""
    import grpc

    from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc

    out: list[ChangeTiming] = []
    previous: tuple[str, ...] = ()
    async with grpc.aio.insecure_channel(scheduler_address) as channel:
        stub = s_grpc.SchedulerStub(channel)
        for at_h, retire, model, tp in script:
            await asyncio.sleep(max(0.0, t0 + at_h * hour_s * time_scale - time.monotonic()))
            began = (time.monotonic() - t0) / time_scale
            reply = await stub.Reconfigure(change_request(retire or previous, model, tp, f"scripted at hour {at_h:g}"),
                                           timeout=600)
            out.append(ChangeTiming(_change_label((at_h, retire, model, tp)), began, reply.drain_s / time_scale,
                                    reply.switch_s / time_scale, reply.drained_requests, reply.migrated_requests))
            previous = tuple(reply.started)
            print(f"  live: {out[-1].label} at {began:.2f} s: drained {reply.drained_requests} requests in "
                  f"{out[-1].drain_s:.2f} s, switched in {out[-1].switch_s:.2f} s (simulated)", flush=True)
    return out


def _change_label(entry) -> str:
    """A script entry in words: its GPUs and what they serve after it."""
    _, retire, model, tp = entry
    return f"{'+'.join(retire) if retire else 'the moved GPUs'} -> {model} TP {tp}"


@dataclasses.dataclass
class ModelChangeResult:
    live: object  # metrics.Summary
    sim: object
    static: object  # the step-level simulator with no change (a diagnostic: what the changes were worth)
    live_changes: list[ChangeTiming]
    sim_changes: list[ChangeTiming]
    live_lost: int
    sim_lost: int
    live_records: list = dataclasses.field(default_factory=list)  # metrics.RequestRecord, for the plot
    sim_records: list = dataclasses.field(default_factory=list)

    def goodput_diffs(self) -> dict[str, float]:
        """Relative goodput difference live vs step-level simulator, overall and per model."""
        out = {"all": _rel(self.live.overall.goodput_rps, self.sim.overall.goodput_rps)}
        for g in self.live.per_model:
            ref = next(s for s in self.sim.per_model if s.name == g.name)
            out[g.name] = _rel(g.goodput_rps, ref.goodput_rps)
        return out

    @property
    def agrees(self) -> bool:
        return all(abs(d) <= TOLERANCE for d in self.goodput_diffs().values())

    def table(self) -> str:
        lines = ["| metric | live (dilated) | step-level elastic sim | live vs sim | step-level, no change "
                 "(diagnostic) |", "|---|---|---|---|---|"]
        diffs = self.goodput_diffs()
        lines.append(f"| goodput req/s | {self.live.overall.goodput_rps:.2f} | {self.sim.overall.goodput_rps:.2f} | "
                     f"{diffs['all']:+.1%} | {self.static.overall.goodput_rps:.2f} |")
        for g in self.live.per_model:
            ref = next(s for s in self.sim.per_model if s.name == g.name)
            static = next(s for s in self.static.per_model if s.name == g.name)
            lines.append(f"| goodput {g.name} req/s | {g.goodput_rps:.2f} | {ref.goodput_rps:.2f} | "
                         f"{diffs[g.name]:+.1%} | {static.goodput_rps:.2f} |")
        for name, get in (("SLO attainment %", lambda s: s.overall.attainment_offered),
                          ("refused %", lambda s: s.overall.refused_fraction)):
            lines.append(f"| {name} | " + " | ".join(f"{100 * get(s):.2f}" for s in (self.live, self.sim)) +
                         f" | | {100 * get(self.static):.2f} |")
        lines.append(f"| requests lost | {self.live_lost} | {self.sim_lost} | | |")
        for lv, sv in zip(self.live_changes, self.sim_changes):
            lines.append(f"| {lv.label}: began at s | {lv.at_s:.2f} | {sv.at_s:.2f} | | |")
            lines.append(f"| ... requests drained | {lv.drained} | {sv.drained} | | |")
            lines.append(f"| ... of them migrated by KV hand-off | {lv.migrated} | {sv.migrated} | | |")
            lines.append(f"| ... drain s (instance takes no new request) | {lv.drain_s:.2f} | {sv.drain_s:.2f} | | |")
            lines.append(f"| ... switch s = downtime of the instance | {lv.switch_s:.2f} | {sv.switch_s:.2f} | | |")
        return "\n".join(lines)


def run_model_change(args) -> ModelChangeResult:
    from octoserve.services.config import node_config_from_raw
    from octoserve.services.node.launcher import start_node
    from octoserve.services.loadgen import BenchOptions, run_bench
    from octoserve.services.sim.elastic_step import ElasticStepSim

    profile = mix_shift_day(rate_rps=args.rate, hours=24.0, hour_s=args.hour_s)
    requests = [dataclasses.replace(r, output_tokens=min(r.output_tokens, args.max_output))
                for r in generate_day(profile, args.seed)]
    trace = day_trace(requests)
    config = node_config(args.config, args.cost_profile)
    config.pop("elastic")  # no balancer: the script reconfigures
    node_cfg = node_config_from_raw(config)
    missing = [i for i in MOVED if i not in {inst.id for inst in node_cfg.instances}]
    if missing:
        raise ValueError(f"--model-change moves {', '.join(MOVED)}: the config has no {', '.join(missing)}; use a "
                         "placement with those 8B instances (the default one)")
    script = change_script(args.change_at_h, args.back_at_h)
    plan = sim_plan(node_cfg, script, args.hour_s)
    t0 = time.perf_counter()
    estep = ElasticStepSim(node_cfg, balance=False, plan_at=plan, period_s=PERIOD_S, window_s=WINDOW_S).run(trace)
    sim_changes = [ChangeTiming(_change_label(entry), ev.planned_s, ev.drain_end_s - ev.planned_s,
                                ev.done_s - ev.drain_end_s, ev.held, ev.migrated)
                   for entry, ev in zip(script, estep.reconfigs)]
    print(f"step-level elastic simulator: {len(requests)} requests over {profile.duration_s:g} s in "
          f"{time.perf_counter() - t0:.1f} s; {len(estep.done)} of {len(plan)} model changes done", flush=True)
    print(f"live: {profile.duration_s * args.time_scale:.0f} s of arrivals at time scale {args.time_scale:g} ...",
          flush=True)
    node = start_node(config, args.time_scale, startup_timeout_s=180, grace_s=5)
    try:
        async def live():
            t_start = time.monotonic()
            return await asyncio.gather(
                run_bench(node.router_address, trace, time_scale=args.time_scale,
                          options=BenchOptions(drain_timeout_s=120.0)),
                scripted_changes(node.scheduler.address, script, args.hour_s, args.time_scale, t_start))

        records, live_changes = asyncio.run(live())
    finally:
        node.stop()
    live_sum = summarize(records, profile.slo, profile.duration_s)
    sim_sum = summarize(estep.sim.records, profile.slo, profile.duration_s)
    static = ElasticStepSim(node_cfg, balance=False, period_s=PERIOD_S, window_s=WINDOW_S).run(trace)
    result = ModelChangeResult(live_sum, sim_sum, summarize(static.sim.records, profile.slo, profile.duration_s),
                               live_changes, sim_changes,
                               live_sum.overall.num_unfinished,
                               estep.lost + sim_sum.overall.num_unfinished + (len(plan) - len(estep.done)),
                               records, estep.sim.records)
    if getattr(args, "plot", None):
        plot_model_change(result, profile.slo, args.plot, bin_s=2 * args.hour_s)
    return result


def plot_model_change(result: ModelChangeResult, slo, path: str, bin_s: float) -> None:
    """Goodput per model over the day (by arrival, `bin_s` bins), live and simulated, with each change's drain
    (light) and switch (dark) shaded: live above the axis' middle, simulated below."""
    from octoserve.services import plots
    from octoserve.services.metrics import attainment_over_time

    fig, ax = plots.plt.subplots(figsize=(10, 4.5))
    for model, colour in ((SMALL, "tab:blue"), (LARGE, "tab:red")):
        for name, records, style in (("live", result.live_records, "-"), ("step-level sim", result.sim_records, "--")):
            bins = attainment_over_time([r for r in records if r.model == model], slo, bin_s)
            ax.plot([b.start_s + bin_s / 2 for b in bins], [b.num_good / bin_s for b in bins], style, color=colour,
                    label=f"{model}, {name}")
    for changes, (y0, y1) in ((result.live_changes, (0.5, 1.0)), (result.sim_changes, (0.0, 0.5))):
        for c in changes:
            ax.axvspan(c.at_s, c.at_s + c.drain_s, y0, y1, color="grey", alpha=0.2)
            ax.axvspan(c.at_s + c.drain_s, c.at_s + c.drain_s + c.switch_s, y0, y1, color="grey", alpha=0.5)
    ax.set_xlabel("simulated seconds (arrival time)")
    ax.set_ylabel("goodput (req/s meeting every SLO)")
    ax.set_title("A model change live vs the step-level simulator (shaded: drain, then switch; top live, bottom sim)",
                 fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    print(f"plot: {plots._save(fig, path)}")


def _print_model_change(result: ModelChangeResult) -> int:
    print("\n" + result.table())
    print(f"\nagreement with the step-level elastic simulator (goodput overall and per model) within "
          f"±{TOLERANCE:.0%}: {'yes' if result.agrees else 'NO'}; lost live: {result.live_lost}, "
          f"simulated: {result.sim_lost}")
    return 0 if result.agrees and result.live_lost == 0 and result.sim_lost == 0 else 1


def _rel(live: float, ref: float) -> float:
    return (live - ref) / ref if ref else (0.0 if live == ref else float("inf"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=config_file, default=None,
                        help="node config YAML (default: the embedded default)")
    parser.add_argument("--rate", type=float, default=8.0)
    parser.add_argument("--hour-s", type=float, default=1.0)
    parser.add_argument("--time-scale", type=float, default=8.0)
    parser.add_argument("--max-output", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranker", choices=("none", "forward"), default="none",
                        help="the balancer on every side: the estimate alone with drained role changes (default, as "
                             "first measured), or the node's default, the forward ranker with in-place role changes")
    from octoserve.services.config import add_cost_profile_argument

    add_cost_profile_argument(parser)
    parser.add_argument("--model-change", action="store_true",
                        help="no balancer: a scripted model change (two 8B GPUs -> a 70B TP 2 and back) instead")
    parser.add_argument("--change-at-h", type=float, default=8.0, help="--model-change: hour of the move to the 70B")
    parser.add_argument("--plot", default=None, help="--model-change: PNG of goodput per model over the day")
    parser.add_argument("--back-at-h", type=float, default=20.0,
                        help="--model-change: hour of the move back to two 8B (0: none)")
    args = parser.parse_args(argv)
    if args.model_change:
        try:
            change_script(args.change_at_h, args.back_at_h)
        except ValueError as e:
            parser.error(str(e))
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return _print_model_change(run_model_change(args)) if args.model_change else run(args)


if __name__ == "__main__":
    sys.exit(main())
