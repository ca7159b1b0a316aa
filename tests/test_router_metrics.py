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


def _label_values(registry, metric: str) -> set[str]:
    return {s.labels["model"] for fam in registry.collect() if fam.name == metric for s in fam.samples}


def test_model_labels_are_bounded_to_the_served_models():
    from octoserve.router.metrics import UNSERVED_LABEL
    from octoserve.services.core.errors import InvalidArgument

    m = RouterMetrics(served_models=["llama-3-8b"])
    for name in ("llama-3-8b", "gpt-4", "", "x" * 500, "gpt-4"):
        m.ttft(name, 0.01)
        m.itl(name, 0.01, 1)
        m.refused(name, InvalidArgument("prompt", "empty"))
    for metric in ("octoserve_router_ttft_seconds", "octoserve_router_itl_seconds", "octoserve_router_refusals"):
        assert _label_values(m.registry, metric) == {"llama-3-8b", UNSERVED_LABEL}
    get = m.registry.get_sample_value
    assert get("octoserve_router_ttft_seconds_count", {"model": UNSERVED_LABEL}) == 4
    assert get("octoserve_router_refusals_total", {"model": UNSERVED_LABEL, "error": "InvalidArgument"}) == 4


def test_latencies_are_modelled_seconds_and_every_metric_states_its_unit():
    m = RouterMetrics(served_models=["m"], time_scale=10.0)
    m.ttft("m", 2.0)  # 2 wall seconds on a node dilated 10x: 0.2 modelled seconds
    m.itl("m", 0.3, 3)
    get = m.registry.get_sample_value
    assert abs(get("octoserve_router_ttft_seconds_sum", {"model": "m"}) - 0.2) < 1e-12
    assert abs(get("octoserve_router_itl_seconds_sum", {"model": "m"}) - 0.09) < 1e-12
    for fam in m.registry.collect():
        unit = "seconds on the modelled clock (wall seconds / --time-scale)" if fam.name.endswith("_seconds") \
            else "count"
        assert unit in fam.documentation, (fam.name, fam.documentation)


def test_worker_and_scheduler_metrics_state_their_units():
    from octoserve.services.rpc.worker_base import WorkerMetrics

    units = ("count", "blocks", "ratio 0-1", "tokens", "wall seconds")
    for fam in WorkerMetrics("sm-0").registry.collect():
        assert fam.documentation.rsplit(", ", 1)[-1].startswith(units), (fam.name, fam.documentation)
