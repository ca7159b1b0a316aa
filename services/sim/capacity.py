"""SLO capacity by multi-seed bisection, and the two rankings of placements, shared by `plan` and `bench-suite`.

Definitions (docs/BENCHMARKS_METHOD.md):
- a run *passes* at a rate when >= 90 % of its OFFERED requests are good under DistServe's per-request definition
  (refused = miss) AND the seed's literal fleet SLO holds: TTFT P95 over admitted < the TTFT SLO and pooled
  per-token ITL P95 < the ITL SLO (`passes`); *per model* (`passes_per_model`, the criterion placements are ranked
  by): every model's own requests pass against that model's own SLOs, so the 8B's volume cannot hide the 70B;
- a probe is one rate run under N seeds (the seed changes the trace); it passes when a majority of its seeds pass;
- SLO capacity is the highest probed rate that passes, found by bisection inside a bracket [lo, hi): lo passes
  (or is 0), hi fails (or is the proven ceiling roofline / 0.9, above which 90 % of offered cannot be good).
  Its spread is the capacity per seed: for each seed, the highest probed rate it passes with every lower probe
  passing too.

`bisect_capacity` drives any number of searches step by step through a `run_step` function, so the suite can run
one step's probes of every policy and seed together in its process pool and tests can pass a fake.
`measured_run` is the one place a simulation's summary is restricted to its steady-state measurement window.

Invariants: a search's bracket only narrows; the result depends only on what `run_step` returns; ties in the
rankings are broken by label, so the order is fixed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, replace

CAPACITY_ATTAINMENT = 0.9  # of offered requests good (DistServe goodput, refused = miss)
# Simulated time after the last arrival, so every request admitted in the window is followed to its end: a request
# still running when the run stops counts as a miss, and a 70B output of 4,000 tokens at the pessimistic profile's
# ~27 ms a token runs 108 s. With 30 s the 70B's admitted requests at the seed-003 peak under the pessimistic
# profile read 90.5 % good, every miss a stream of 1,100-1,400 tokens cut off mid-decode (96.4 % with 120 s).
DRAIN_S = 120.0


def passes(group, slo=None, threshold: float = CAPACITY_ATTAINMENT) -> bool:
    """The capacity criterion on one metrics group (`octoserve.services.metrics.GroupStats`): `passes_capacity`. `slo` is
    unused (the group carries its fleet-SLO verdict) and kept for callers that pass it."""
    from octoserve.services.metrics import passes_capacity

    return passes_capacity(group, threshold)


def passes_per_model(summary, threshold: float = CAPACITY_ATTAINMENT) -> tuple[bool, float]:
    """The per-model criterion on one run's `Summary`: (every model passes `passes` on its own requests, the
    attainment of offered of its worst model)."""
    groups = summary.per_model
    return all(passes(g, threshold=threshold) for g in groups), min(g.attainment_offered for g in groups)


def measured_run(config, trace, *, seed: int, drain_s: float, warmup_s: float):
    """(SimResult, its Summary over the measurement window [warmup_s, last arrival])."""
    from octoserve.services.sim.driver import run_simulation

    res = run_simulation(config, trace, seed=seed, drain_s=drain_s, warmup_s=warmup_s)
    return res, res.summary


@dataclass(frozen=True, slots=True)
class Probe:
    rate_rps: float
    passed: tuple[bool, ...]  # per seed, in seed order
    attainment_offered: tuple[float, ...]  # per seed

    @property
    def passes(self) -> bool:
        return 2 * sum(self.passed) > len(self.passed)

    @property
    def attainment_spread(self) -> tuple[float, float, float]:
        """(min, mean, max) of the seeds' attainment of offered."""
        a = self.attainment_offered
        return min(a), sum(a) / len(a), max(a)


@dataclass(frozen=True, slots=True)
class CapacitySearch:
    lo: float  # passes (or 0)
    hi: float  # fails (or a proven ceiling; inf: nothing above lo is known to fail)
    probes: tuple[Probe, ...] = ()
    floor: float = 0.0  # the initial lo: every seed's capacity is at least this

    @property
    def capacity_rps(self) -> float:
        return self.lo

    def next_rate(self, min_gap_rps: float = 1.0) -> float | None:
        if math.isinf(self.hi) or self.hi - self.lo < min_gap_rps:
            return None
        return round((self.lo + self.hi) / 2.0, 1)

    def with_probe(self, probe: Probe) -> CapacitySearch:
        lo, hi = (probe.rate_rps, self.hi) if probe.passes else (self.lo, probe.rate_rps)
        return replace(self, lo=lo, hi=hi, probes=(*self.probes, probe))

    def per_seed_capacity(self) -> tuple[float, ...]:
        """Per seed: the highest probed rate it passes with every lower probed rate passing too (floor if none)."""
        if not self.probes:
            return ()
        out = []
        for s in range(len(self.probes[0].passed)):
            cap = self.floor
            for p in sorted(self.probes, key=lambda p: p.rate_rps):
                if not p.passed[s]:
                    break
                cap = p.rate_rps
            out.append(cap)
        return tuple(out)

    def spread(self) -> tuple[float, float, float]:
        """(min, median, max) of the per-seed capacities (the bracket's lo three times when nothing was probed)."""
        caps = sorted(self.per_seed_capacity()) or [self.lo]
        mid = len(caps) // 2
        median = caps[mid] if len(caps) % 2 else (caps[mid - 1] + caps[mid]) / 2.0
        return caps[0], median, caps[-1]


def start_search(points: Sequence[tuple[float, bool]], ceiling_rps: float = math.inf) -> CapacitySearch:
    """A search bracketed by (rate, passed) points: lo the highest passing rate with every lower point passing,
    hi the lowest failing rate above it, else `ceiling_rps`."""
    lo, hi = 0.0, ceiling_rps
    for rate, ok in sorted(points):
        if not ok:
            hi = min(hi, rate)
            break
        lo = rate
    return CapacitySearch(lo, hi, floor=lo)


RunStep = Callable[[Sequence[tuple[Hashable, float]]], Mapping[tuple[Hashable, float], Probe]]


def bisect_capacity(searches: Mapping[Hashable, CapacitySearch], run_step: RunStep, steps: int,
                    log: Callable[[str], None] = lambda _m: None) -> dict[Hashable, CapacitySearch]:
    """Up to `steps` bisection steps; each step asks `run_step` for one probe per unfinished search."""
    out = dict(searches)
    for step in range(steps):
        asks = [(key, rate) for key, s in out.items() if (rate := s.next_rate()) is not None]
        if not asks:
            break
        log(f"capacity bisection step {step + 1}/{steps}: {len(asks)} probes")
        probes = run_step(asks)
        for key, rate in asks:
            out[key] = out[key].with_probe(probes[(key, rate)])
    return out


@dataclass(frozen=True, slots=True)
class Recommendation:
    by_capacity: str  # label of the placement with the highest SLO capacity
    by_goodput: str  # label of the placement with the highest steady-state goodput at the offered rate


def rank_by_both(evaluated: Mapping[str, tuple[float, float]]) -> tuple[list[str], list[str], Recommendation]:
    """label -> (SLO capacity req/s, goodput req/s at the offered rate): (labels by capacity, labels by goodput,
    the two winners). Higher first, NaN last; a tie goes to the other criterion, then to the label."""

    def desc(v: float) -> tuple[bool, float]:
        return math.isnan(v), -v if not math.isnan(v) else 0.0

    def order(first: int) -> list[str]:
        return sorted(evaluated, key=lambda k: (*desc(evaluated[k][first]), *desc(evaluated[k][1 - first]), k))

    by_cap, by_goodput = order(0), order(1)
    return by_cap, by_goodput, Recommendation(by_cap[0], by_goodput[0])
