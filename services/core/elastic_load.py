"""What the elastic balancer reads each balancing period, and the demand forecast's two statistics.

`NodeLoad` is built by the simulator or the live scheduler from the window's load reports and arrivals: per instance
(`InstanceLoad`) its prefill backlog against its TTFT slack, its decode batch and KV use against its ITL headroom;
per model (`ModelDemand`) the windowed arrival rate, its trend (`demand_trend`), the recent rate and its step score
(`step_score`) and the mean prompt and output lengths. How the balancer forecasts from them: services/core/balancer.py.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from octoserve.services.core.placement import InstanceConfig
from octoserve.services.core.planner import ModelLoad



@dataclass(frozen=True, slots=True)
class InstanceLoad:
    """One instance over the last window."""

    instance_id: str
    prefill_backlog_tokens: float = 0.0  # uncached prompt tokens waiting or in prefill
    ttft_slack_s: float = math.inf  # TTFT SLO minus the predicted TTFT of a request arriving now (< 0: late)
    decode_batch: int = 0  # running decodes
    decode_batch_limit: int = 0  # the largest batch whose step fits the ITL SLO (0: not a decoding instance)
    kv_used: float = 0.0  # fraction of its KV blocks in use
    itl_headroom: float = 1.0  # 1 - step time / ITL SLO over the window (< 0: steps overran)
    accepting: bool = True  # False while it drains for a reconfiguration
    running: int = 0  # requests admitted and not finished
    est_drain_s: float = 0.0  # until its last running request finishes, if it stopped taking requests now
    good_rps: float = 0.0  # requests it finished within their SLO per second over the window


@dataclass(frozen=True, slots=True)
class ModelDemand:
    """One model's demand over the last window."""

    model: str
    arrival_rps: float  # requests arriving per second (refused ones included)
    trend_rps_per_s: float = 0.0  # slope of the arrival rate over the window (`demand_trend`)
    mean_prompt_tokens: float = 1000.0
    mean_output_tokens: float = 400.0
    cached_fraction: float = 0.0  # share of prompt tokens the prefix cache served
    refused_rps: float = 0.0  # requests admission refused per second, every reason (the routers' reports live)
    recent_rps: float | None = None  # the rate over the window's last part (`step_score`); None: not measured
    step_z: float = 0.0  # how many standard errors the recent rate is off the earlier part's (`step_score`)

    def forecast_rps(self, horizon_s: float, step: bool = False) -> float:
        """Mean rate over the next `horizon_s` under a linear trend, never below 0; with `step` (a step change was
        seen) the recent rate, held flat: a ramp fitted across a step is neither the old level nor the new one."""
        if step and self.recent_rps is not None:
            return max(0.0, self.recent_rps)
        return max(0.0, self.arrival_rps + self.trend_rps_per_s * horizon_s / 2.0)

    def as_model_load(self, share: float) -> ModelLoad:
        return ModelLoad(self.model, share, max(1.0, self.mean_prompt_tokens), max(1.0, self.mean_output_tokens),
                         self.cached_fraction)


@dataclass(frozen=True, slots=True)
class NodeLoad:
    """What `ElasticBalancer.plan` reads each period."""

    window_s: float  # the length of the window the figures cover
    placement: tuple[InstanceConfig, ...]  # every instance now on the node, draining ones included
    instances: tuple[InstanceLoad, ...]  # one per instance of `placement` (missing ones count as idle)
    demand: tuple[ModelDemand, ...]  # one per model

    def load_of(self, instance_id: str) -> InstanceLoad:
        for load in self.instances:
            if load.instance_id == instance_id:
                return load
        return InstanceLoad(instance_id)

    def demand_of(self, model: str) -> ModelDemand:
        for d in self.demand:
            if d.model == model:
                return d
        return ModelDemand(model, 0.0)


def demand_trend(samples: Sequence[tuple[float, float]]) -> float:
    """Least-squares slope of [(t_s, rate)] samples (req/s per s); 0 with fewer than two distinct times."""
    n = len(samples)
    if n < 2:
        return 0.0
    mt = sum(t for t, _ in samples) / n
    mv = sum(v for _, v in samples) / n
    var = sum((t - mt) ** 2 for t, _ in samples)
    if var <= 0:
        return 0.0
    return sum((t - mt) * (v - mv) for t, v in samples) / var


RECENT_SHARE = 0.4  # a step's recent rate is counted over this share of the window (2 of the callers' 5 bins)


def step_score(counts: Sequence[int], bin_s: float, recent_bins: int = 2) -> tuple[float, float]:
    """(recent rate, z) from per-bin arrival counts of one window: the rate over the last `recent_bins` bins and how
    many Poisson standard errors it lies from the rate over the earlier bins (signed: > 0 when demand jumped up).
    A step change shows as a large |z| at once, where the window's least-squares trend only tilts; a steady or
    slowly drifting rate keeps |z| near 1."""
    n = len(counts)
    if n <= recent_bins or bin_s <= 0:
        return (sum(counts) / (n * bin_s) if n and bin_s > 0 else 0.0), 0.0
    recent_s, early_s = recent_bins * bin_s, (n - recent_bins) * bin_s
    recent, early = sum(counts[-recent_bins:]) / recent_s, sum(counts[:-recent_bins]) / early_s
    var = max(recent, 1.0 / recent_s) / recent_s + max(early, 1.0 / early_s) / early_s
    return recent, (recent - early) / math.sqrt(var)


def pressure(loads: NodeLoad, model: str) -> str:
    """One model's load figures for a log line: prefill backlog against the tightest TTFT slack, decode batch
    against its limit, KV use and the ITL headroom, over its instances that take requests."""
    ids = {i.id for i in loads.placement if i.model == model}
    mine = [l for l in loads.instances if l.instance_id in ids and l.accepting]
    if not mine:
        return "no instance taking requests"
    slack = min(l.ttft_slack_s for l in mine)
    limit = sum(l.decode_batch_limit for l in mine)
    return (f"prefill backlog {sum(l.prefill_backlog_tokens for l in mine):.0f} tok, TTFT slack "
            f"{'inf' if math.isinf(slack) else f'{slack * 1000:.0f} ms'}, decode {sum(l.decode_batch for l in mine)}/"
            f"{limit}, KV {max(l.kv_used for l in mine):.0%}, ITL headroom {min(l.itl_headroom for l in mine):.0%}")

