"""Builds the engine of one instance of a node config: `make_engine(node_cfg, instance_id, engine=...)`.

Engines are imported only when chosen, so a sim-only install never imports vLLM. Besides "sim" and "vllm", a
`package.module:callable` name builds an engine from any callable with make_engine's signature (tests, plug-ins).
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any

from octoserve.services.engine.base import Engine

ENGINE_NAMES = ("sim", "vllm")


def make_engine(
    node_cfg: Any,
    instance_id: str,
    *,
    engine: str = "sim",
    time_scale: float = 1.0,
    model_path: str | None = None,
    seed: int = 0,
    flippable: bool = False,
) -> Engine:
    """The Engine for `instance_id` of `node_cfg` (a octoserve.services.core.placement.NodeConfig).

    `flippable`: a vllm engine whose role can change later without a restart (KV connector role "kv_both"); a sim
    engine's role change builds a new sim engine, so it ignores this.
    """
    try:
        instance = node_cfg.instance(instance_id)
    except KeyError:
        known = ", ".join(i.id for i in node_cfg.instances)
        raise ValueError(f"instance {instance_id!r} is not in the node config; choose one of: {known}") from None
    if engine == "sim":
        return make_sim_engine(node_cfg, instance, time_scale=time_scale)
    if engine == "vllm":
        if not model_path:
            raise ValueError("the vllm engine needs --model DIR (a local model directory)")
        from octoserve.services.engine.vllm_engine import make_vllm_engine

        return make_vllm_engine(instance, model_path, node_cfg=node_cfg, flippable=flippable)
    if ":" in engine:
        module_name, _, attr = engine.partition(":")
        factory = getattr(importlib.import_module(module_name), attr)
        return factory(node_cfg, instance_id, time_scale=time_scale, model_path=model_path, seed=seed)
    raise ValueError(f"unknown engine {engine!r}; choose one of: {', '.join(ENGINE_NAMES)} (or module:callable)")


def make_sim_engine(node_cfg: Any, instance: Any, *, time_scale: float = 1.0) -> Engine:
    """A SimEngine built from the same parts the discrete-event simulator uses (octoserve.services.core.instance)."""
    from octoserve.services.core.instance import gang_share, instance_parts
    from octoserve.services.engine.sim_engine import SimEngine

    parts = instance_parts(node_cfg, instance)
    engine = SimEngine(
        instance.id, instance.model, parts.batcher_config, parts.new_kv(instance), parts.cost_model,
        time_scale=time_scale, gang=gang_share(node_cfg, instance),
    )
    engine.batcher_config_for = lambda role: instance_parts(
        node_cfg, dataclasses.replace(instance, role=role), parts.cost_model).batcher_config
    return engine
