"""One request of a day's trace (services/workload_day.py), or of the recent demand a balancer replays: what the
elastic simulators and the balancers' forward rankers serve. Plain data; its metrics record is
`workload_day.day_record`."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class DayRequest:
    request_id: str
    arrival_s: float
    model: str
    prompt_tokens: int
    output_tokens: int
    ttft_slo_ms: float
    phase: str
