"""The balancer's forward ranker in the elastic simulator: candidate moves played forward from the node's state.

`ForwardSimRanker.forecast` (the `ForwardRanker` protocol of services/core/balancer.py) answers, for "hold" and
each candidate move, what the node would serve over the next `horizon_s` if it made that move now:
- the state is cloned (`fork`): every instance's prefill queue, decode slots and running requests, and the
  reconfigurations in flight (their drain, switch or load continuing); the live simulator is never touched;
- the move's changes start at once where the balancer's guards allow (at most `max_in_flight` in flight, every
  model still taking requests), the rest as soon as they are allowed, each paying its drain (or KV hand-off),
  its load or role switch, exactly as the live simulator carries a reconfiguration out;
- every candidate serves the same forecast arrivals (common random numbers): Poisson at the balancer's forecast
  rate per model, the arrival x seconds ahead taking the lengths and SLO of one of that model's arrivals near
  x seconds into the last `window_s` (a persistence forecast: the window plays again in order, so demand that
  alternates within it, prefill-heavy and decode-heavy phases, is forecast in its order), drawn from a
  `random.Random` seeded by (`seed`, the call's time), so a call is deterministic and hold and the moves differ
  only by what they do;
- until one load window (the simulator's `window_s`) of arrivals has been seen, every move scores 0 (no
  evidence: the balancer holds); until a whole `window_s` of the ranker's has, it replays what there is;
- the score is the goodput of those arrivals (the objective's weights): requests admitted whose TTFT and TPOT meet
  the SLOs, per second of the horizon.

Requests already on the node count in no score: hold and a move serve them alike, except where a drain hands some
off (whose pause the hand-off rule keeps within their TPOT's room).
"""

from __future__ import annotations

import bisect
import copy
import dataclasses
import math
import random
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from octoserve.services.core.balancer import MoveCandidate
from octoserve.services.core.elastic_layouts import orphaned_by
from octoserve.services.core.reconfig import Phase, Reconfiguration
from octoserve.services.core.day_request import DayRequest

if TYPE_CHECKING:
    from octoserve.services.sim.elastic_sim import ElasticSim, SimInstance, SimRequest


REPLAY_NEIGHBOURS = 3  # a forecast arrival takes the lengths of one of the 2 x this + 1 past ones nearest its offset


class ForwardSimRanker:
    name = "forward"

    def __init__(self, sim: "ElasticSim", seed: int = 0, window_s: float | None = None) -> None:
        self.sim = sim
        self.seed = seed
        self.window_s = sim.window_s if window_s is None else window_s  # where the arrivals' lengths are drawn from
        self.calls = 0  # forecasts asked
        self.simulated = 0  # candidate moves played forward

    def forecast(self, now_s: float, moves: Sequence[MoveCandidate], rates_rps: Mapping[str, float],
                 horizons_s: Sequence[float]) -> list[list[float]]:
        if now_s < self.sim.window_s:  # not yet one load window of arrivals to draw from: no evidence, hold
            return [[0.0] * len(horizons_s) for _ in moves]
        self.calls += 1
        arrivals = self.arrivals(now_s, rates_rps, max(horizons_s))
        past = self.sim._window(now_s - self.sim.window_s, now_s)
        out = []
        for move in moves:
            out.append(play_forward(self.sim, move.changes, arrivals, past, now_s, horizons_s))
            self.simulated += 1
        return out

    def arrivals(self, now_s: float, rates_rps: Mapping[str, float], horizon_s: float) -> list[DayRequest]:
        """The forecast arrivals over [now_s, now_s + horizon_s): the same for every move of one call."""
        rng = random.Random(self.seed * 1_000_003 + round(now_s * 1000))
        span = min(self.window_s, now_s)  # early in a run, what has been seen so far
        lo = now_s - span
        recent = self.sim._window(lo, now_s)
        out: list[DayRequest] = []
        for model in sorted(rates_rps):
            pool = [r for r in recent if r.model == model]
            times = [r.arrival_s for r in pool]
            rate = rates_rps[model]
            if not pool or rate <= 0:
                continue
            t = now_s + rng.expovariate(rate)
            while t < now_s + horizon_s:
                # Persistence: the arrival x seconds ahead is like one of those that came x seconds into the window
                # (one of the `REPLAY_NEIGHBOURS` nearest), so a pattern within the window plays again in order.
                k = bisect.bisect_left(times, lo + (t - now_s) % span)
                k = min(len(pool) - 1, max(0, k + rng.randint(-REPLAY_NEIGHBOURS, REPLAY_NEIGHBOURS)))
                out.append(dataclasses.replace(pool[k], request_id=f"fw-{model}-{len(out)}", arrival_s=t))
                t += rng.expovariate(rate)
        out.sort(key=lambda r: r.arrival_s)
        return out


def fork(sim: "ElasticSim", requests: Sequence[DayRequest]) -> "ElasticSim":
    """A copy of `sim` at its current time that serves `requests` (sorted; those before now only feed the mean
    lengths) and shares nothing mutable with it: instances, their queues and running requests, and the
    reconfigurations not yet DONE are cloned; finished work and the day's records are left behind."""
    twin = copy.copy(sim)
    memo: dict[int, object] = {}
    twin.instances = {iid: _clone_inst(inst, memo) for iid, inst in sim.instances.items()}
    twin.reconfigs = [dataclasses.replace(ev) for ev in sim.reconfigs if ev.phase is not Phase.DONE]
    twin.requests = list(requests)
    twin._arrivals = [r.arrival_s for r in twin.requests]
    twin.trackers, twin.refused = [], []
    twin.placements, twin.layout_log = [], []
    twin.lost = twin.migrated = 0
    twin.migration_reasons = Counter()
    twin.mode, twin.balancer, twin.progress = "static", None, None
    return twin


def _clone_inst(inst: "SimInstance", memo: dict[int, object]) -> "SimInstance":
    if id(inst) in memo:
        return memo[id(inst)]
    twin = copy.copy(inst)  # shares the config, the cost model and the batch-size memo (read-only here)
    memo[id(inst)] = twin
    twin.heap = list(inst.heap)
    twin.running = [_clone_req(r, memo) for r in inst.running]
    twin.queued = [_clone_req(r, memo) for r in inst.queued]
    return twin


def _clone_req(req: "SimRequest", memo: dict[int, object]) -> "SimRequest":
    if id(req) in memo:
        return memo[id(req)]
    twin = copy.copy(req)
    memo[id(req)] = twin
    # The instances it is on: clones too (an instance already gone from the node is cloned on the way, so that
    # nothing the fork does can reach the live one).
    if req.entry_inst is not None:
        twin.entry_inst = _clone_inst(req.entry_inst, memo)
    if req.decoder_inst is not None:
        twin.decoder_inst = _clone_inst(req.decoder_inst, memo)
    return twin


def play_forward(sim: "ElasticSim", changes: Sequence[Reconfiguration], arrivals: Sequence[DayRequest],
                 past: Sequence[DayRequest], now_s: float, horizons_s: Sequence[float]) -> list[float]:
    """What a fork of `sim` making `changes` from `now_s` serves within the SLOs of the `arrivals` over each
    horizon, weighted by the objective, per second of that horizon (module doc)."""
    twin = fork(sim, [*past, *arrivals])
    pending = list(changes)
    _start_allowed(twin, pending)
    next_tick = (math.floor(now_s / sim.period_s + 1e-9) + 1) * sim.period_s
    for req in arrivals:
        while next_tick <= req.arrival_s:
            twin._tick(next_tick)
            _start_allowed(twin, pending)
            next_tick = round(next_tick + sim.period_s, 9)
        twin.now_s = req.arrival_s
        twin._advance_reconfigs(req.arrival_s)
        twin._admit(req)
    itl_ms = sim.slo.itl_ms
    good = [0.0] * len(horizons_s)
    for tr in twin.trackers:
        req = tr.req
        tpot_ms = (tr.finish_s - tr.first_s) / (req.output_tokens - 1) * 1000.0 if req.output_tokens > 1 else 0.0
        if (tr.first_s - req.arrival_s) * 1000.0 <= req.ttft_slo_ms and tpot_ms <= itl_ms:
            for k, h in enumerate(horizons_s):
                if req.arrival_s < now_s + h:
                    good[k] += sim.weights.get(req.model, 1.0)
    return [g / h if h > 0 else 0.0 for g, h in zip(good, horizons_s)]


def _start_allowed(twin: "ElasticSim", pending: list[Reconfiguration]) -> None:
    """Start the pending changes the balancer's guards would let start now: at most `max_in_flight` in flight,
    their instances all present and taking requests, their models still served by the rest."""
    for r in list(pending):
        if len(twin._in_flight()) >= twin.policy.max_in_flight:
            return
        insts = twin.instances
        if not all(i in insts and insts[i].accepting for i in r.retire):
            continue
        rest = [inst.cfg for iid, inst in insts.items() if inst.accepting and iid not in r.retire]
        if orphaned_by([insts[i].cfg for i in r.retire], r.start, rest, r.in_place):
            continue
        twin._start(r)
        pending.remove(r)
