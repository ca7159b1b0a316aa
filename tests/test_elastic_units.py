"""The pure parts of elastic pools on the live node: the admin request as a Reconfiguration, the CLI's parsing, the
live placement's versions and snapshots, and the router's view built from a snapshot."""

from __future__ import annotations

import argparse
import asyncio
import json

import grpc
import pytest

from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.core.reconfig import ReconfigKind
from octoserve.services.core.types import Role
from octoserve.services.reconfigure_cli import add_arguments, request_from_args
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.scheduler import elastic
from octoserve.services.usage import UsageError
from tests.test_elastic_live import OTHER_MODEL, elastic_config


def _config():
    return node_config_from_dict(elastic_config())


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--scheduler", "127.0.0.1:1", *argv])


def test_role_change_request():
    cfg = _config()
    current = {i.id: i for i in cfg.instances}
    r = elastic.reconfiguration_from_pb(request_from_args(_parse("--role", "d1=prefill")), current, cfg)
    assert r.kind is ReconfigKind.ROLE and r.retire == ("d1",)
    (inst,) = r.start
    assert (inst.id, inst.role, inst.gpu_ids, inst.model) == ("d1", Role.PREFILL, (4,), current["d1"].model)
    assert r.load_s == 0.0 and not r.in_place
    r = elastic.reconfiguration_from_pb(request_from_args(_parse("--role", "d1=colocated", "--in-place")), current, cfg)
    assert (r.kind, r.retire, r.start[0].role, r.in_place) == (ReconfigKind.ROLE, ("d1",), Role.COLOCATED, True)
    with pytest.raises(elastic.ReconfigError, match="only decode <-> colocated runs in place, not decode -> prefill"):
        elastic.reconfiguration_from_pb(request_from_args(_parse("--role", "d1=prefill", "--in-place")), current, cfg)


def test_model_change_request_starts_on_the_freed_gpus_with_the_modelled_load_time():
    cfg = _config()
    current = {i.id: i for i in cfg.instances}
    req = request_from_args(_parse("--model", f"c0,c1={OTHER_MODEL}:colocated:1", "--reason", "more of the other"))
    r = elastic.reconfiguration_from_pb(req, current, cfg)
    assert r.kind is ReconfigKind.MODEL and r.retire == ("c0", "c1") and r.reason == "more of the other"
    assert [(i.model, i.gpu_ids, i.role) for i in r.start] == [(OTHER_MODEL, (0,), Role.COLOCATED),
                                                              (OTHER_MODEL, (1,), Role.COLOCATED)]
    assert len({i.id for i in r.start}) == 2 and not {i.id for i in r.start} & set(current)
    # 8B weights (bf16) over one GPU's PCIe: bytes / rate, exactly.
    spec = cfg.models[OTHER_MODEL]
    assert r.load_s == spec.weight_bytes_per_gpu(1) / cfg.gpu.pcie_bytes_per_s
    # ... and it is refused before anything drains: both were the 8B's only instances.
    assert elastic.check_reconfiguration(current, r) == [f"{r.reconfig_id}: would leave no instance of ['llama-3-8b']"]


@pytest.mark.parametrize("argv, message", [
    (("--role", "d1"), "give ID=ROLE"),
    (("--role", "d1=gpu"), "give ID=ROLE"),
    (("--model", "c1"), "IDS=MODEL"),
    (("--model", "c1=m:mixed"), "role 'mixed'"),
    (("--model", "c1=m:colocated:x"), "TP 'x'"),
    (("--model", "c1=m", "--in-place"), "--in-place goes with --role"),
])
def test_cli_bad_input_says_what_to_change(argv, message):
    with pytest.raises(UsageError, match=message):
        request_from_args(_parse(*argv))


@pytest.mark.parametrize("request_pb, message", [
    (s_pb.ReconfigureRequest(role_change=s_pb.RoleChange(instance_id="zz", role=w_pb.PREFILL)), "no instance 'zz'"),
    (s_pb.ReconfigureRequest(role_change=s_pb.RoleChange(instance_id="d1")), "is not a role; send colocated"),
    (s_pb.ReconfigureRequest(model_change=s_pb.ModelChange(retire=["c1"], model="nope")), "unknown model"),
    (s_pb.ReconfigureRequest(model_change=s_pb.ModelChange(retire=["c1"], model=OTHER_MODEL, tensor_parallel=2)),
     "not a multiple"),
    (s_pb.ReconfigureRequest(), "send a role_change or a model_change"),
])
def test_bad_reconfigure_request_is_invalid_argument(request_pb, message):
    cfg = _config()
    with pytest.raises(elastic.ReconfigError, match=message) as e:
        elastic.reconfiguration_from_pb(request_pb, {i.id: i for i in cfg.instances}, cfg)
    assert e.value.code is grpc.StatusCode.INVALID_ARGUMENT


def test_model_change_that_would_leave_a_model_without_instances_is_refused():
    cfg = _config()
    current = {i.id: i for i in cfg.instances}
    r = elastic.reconfiguration_from_pb(s_pb.ReconfigureRequest(model_change=s_pb.ModelChange(
        retire=["y0"], model="llama-3-8b")), current, cfg)
    assert any("would leave no instance" in p for p in elastic.check_reconfiguration(current, r))


def test_live_placement_versions_and_snapshot():
    async def run():
        cfg = _config()
        lp = elastic.LivePlacement(cfg)
        snap = lp.snapshot({"c0": "127.0.0.1:1"})
        assert snap.version == 1 and not snap.complete
        assert [p.state for p in snap.instances] == [s_pb.INSTANCE_SERVING] * len(cfg.instances)
        c0 = json.loads(snap.instances[0].instance_config_json)
        assert c0 == {"id": "c0", "model": "llama-3-8b", "role": "colocated", "tp": 1, "gpu_ids": [0],
                      "max_num_seqs": 256, "max_num_batched_tokens": 2048, "gpu_memory_utilization": 0.22,
                      "block_size": 16, "enable_prefix_caching": True}
        waiter = asyncio.create_task(lp.wait_change(lp.version))
        await asyncio.sleep(0)
        assert not waiter.done()
        lp.states["d1"] = elastic.State.DRAINING
        await lp.publish()
        await asyncio.wait_for(waiter, 1)
        snap = lp.snapshot({i.id: "127.0.0.1:1" for i in cfg.instances})
        assert snap.version == 2 and snap.complete
        assert {p.instance_id: p.state for p in snap.instances}["d1"] == s_pb.INSTANCE_DRAINING

    asyncio.run(run())


class _Policy:
    def __init__(self, config) -> None:
        self.config, self.cost_models, self.forgotten = config, {}, []

    def forget_instance(self, iid: str) -> None:
        self.forgotten.append(iid)


class _Client:
    def __init__(self, inst, address: str) -> None:
        self.inst, self.address, self.started, self.stopped, self.retiring = inst, address, False, False, False

    def start(self) -> None:
        self.started = True

    def stop_streams(self) -> None:
        self.stopped = True

    def retire(self) -> None:
        self.retiring = True

    def mark_down(self) -> None:
        pass

    async def close(self) -> None:
        pass


def test_router_view_follows_a_snapshot():
    from octoserve.router.placement_watch import PlacementFollower
    from octoserve.router.pool import WorkerPool

    async def run():
        cfg = _config()
        policy, pool, servicer = _Policy(cfg), WorkerPool({}), argparse.Namespace(config=cfg)
        f = PlacementFollower("127.0.0.1:1", cfg, policy, pool, servicer, _Client)
        lp = elastic.LivePlacement(cfg)
        addresses = {i.id: f"127.0.0.1:{n + 10}" for n, i in enumerate(cfg.instances)}
        f.apply(lp.snapshot(addresses), start_clients=False)
        assert set(pool.clients) == {i.id for i in cfg.instances}
        assert [i.id for i in policy.config.instances] == [i.id for i in cfg.instances]
        old_d1 = pool.clients["d1"]
        # d1 drains: out of routing, session kept.
        lp.states["d1"] = elastic.State.DRAINING
        await lp.publish()
        f.apply(lp.snapshot(addresses))
        assert "d1" not in [i.id for i in policy.config.instances] and pool.clients["d1"] is old_d1
        # d1 becomes a prefill instance: new session, prefix index dropped, routed as prefill.
        lp.instances["d1"] = elastic.dataclasses.replace(lp.instances["d1"], role=Role.PREFILL)
        lp.states["d1"] = elastic.State.SERVING
        await lp.publish()
        f.apply(lp.snapshot(addresses))
        # The old session is read until the worker ends it (the last tokens of the drain), not cut now.
        assert pool.clients["d1"] is not old_d1 and pool.clients["d1"].started
        assert old_d1.retiring and not old_d1.stopped
        assert pool["d1"] is pool.clients["d1"] and pool.retired["d1"] is old_d1
        assert policy.forgotten == ["d1"]
        assert policy.config.instance("d1").role is Role.PREFILL and servicer.config is policy.config
        # y0 removed, a new instance starting (not routed until SERVING).
        del lp.instances["y0"], lp.states["y0"]
        new = elastic.InstanceConfig("y-new", OTHER_MODEL, Role.COLOCATED, 1, (5,))
        lp.instances["y-new"], lp.states["y-new"] = new, elastic.State.STARTING
        await lp.publish()
        f.apply(lp.snapshot({**addresses, "y-new": "127.0.0.1:99"}))
        assert "y0" not in pool.clients and "y0" in pool.retired and "y-new" in pool.clients
        assert pool.retired["y0"].retiring and not pool.retired["y0"].stopped
        assert "y-new" not in [i.id for i in policy.config.instances] and "y-new" in policy.cost_models
        lp.states["y-new"] = elastic.State.SERVING
        await lp.publish()
        f.apply(lp.snapshot({**addresses, "y-new": "127.0.0.1:99"}))
        assert policy.config.instances_of(OTHER_MODEL) == (new,)
        await f.close()

    asyncio.run(run())


def test_demand_window_rates_lengths_and_trend():
    from octoserve.services.core.live_balancer import DemandWindow

    w = DemandWindow(window_s=4.0)
    w.add(0.5, "llama-3-8b-other", 4, 4000, 40)  # before the window at now = 5
    for t, n in ((1.0, 2), (2.0, 4), (3.0, 6), (4.0, 8)):  # the 8B's arrivals grow by 2 req/s every second
        w.add(t, "llama-3-8b", n, 100 * n, 10 * n)
    small, other = w.demand(5.0, ["llama-3-8b", "llama-3-8b-other"])
    assert (small.arrival_rps, small.mean_prompt_tokens, small.mean_output_tokens) == (20 / 4.0, 100.0, 10.0)
    assert small.trend_rps_per_s == pytest.approx(2.0)
    assert (other.arrival_rps, other.trend_rps_per_s) == (0.0, 0.0)


def test_elastic_section_names_unknown_keys():
    from octoserve.services.core.live_balancer import LiveElasticBalancer

    with pytest.raises(ValueError, match=r"unknown keys \['min_dwel_s'\]"):
        elastic.balancer_from_section({"balancer": "elastic", "min_dwel_s": 5}, _config())
    from octoserve.services.config import load_node_config

    balancer, period_s = elastic.balancer_from_section({"balancer": "elastic", "period_s": 2, "min_dwell_s": 7},
                                                       load_node_config(None))
    assert isinstance(balancer, LiveElasticBalancer) and period_s == 2.0
    assert balancer.inner.policy.min_dwell_s == 7
    with pytest.raises(ValueError, match="must be 'elastic' or package.module:factory"):
        elastic.balancer_from_section({"balancer": "mine"}, _config())
    assert elastic.balancer_from_section(None, _config()) is None


def test_live_placement_survives_a_restart_through_its_state_file(tmp_path):
    async def run():
        path = str(tmp_path / "placement.json")
        cfg = _config()
        lp = elastic.LivePlacement(cfg, path)
        del lp.instances["c1"]
        lp.instances["y1"] = elastic.InstanceConfig("y1", OTHER_MODEL, Role.COLOCATED, 1, (1,), gpu_memory_utilization=0.22)
        await lp.publish()
        again = elastic.LivePlacement(cfg, path)  # what a restarted scheduler reads
        assert again.instances == lp.instances and list(again.instances)[-1] == "y1"
        assert set(again.states) == set(again.instances)
        assert elastic.LivePlacement(cfg, str(tmp_path / "none.json")).instances == {i.id: i for i in cfg.instances}

    asyncio.run(run())


def test_a_step_in_the_live_demand_takes_the_balancers_step_path():
    from octoserve.services.core.balancer import BalancerPolicy
    from octoserve.services.core.live_balancer import DemandWindow, LiveElasticBalancer, LiveView
    from tests.test_balancer import LM, NODE, SM_C, inst

    w = DemandWindow(window_s=10.0)
    for t in range(1, 7):  # the 70B at 4 req/s for 6 s, then 12 req/s: the routers' one-second reports
        w.add(float(t), "llama-3-70b", 4, 4000, 1000)
        w.add(float(t), "llama-3-8b", 10, 10000, 2500)
    for t in (7.0, 8.0, 9.0, 10.0):
        w.add(t, "llama-3-70b", 12, 12000, 3000)
        w.add(t, "llama-3-8b", 10, 10000, 2500)
    large, small = w.demand(10.0, ["llama-3-70b", "llama-3-8b"])
    assert large.recent_rps == pytest.approx(12.0) and large.step_z > 4.0  # a step, well past the 4-sigma line
    assert small.recent_rps == pytest.approx(10.0) and abs(small.step_z) < 1.0
    current = (LM, *SM_C)
    grown = (LM, inst("lm-1", "llama-3-70b", Role.COLOCATED, (4, 5)), SM_C[2], SM_C[3])
    balancer = LiveElasticBalancer(NODE, BalancerPolicy(confirm_periods=3))
    balancer.inner.layouts = [current, grown]
    view = LiveView(current, {i.id: True for i in current}, {}, (large, small), w.window_s)
    (r,) = balancer.plan(10.0, view, [])  # no three periods of confirmation: the step path
    assert r.retire == ("sm-0", "sm-1")
    assert "step seen in llama-3-70b: recent rates; llama-3-70b 12.0 req/s" in r.reason
    # The same arrivals spread evenly over the window (5.6 req/s, no step): the balancer waits for confirmation.
    flat = DemandWindow(window_s=10.0)
    for t in range(1, 11):
        flat.add(float(t), "llama-3-70b", 6 if t % 5 else 4, 5000, 1250)
        flat.add(float(t), "llama-3-8b", 10, 10000, 2500)
    calm = LiveElasticBalancer(NODE, BalancerPolicy(confirm_periods=3))
    calm.inner.layouts = [current, grown]
    demand = flat.demand(10.0, ["llama-3-70b", "llama-3-8b"])
    assert abs(demand[0].step_z) < 4.0
    assert calm.plan(10.0, LiveView(current, {i.id: True for i in current}, {}, demand, 10.0), []) == []
