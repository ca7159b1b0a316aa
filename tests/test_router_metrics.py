"""octoserve.router.metrics.WeightedHistogram: exact Prometheus histogram samples, weights counted as repeated observations."""

import prometheus_client as prom

from octoserve.router.metrics import RouterMetrics, WeightedHistogram


def test_weighted_histogram_exports_cumulative_buckets_sum_and_count():
    registry = prom.CollectorRegistry()
    h = WeightedHistogram("x_seconds", "doc", "model", (0.01, 0.1), registry)
    a = h.series("a")
    h.observe(a, 0.005)  # <= 0.01
    h.observe(a, 0.01)  # le is inclusive: still the first bucket
    h.observe(a, 0.05, weight=3)  # three observations of 0.05
    h.observe(a, 2.0)  # +Inf
    value = lambda name, **labels: registry.get_sample_value(name, {"model": "a", **labels})  # noqa: E731
    assert value("x_seconds_bucket", le="0.01") == 2
    assert value("x_seconds_bucket", le="0.1") == 5
    assert value("x_seconds_bucket", le="+Inf") == 6
    assert value("x_seconds_count") == 6
    assert abs(value("x_seconds_sum") - (0.005 + 0.01 + 0.15 + 2.0)) < 1e-12
    assert registry.get_sample_value("x_seconds_count", {"model": "b"}) is None


def test_router_itl_counts_a_k_token_message_as_k_gaps():
    m = RouterMetrics()
    m.itl("m", 0.002, 4)  # a 4-token message 8 ms after the previous one: four gaps of 2 ms
    get = m.registry.get_sample_value
    assert get("octoserve_router_itl_seconds_count", {"model": "m"}) == 4
    assert get("octoserve_router_itl_seconds_bucket", {"model": "m", "le": "0.001"}) == 0
    assert get("octoserve_router_itl_seconds_bucket", {"model": "m", "le": "0.0025"}) == 4
    assert abs(get("octoserve_router_itl_seconds_sum", {"model": "m"}) - 0.008) < 1e-12
