"""Admission refusals reach the live balancer: the router counts each refusal per model and reason, reports it to
the scheduler with its arrivals every second (`Scheduler.ReportDemand`), and the scheduler's balancer input
(`ModelDemand.refused_rps`, `DemandWindow.refusals`) shows them. Real gRPC servers on 127.0.0.1: the scheduler,
sim-engine workers and a router that follows the scheduler's placement."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from octoserve.router.app import router_spec
from octoserve.router.servicer import RouterSettings
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
from octoserve.services.rpc.server import start_service
from octoserve.services.core.live_balancer import DemandWindow
from octoserve.services.scheduler.service import scheduler_spec
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from tests.fault_fixtures import until
from tests.service_fixtures import COLOCATED_MODEL, DISAGG_MODEL, request, small_config, start_inprocess_node

ASYNC = pytest.mark.asyncio(loop_scope="function")


def test_demand_window_counts_refusals_among_arrivals():
    w = DemandWindow(window_s=4.0)
    w.add(0.5, "m", 10, 100, 10, {"ttft": 10})  # before the window at now = 5
    w.add(2.0, "m", 6, 600, 60, {"ttft": 2, "kv_headroom": 1})
    w.add(3.0, "m", 6, 600, 60)  # an older router's report: no refusals
    w.add(4.0, "m", 4, 400, 40, {"ttft": 3})
    (d,) = w.demand(5.0, ["m"])
    assert (d.arrival_rps, d.refused_rps) == (16 / 4.0, 6 / 4.0)
    assert w.refusals(5.0, "m") == {"ttft": 5, "kv_headroom": 1}
    assert w.refusals(5.0, "other") == {}


async def _scheduler_and_router(node):
    """A scheduler knowing the node's workers, and a router that follows its placement and reports demand to it."""
    spec, scheduler = scheduler_spec(node.config, metrics_port=None)
    running = await start_service(spec)
    channel = grpc.aio.insecure_channel(running.address)
    stub = s_grpc.SchedulerStub(channel)
    for iid, worker in node.workers.items():
        await stub.RegisterWorker(s_pb.RegisterWorkerRequest(instance_id=iid, address=worker.address), timeout=5)

    async def no_endpoints():
        return {}

    rspec, _ = router_spec(node.config, no_endpoints, settings=RouterSettings(), metrics_port=None, grace_s=2.0,
                           startup_timeout_s=20.0, scheduler_address=running.address)
    router = await start_service(rspec)
    return running, scheduler, channel, stub, router


@ASYNC
async def test_a_routers_refusals_reach_the_schedulers_balancer_input():
    node = await start_inprocess_node()
    running, scheduler, channel, stub, router = await _scheduler_and_router(node)
    gen_channel = grpc.aio.insecure_channel(router.address)
    gen = gen_grpc.GenerationStub(gen_channel)
    try:
        # 12,000 prompt tokens: their prefill alone is over the 250 ms STANDARD TTFT SLO (slo_infeasible); as BATCH
        # (10 s SLO) they fit the SLO but not any instance's 703 KV blocks (kv_headroom). Short prompts are served.
        codes: dict[str, list[grpc.StatusCode]] = {}

        async def send(name: str, req: gen_pb.GenerateRequest) -> None:
            try:
                async for _ in gen.Generate(req, timeout=20):
                    pass
                codes.setdefault(name, []).append(grpc.StatusCode.OK)
            except grpc.aio.AioRpcError as e:
                codes.setdefault(name, []).append(e.code())

        sends = [send("ok", request(COLOCATED_MODEL)) for _ in range(3)]
        sends += [send("infeasible", request(COLOCATED_MODEL, num_prompt_tokens=12000)) for _ in range(2)]
        sends += [send("kv", request(COLOCATED_MODEL, num_prompt_tokens=12000, priority=gen_pb.BATCH))
                  for _ in range(4)]
        sends += [send("pd_infeasible", request(DISAGG_MODEL, num_prompt_tokens=12000))]
        await asyncio.gather(*sends)
        assert codes == {"ok": [grpc.StatusCode.OK] * 3,
                         "infeasible": [grpc.StatusCode.FAILED_PRECONDITION] * 2,
                         "kv": [grpc.StatusCode.RESOURCE_EXHAUSTED] * 4,
                         "pd_infeasible": [grpc.StatusCode.FAILED_PRECONDITION]}

        def seen() -> dict:
            now_s = asyncio.get_running_loop().time()  # the scheduler's clock: monotonic / time scale 1
            return {m: scheduler.demand.refusals(now_s, m) for m in (COLOCATED_MODEL, DISAGG_MODEL)}

        want = {COLOCATED_MODEL: {"slo_infeasible": 2, "kv_headroom": 4}, DISAGG_MODEL: {"slo_infeasible": 1}}
        await until(lambda: seen() == want, 5.0, f"the scheduler's window shows {want}")
        now_s = asyncio.get_running_loop().time()
        view = scheduler.live_view(now_s)
        demand = {d.model: d for d in view.demand}
        window = scheduler.demand.window_s
        assert demand[COLOCATED_MODEL].refused_rps == pytest.approx(6 / window)
        assert demand[COLOCATED_MODEL].arrival_rps == pytest.approx(9 / window)
        assert demand[DISAGG_MODEL].refused_rps == pytest.approx(1 / window)
        assert demand[DISAGG_MODEL].arrival_rps == pytest.approx(1 / window)
        metric = scheduler.registry.get_sample_value
        assert metric("octoserve_scheduler_refusals_total", {"model": COLOCATED_MODEL, "reason": "kv_headroom"}) == 4
        assert metric("octoserve_scheduler_refusals_total",
                      {"model": COLOCATED_MODEL, "reason": "slo_infeasible"}) == 2
    finally:
        await gen_channel.close()
        await router.shutdown()
        await channel.close()
        await running.shutdown()
        await node.stop()


@ASYNC
async def test_report_demand_accepts_old_reports_and_refuses_inconsistent_ones():
    config = small_config()
    spec, scheduler = scheduler_spec(config, metrics_port=None)
    running = await start_service(spec)
    channel = grpc.aio.insecure_channel(running.address)
    stub = s_grpc.SchedulerStub(channel)
    try:
        # A router from before refusals were reported: arrivals only, accepted, no refusal counted.
        await stub.ReportDemand(s_pb.DemandReport(interval_s=1.0, models=[
            s_pb.ModelArrivals(model=COLOCATED_MODEL, arrivals=5, prompt_tokens=500, output_tokens=50)]), timeout=5)
        # An unknown reason (a newer router's) is kept as "other"; nothing reported is dropped.
        await stub.ReportDemand(s_pb.DemandReport(interval_s=1.0, models=[
            s_pb.ModelArrivals(model=COLOCATED_MODEL, arrivals=3, prompt_tokens=300, output_tokens=30,
                               refused={"ttft": 1, "brand_new": 2})]), timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await stub.ReportDemand(s_pb.DemandReport(interval_s=1.0, models=[
                s_pb.ModelArrivals(model=COLOCATED_MODEL, arrivals=1, refused={"ttft": 2})]), timeout=5)
        assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert e.value.details() == (f"model '{COLOCATED_MODEL}': 2 refusals reported but 1 arrivals; send each "
                                     "refused request in the arrivals too")
        now_s = asyncio.get_running_loop().time()
        assert scheduler.demand.refusals(now_s, COLOCATED_MODEL) == {"ttft": 1, "other": 2}
        (d,) = [d for d in scheduler.live_view(now_s).demand if d.model == COLOCATED_MODEL]
        window = scheduler.demand.window_s
        assert (d.arrival_rps, d.refused_rps) == (pytest.approx(8 / window), pytest.approx(3 / window))
    finally:
        await channel.close()
        await running.shutdown()


def test_the_step_level_simulators_balancer_input_counts_its_routers_refusals():
    """The step-level simulator feeds its demand window as the routers do: arrivals, and the router policy's
    refusals among them by reason."""
    from octoserve.services.sim.elastic_step import ElasticStepSim
    from octoserve.services.core.types import Priority
    from octoserve.services.workload import TraceRequest

    config = small_config()
    sim = ElasticStepSim(config, balance=False, window_s=10.0)
    long_prompt = tuple(100 + i for i in range(12000))  # over the 250 ms TTFT SLO on its own: slo_infeasible
    def req(k: int, arrival_s: float, prompt: tuple[int, ...]) -> TraceRequest:
        return TraceRequest(f"r{k}", arrival_s, COLOCATED_MODEL, prompt, 8, 8, Priority.STANDARD, 250.0)

    # Ten arrivals within the first two balancing periods (ticks at 0, 1 and 2 s), every third one refused; one more
    # at 2.5 s, after the last report.
    trace = [req(k, 0.1 + 0.2 * k, long_prompt if k % 3 == 0 else (1, 2, 3, 4)) for k in range(10)]
    trace.append(req(10, 2.5, (1, 2, 3, 4)))
    sim.run(trace)
    assert sim.demand.refusals(2.0, COLOCATED_MODEL) == {"slo_infeasible": 4}
    d, pd = sim.demand.demand(2.0, [COLOCATED_MODEL, DISAGG_MODEL])
    assert (d.arrival_rps, d.refused_rps) == (10 / 10.0, 4 / 10.0)
    assert (pd.arrival_rps, pd.refused_rps) == (0.0, 0.0)


def test_the_reporter_counts_refusals_after_routing_too():
    """A request routed and then refused (its decode reservation failed) counts once as an arrival and once as a
    refusal (`decode_reserve`); the report carries each model's refusals by reason and starts again from zero."""
    import random

    from octoserve.router.demand_report import DemandReporter
    from octoserve.services.core.errors import Overloaded
    from octoserve.services.core.routing import RouterPolicy, build_cost_models
    from octoserve.services.core.types import EngineLoad, Priority, Role
    from octoserve.services.rpc import convert

    config = small_config()
    policy = RouterPolicy(config, build_cost_models(config), random.Random(0))
    reporter = DemandReporter("127.0.0.1:1", policy)  # not started: nothing is sent

    def spec(i: int, n: int):
        return convert.spec_from_public(request(DISAGG_MODEL, num_prompt_tokens=n), f"r{i}", 0.0, None)

    loads = {iid: EngineLoad(iid, DISAGG_MODEL, role, 0, 0, 703, 703, 16, 0, 2e4, 0.006, max_num_seqs=64)
             for iid, role in (("p0", Role.PREFILL), ("d0", Role.DECODE))}
    assert policy.route(spec(0, 12000), loads, 0.0).reason == "slo_infeasible"
    routed = spec(1, 32)
    assert policy.route(routed, loads, 0.0).decode_instance_id == "d0"
    policy.refused_after_routing(routed, Overloaded(DISAGG_MODEL, Priority.STANDARD, 50, "no KV"), "decode_reserve")
    (m,) = reporter.report(1.0).models
    assert (m.model, m.arrivals, dict(m.refused)) == (DISAGG_MODEL, 2, {"slo_infeasible": 1, "decode_reserve": 1})
    assert reporter.report(1.0).models == []


def test_the_live_balancers_measured_corrections_observe_reported_refusals():
    """Saturation detection on the live input: with `measured_corrections` on, a model whose shape held a whole
    window while refusing >= 5 % of its arrivals is observed (its served rate over its estimated capacity); the same
    arrivals without refusals are not."""
    from octoserve.services.core.balancer import BalancerPolicy
    from octoserve.services.core.live_balancer import LiveElasticBalancer, LiveView
    from tests.test_balancer import LM, NODE, SM_C

    current = (LM, *SM_C)
    models = ["llama-3-70b", "llama-3-8b"]

    def run(refuse: bool):
        balancer = LiveElasticBalancer(NODE, BalancerPolicy(measured_corrections=True))
        balancer.inner.layouts = [current]
        window = DemandWindow(window_s=10.0)
        for t in range(1, 21):  # the 8B at 40 req/s, a fifth of it refused; the 70B at 1 req/s
            window.add(float(t), "llama-3-8b", 40, 40_000, 10_000, {"ttft": 8} if refuse else None)
            window.add(float(t), "llama-3-70b", 1, 1000, 250)
            if t in (10, 20):  # the shape is seen at 10 s and has held a whole window at 20 s
                view = LiveView(current, {i.id: True for i in current}, {}, window.demand(float(t), models), 10.0)
                balancer.plan(float(t), view, [])
        return balancer, window.demand(20.0, models)[1]

    saturated, small = run(True)
    cap = saturated.inner.capacity.model_capacity_rps(list(SM_C), small.as_model_load(1.0))
    assert small.refused_rps > 0.05 * small.arrival_rps and small.arrival_rps > 0.5 * cap
    ratio = (small.arrival_rps - small.refused_rps) / cap
    observed = [d.detail for d in saturated.inner.log if d.reason == "measured:observed"]
    assert observed == [f"llama-3-8b TP1Cx4 served {ratio:.2f} of its estimated capacity, saturated "
                        f"(factor {ratio:.2f})"]
    calm, _ = run(False)
    assert calm.inner.counters["measured:observed"] == 0
