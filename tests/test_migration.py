"""Live migration of running decodes off a draining instance (services/core/migration.py, services/rpc/migration.py,
router/migration.py).

- The rule: drain vs migrate per request, with its reasons, and the plan's use of the targets' headroom.
- The batcher hooks: a suspended request resumes where it stopped; a migrated one decodes on from its last token.
- In-process node on 127.0.0.1 (real gRPC servers: router, two colocated workers): a draining worker hands its running
  decodes to the other replica; every client stream completes with the same request id and exactly the tokens an
  unmigrated run produces (the sim engine's tokens are a pure function of the request and the position); a target
  that refuses leaves the requests to drain where they are, also exact.
Nothing here asserts a duration.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from octoserve.services.core import migration
from octoserve.services.core.batch_state import RequestStatus
from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.core.sim_executor import sim_token_id
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.migration import migrate_out
from octoserve.v1 import generate_pb2 as gen_pb
from tests.fault_fixtures import Stream, prompt, two_replica_config
from tests.service_fixtures import COLOCATED_MODEL, start_inprocess_node
from tests.test_batcher import make_batcher, spec, step


def expected_tokens(prompt_ids, n: int) -> list[int]:
    return [sim_token_id(len(prompt_ids), prompt_ids[0], p) for p in range(n)]


# ---- the rule ------------------------------------------------------------------------------------------------------

def test_decide_reasons():
    assert migration.decide(2.0, 0.01, 0.01) == migration.MIGRATE
    assert migration.decide(0.01, 0.01, 0.01) == migration.DRAIN_SHORTER  # the drain is no longer than the hand-off
    assert migration.decide(0.5, 0.01, 0.6) == migration.DRAIN_SHORTER  # the stall outlasts the decode left
    assert migration.decide(10.0, 0.01, 2.0, max_pause_s=1.0) == migration.PAUSE_TOO_LONG
    assert migration.decide(10.0, 0.01, 2.0, max_pause_s=1.0, tpot_slack_s=3.0) == migration.MIGRATE


def test_plan_uses_headroom_longest_first():
    running = [migration.RunningDecode("short", 100, 1), migration.RunningDecode("a", 160, 500),
               migration.RunningDecode("b", 160, 400), migration.RunningDecode("c", 160, 300)]
    # t0 has room for one 161-token context (11 blocks of 16) and t1 for one more; nothing is left for "c".
    targets = [migration.Target("t0", 11, 16, 4), migration.Target("t1", 15, 16, 1)]
    got = migration.plan(running, targets, step_s=0.01, transfer_s=lambda n: n * 1e-4)
    assert [(d.request_id, d.reason, d.target) for d in got] == [
        ("a", migration.MIGRATE, "t1"), ("b", migration.MIGRATE, "t0"), ("c", migration.TARGET_FULL, ""),
        ("short", migration.DRAIN_SHORTER, "")]
    assert [d.reason for d in migration.plan(running[1:2], [], step_s=1.0, transfer_s=lambda n: 0.0)] == [
        migration.NO_TARGET]


def _cost_70b():
    from octoserve.services.core.cost_model import CostModel
    from octoserve.services.core.specs import GPU_PRESETS, MODEL_PRESETS

    return CostModel(MODEL_PRESETS["llama-3-70b"], GPU_PRESETS["h100-sxm-80gb"], 4)


def test_plan_counts_the_load_it_adds_to_the_target():
    """Five long decodes leave a retiring 70B instance; the target (16 decodes of 2000 tokens running) has slots and
    KV for all five, but its decode step, by the cost model, stays within the ITL budget with only two of them
    added: those two (the longest remaining) move, the other three drain (target_itl)."""
    cost = _cost_70b()
    running = [migration.RunningDecode(f"r{k}", 2000, 500 - 100 * k) for k in range(5)]
    base_batch, base_kv = 16, 16 * 2000
    with_two = migration.batch_step_s(cost, base_batch + 2, base_kv + 2 * 2001)
    with_three = migration.batch_step_s(cost, base_batch + 3, base_kv + 3 * 2001)
    assert with_two < with_three
    budget = (with_two + with_three) / 2
    target = migration.Target("t0", 10_000, 16, 64, decode_batch=base_batch, kv_tokens=base_kv)
    got = migration.plan(running, [target], step_s=0.02, transfer_s=lambda n: n * 1e-5,
                         target_step_s=lambda i, b, kv: migration.batch_step_s(cost, b, kv), itl_budget_s=budget)
    assert [(d.request_id, d.reason, d.target) for d in got] == [
        ("r0", migration.MIGRATE, "t0"), ("r1", migration.MIGRATE, "t0"), ("r2", migration.TARGET_ITL, ""),
        ("r3", migration.TARGET_ITL, ""), ("r4", migration.TARGET_ITL, "")]
    # Unchecked (no step model), the same target takes all five: its slots and KV alone allow it.
    assert [d.reason for d in migration.plan(running, [target], step_s=0.02, transfer_s=lambda n: n * 1e-5)] == [
        migration.MIGRATE] * 5
    # A second, idle target takes what the first cannot: the ITL check sends a request to another target, not
    # only to the drain. (t0 has more free KV, so it is preferred while its step allows.)
    idle = migration.Target("t1", 5_000, 16, 64)
    got = migration.plan(running, [target, idle], step_s=0.02, transfer_s=lambda n: n * 1e-5,
                         target_step_s=lambda i, b, kv: migration.batch_step_s(cost, b, kv), itl_budget_s=budget)
    assert [(d.request_id, d.target) for d in got] == [("r0", "t0"), ("r1", "t0"), ("r2", "t1"), ("r3", "t1"),
                                                      ("r4", "t1")]


def test_decide_checks_the_targets_step():
    assert migration.decide(2.0, 0.01, 0.02, target_step_s=0.031, itl_budget_s=0.030) == migration.TARGET_ITL
    assert migration.decide(2.0, 0.01, 0.02, target_step_s=0.030, itl_budget_s=0.030) == migration.MIGRATE
    # The drain being shorter is the first reason: moving would not help whatever the target's load.
    assert migration.decide(0.01, 0.01, 0.02, target_step_s=1.0, itl_budget_s=0.030) == migration.DRAIN_SHORTER
    assert migration.batch_step_s(_cost_70b(), 0, 0) == 0.0
    cost = _cost_70b()
    assert migration.batch_step_s(cost, 4, 4 * 1000) == cost.decode_step_time_s(4, 999)


# ---- the batcher hooks -----------------------------------------------------------------------------------------------

def test_suspend_resume_and_migrate_in():
    b = make_batcher(max_num_seqs=4)
    b.add_request(spec("r", max_tokens=30), 0.0)
    assert b.suspend_running("r") is None  # still waiting for its prefill: not a running decode
    step(b, token=7)  # prefill + first token
    assert b.suspend_running("r") == (7,)
    assert b.num_running == 0 and not b.has_work and b.request("r").status is RequestStatus.HANDOFF
    plan, _ = step(b)
    assert plan.is_empty  # a suspended request is not scheduled
    assert b.resume_suspended("r") and b.num_running == 1
    step(b, token=8)
    free = b.kv.num_free_blocks
    assert b.suspend_running("r") == (7, 8) and b.release_handoff("r")  # migrated away: its KV is freed
    assert b.kv.num_free_blocks > free and b.request("r") is None

    target = make_batcher(max_num_seqs=4)
    assert target.reserve_migrated(spec("r", max_tokens=30), (7, 8), 1.0)
    assert not target.reserve_migrated(spec("r", max_tokens=30), (7, 8), 1.0)  # one reservation per request
    target.commit_migrated("r", 1.0)
    r = target.request("r")
    assert r.num_output_tokens == 2 and r.num_uncomputed_tokens == 1 and target.num_running == 1
    plan, out = step(target, token=9)  # one decode step: the next token, counted after the migrated ones
    assert [c.num_new_tokens for c in plan.chunks] == [1]
    assert [(o.new_token_ids, o.num_output_tokens) for o in out.outputs] == [((9,), 3)]


# ---- in-process node -------------------------------------------------------------------------------------------------

MAX_TOKENS = 160
TIME_SCALE = 4.0


async def _running_on_both(node, streams) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while True:
        loads = {i: await node.load(i) for i in ("c0", "c1")}
        if all(l.num_running >= 1 for l in loads.values()) and all(len(s.tokens) >= 4 for s in streams):
            return
        assert loop.time() < deadline, f"requests not running on both replicas: {loads}"
        await asyncio.sleep(0.02)


def _targets(node, free_blocks: int = 700) -> list[w_pb.MigrationTarget]:
    return [w_pb.MigrationTarget(instance_id="c0", address=node.workers["c0"].address, free_blocks=free_blocks,
                                 block_size=16, free_slots=64)]


async def _start(node, n: int) -> tuple[list[Stream], list[asyncio.Task]]:
    stub = node.generation()
    streams = [Stream(gen_pb.GenerateRequest(model=COLOCATED_MODEL, token_ids=prompt(40 + k, k), max_tokens=MAX_TOKENS,
                                             ignore_eos=True)) for k in range(n)]
    tasks = [asyncio.create_task(s.run(stub, timeout_s=120)) for s in streams]
    await _running_on_both(node, streams)
    return streams, tasks


def _assert_exact(streams) -> None:
    for s in streams:
        assert s.code is grpc.StatusCode.OK, (s.code, s.details)
        assert s.tokens == expected_tokens(list(s.request.token_ids.ids), MAX_TOKENS), s.request_id


@pytest.mark.asyncio(loop_scope="function")
async def test_draining_worker_migrates_running_decodes_exactly():
    node = await start_inprocess_node(node_config_from_dict(two_replica_config()), time_scale=TIME_SCALE)
    try:
        streams, tasks = await _start(node, 6)
        source = node.servicers["c1"]
        on_c1 = set(source.tasks)
        assert on_c1
        source.draining = True  # as SetRole does: no new request reaches it
        moved, kept = await migrate_out(source, _targets(node), 1.0)
        assert moved == len(on_c1) and not kept
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        _assert_exact(streams)
        # The source's part ended once the router released the hand-off: no request, no KV left there.
        assert source.in_flight == 0 and not source.migrating
        load = await node.load("c1")
        assert load.num_free_blocks == load.num_total_blocks and load.num_running == 0
        servicer = node.router_servicer
        decisions = source.metrics.migration_decisions.labels("c1", migration.MIGRATE)._value.get()
        assert decisions == len(on_c1)
        assert not servicer.requests  # every request finished at the router
        followed = servicer.metrics.migrations.labels(COLOCATED_MODEL, "followed")._value.get()
        assert followed == len(on_c1)
    finally:
        await node.stop()


@pytest.mark.asyncio(loop_scope="function")
async def test_refused_migration_falls_back_to_drain():
    node = await start_inprocess_node(node_config_from_dict(two_replica_config()), time_scale=TIME_SCALE)
    try:
        streams, tasks = await _start(node, 4)
        source, target = node.servicers["c1"], node.servicers["c0"]
        on_c1 = set(source.tasks)
        target.draining = True  # the target refuses every reservation (UNAVAILABLE), whatever the plan thought
        source.draining = True
        moved, kept = await migrate_out(source, _targets(node), 1.0)
        assert moved == 0 and dict(kept) == {migration.TARGET_REFUSED: len(on_c1)}
        assert set(source.tasks) == on_c1  # they decode on where they were
        target.draining = False
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        _assert_exact(streams)
        # A plan that sees no room keeps them too (target_full), without asking the target.
    finally:
        await node.stop()


@pytest.mark.asyncio(loop_scope="function")
async def test_a_target_whose_step_would_miss_the_itl_budget_keeps_them_here():
    """The SetRole's ITL budget: the target has slots and KV for every request, but its decode step by the cost
    model with even one of them added (an 8B step is milliseconds) is over a 0.1 ms budget: each stays and drains
    (`target_itl`, counted), and its stream is exact."""
    node = await start_inprocess_node(node_config_from_dict(two_replica_config()), time_scale=TIME_SCALE)
    try:
        streams, tasks = await _start(node, 4)
        source = node.servicers["c1"]
        on_c1 = set(source.tasks)
        source.draining = True
        targets = _targets(node)
        targets[0].decode_batch, targets[0].kv_tokens, targets[0].tensor_parallel = 2, 200, 1
        moved, kept = await migrate_out(source, targets, 1.0, itl_budget_s=1e-4)
        assert moved == 0 and dict(kept) == {migration.TARGET_ITL: len(on_c1)}
        counted = source.metrics.migration_decisions.labels("c1", migration.TARGET_ITL)._value.get()
        assert counted == len(on_c1)
        assert set(source.tasks) == on_c1  # they decode on where they were
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        _assert_exact(streams)
    finally:
        await node.stop()


def test_scheduler_names_each_targets_batch_kv_and_tp():
    """What the scheduler sends a draining worker about each target: its last reported batch and KV in use (blocks
    in use x block size) and its TP degree, for the target's step by the cost model."""
    from octoserve.services.core.types import EngineLoad, Role
    from octoserve.services.scheduler.service import SchedulerServicer

    s = SchedulerServicer(node_config_from_dict(two_replica_config()))
    for iid, (running, free) in {"c0": (3, 650), "c1": (5, 600)}.items():
        s.loads[iid] = EngineLoad(iid, COLOCATED_MODEL, Role.COLOCATED, running, 0, 703, free, 16, 0, 1e4, 0.006,
                                  max_num_seqs=64)
        s.addresses[iid] = "127.0.0.1:1"
    (t,) = s.elastic.migration_targets("c1", {"c1"})
    assert (t.instance_id, t.free_slots, t.free_blocks, t.decode_batch, t.kv_tokens, t.tensor_parallel) == (
        "c0", 61, 650, 3, (703 - 650) * 16, 1)


@pytest.mark.asyncio(loop_scope="function")
async def test_no_room_in_the_plan_keeps_requests():
    node = await start_inprocess_node(node_config_from_dict(two_replica_config()), time_scale=TIME_SCALE)
    try:
        streams, tasks = await _start(node, 4)
        source = node.servicers["c1"]
        on_c1 = set(source.tasks)
        source.draining = True
        moved, kept = await migrate_out(source, _targets(node, free_blocks=1), 1.0)
        assert moved == 0 and dict(kept) == {migration.TARGET_FULL: len(on_c1)}
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        _assert_exact(streams)
    finally:
        await node.stop()


@pytest.mark.asyncio(loop_scope="function")
async def test_disaggregated_decode_migrates_to_the_other_decode_instance():
    from tests.fault_fixtures import disagg_config, until
    from tests.service_fixtures import DISAGG_MODEL

    node = await start_inprocess_node(node_config_from_dict(disagg_config()), time_scale=TIME_SCALE)
    try:
        stub = node.generation()
        streams = [Stream(gen_pb.GenerateRequest(model=DISAGG_MODEL, token_ids=prompt(40 + k, 50 + k),
                                                 max_tokens=MAX_TOKENS, ignore_eos=True)) for k in range(6)]
        tasks = [asyncio.create_task(s.run(stub, timeout_s=120)) for s in streams]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while not all(len(s.tokens) >= 4 for s in streams) or not node.servicers["d1"].tasks:
            assert loop.time() < deadline, "the decode instances never ran the requests"
            await asyncio.sleep(0.02)
        source = node.servicers["d1"]
        on_d1 = set(source.tasks)
        source.draining = True
        targets = [w_pb.MigrationTarget(instance_id="d0", address=node.workers["d0"].address, free_blocks=700,
                                        block_size=16, free_slots=64)]
        moved, kept = await migrate_out(source, targets, 1.0)
        assert moved == len(on_d1) and not kept
        # The router now knows them on (their prefill instance, d0): d1 could go away without concerning them.
        # (the markers reach the router on d1's session after migrate_out returned)
        def placed() -> dict:
            return {rid: st.instance_ids for rid, st in node.router_servicer.requests.items() if rid in on_d1}
        async def followed() -> bool:
            return all(ids[-1] == "d0" and "d1" not in ids for ids in placed().values())
        await until(followed, 30, "the router follows the hand-offs")
        assert len(placed()) == len(on_d1)
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        _assert_exact(streams)
        assert source.in_flight == 0
    finally:
        await node.stop()


async def _start_switchable_worker(instance_id: str):
    """A sim worker of `two_replica_config()`'s colocated instance `instance_id`, behind the role switch a real worker
    process runs, served over gRPC on 127.0.0.1; returns (running service, switch)."""
    import argparse

    from octoserve.services.core.types import Role
    from octoserve.services.engine.factory import make_engine
    from octoserve.services.rpc import role_switch
    from octoserve.services.rpc.hardening import add_servicer
    from octoserve.services.rpc.server import ServiceSpec, start_service
    from octoserve.services.rpc.worker_main import WORKER_SERVICE
    from tests.service_fixtures import WORKER_DESCRIPTOR

    config = node_config_from_dict(two_replica_config())
    first = role_switch.servicer_for_role(Role.COLOCATED,
                                          make_engine(config, instance_id, engine="sim", time_scale=1.0))
    first.model_spec = config.models[COLOCATED_MODEL]
    args = argparse.Namespace(engine="sim", instance=instance_id, time_scale=1.0)
    switch = role_switch.RoleSwitch(first, role_switch.rebuilder(config, args, first))
    spec = ServiceSpec(name=f"worker:{instance_id}", metrics_port=None, grace_s=1.0, service_names=(WORKER_SERVICE,),
                       add_servicers=lambda server: add_servicer(switch, WORKER_DESCRIPTOR, server),
                       start=switch.start, drain=switch.drain, close=switch.close, registry=switch.metrics.registry)
    return await start_service(spec), switch


@pytest.mark.asyncio(loop_scope="function")
async def test_after_a_role_change_a_stale_route_is_unavailable_so_the_router_places_it_elsewhere():
    """A drain that migrates ends within milliseconds, possibly before a router saw the DRAINING placement: a
    start RPC for the old role then answers UNAVAILABLE (the router re-routes a request with no token yet), not
    FAILED_PRECONDITION (which would fail it). A worker that never changed role keeps the FAILED_PRECONDITION."""
    from octoserve.services.rpc import convert
    from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc
    from octoserve.services.core.types import Role
    from tests.service_fixtures import request as public_request

    running, _ = await _start_switchable_worker("c0")
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = w_grpc.WorkerStub(channel)
            pb_spec = convert.spec_to_pb(convert.spec_from_public(public_request(), "r1", 0.0, None))
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Prefill(w_pb.PrefillRequest(spec=pb_spec), timeout=5)
            assert e.value.code() is grpc.StatusCode.FAILED_PRECONDITION  # never changed role: a caller's mistake
            await stub.SetRole(w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[Role.DECODE]), timeout=10)
            for call in (stub.Generate(w_pb.WorkerGenerateRequest(session_id="s", spec=pb_spec), timeout=5),
                         stub.Prefill(w_pb.PrefillRequest(spec=pb_spec), timeout=5)):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call
                assert e.value.code() is grpc.StatusCode.UNAVAILABLE and "route elsewhere" in e.value.details()
            reply = await stub.Reserve(w_pb.ReserveRequest(spec=pb_spec), timeout=5)  # the new role serves it
            assert reply.reserved
    finally:
        await running.shutdown()


# ---- the node as processes: the scheduler's reconfiguration migrates, the router follows -----------------------------

def _migrate_config() -> dict:
    """The colocated 8B on c0, c1, and another 8B on y0 (the model c1's GPU goes to)."""
    from tests.fault_fixtures import INSTANCE
    from tests.service_fixtures import MAX_CONTEXT

    spec = {"preset": "llama-3-8b", "max_context_len": MAX_CONTEXT}
    return {
        "gpu": "h100-sxm-80gb", "num_gpus": 8,
        "models": {COLOCATED_MODEL: spec, OTHER_MODEL: spec},
        "instances": [
            {"id": "c0", "model": COLOCATED_MODEL, "role": "colocated", "gpu_ids": [0], **INSTANCE},
            {"id": "c1", "model": COLOCATED_MODEL, "role": "colocated", "gpu_ids": [1], **INSTANCE},
            {"id": "y0", "model": OTHER_MODEL, "role": "colocated", "gpu_ids": [2], **INSTANCE},
        ],
    }


OTHER_MODEL = "llama-3-8b-other"


@pytest.mark.slow
@pytest.mark.asyncio(loop_scope="function")
async def test_model_change_under_load_migrates_and_router_follows(tmp_path):
    from octoserve.services.node.launcher import start_node
    from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
    from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc
    from octoserve.v1 import generate_pb2_grpc as gen_grpc
    from tests.fault_fixtures import access_log, load

    node = start_node(_migrate_config(), time_scale=TIME_SCALE, run_dir=tmp_path, startup_timeout_s=90, grace_s=3,
                      router_args=("--access-log", "all"))
    try:
        async with grpc.aio.insecure_channel(node.router_address) as rch, \
                grpc.aio.insecure_channel(node.scheduler.address) as sch:
            router, scheduler = gen_grpc.GenerationStub(rch), s_grpc.SchedulerStub(sch)
            streams = [Stream(gen_pb.GenerateRequest(model=COLOCATED_MODEL, token_ids=prompt(40 + k, 100 + k),
                                                     max_tokens=MAX_TOKENS, ignore_eos=True)) for k in range(8)]
            loop = asyncio.get_running_loop()
            ended_at: list[float] = []

            async def run(s: Stream) -> None:
                await s.run(router, timeout_s=180)
                ended_at.append(loop.time())

            tasks = [asyncio.create_task(run(s)) for s in streams]
            deadline = loop.time() + 60
            while (await load(node.workers["c1"].address)).num_running < 2 or any(len(s.tokens) < 4 for s in streams):
                assert loop.time() < deadline, "c1 never ran two requests"
                await asyncio.sleep(0.05)
            called_at = loop.time()
            reply = await scheduler.Reconfigure(s_pb.ReconfigureRequest(model_change=s_pb.ModelChange(
                retire=["c1"], model=OTHER_MODEL, role=w_pb.COLOCATED, tensor_parallel=1), reason="test: migrate"),
                timeout=180)
            # The running decodes on c1 moved to c0: c1's drain did not wait for them to finish. They were still
            # running when the drain ended (the new model's start after it may outlast them on a loaded machine).
            assert 2 <= reply.migrated_requests <= reply.drained_requests
            drained_at = called_at + reply.drain_s
            assert sum(1 for t in ended_at if t > drained_at) + sum(1 for s in streams if s.code is None) \
                >= reply.migrated_requests
            await asyncio.wait_for(asyncio.gather(*tasks), 180)
        _assert_exact(streams)
        log = access_log(node)
        moved = [e for e in log.values() if e["instances"] == ["c1", "c0"]]
        assert len(moved) == reply.migrated_requests, [e["instances"] for e in log.values()]
        assert all(e["code"] == "OK" for e in log.values()) and len(log) == len(streams)
    finally:
        node.stop()


@pytest.mark.asyncio(loop_scope="function")
async def test_set_role_with_a_target_tp_the_model_cannot_take_is_invalid_and_changes_nothing():
    from octoserve.services.core.types import Role
    from octoserve.services.rpc import convert
    from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc

    running, switch = await _start_switchable_worker("c1")
    try:
        async with grpc.aio.insecure_channel(running.address) as channel:
            stub = w_grpc.WorkerStub(channel)
            bad = w_pb.MigrationTarget(instance_id="c0", address="127.0.0.1:1", free_blocks=700, block_size=16,
                                       free_slots=64, tensor_parallel=3)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.SetRole(w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[Role.DECODE], migration_targets=[bad],
                                                       migration_itl_budget_s=0.03), timeout=10)
            assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert e.value.details().startswith("migration target 'c0': ")
            assert "tp=3 must divide num_attention_heads=32" in e.value.details()
            assert not switch.inner.draining and switch.inner.engine.role is Role.COLOCATED and not switch.role_changes
    finally:
        await running.shutdown()
