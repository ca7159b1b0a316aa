"""Time-varying workloads: a day of traffic whose model mix and lengths change, time-compressed.

`DayProfile` is a schedule: at each instant it gives the total rate, each model's share and each model's prompt and
output length distributions. `generate_day(profile, seed)` draws the arrivals (a Poisson process, thinned second by
second to the schedule) as light `DayRequest`s: the elastic simulator needs lengths and SLOs, not token ids.

The named day "mix-shift-day" (`DAY_PROFILES`), compressed `COMPRESSION` = 240x (one hour of the day is
`HOUR_S` = 15 simulated seconds, the day 360 s):
- the 8B share of requests follows 0.5 + 0.4 cos(2 pi h / 24): 90 % at hour 0, 10 % at hour 12, 90 % again at 24
  (the 70B share is the rest), at a constant total rate;
- a step change: from hour 18 to hour 21 the 8B share drops at once to 15 % (a burst of 70B traffic), then the
  curve resumes;
- a P/D phase from hour 3 to hour 9: every half hour (7.5 s) the traffic alternates between long prompts with short
  outputs (prefill-heavy: prompt mean 2,000, output mean 60) and short prompts with long outputs (decode-heavy:
  prompt mean 200, output mean 600). Outside it, prompts average 1,000 tokens and outputs 250 (lognormal,
  sigma 0.6).

Invariants: the trace is a pure function of (profile, seed); arrivals are sorted; every length is >= 1.
"""

from __future__ import annotations

import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

from octoserve.services.core.day_request import DayRequest
from octoserve.services.core.types import Priority
from octoserve.services.metrics import RequestRecord, SloSpec
from octoserve.services.workload import LengthDist, TraceRequest

SMALL, LARGE = "llama-3-8b", "llama-3-70b"
COMPRESSION = 240.0  # one real hour -> 15 simulated seconds
HOUR_S = 3600.0 / COMPRESSION


@dataclass(frozen=True, slots=True)
class Segment:
    """What arrives at one instant: total rate, per-model share and lengths."""

    rate_rps: float
    shares: tuple[tuple[str, float], ...]  # model -> share of requests (sums to 1)
    prompt: LengthDist
    output: LengthDist
    label: str = ""  # the phase it belongs to ("base", "step", "prefill-heavy", "decode-heavy")


@dataclass(frozen=True, slots=True)
class DayProfile:
    name: str
    duration_s: float
    schedule: Callable[[float], Segment]  # t_s -> what arrives then
    ttft_slo_ms: float = 250.0
    itl_slo_ms: float = 30.0
    step_s: float | None = None  # the step change's time, if the day has one
    hour_s: float = HOUR_S

    @property
    def slo(self) -> SloSpec:
        return SloSpec(self.ttft_slo_ms, self.itl_slo_ms)


def day_record(req: DayRequest, first_token_s: float | None = None, finish_s: float | None = None,
               refused: bool = False, error: str = "") -> RequestRecord:
    """The metrics record of one day request as served (or refused)."""
    return RequestRecord(
        request_id=req.request_id, model=req.model, priority=Priority.STANDARD, arrival_s=req.arrival_s,
        ttft_slo_ms=req.ttft_slo_ms, num_prompt_tokens=req.prompt_tokens,
        num_output_tokens=0 if refused else req.output_tokens, first_token_s=first_token_s, finish_s=finish_s,
        refused=refused, error=error,
    )


def generate_day(profile: DayProfile, seed: int = 0, *, start_s: float = 0.0,
                 end_s: float | None = None) -> list[DayRequest]:
    """Poisson arrivals at the schedule's rate, drawn second by second over [start_s, end_s)."""
    rng = random.Random(seed)
    end_s = profile.duration_s if end_s is None else end_s
    out: list[DayRequest] = []
    t0 = start_s
    while t0 < end_s:
        seg = profile.schedule(t0 + 0.5)
        t1 = min(t0 + 1.0, end_s)
        t = t0 + rng.expovariate(seg.rate_rps)
        models = [m for m, _ in seg.shares]
        cum = list(itertools.accumulate(s for _, s in seg.shares))
        while t < t1:
            u = rng.random() * cum[-1]
            model = models[next(i for i, c in enumerate(cum) if u < c)]
            out.append(DayRequest(f"d{len(out):07d}", t - start_s, model, max(1, seg.prompt.sample(rng)),
                                  max(1, seg.output.sample(rng)), profile.ttft_slo_ms, seg.label))
            t += rng.expovariate(seg.rate_rps)
        t0 = t1
    return out


# --- the named days ---------------------------------------------------------------------------------------------

BASE_PROMPT = LengthDist.lognormal(1000.0, 0.6, min_tokens=16, max_tokens=6000)
BASE_OUTPUT = LengthDist.lognormal(250.0, 0.6, min_tokens=1, max_tokens=2000)
PREFILL_HEAVY = (LengthDist.lognormal(2000.0, 0.5, min_tokens=64, max_tokens=6000),
                 LengthDist.lognormal(60.0, 0.5, min_tokens=1, max_tokens=500))
DECODE_HEAVY = (LengthDist.lognormal(200.0, 0.5, min_tokens=16, max_tokens=2000),
                LengthDist.lognormal(600.0, 0.5, min_tokens=1, max_tokens=3000))


def mix_shift_schedule(rate_rps: float, hour_s: float = HOUR_S, *, step: tuple[float, float, float] = (18, 21, 0.15),
                       pd_phase: tuple[float, float] = (3, 9),
                       load_rps: tuple[float, float] | None = None) -> Callable[[float], Segment]:
    """The mix-shift day's schedule. The 8B share s(t) is of requests at `rate_rps` when `load_rps` is None; with
    `load_rps` = (8B alone, 70B alone), the req/s each model would need the whole node for, s(t) is the 8B's share of
    the node's load instead: the 8B offers s x 8B-alone and the 70B (1 - s) x 70B-alone req/s, `rate_rps` unused."""
    step_from, step_to, step_share = step

    def at(t_s: float) -> Segment:
        h = t_s / hour_s
        small = 0.5 + 0.4 * math.cos(2 * math.pi * h / 24.0)
        label = "base"
        prompt, output = BASE_PROMPT, BASE_OUTPUT
        if step_from <= h < step_to:
            small, label = step_share, "step"
        if pd_phase[0] <= h < pd_phase[1]:
            heavy_prefill = int((h - pd_phase[0]) * 2) % 2 == 0
            prompt, output = PREFILL_HEAVY if heavy_prefill else DECODE_HEAVY
            label = "prefill-heavy" if heavy_prefill else "decode-heavy"
        if load_rps is None:
            return Segment(rate_rps, ((SMALL, small), (LARGE, 1.0 - small)), prompt, output, label)
        r_small, r_large = small * load_rps[0], (1.0 - small) * load_rps[1]
        total = r_small + r_large
        return Segment(total, ((SMALL, r_small / total), (LARGE, r_large / total)), prompt, output, label)

    return at


def mix_shift_day(rate_rps: float = 40.0, hours: float = 24.0, hour_s: float = HOUR_S,
                  load_rps: tuple[float, float] | None = None) -> DayProfile:
    """The mix-shift day (module doc); `load_rps` switches the mix from requests to load (`mix_shift_schedule`)."""
    name = "mix-shift-day" if load_rps is None else "mix-shift-day-load"
    return DayProfile(name, hours * hour_s, mix_shift_schedule(rate_rps, hour_s, load_rps=load_rps),
                      step_s=18 * hour_s if hours > 18 else None, hour_s=hour_s)


def pd_phase_day(rate_rps: float = 16.0, small_share: float = 0.5, hours: float = 8.0,
                 hour_s: float = HOUR_S) -> DayProfile:
    """Only the P/D phase, at a fixed model mix: prefill-heavy and decode-heavy traffic alternate every half hour."""
    def at(t_s: float) -> Segment:
        heavy_prefill = int(t_s / hour_s * 2) % 2 == 0
        prompt, output = PREFILL_HEAVY if heavy_prefill else DECODE_HEAVY
        return Segment(rate_rps, ((SMALL, small_share), (LARGE, 1.0 - small_share)), prompt, output,
                       "prefill-heavy" if heavy_prefill else "decode-heavy")

    return DayProfile("pd-phase", hours * hour_s, at, hour_s=hour_s)


DAY_PROFILES: dict[str, Callable[..., DayProfile]] = {"mix-shift-day": mix_shift_day, "pd-phase": pd_phase_day}


def day_trace(requests: list[DayRequest]) -> list[TraceRequest]:
    """The day's requests as the load harness sends them: distinct token prompts (no shared prefix)."""
    return [TraceRequest(r.request_id, r.arrival_s, r.model,
                         tuple(1000 + (n * 7919 + i * 31) % 30000 for i in range(r.prompt_tokens)),
                         r.output_tokens, r.output_tokens, Priority.STANDARD, r.ttft_slo_ms)
            for n, r in enumerate(requests)]
