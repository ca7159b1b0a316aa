"""The elastic node simulator: a node under a time-varying workload, its placement changed while it serves.

Three ways to run a day (`run_day`):
- "static": one placement all day;
- "oracle": the best placement for each (compressed) hour's true demand, switched at the hour with zero cost
  (running requests finish where they are, the new instances start empty at once on the same GPUs). "Best" is
  measured, not estimated: the top `oracle_trials` candidates by the capacity estimate for that hour, plus the
  `oracle_extra` placements (say the best static one) and the placement in place, are each simulated over that
  hour's requests (from `window_s` before it, empty), and the one that serves the most within the SLOs is taken
  (`oracle_trials` 0: the estimate's pick alone);
- "elastic": the `ElasticBalancer` (services/core/balancer.py) plans every `period_s` from the last `window_s` of
  load, and the simulator carries out each reconfiguration: DRAINING (the retired instances take no new request;
  running decodes migrate by KV hand-off to another instance of the same model when the hand-off is shorter than
  their remaining decode, that instance has a free slot by then and its decode step stays within the ITL SLO: the
  rule of services/core/migration.py, which the live node applies too; the rest finish in place), SWITCHING
  (`load_s` of weights, or the role switch), DONE (the started instances take requests, empty). An in-place role
  change (decode <-> colocated, `Reconfiguration.in_place`) skips DRAINING: the instance keeps everything it holds
  and takes new requests in its old role until the switch is done, then in the new one.

The instance model is a queueing one, coarser than the step-level simulator (services/sim/driver.py) and much
faster, so that a day is practical: each instance has a prefill server (FIFO, the cost model's prefill rate at its
chunk) and B decode slots (B the largest batch whose step, at the day's mean context, fits the ITL target and whose
KV fits; every token of a slot takes that step time). A colocated instance time-shares its GPUs: a fraction a of
its time prefills and (1 - a) of its slots decode, with a re-balanced each period to the window's mean lengths
(1 / (1 + (prompt / prefill rate) / (output x step / B)) ... see `_colocated_share`). A disaggregated request's KV
moves to its decode instance in the cost model's NVLink time. A request is admitted to the instance (pair) with the
earliest first token, and refused when its predicted TTFT or TPOT misses the SLO (as the router's admission).

Invariants: arrivals are processed in order; every admitted request has one finish time, which a migration may only
move later by its hand-off; no instance goes away before its last running request has finished or moved: the
`lost` count (requests still running on an instance when it is removed) is checked, and it is 0.

Why one module past 600 lines: the elastic queueing model: instances, requests and reconfigurations together.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from octoserve.services.core import migration
from octoserve.services.core.balancer import BalancerPolicy, ElasticBalancer, RANKERS
from octoserve.services.core.elastic_capacity import (
    CapacityModel,
    alone_capacity_rps,
    objective_weights,
    placement_goodput_rps,
    unserved,
)
from octoserve.services.core.elastic_layouts import candidate_layouts
from octoserve.services.core.elastic_load import InstanceLoad, ModelDemand, NodeLoad, demand_trend, step_score
from octoserve.services.core.placement import InstanceConfig, NodeConfig, num_kv_blocks_for
from octoserve.services.core.reconfig import IN_FLIGHT, Phase, ReconfigKind, Reconfiguration, advance
from octoserve.services.core.types import Role
from octoserve.services.sim.forward_ranker import ForwardSimRanker
from octoserve.services.metrics import RequestRecord, Summary, Window, detect_window, summarize
from octoserve.services.core.day_request import DayRequest
from octoserve.services.workload_day import DayProfile, day_record

MODES = ("static", "oracle", "elastic")
ORACLE_TRIALS = 3  # the oracle simulates this many of the estimate's best placements for each hour
_SIZES: dict[tuple, dict[tuple[int, int], tuple[int, float]]] = {}  # `SimInstance._size` memo, per instance shape


class SimRequest:
    """One request of the day in the queueing model: where it runs and when each of its phases began and ended
    (the scheduler's forward ranker replays live requests as these)."""

    __slots__ = ("req", "first_s", "decode_start_s", "finish_s", "entry", "decoder", "migrations", "tau_s",
                 "prefill_begin_s", "busy_until_s", "reroutes", "entry_inst", "decoder_inst")

    def __init__(self, req: DayRequest) -> None:
        self.req = req
        self.prefill_begin_s = math.nan
        self.busy_until_s = math.nan  # when its prefill releases the entry instance's prefill server
        self.reroutes = 0
        self.entry_inst: SimInstance | None = None
        self.decoder_inst: SimInstance | None = None
        self.first_s = math.nan
        self.decode_start_s = math.nan
        self.finish_s = math.nan
        self.entry = ""
        self.decoder = ""
        self.migrations = 0
        self.tau_s = 0.0


class SimInstance:
    """One engine instance in the queueing model."""

    def __init__(self, node: NodeConfig, cfg: InstanceConfig, now_s: float, mean_lengths: tuple[float, float],
                 itl_target_s: float) -> None:
        self.cfg = cfg
        self.cost = node.cost_model(cfg)
        self.prefill_tok_s = self.cost.prefill_tokens_per_s(max(2048, cfg.max_num_batched_tokens))
        self.kv_tokens = num_kv_blocks_for(node, cfg) * cfg.block_size
        self.itl_target_s = itl_target_s
        self._sizes: dict[tuple[int, int], tuple[int, float]] = _SIZES.setdefault(
            (node.cost_profile, node.gpu.name, cfg.model, cfg.tp, cfg.max_num_seqs, self.kv_tokens, itl_target_s), {})
        self.full_slots, self.tau_s = self._size(mean_lengths)
        self.accepting = True
        self.prefill_free_s = now_s
        self.heap: list[float] = []
        self.share = 1.0 if cfg.role is Role.PREFILL else 0.0  # prefill's share of the GPU time
        self.running: list[SimRequest] = []  # requests whose decode is (or will be) on this instance
        self.queued: list[SimRequest] = []  # requests whose prefill is (or will be) on this instance
        self.removed_s = math.inf  # when a reconfiguration took it away
        self.rebalance(now_s, mean_lengths)

    def _size(self, mean_lengths: tuple[float, float]) -> tuple[int, float]:
        """(B, step time): B the largest batch whose step, at the mean context, fits the ITL target and whose KV
        fits; memoised per 10-token length bucket (an engine's batch follows the lengths it is given)."""
        prompt, output = mean_lengths
        key = (int(prompt // 10), int(output // 10))
        if key not in self._sizes:
            prompt, output = key[0] * 10 + 5, key[1] * 10 + 5
            ctx = int(prompt + output / 2)
            b_max = min(self.cfg.max_num_seqs, int(self.kv_tokens // max(1.0, prompt + output)))
            lo, hi = 0, max(0, b_max)  # the step time grows with the batch: the largest fitting B by bisection
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if self.cost.decode_step_time_s(mid, ctx) <= self.itl_target_s:
                    lo = mid
                else:
                    hi = mid - 1
            b = max(1, lo)
            self._sizes[key] = (b, self.cost.decode_step_time_s(b, ctx))
        return self._sizes[key]

    @property
    def prefills(self) -> bool:
        return self.cfg.role is not Role.DECODE

    @property
    def decodes(self) -> bool:
        return self.cfg.role is not Role.PREFILL

    def _colocated_share(self, mean_lengths: tuple[float, float]) -> float:
        prompt, output = mean_lengths
        prefill_s = prompt / self.prefill_tok_s
        decode_s = output * self.tau_s / self.full_slots
        return prefill_s / (prefill_s + decode_s)

    def rebalance(self, now_s: float, mean_lengths: tuple[float, float]) -> None:
        """The batch follows the current mean lengths (`_size`), and a colocated instance re-splits its time
        between prefill and decode for them."""
        self.full_slots, self.tau_s = self._size(mean_lengths)
        if self.cfg.role is Role.COLOCATED:
            self.share = self._colocated_share(mean_lengths)
        slots = 0 if self.cfg.role is Role.PREFILL else max(1, round(self.full_slots * (1.0 - self.share)))
        while len(self.heap) < slots:
            heapq.heappush(self.heap, now_s)
        while len(self.heap) > slots:
            heapq.heappop(self.heap)

    @property
    def prefill_rate(self) -> float:
        return self.prefill_tok_s * (self.share if self.cfg.role is Role.COLOCATED else 1.0)

    def switch_role(self, cfg: InstanceConfig, now_s: float, mean_lengths: tuple[float, float]) -> None:
        """An in-place role change (decode <-> colocated): the running decodes and queued prompts stay; a decode
        instance gives all its slots to decoding, a colocated one re-splits its time."""
        self.cfg = cfg
        if cfg.role is Role.DECODE:
            self.share = 0.0
        self.rebalance(now_s, mean_lengths)

    def drain_end_s(self, now_s: float) -> float:
        """When its last prefill and its last running decode end."""
        return max([now_s, self.prefill_free_s] + [r.finish_s for r in self.running])


@dataclass
class ReconfigEvent:
    reconfig: Reconfiguration
    planned_s: float
    drain_end_s: float = math.nan
    done_s: float = math.nan
    phase: Phase = Phase.PLANNED
    migrated: int = 0  # running decodes moved by KV hand-off
    rerouted: int = 0  # requests with no token yet placed again elsewhere


@dataclass
class DayResult:
    mode: str
    records: list[RequestRecord]
    summary: Summary
    reconfigs: list[ReconfigEvent]
    placements: list[tuple[float, str]]  # (time, placement label) each time it changed
    lost: int  # requests still running on an instance when it was removed: must be 0
    migrated: int
    counters: dict[str, int] = field(default_factory=dict)  # the balancer's decisions by reason
    decisions: list[tuple[float, str, str]] = field(default_factory=list)
    wall_s: float = 0.0
    initial: tuple[InstanceConfig, ...] = ()  # the placement it started from
    layouts: list[tuple[float, tuple[InstanceConfig, ...]]] = field(default_factory=list)  # (time, placement)
    forward_rankings: int = 0  # times the balancer's forward ranker played its candidates forward
    forward_moves: int = 0  # candidate moves (hold included) it played forward


def label_of(instances: Sequence[InstanceConfig]) -> str:
    parts = []
    for model in sorted({i.model for i in instances}):
        counts: dict[tuple[int, str], int] = {}
        for i in instances:
            if i.model == model:
                counts[(i.tp, i.role.value[0].upper())] = counts.get((i.tp, i.role.value[0].upper()), 0) + 1
        parts.append(f"{model} " + " ".join(f"TP{tp}{role}x{n}" for (tp, role), n in sorted(counts.items(), reverse=True)))
    return " | ".join(parts)


def demand_of(requests: Sequence[DayRequest], models: Sequence[str], start_s: float, end_s: float,
              bins: int = 5) -> tuple[ModelDemand, ...]:
    """Per-model windowed demand of `requests` arriving in [start_s, end_s): rate, trend over `bins` sub-windows,
    the recent rate and its step score (`step_score`: the last two sub-windows against the earlier ones), mean
    lengths."""
    span = max(end_s - start_s, 1e-9)
    out = []
    for m in models:
        reqs = [r for r in requests if r.model == m and start_s <= r.arrival_s < end_s]
        counts = [0] * bins
        for r in reqs:
            counts[min(bins - 1, int((r.arrival_s - start_s) / span * bins))] += 1
        trend = demand_trend([(start_s + (k + 0.5) * span / bins, c / (span / bins)) for k, c in enumerate(counts)])
        prompt = sum(r.prompt_tokens for r in reqs) / len(reqs) if reqs else 1000.0
        output = sum(r.output_tokens for r in reqs) / len(reqs) if reqs else 250.0
        recent, z = step_score(counts, span / bins)
        out.append(ModelDemand(m, len(reqs) / span, trend, prompt, output, recent_rps=recent, step_z=z))
    return tuple(out)


model_alone_rps = alone_capacity_rps  # the req/s a model would serve with the whole node to itself


def best_layout(capacity: CapacityModel, layouts: Sequence[Sequence[InstanceConfig]],
                demand: Sequence[ModelDemand], weights: dict[str, float] | None = None) -> tuple[InstanceConfig, ...]:
    """The layout with the highest forecast score for `demand` among those that give every model some capacity
    (`unserved`), as the balancer chooses (ties: the first)."""
    d = {x.model: x for x in demand}
    scored = [(placement_goodput_rps(capacity, l, d, 0.0, weights), l) for l in layouts]
    serving = [(g, l) for (g, caps), l in scored if not unserved(caps)] or [(g, l) for (g, _), l in scored]
    return tuple(max(serving, key=lambda x: x[0])[1])


class ElasticSim:
    def __init__(self, node: NodeConfig, profile: DayProfile, requests: Sequence[DayRequest],
                 placement: Sequence[InstanceConfig], *, mode: str = "static",
                 policy: BalancerPolicy = BalancerPolicy(), layouts: Sequence[Sequence[InstanceConfig]] | None = None,
                 period_s: float = 2.0, window_s: float = 10.0, itl_target_fraction: float = 0.9,
                 max_migration_pause_s: float = 1.0, progress: Callable[[float], None] | None = None,
                 oracle_trials: int = ORACLE_TRIALS, oracle_extra: Sequence[Sequence[InstanceConfig]] = (),
                 ranker: str = "none", seed: int = 0) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if ranker not in RANKERS:
            raise ValueError(f"ranker must be one of {RANKERS}, got {ranker!r}")
        self.node, self.profile, self.requests, self.mode = node, profile, list(requests), mode
        self.models = sorted(node.models)
        self.slo = profile.slo
        self.itl_target_s = profile.itl_slo_ms / 1000.0 * itl_target_fraction
        self.period_s, self.window_s = period_s, window_s
        self.max_migration_pause_s = max_migration_pause_s
        self.oracle_trials, self.oracle_extra = oracle_trials, [tuple(l) for l in oracle_extra]
        self.layouts = [tuple(l) for l in layouts] if layouts is not None else candidate_layouts(node)
        self.capacity = CapacityModel(node, itl_target_fraction)
        self.policy = policy
        self.weights = objective_weights(node, policy.objective)  # the oracle scores placements as the balancer does
        # The balancer's forward ranker ("forward": services/sim/forward_ranker.py), seeded for its arrivals.
        self.ranker = ForwardSimRanker(self, seed, policy.forward_window_s) if ranker == "forward" and mode == "elastic" else None
        self.balancer = ElasticBalancer(node, policy, self.layouts, self.ranker) if mode == "elastic" else None
        self.progress = progress
        self.now_s = 0.0
        mean = self._mean_lengths(0.0)
        self.instances: dict[str, SimInstance] = {c.id: SimInstance(node, c, 0.0, mean[c.model], self.itl_target_s)
                                            for c in placement}
        self.reconfigs: list[ReconfigEvent] = []
        self.initial = tuple(placement)
        self.placements: list[tuple[float, str]] = [(0.0, label_of(placement))]
        self.layout_log: list[tuple[float, tuple[InstanceConfig, ...]]] = [(0.0, tuple(placement))]
        self.trackers: list[SimRequest] = []
        self.refused: list[DayRequest] = []
        self.lost = 0
        self.migrated = 0
        self.migration_reasons: Counter[str] = Counter()  # drain-or-migrate decisions by reason (core/migration.py)

    # - helpers -

    def _mean_lengths(self, now_s: float) -> dict[str, tuple[float, float]]:
        """Per model, the mean (prompt, output) of the arrivals in the last window (the whole day's first window at 0)."""
        lo, hi = (now_s - self.window_s, now_s) if now_s > 0 else (0.0, self.window_s)
        out = {}
        for m in self.models:
            reqs = [r for r in self._window(lo, hi) if r.model == m]
            out[m] = ((sum(r.prompt_tokens for r in reqs) / len(reqs), sum(r.output_tokens for r in reqs) / len(reqs))
                      if reqs else (1000.0, 250.0))
        return out

    def _window(self, lo: float, hi: float) -> list[DayRequest]:
        import bisect  # noqa: PLC0415

        if not hasattr(self, "_arrivals"):
            self._arrivals = [r.arrival_s for r in self.requests]
        return self.requests[bisect.bisect_left(self._arrivals, lo):bisect.bisect_left(self._arrivals, hi)]

    def _current_configs(self) -> dict[str, InstanceConfig]:
        return {i: inst.cfg for i, inst in self.instances.items()}

    # - admission and routing -

    def _admit(self, req: DayRequest) -> None:
        tr = SimRequest(req)
        if self._place(tr, req.arrival_s, force=False):
            self.trackers.append(tr)
        else:
            self.refused.append(req)

    def _place(self, tr: SimRequest, t: float, *, force: bool) -> bool:
        """Put `tr` on the instance (pair) with the earliest first token from `t`. Unless `force` (a request already
        admitted, placed again), refuse when its predicted TTFT or TPOT misses the SLO."""
        req = tr.req
        best = None
        decoders = [i for i in self.instances.values()
                    if i.accepting and i.cfg.model == req.model and i.cfg.role is Role.DECODE and i.heap]
        for e in self.instances.values():
            if not (e.accepting and e.cfg.model == req.model and e.prefills):
                continue
            begin = max(t, e.prefill_free_s)
            first = begin + req.prompt_tokens / e.prefill_tok_s  # its chunks run at full speed...
            busy_until = begin + req.prompt_tokens / e.prefill_rate  # ... but hold the server for its share
            if e.cfg.role is Role.COLOCATED:
                if not e.heap:
                    continue
                d, xfer = e, 0.0
            else:
                if not decoders:
                    continue
                d = min(decoders, key=lambda x: x.heap[0])
                xfer = e.cost.kv_transfer_time_s(req.prompt_tokens)
            start = max(first + xfer, d.heap[0])
            finish = start + (req.output_tokens - 1) * d.tau_s if req.output_tokens > 1 else first
            key = (first, finish)
            if best is None or key < best[0]:
                best = (key, e, d, start, begin, busy_until)
        if best is None:
            if force:
                raise AssertionError(f"{req.request_id}: no instance of {req.model} takes requests")
            return False
        (first, finish), e, d, start, begin, busy_until = best
        tpot = (finish - first) / (req.output_tokens - 1) if req.output_tokens > 1 else 0.0
        if not force and ((first - req.arrival_s) * 1000.0 > req.ttft_slo_ms or tpot * 1000.0 > self.slo.itl_ms):
            return False
        tr.first_s, tr.decode_start_s, tr.finish_s = first, start, finish
        tr.prefill_begin_s, tr.busy_until_s = begin, busy_until
        tr.entry, tr.decoder, tr.tau_s = e.cfg.id, d.cfg.id, d.tau_s
        tr.entry_inst, tr.decoder_inst = e, d
        e.prefill_free_s = busy_until
        heapq.heapreplace(d.heap, finish)
        d.running.append(tr)
        e.queued.append(tr)
        return True

    def _unplace(self, tr: SimRequest) -> None:
        """Take back a request that has no token yet: free its prefill turn and its decode slot."""
        e, d = tr.entry_inst, tr.decoder_inst
        if e is not None:
            e.queued.remove(tr)
            e.prefill_free_s = max([self.now_s] + [x.busy_until_s for x in e.queued])
        if d is not None:
            d.running.remove(tr)
            if tr.finish_s in d.heap:  # the slot is free again from when this request would have taken it
                d.heap[d.heap.index(tr.finish_s)] = max(self.now_s, tr.decode_start_s)
                heapq.heapify(d.heap)

    def _reroute(self, retiring: set[str]) -> int:
        """Requests with no token yet whose prefill or decode was to run on a retiring instance are placed again on
        the instances that still take requests (as the router does for an instance that goes away)."""
        now = self.now_s
        moved = []
        for iid in retiring:
            inst = self.instances[iid]
            for tr in inst.queued + inst.running:
                if tr.first_s > now and tr.prefill_begin_s >= now and tr not in moved:
                    moved.append(tr)
        for tr in sorted(moved, key=lambda x: x.req.arrival_s):
            self._unplace(tr)
        for tr in sorted(moved, key=lambda x: x.req.arrival_s):
            self._place(tr, now, force=True)
            tr.reroutes += 1
        return len(moved)

    # - reconfigurations -

    def _start(self, r: Reconfiguration) -> ReconfigEvent:
        if r.in_place:  # nothing drains: the instance serves in its old role until the switch is done
            ev = ReconfigEvent(r, self.now_s, drain_end_s=self.now_s, done_s=self.now_s + self.policy.role_switch_s,
                               phase=Phase.SWITCHING)
            self.reconfigs.append(ev)
            return ev
        ev = ReconfigEvent(r, self.now_s, phase=Phase.DRAINING)
        for iid in r.retire:
            self.instances[iid].accepting = False
        ev.rerouted = self._reroute(set(r.retire))
        for iid in r.retire:
            ev.migrated += self._migrate_out(self.instances[iid], set(r.retire))
        ev.drain_end_s = max(self.instances[i].drain_end_s(self.now_s) for i in r.retire)
        self.reconfigs.append(ev)
        return ev

    def _migrate_out(self, inst: SimInstance, retiring: set[str]) -> int:
        """KV hand-off of `inst`'s running decodes to other instances of its model, when faster than finishing."""
        now = self.now_s
        inst.running = [x for x in inst.running if x.finish_s > now]
        targets = [i for i in self.instances.values() if i.accepting and i.cfg.id not in retiring
                   and i.cfg.model == inst.cfg.model and i.decodes and i.heap]
        moved = 0
        keep = []
        for tr in sorted(inst.running, key=lambda x: -x.finish_s):
            started = max(now, tr.decode_start_s)
            remaining_s = tr.finish_s - started
            done_tokens = max(0, int((now - tr.decode_start_s) / tr.tau_s)) if now > tr.decode_start_s else 0
            xfer = inst.cost.kv_transfer_time_s(tr.req.prompt_tokens + done_tokens)
            target = min(targets, key=lambda x: x.heap[0], default=None)
            if target is None:
                self.migration_reasons[migration.NO_TARGET] += 1
                keep.append(tr)
                continue
            new_start = max(now + xfer, target.heap[0], tr.decode_start_s)
            pause_s = new_start - started  # the gap the hand-off adds to this request's stream
            out = max(1, tr.req.output_tokens - 1)
            tpot_slack_s = (self.slo.itl_ms / 1000.0 - (tr.finish_s - tr.first_s) / out) * out  # its TPOT's room
            # The target's step with the request added: this model's decode slots each take the step of the full
            # slot batch (`tau_s`, sized to the ITL target), so a request that takes a free slot, or waits for one
            # (`pause_s`), adds nothing beyond it; the check refuses only a target whose full batch misses the SLO.
            reason = migration.decide(remaining_s, xfer, pause_s, max_pause_s=self.max_migration_pause_s,
                                      tpot_slack_s=tpot_slack_s, target_step_s=target.tau_s,
                                      itl_budget_s=self.slo.itl_ms / 1000.0)
            self.migration_reasons[reason] += 1
            if reason != migration.MIGRATE:
                keep.append(tr)
                continue
            new_finish = tr.finish_s + pause_s + remaining_s / tr.tau_s * (target.tau_s - tr.tau_s)
            heapq.heapreplace(target.heap, new_finish)
            tr.finish_s, tr.decoder, tr.tau_s = new_finish, target.cfg.id, target.tau_s
            tr.decoder_inst = target
            tr.decode_start_s = new_start
            tr.migrations += 1
            target.running.append(tr)
            moved += 1
        inst.running = keep
        self.migrated += moved
        return moved

    def _advance_reconfigs(self, until_s: float) -> None:
        for ev in self.reconfigs:
            r = ev.reconfig
            if ev.phase is Phase.DRAINING:
                # Nothing joins a draining instance, so its drain end only stands (finished requests are forgotten
                # by `_tick`, which must not pull it earlier).
                ev.drain_end_s = max([ev.drain_end_s] + [self.instances[i].drain_end_s(ev.planned_s) for i in r.retire])
                if ev.drain_end_s <= until_s:
                    ev.phase = advance(ev.phase, Phase.SWITCHING)
                    for iid in r.retire:
                        self.instances.pop(iid).removed_s = ev.drain_end_s
                    ev.done_s = ev.drain_end_s + (r.load_s if r.kind is ReconfigKind.MODEL else self.policy.role_switch_s)
            if ev.phase is Phase.SWITCHING and ev.done_s <= until_s:
                ev.phase = advance(ev.phase, Phase.DONE)
                mean = self._mean_lengths(ev.done_s)
                for c in r.start:
                    if r.in_place:
                        self.instances[c.id].switch_role(c, ev.done_s, mean[c.model])
                    else:
                        self.instances[c.id] = SimInstance(self.node, c, ev.done_s, mean[c.model], self.itl_target_s)
                self._placed(ev.done_s)

    def _placed(self, t_s: float) -> None:
        configs = tuple(i.cfg for i in self.instances.values())
        self.placements.append((t_s, label_of(configs)))
        self.layout_log.append((t_s, configs))

    def _in_flight(self) -> list[Reconfiguration]:
        return [ev.reconfig for ev in self.reconfigs if ev.phase in IN_FLIGHT]

    def _node_load(self) -> NodeLoad:
        now = self.now_s
        placement = [i.cfg for i in self.instances.values()]
        loads = []
        for inst in self.instances.values():
            backlog_s = max(0.0, inst.prefill_free_s - now)
            decoding = sum(1 for x in inst.running if x.decode_start_s <= now < x.finish_s)
            loads.append(InstanceLoad(
                inst.cfg.id, prefill_backlog_tokens=backlog_s * inst.prefill_rate,
                ttft_slack_s=self.profile.ttft_slo_ms / 1000.0 - backlog_s, decode_batch=decoding,
                decode_batch_limit=len(inst.heap), kv_used=decoding / max(1, len(inst.heap)),
                itl_headroom=1.0 - inst.tau_s * 1000.0 / self.slo.itl_ms, accepting=inst.accepting,
                running=sum(1 for x in inst.running if x.finish_s > now), est_drain_s=inst.drain_end_s(now) - now))
        lo = max(0.0, now - self.window_s)
        demand = demand_of(self._window(now - self.window_s, now), self.models, lo, now)
        # What was measured: the requests refused in the window, per model (the router's refusal counts live), so
        # the balancer can correct its estimate by what the placement served (`Corrections`).
        refused: dict[str, int] = {}
        for r in reversed(self.refused):
            if r.arrival_s < lo:
                break
            if r.arrival_s < now:
                refused[r.model] = refused.get(r.model, 0) + 1
        span = max(now - lo, 1e-9)
        demand = tuple(dataclasses.replace(d, refused_rps=refused.get(d.model, 0) / span) for d in demand)
        return NodeLoad(self.window_s, tuple(placement), tuple(loads), demand)

    def _oracle_switch(self, hour: int) -> None:
        h = self.profile.hour_s
        demand = demand_of(self._window(hour * h, (hour + 1) * h), self.models, hour * h, (hour + 1) * h)
        target = best_layout(self.capacity, self.layouts, demand, self.weights)
        if self.oracle_trials > 0 and self._window(hour * h, (hour + 1) * h):
            target = self._oracle_measured(hour, demand, target)
        current = {(c.model, c.role, c.tp, c.gpu_ids): iid for iid, c in self._current_configs().items()}
        mean = self._mean_lengths(self.now_s)
        new: dict[str, SimInstance] = {}
        for c in target:
            iid = current.get((c.model, c.role, c.tp, c.gpu_ids))
            new[c.id] = self.instances[iid] if iid is not None else SimInstance(self.node, c, self.now_s, mean[c.model],
                                                                          self.itl_target_s)
        # Zero switching cost: the replaced instances' running requests finish as planned (they are not lost).
        if set(new) != set(self.instances) or any(new[k] is not self.instances.get(k) for k in new):
            self.instances = new
            self._placed(self.now_s)

    def _oracle_measured(self, hour: int, demand: Sequence[ModelDemand], pick: Sequence[InstanceConfig]
                         ) -> tuple[InstanceConfig, ...]:
        """The oracle's hour by measurement: the candidates (module doc) each simulated over the hour, the best
        score (the objective's weights over the per-model goodput) taken; ties keep the estimate's order."""
        h = self.profile.hour_s
        d = {x.model: x for x in demand}
        scored = [(placement_goodput_rps(self.capacity, l, d, 0.0, self.weights), l) for l in self.layouts]
        ranked = [l for (g, caps), l in sorted(scored, key=lambda x: -x[0][0]) if not unserved(caps)]
        current = tuple(i.cfg for i in self.instances.values())
        cands: list[tuple[InstanceConfig, ...]] = []
        for l in [tuple(pick), *ranked[:self.oracle_trials], *self.oracle_extra, current]:
            if l and not unserved(placement_goodput_rps(self.capacity, l, d, 0.0)[1]) and \
                    _layout_key(l) not in {_layout_key(c) for c in cands}:
                cands.append(l)
        if len(cands) < 2:
            return tuple(pick)
        reqs = self._window(hour * h - self.window_s, (hour + 1) * h)
        best, best_score = tuple(pick), -math.inf
        for l in cands:
            sim = ElasticSim(self.node, self.profile, reqs, l, mode="static", layouts=self.layouts,
                             period_s=self.period_s, window_s=self.window_s, oracle_trials=0)
            res = sim.run()
            summary = summarize(res.records, self.slo, Window(hour * h, (hour + 1) * h))
            score = sum(self.weights.get(g.name, 1.0) * g.goodput_rps for g in summary.per_model)
            if score > best_score + 1e-9:
                best, best_score = l, score
        return best

    # - the run -

    def _tick(self, t_s: float) -> None:
        """Periodic work at `t_s`: forget finished work, rebalance colocated shares, re-plan (oracle at hours,
        elastic each period)."""
        self.now_s = t_s
        for inst in self.instances.values():
            inst.queued = [x for x in inst.queued if x.busy_until_s > t_s or x.first_s > t_s]
            inst.running = [x for x in inst.running if x.finish_s > t_s]
        self._advance_reconfigs(t_s)
        if self.mode == "oracle" and abs(t_s / self.profile.hour_s - round(t_s / self.profile.hour_s)) < 1e-9:
            self._oracle_switch(round(t_s / self.profile.hour_s))
        mean = self._mean_lengths(t_s)
        for inst in self.instances.values():
            inst.rebalance(t_s, mean[inst.cfg.model])
        if self.mode == "elastic" and t_s >= self.window_s:
            for r in self.balancer.plan(t_s, self._node_load(), self._in_flight()):
                self._start(r)

    def run(self) -> DayResult:
        wall0 = time.perf_counter()
        next_tick = 0.0
        step = self.period_s if self.mode == "elastic" else min(self.period_s, self.profile.hour_s)
        if self.mode == "oracle":
            step = math.gcd(int(self.period_s * 1000), int(self.profile.hour_s * 1000)) / 1000.0
        for req in self.requests:
            while next_tick <= req.arrival_s:
                self._tick(next_tick)
                next_tick = round(next_tick + step, 9)
                if self.progress:
                    self.progress(next_tick)
            self.now_s = req.arrival_s
            self._advance_reconfigs(req.arrival_s)
            self._admit(req)
        # Drain: let the in-flight reconfigurations finish.
        end = max([self.profile.duration_s] + [tr.finish_s for tr in self.trackers])
        self.now_s = end
        self._advance_reconfigs(end + 3600.0)
        return self._result(time.perf_counter() - wall0)

    def _result(self, wall_s: float) -> DayResult:
        # Lost: a request whose prefill or decode instance was taken away before that work was done. Counted from
        # the requests' own times and the instances' removal times, independently of the drain bookkeeping.
        self.lost = sum(1 for tr in self.trackers
                        if tr.entry_inst.removed_s < tr.first_s or tr.decoder_inst.removed_s < tr.finish_s)
        records = [day_record(tr.req, first_token_s=tr.first_s, finish_s=tr.finish_s) for tr in self.trackers]
        records += [day_record(r, refused=True) for r in self.refused]
        records.sort(key=lambda r: r.arrival_s)
        # A day has no steady state by design: the warm-up is stated (one compressed hour), and `steady` says so.
        window = detect_window(occupancy(records), self.profile.duration_s, warmup_s=self.profile.hour_s)
        summary = summarize(records, self.slo, window)
        counters = dict(self.balancer.counters) if self.balancer else {}
        decisions = [(d.now_s, d.reason, d.detail) for d in self.balancer.log] if self.balancer else []
        ranked = (self.ranker.calls, self.ranker.simulated) if self.ranker else (0, 0)
        return DayResult(self.mode, records, summary, self.reconfigs, self.placements, self.lost, self.migrated,
                         counters, decisions, wall_s, self.initial, self.layout_log, *ranked)


def _layout_key(layout: Sequence[InstanceConfig]) -> tuple:
    return tuple(sorted((i.model, i.role.value, i.tp, i.gpu_ids) for i in layout))


def occupancy(records: Sequence[RequestRecord], step_s: float = 1.0) -> list[tuple[float, float]]:
    """Requests admitted and not finished, sampled every `step_s`."""
    events = []
    for r in records:
        if r.completed and r.finish_s is not None:
            events.append((r.arrival_s, 1))
            events.append((r.finish_s, -1))
    events.sort()
    out, level, k = [], 0, 0
    end = max((t for t, _ in events), default=0.0)
    t = 0.0
    while t <= end:
        while k < len(events) and events[k][0] <= t:
            level += events[k][1]
            k += 1
        out.append((t, float(level)))
        t += step_s
    return out


def run_day(node: NodeConfig, profile: DayProfile, requests: Sequence[DayRequest],
            placement: Sequence[InstanceConfig], mode: str, **kwargs) -> DayResult:
    return ElasticSim(node, profile, requests, placement, mode=mode, **kwargs).run()
