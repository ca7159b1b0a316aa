"""The forward ranker on the live node: the demand window's history as arrivals, the twin built from the workers'
load reports, and the live balancer ranking candidate moves by playing them forward on it."""

import pytest

from octoserve.services.core.balancer import BalancerPolicy, MoveCandidate
from octoserve.services.core.types import EngineLoad, Role
from octoserve.services.core.live_balancer import DemandWindow, LiveView
from octoserve.services.sim.live_ranker import LiveForwardRanker, balancer_with_ranker, elastic_balancer, node_twin
from tests.test_balancer import LM, NODE, SM_PD

L, S = "llama-3-70b", "llama-3-8b"
CURRENT = (LM, *SM_PD)  # the 70B at TP 4; the 8B as one prefill and three decode instances


def idle(inst) -> EngineLoad:
    return EngineLoad(inst.id, inst.model, inst.role, 0, 0, 1000, 1000, 16, 0, 2e4, 0.01)


def prefill_heavy(seconds: int = 60) -> DemandWindow:
    """One report a second: the 8B at 30 req/s of 3,000-token prompts and 20-token outputs, the 70B at 1 req/s."""
    w = DemandWindow(10.0, 60.0)
    for t in range(1, seconds + 1):
        w.add(float(t), S, 30, 30 * 3000, 30 * 20)
        w.add(float(t), L, 1, 1000, 200)
    return w


def view_of(w: DemandWindow, now_s: float, loads) -> LiveView:
    return LiveView(CURRENT, {i.id: True for i in CURRENT}, loads, w.demand(now_s, [L, S]), w.window_s,
                    arrivals=w.arrivals(now_s, 250.0))


def test_the_demand_window_keeps_a_rankers_history_and_spreads_each_report_over_its_interval():
    w = DemandWindow(window_s=4.0, history_s=10.0)
    w.add(1.0, S, 2, 200, 20)  # the first report of a model: over the second before it
    w.add(3.0, S, 4, 800, 40)  # over the two seconds since the previous one
    w.add(9.0, S, 1, 500, 7)
    w.add(10.0, L, 0, 0, 0)
    # The demand reads the last 4 s only; the history keeps all 10.
    (small,) = w.demand(10.0, [S])
    assert (small.arrival_rps, small.mean_prompt_tokens) == (1 / 4.0, 500.0)
    seen = w.arrivals(10.0, 250.0)
    assert [(r.arrival_s, r.model, r.prompt_tokens, r.output_tokens, r.ttft_slo_ms) for r in seen] == [
        (0.25, S, 100, 10, 250.0), (0.75, S, 100, 10, 250.0),
        (1.25, S, 200, 10, 250.0), (1.75, S, 200, 10, 250.0), (2.25, S, 200, 10, 250.0), (2.75, S, 200, 10, 250.0),
        (6.0, S, 500, 7, 250.0)]
    assert len({r.request_id for r in seen}) == len(seen)
    # Past the history a report is gone; the next one still spreads over its interval since that report (3-9 s).
    assert [r.arrival_s for r in w.arrivals(13.5, 250.0)] == [6.0]
    assert DemandWindow(window_s=10.0).history_s == 10.0  # without a ranker: the window alone


def test_the_twin_holds_the_reported_queues():
    w = prefill_heavy()
    loads = {i.id: idle(i) for i in CURRENT}
    loads["sm-p0"] = EngineLoad("sm-p0", S, Role.PREFILL, 0, 40, 1000, 500, 16, 120_000, 2e4, 0.0)
    loads["sm-d0"] = EngineLoad("sm-d0", S, Role.DECODE, 4, 0, 1000, 900, 16, 0, 0.0, 0.008, mean_output_tokens=200.0,
                                num_reserved=1)
    view = view_of(w, 60.0, loads)
    view = LiveView(view.placement, {**view.accepting, "sm-d2": False}, view.engine_loads, view.demand,
                    view.window_s, arrivals=view.arrivals)
    twin = node_twin(NODE, BalancerPolicy(), view, 60.0, 10.0)
    p0, d0, d1, d2 = (twin.instances[i] for i in ("sm-p0", "sm-d0", "sm-d1", "sm-d2"))
    # The prefill server is busy for the reported backlog at the instance's prefill rate.
    assert p0.prefill_free_s == pytest.approx(60.0 + 120_000 / p0.prefill_rate)
    # Five decode slots held (4 running + 1 reserved), their remaining outputs spread over the mean output of 200.
    left = [round(200 * (k + 0.5) / 5) for k in range(5)]
    assert left == [20, 60, 100, 140, 180]
    assert sorted(tr.finish_s for tr in d0.running) == pytest.approx([60.0 + n * d0.tau_s for n in left])
    assert sorted(d0.heap)[-5:] == pytest.approx([60.0 + n * d0.tau_s for n in left])
    assert not d1.running and d1.prefill_free_s == 60.0
    assert (d1.accepting, d2.accepting) == (True, False)  # not SERVING in the live placement: takes nothing new
    # The replayed past is the window's history; the 8B's mean lengths come from it.
    assert len(twin._window(0.0, 60.0)) == 60 * 31
    assert twin._mean_lengths(60.0)[S] == (3000.0, 20.0)


def test_the_live_balancer_ranks_moves_by_playing_them_forward_from_the_reported_state():
    w = prefill_heavy()
    loads = {i.id: idle(i) for i in CURRENT}
    backlog = dict(loads, **{"sm-p0": EngineLoad("sm-p0", S, Role.PREFILL, 0, 40, 1000, 500, 16, 120_000, 2e4, 0.0)})
    b = balancer_with_ranker(NODE, BalancerPolicy(), ranker="forward")
    (r,) = b.plan(60.0, view_of(w, 60.0, backlog), [])
    assert b.inner.counters["ranked:forward"] == 1 and b.inner.counters["planned:role"] == 1
    assert (r.retire, r.start[0].role) == (("sm-d0",), Role.COLOCATED)  # the first step towards more prefill
    assert "played forward over 60 s" in r.reason
    assert (b.ranker.calls, b.ranker.simulated) == (1, 4)  # hold and the estimate's best three
    # Hold played forward from the reported state: the queued prefill costs it goodput against an empty node.
    hold = MoveCandidate("hold", CURRENT, (), 0.0)
    rates = {L: 1.0, S: 30.0}
    ranker = LiveForwardRanker(NODE, BalancerPolicy(), 10.0)
    ranker.view = view_of(w, 60.0, backlog)
    (with_backlog,) = ranker.forecast(60.0, [hold], rates, [20.0])
    ranker.view = view_of(w, 60.0, loads)
    (empty,) = ranker.forecast(60.0, [hold], rates, [20.0])
    assert 0.0 < with_backlog[0] < empty[0]


def test_without_a_windows_history_the_live_ranker_holds():
    w = prefill_heavy(seconds=8)  # less than the 10-s load window
    b = balancer_with_ranker(NODE, BalancerPolicy(), ranker="forward")
    assert b.plan(8.0, view_of(w, 8.0, {i.id: idle(i) for i in CURRENT}), []) == []
    assert b.inner.counters["ranked:forward"] == 0 and b.inner.counters["planned:role"] == 0
    assert b.ranker.calls == 0


def test_the_elastic_section_names_the_ranker():
    b = elastic_balancer(NODE, {"balancer": "elastic", "ranker": "forward", "forward_window_s": 30})
    assert isinstance(b.ranker, LiveForwardRanker) and b.inner.ranker is b.ranker
    assert (b.window_s, b.history_s) == (10.0, 30.0)
    default = elastic_balancer(NODE, {"balancer": "elastic"})  # the forward ranker, with in-place role changes
    assert isinstance(default.ranker, LiveForwardRanker) and default.inner.in_place and default.history_s == 60.0
    plain = elastic_balancer(NODE, {"balancer": "elastic", "ranker": "none"})
    assert (plain.ranker, plain.history_s, plain.inner.in_place) == (None, 10.0, False)
    with pytest.raises(ValueError, match="elastic.ranker must be one of none, forward, got 'replay'"):
        elastic_balancer(NODE, {"balancer": "elastic", "ranker": "replay"})


ASYNC = pytest.mark.asyncio(loop_scope="function")


@ASYNC
async def test_a_schedulers_forward_ranker_sees_the_reported_arrivals_over_grpc():
    """A real scheduler on 127.0.0.1 with `ranker: forward`: the routers' reports reach the view the balancer is
    handed as arrivals to replay, kept beyond the load window; without a ranker the view carries none."""
    import asyncio

    import grpc

    from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
    from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
    from octoserve.services.rpc.server import start_service
    from octoserve.services.scheduler.service import scheduler_spec
    from tests.service_fixtures import COLOCATED_MODEL, small_config

    config = small_config()
    for section, history_s in (({"balancer": "elastic", "ranker": "forward", "period_s": 3600}, 60.0),
                               # a replay window no longer than the load window: the view still carries it
                               ({"balancer": "elastic", "ranker": "forward", "forward_window_s": 5,
                                 "period_s": 3600}, 10.0),
                               ({"balancer": "elastic", "ranker": "none", "period_s": 3600}, None)):
        spec, scheduler = scheduler_spec(config, metrics_port=None, elastic_section=section)
        running = await start_service(spec)
        channel = grpc.aio.insecure_channel(running.address)
        try:
            stub = s_grpc.SchedulerStub(channel)
            for n in (3, 5):
                await stub.ReportDemand(s_pb.DemandReport(interval_s=1.0, models=[
                    s_pb.ModelArrivals(model=COLOCATED_MODEL, arrivals=n, prompt_tokens=100 * n,
                                       output_tokens=10 * n)]), timeout=5)
            assert scheduler.demand.history_s == (history_s or 10.0)
            view = scheduler.live_view(asyncio.get_running_loop().time())
            if history_s is not None:
                assert [(r.model, r.prompt_tokens, r.output_tokens, r.ttft_slo_ms) for r in view.arrivals] == \
                    [(COLOCATED_MODEL, 100, 10, config.slo.ttft_ms)] * 8
            else:
                assert view.arrivals == ()
        finally:
            await channel.close()
            await running.shutdown()
