"""The router's Prometheus metrics: TTFT, ITL, E2E, in-flight, refusals and outcomes by model.

Times are wall-clock seconds as the router sees them (modelled time x time_scale under the sim engine); divide by
the time scale to compare with SLOs. Label children are resolved once per model, so the per-message cost is a
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


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = prom.CollectorRegistry()
        self._ttft = prom.Histogram("octoserve_router_ttft_seconds", "time to first token", ["model"],
                                    buckets=LATENCY_BUCKETS_S, registry=r)
        self._itl = WeightedHistogram("octoserve_router_itl_seconds", "inter-token latency (a k-token message counts "
                                      "k gaps of gap/k)", "model", LATENCY_BUCKETS_S, r)
        self._e2e = prom.Histogram("octoserve_router_e2e_seconds", "request latency", ["model"],
                                   buckets=LATENCY_BUCKETS_S, registry=r)
        self._outcomes = prom.Counter("octoserve_router_requests", "finished requests by outcome",
                                      ["model", "outcome"], registry=r)
        self._refusals = prom.Counter("octoserve_router_refusals", "requests refused before dispatch",
                                      ["model", "error"], registry=r)
        self.in_flight = prom.Gauge("octoserve_router_in_flight_requests", "requests being served", registry=r)
        self.cutoffs = prom.Counter("octoserve_router_client_cutoffs", "streams cut off for not reading", registry=r)
        self.failovers = prom.Counter("octoserve_router_failovers", "requests whose worker was lost, by what followed "
                                      "(rerouted, lost: ended UNAVAILABLE after tokens, refused on re-routing)",
                                      ["outcome"], registry=r)
        self._children: dict[str, tuple] = {}

    def _for(self, model: str) -> tuple:
        c = self._children.get(model)
        if c is None:
            c = self._children[model] = (self._ttft.labels(model), self._itl.series(model), self._e2e.labels(model))
        return c

    def ttft(self, model: str, seconds: float) -> None:
        self._for(model)[0].observe(seconds)

    def itl(self, model: str, gap_s: float, num_tokens: int) -> None:
        self._itl.observe(self._for(model)[1], gap_s, num_tokens)

    def refused(self, model: str, error: OctoserveError) -> None:
        self._refusals.labels(model, type(error).__name__).inc()

    def finished(self, st) -> None:
        self.in_flight.dec()
        if st.error is not None:
            outcome = st.error.code.name.lower()
        elif st.finish_reason:
            outcome = "ok"
        else:
            outcome = "cancelled"
        self._outcomes.labels(st.spec.model, outcome).inc()
        if outcome == "ok":
            self._for(st.spec.model)[2].observe(time.monotonic() - st.wall_start_s)
