"""The router's Prometheus metrics: TTFT, ITL, E2E, in-flight, refusals and outcomes by model.

Times are seconds on the modelled clock: the router's wall-clock measurement divided by its --time-scale (so at
time scale 1 they are wall seconds, and under a dilated sim node they compare directly with the SLOs). The `model`
label takes only the served models' names; any other name a client sends is counted under `unserved`, so a
client cannot create series. Label children are resolved once per model, so the per-message cost is a
dict lookup and an observe. ITL is observed on every streamed message (the router's hot path), so it is kept in a
`WeightedHistogram`: O(1) per message whatever its token count, no lock, exported in Prometheus histogram form at
scrape time (scripts/bench_router.py measured prometheus_client's observe-per-token at ~5 % of the router's
busy time under streaming load).
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Sequence

import prometheus_client as prom
from prometheus_client.core import HistogramMetricFamily

from octoserve.services.core.errors import OctoserveError

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)


class WeightedHistogram:
    """A labelled histogram whose observations carry an integer weight (k equal observations in one call).

    Only the event loop thread writes it; a scrape (the metrics HTTP thread) reads plain ints and floats, so a
    scrape may see one observation half-applied (bucket counted, sum not yet), as with any lock-free counter.
    """

    def __init__(self, name: str, documentation: str, label_name: str, buckets: Sequence[float],
                 registry: prom.CollectorRegistry) -> None:
        self.name = name
        self.documentation = documentation
        self.label_name = label_name
        self.upper_bounds = tuple(float(b) for b in buckets)
        self._series: dict[str, list] = {}  # label value -> [per-bucket counts (last: +Inf), sum]
        registry.register(self)

    def series(self, label: str) -> list:
        s = self._series.get(label)
        if s is None:
            s = self._series[label] = [[0] * (len(self.upper_bounds) + 1), 0.0]
        return s

    def observe(self, series: list, value: float, weight: int = 1) -> None:
        series[0][bisect.bisect_left(self.upper_bounds, value)] += weight
        series[1] += value * weight

    def collect(self):
        family = HistogramMetricFamily(self.name, self.documentation, labels=[self.label_name])
        for label, (counts, total) in list(self._series.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*self.upper_bounds, float("inf")), counts):
                cumulative += count
                buckets.append((prom.utils.floatToGoString(bound), cumulative))
            family.add_metric([label], buckets, total)
        yield family

    def describe(self):
        return [HistogramMetricFamily(self.name, self.documentation, labels=[self.label_name])]


UNSERVED_LABEL = "unserved"
_MODELLED = "seconds on the modelled clock (wall seconds / --time-scale)"


class RouterMetrics:
    """`served_models`: the label values allowed for `model` (None: any, for tests of one model); `time_scale`:
    the router's --time-scale, by which wall-clock latencies are divided."""

    def __init__(self, served_models=None, time_scale: float = 1.0) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.served = None if served_models is None else frozenset(served_models)
        self.time_scale = time_scale
        r = self.registry = prom.CollectorRegistry()
        self._ttft = prom.Histogram("octoserve_router_ttft_seconds", f"time to first token, {_MODELLED}", ["model"],
                                    buckets=LATENCY_BUCKETS_S, registry=r)
        self._itl = WeightedHistogram("octoserve_router_itl_seconds", f"inter-token latency, {_MODELLED} (a k-token "
                                      "message counts k gaps of gap/k)", "model", LATENCY_BUCKETS_S, r)
        self._e2e = prom.Histogram("octoserve_router_e2e_seconds", f"request latency, arrival to last token, "
                                   f"{_MODELLED}", ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self._outcomes = prom.Counter("octoserve_router_requests", "finished requests by outcome (ok, cancelled or "
                                      "the gRPC status), count", ["model", "outcome"], registry=r)
        self._refusals = prom.Counter("octoserve_router_refusals", "requests refused before dispatch, by error "
                                      "type, count", ["model", "error"], registry=r)
        self.in_flight = prom.Gauge("octoserve_router_in_flight_requests", "requests being served, count",
                                    registry=r)
        self.cutoffs = prom.Counter("octoserve_router_client_cutoffs", "streams cut off for not reading, count",
                                    registry=r)
        self.failovers = prom.Counter("octoserve_router_failovers", "requests whose worker was lost, by what followed "
                                      "(rerouted, lost: ended UNAVAILABLE after tokens, refused on re-routing), count",
                                      ["outcome"], registry=r)
        self.continuations = prom.Counter("octoserve_router_continuations", "streams whose instance was lost after "
                                          "they had streamed tokens, by cause (crash, hang, kv_transfer, drain) and "
                                          "what followed (continued on another instance; refused: by admission, the "
                                          "stream ended UNAVAILABLE; bound: past policies.max_continuations, ended "
                                          "UNAVAILABLE), count", ["cause", "outcome"], registry=r)
        self._children: dict[str, tuple] = {}

    def label(self, model: str) -> str:
        """The `model` label value: the name itself when served, else `unserved` (bounded cardinality)."""
        return model if self.served is None or model in self.served else UNSERVED_LABEL

    def _for(self, model: str) -> tuple:
        c = self._children.get(model)
        if c is None:
            name = self.label(model)
            c = (self._ttft.labels(name), self._itl.series(name), self._e2e.labels(name))
            if name != UNSERVED_LABEL:  # unserved names are not cached either: the dict stays bounded too
                self._children[model] = c
        return c

    def ttft(self, model: str, seconds: float) -> None:
        """`seconds`: wall clock, as measured."""
        self._for(model)[0].observe(seconds / self.time_scale)

    def itl(self, model: str, gap_s: float, num_tokens: int) -> None:
        self._itl.observe(self._for(model)[1], gap_s / self.time_scale, num_tokens)

    def continuation(self, cause: str, outcome: str) -> None:
        self.continuations.labels(cause, outcome).inc()

    def refused(self, model: str, error: OctoserveError) -> None:
        self._refusals.labels(self.label(model), type(error).__name__).inc()

    def finished(self, st) -> None:
        self.in_flight.dec()
        if st.error is not None:
            outcome = st.error.code.name.lower()
        elif st.finish_reason:
            outcome = "ok"
        else:
            outcome = "cancelled"
        self._outcomes.labels(self.label(st.spec.model), outcome).inc()
        if outcome == "ok":
            self._for(st.spec.model)[2].observe((time.monotonic() - st.wall_start_s) / self.time_scale)
