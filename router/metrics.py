"""The router's Prometheus metrics: TTFT, ITL, E2E, in-flight, refusals and outcomes by model.

Times are wall-clock seconds as the router sees them (modelled time x time_scale under the sim engine); divide by
the time scale to compare with SLOs. Label children are resolved once per model, so the per-message cost is a
dict lookup and an observe.
"""

from __future__ import annotations

import time

import prometheus_client as prom

from services.core.errors import OctoserveError

LATENCY_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 60.0)


class RouterMetrics:
    def __init__(self) -> None:
        r = self.registry = prom.CollectorRegistry()
        self._ttft = prom.Histogram("octoserve_router_ttft_seconds", "time to first token", ["model"],
                                    buckets=LATENCY_BUCKETS_S, registry=r)
        self._itl = prom.Histogram("octoserve_router_itl_seconds", "inter-token latency (a k-token message counts "
                                   "k gaps of gap/k)", ["model"], buckets=LATENCY_BUCKETS_S, registry=r)
        self._e2e = prom.Histogram("octoserve_router_e2e_seconds", "request latency", ["model"],
                                   buckets=LATENCY_BUCKETS_S, registry=r)
        self._outcomes = prom.Counter("octoserve_router_requests", "finished requests by outcome",
                                      ["model", "outcome"], registry=r)
        self._refusals = prom.Counter("octoserve_router_refusals", "requests refused before dispatch",
                                      ["model", "error"], registry=r)
        self.in_flight = prom.Gauge("octoserve_router_in_flight_requests", "requests being served", registry=r)
        self.cutoffs = prom.Counter("octoserve_router_client_cutoffs", "streams cut off for not reading", registry=r)
        self._children: dict[str, tuple] = {}

    def _for(self, model: str) -> tuple:
        c = self._children.get(model)
        if c is None:
            c = self._children[model] = (self._ttft.labels(model), self._itl.labels(model), self._e2e.labels(model))
        return c

    def ttft(self, model: str, seconds: float) -> None:
        self._for(model)[0].observe(seconds)

    def itl(self, model: str, gap_s: float, num_tokens: int) -> None:
        h = self._for(model)[1]
        for _ in range(num_tokens):
            h.observe(gap_s)

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
