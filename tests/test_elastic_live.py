"""Elastic pools on the live node (separate processes on 127.0.0.1, sim engine, dilated): reconfigurations under a
steady client load.

What each test holds the node to:
- every request sent gets a final status, and every one is served in full (OK, exactly max_tokens tokens): none
  fails or is lost because of a reconfiguration;
- the models keep serving on their other instances throughout (requests to them finish while the retired
  instance drains and switches);
- a role change happens in the worker's process (same PID) and the router routes to the instance in its new
  role afterwards, without a restart;
- a model change stops the retired worker and starts a worker of the other model on the same GPU, which the
  router then routes to.
No duration is held to a wall-clock budget; a model change's reply is checked for consistency (its parts add up
within the call's own time, and the switch includes the modelled weight load, dilated).
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from octoserve.services.cli import main as cli_main
from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.core.reconfig import ReconfigKind, Reconfiguration
from octoserve.services.core.types import Role
from octoserve.services.node.launcher import start_node
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.v1 import generate_pb2 as gen_pb
from octoserve.v1 import generate_pb2_grpc as gen_grpc
from tests.fault_fixtures import INSTANCE, Stream, access_log, prompt, until
from tests.service_fixtures import COLOCATED_MODEL, DISAGG_MODEL, MAX_CONTEXT

pytestmark = [pytest.mark.slow, pytest.mark.asyncio(loop_scope="function")]

OTHER_MODEL = "llama-3-8b-other"
MAX_TOKENS = 24
TIME_SCALE = 3.0


def elastic_config() -> dict:
    """A colocated 8B on c0, c1; a disaggregated 8B on p0 (prefill), d0, d1 (decode); another 8B on y0."""
    spec = {"preset": "llama-3-8b", "max_context_len": MAX_CONTEXT}
    return {
        "gpu": "h100-sxm-80gb", "num_gpus": 8,
        "models": {COLOCATED_MODEL: spec, DISAGG_MODEL: spec, OTHER_MODEL: spec},
        "instances": [
            {"id": "c0", "model": COLOCATED_MODEL, "role": "colocated", "gpu_ids": [0], **INSTANCE},
            {"id": "c1", "model": COLOCATED_MODEL, "role": "colocated", "gpu_ids": [1], **INSTANCE},
            {"id": "p0", "model": DISAGG_MODEL, "role": "prefill", "gpu_ids": [2], "max_num_batched_tokens": 2048,
             **INSTANCE},
            {"id": "d0", "model": DISAGG_MODEL, "role": "decode", "gpu_ids": [3], **INSTANCE},
            {"id": "d1", "model": DISAGG_MODEL, "role": "decode", "gpu_ids": [4], **INSTANCE},
            {"id": "y0", "model": OTHER_MODEL, "role": "colocated", "gpu_ids": [5], **INSTANCE},
        ],
    }


class Load:
    """`per_model` concurrent client streams per model, each sending one request after another until stopped."""

    def __init__(self, stub, models: tuple[str, ...], per_model: int = 2) -> None:
        self.stub, self.models, self.per_model = stub, models, per_model
        self.streams: list[Stream] = []
        self.stop = asyncio.Event()
        self._tasks: list[asyncio.Task] = []
        self._salt = 0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(m)) for m in self.models for _ in range(self.per_model)]

    async def _client(self, model: str) -> None:
        while not self.stop.is_set():
            self._salt += 1
            s = Stream(gen_pb.GenerateRequest(model=model, token_ids=prompt(48, self._salt), max_tokens=MAX_TOKENS,
                                              ignore_eos=True))
            self.streams.append(s)
            await s.run(self.stub, timeout_s=60.0)

    async def finish(self) -> list[Stream]:
        self.stop.set()
        await asyncio.gather(*self._tasks)
        return self.streams

    def done(self, model: str | None = None) -> int:
        return sum(1 for s in self.streams if s.code is not None and (model is None or s.request.model == model))


def _assert_all_served(streams: list[Stream]) -> None:
    bad = [(s.request.model, s.code, s.details, len(s.tokens)) for s in streams
           if s.code is not grpc.StatusCode.OK or len(s.tokens) != MAX_TOKENS]
    assert bad == [], f"{len(bad)} of {len(streams)} requests not served in full: {bad[:5]}"


async def _placement(scheduler) -> dict[str, s_pb.InstancePlacement]:
    p = await scheduler.GetPlacement(s_pb.GetPlacementRequest(), timeout=5)
    return {i.instance_id: i for i in p.instances}


def _start(tmp_path):
    """The elastic test node, with every request in the router's access log."""
    return start_node(elastic_config(), time_scale=TIME_SCALE, run_dir=tmp_path, startup_timeout_s=90, grace_s=3,
                      router_args=("--access-log", "all"))


async def test_role_changes_under_load(tmp_path):
    node = _start(tmp_path)
    try:
        d1_pid = node.workers["d1"].pid
        async with grpc.aio.insecure_channel(node.router_address) as rch, \
                grpc.aio.insecure_channel(node.scheduler.address) as sch:
            scheduler = s_grpc.SchedulerStub(sch)
            load = Load(gen_grpc.GenerationStub(rch), (COLOCATED_MODEL, DISAGG_MODEL))
            load.start()
            await until(lambda: load.done(DISAGG_MODEL) >= 6, 60, "the disaggregated model serves")

            # decode -> prefill: P:D goes from 1:2 to 2:1 while requests keep arriving.
            reply = await scheduler.Reconfigure(s_pb.ReconfigureRequest(
                role_change=s_pb.RoleChange(instance_id="d1", role=w_pb.PREFILL), reason="test: more prefill"),
                timeout=120)
            assert list(reply.started) == ["d1"]
            assert (await _placement(scheduler))["d1"].role == w_pb.PREFILL
            switched_at = len(load.streams)
            await until(lambda: load.done(DISAGG_MODEL) >= switched_at // 2 + 12, 60, "served after the change")

            # ... and back, by the CLI: prefill -> decode (the router re-opens the token session).
            code = await asyncio.to_thread(cli_main, ["reconfigure", "--run-dir", str(tmp_path), "--role", "d1=decode"])
            assert code == 0
            assert (await _placement(scheduler))["d1"].role == w_pb.DECODE
            back_at = len(load.streams)
            await until(lambda: sum(1 for s in load.streams[back_at:] if s.code is not None) >= 16, 60,
                         "served after the change back")
            streams = await load.finish()
        _assert_all_served(streams)
        assert node.workers["d1"].pid == d1_pid and node.workers["d1"].proc.poll() is None  # no restart
        # The router routed to d1 as a prefill instance after the first change, and as a decode one after the second.
        log = access_log(node)
        as_prefill = [e for e in log.values() if e["instances"][:1] == ["d1"]]
        as_decode = [e for e in log.values() if e["instances"][1:] == ["d1"]]
        assert as_prefill, "no request was prefilled on d1 in its prefill role"
        assert as_decode, "no request was decoded on d1"
        assert len(log) == len(streams)
        assert all(e["code"] == "OK" for e in log.values())
    finally:
        node.stop()


async def _running_on(scheduler, instance_id: str) -> int:
    loads = await scheduler.GetLoads(s_pb.GetLoadsRequest(), timeout=5)
    return next((l.num_running for l in loads.loads if l.instance_id == instance_id), 0)


async def test_in_place_role_changes_under_load_drain_nothing_and_stream_on(tmp_path):
    """Decode -> colocated and back, in place, while d0 is decoding: nothing drains (0 requests drained, the
    instance SERVING throughout, the same engine generation so the router keeps its session), every request is
    served in full, d0 takes whole requests as colocated and hand-offs again as decode, and a prefill -> decode
    change asked in place is refused, naming what to send."""
    node = _start(tmp_path)
    try:
        d0_pid = node.workers["d0"].pid
        async with grpc.aio.insecure_channel(node.router_address) as rch, \
                grpc.aio.insecure_channel(node.scheduler.address) as sch:
            scheduler = s_grpc.SchedulerStub(sch)
            load = Load(gen_grpc.GenerationStub(rch), (DISAGG_MODEL,), per_model=4)
            load.start()
            await until(lambda: load.done(DISAGG_MODEL) >= 6, 60, "the disaggregated model serves")
            before = await _placement(scheduler)
            assert before["d0"].engine_generation == 1

            async def change(role, settle: str) -> s_pb.ReconfigureReply:
                for _ in range(500):  # switch while d0 holds running decodes (bounded: the load keeps it busy)
                    if await _running_on(scheduler, "d0") > 0:
                        break
                    await asyncio.sleep(0.01)
                assert await _running_on(scheduler, "d0") > 0
                reply = await scheduler.Reconfigure(s_pb.ReconfigureRequest(
                    role_change=s_pb.RoleChange(instance_id="d0", role=role, in_place=True), reason="test: in place"),
                    timeout=60)
                at = len(load.streams)
                await until(lambda: sum(1 for s in load.streams[at:] if s.code is not None) >= 12, 60, settle)
                return reply, at

            to_colocated, colocated_from = await change(w_pb.COLOCATED, "served after d0 turned colocated")
            after = await _placement(scheduler)
            assert (after["d0"].role, after["d0"].state, after["d0"].engine_generation) == \
                (w_pb.COLOCATED, s_pb.INSTANCE_SERVING, 1)
            to_decode, decode_from = await change(w_pb.DECODE, "served after d0 turned decode again")
            assert (await _placement(scheduler))["d0"].role == w_pb.DECODE
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await scheduler.Reconfigure(s_pb.ReconfigureRequest(
                    role_change=s_pb.RoleChange(instance_id="p0", role=w_pb.DECODE, in_place=True)), timeout=30)
            streams = await load.finish()
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert refused.value.details() == ("role_change.in_place: only decode <-> colocated runs in place, not "
                                           "prefill -> decode; send in_place false to drain")
        for reply in (to_colocated, to_decode):
            assert (list(reply.started), reply.drained_requests, reply.migrated_requests, reply.drain_s) == \
                (["d0"], 0, 0, 0.0)
        _assert_all_served(streams)
        assert node.workers["d0"].pid == d0_pid and node.workers["d0"].proc.poll() is None
        log = access_log(node)
        assert len(log) == len(streams) and all(e["code"] == "OK" for e in log.values())
        ids = [s.request_id for s in streams]
        whole_on_d0 = [r for r in ids[colocated_from:decode_from] if r in log and log[r]["instances"] == ["d0"]]
        handed_to_d0 = [r for r in ids[decode_from:] if r in log and log[r]["instances"][1:] == ["d0"]]
        assert whole_on_d0, "no request ran whole on d0 while it was colocated"
        assert handed_to_d0, "no request was handed to d0 once it decoded again"
    finally:
        node.stop()


async def test_model_change_under_load(tmp_path):
    node = start_node(elastic_config(), time_scale=TIME_SCALE, run_dir=tmp_path, startup_timeout_s=90, grace_s=3,
                      router_args=("--access-log", "all"))
    try:
        c1 = node.workers["c1"]
        async with grpc.aio.insecure_channel(node.router_address) as rch, \
                grpc.aio.insecure_channel(node.scheduler.address) as sch:
            scheduler = s_grpc.SchedulerStub(sch)
            router = gen_grpc.GenerationStub(rch)
            load = Load(router, (COLOCATED_MODEL, OTHER_MODEL))
            load.start()
            await until(lambda: load.done() >= 8, 60, "both models serve")
            before = load.done(COLOCATED_MODEL)

            loop = asyncio.get_running_loop()
            called_at = loop.time()
            reply = await scheduler.Reconfigure(s_pb.ReconfigureRequest(model_change=s_pb.ModelChange(
                retire=["c1"], model=OTHER_MODEL, role=w_pb.COLOCATED, tensor_parallel=1)), timeout=180)
            call_s = loop.time() - called_at
            (new_id,) = reply.started
            # The colocated model kept serving on c0 while c1 drained and its GPU changed model.
            assert load.done(COLOCATED_MODEL) > before
            placement = await _placement(scheduler)
            assert "c1" not in placement and placement[new_id].model == OTHER_MODEL
            assert list(placement[new_id].gpu_ids) == [1] and placement[new_id].state == s_pb.INSTANCE_SERVING
            await until(lambda: c1.proc.poll() is not None, 30, "the retired worker stopped")
            assert new_id in node.workers and "c1" not in node.workers
            changed_at = len(load.streams)
            await until(lambda: sum(1 for s in load.streams[changed_at:] if s.code is not None) >= 20, 60,
                         "served after the change")
            models = {m.name: m for m in (await router.ListModels(gen_pb.ListModelsRequest(), timeout=5)).models}
            streams = await load.finish()
        _assert_all_served(streams)
        assert models[OTHER_MODEL].num_instances == 2 and models[COLOCATED_MODEL].num_instances == 1
        log = access_log(node)
        assert len(log) == len(streams) and all(e["code"] == "OK" for e in log.values())
        assert any(e["instances"] == [new_id] for e in log.values()), "the new instance served no request"
        # The reply's times: the drain and the switch add up to the total, all within the call; the switch holds the
        # new instance back for its weight load (modelled over PCIe, dilated) before it serves.
        node_cfg = node_config_from_dict(elastic_config())
        load_s = node_cfg.models[OTHER_MODEL].weight_bytes_per_gpu(1) / node_cfg.gpu.pcie_bytes_per_s
        assert reply.total_s == pytest.approx(reply.drain_s + reply.switch_s)
        assert 0.0 <= reply.drain_s and load_s * TIME_SCALE <= reply.switch_s and reply.total_s <= call_s
    finally:
        node.stop()


class FlipOnce:
    """A Balancer for the policy-loop test: the first time the disaggregated model's decode instances run
    requests, it turns d1 into a prefill instance; it plans nothing after that."""

    def __init__(self, config) -> None:
        self.d1 = config.instance("d1")
        self.planned = False

    def plan(self, now_s, loads, in_flight):
        busy = sum(load.num_running for iid, load in loads.engine_loads.items() if iid in ("d0", "d1"))
        if self.planned or in_flight or busy == 0:
            return []
        self.planned = True
        import dataclasses

        return [Reconfiguration("flip-d1", ReconfigKind.ROLE, ("d1",), (dataclasses.replace(self.d1, role=Role.PREFILL),),
                                f"test: {busy} requests decoding, more prefill wanted")]


async def test_balancer_loop_reconfigures_under_load(tmp_path):
    config = {**elastic_config(), "elastic": {"balancer": "tests.test_elastic_live:FlipOnce", "period_s": 0.5}}
    node = start_node(config, time_scale=TIME_SCALE, run_dir=tmp_path, startup_timeout_s=90, grace_s=3)
    try:
        async with grpc.aio.insecure_channel(node.router_address) as rch, \
                grpc.aio.insecure_channel(node.scheduler.address) as sch:
            scheduler = s_grpc.SchedulerStub(sch)
            load = Load(gen_grpc.GenerationStub(rch), (DISAGG_MODEL,))
            load.start()
            roles: list[int] = []

            async def flipped() -> bool:
                roles.append((await _placement(scheduler))["d1"].role)
                return roles[-1] == w_pb.PREFILL
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 60
            while not await flipped():
                assert loop.time() < deadline, "the balancer loop did not reconfigure d1"
                await asyncio.sleep(0.1)
            flipped_at = len(load.streams)
            await until(lambda: sum(1 for s in load.streams[flipped_at:] if s.code is not None) >= 8, 60,
                         "served after the balancer's change")
            streams = await load.finish()
        _assert_all_served(streams)
        log = node.scheduler.log_file.read_text()
        assert "reconfiguration done" in log and "test: " in log  # the plan's reason is logged
    finally:
        node.stop()
