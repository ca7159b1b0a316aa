"""Elastic pools in the scheduler: the live placement, its watch stream, and carrying out reconfigurations.

- `LivePlacement`: the instances the node serves now (id -> InstanceConfig), each SERVING, DRAINING or STARTING,
  and a version that grows with every change. `WatchPlacement` subscribers get a full snapshot after each change
  (snapshots, not deltas: a router that missed some, or re-subscribes after a scheduler restart, is current at once).
- `ElasticRunner.run(r)`: one `Reconfiguration` (services/core/reconfig.py), one at a time per instance:
  1. DRAINING: the retired instances are published as draining (routers stop placing new requests there) and told
     to drain (`Worker.SetRole`): requests that reach them anyway answer UNAVAILABLE before their first token, so
     the router places them elsewhere. Their running decodes migrate by KV hand-off to the other serving
     instances of the same model named in the SetRole (`migration_targets`, with the headroom this scheduler last
     saw) when the hand-off is shorter than their remaining decode and a target has room (the rule in
     services/core/migration.py, decided on the worker, which knows each request); the other running requests,
     held hand-offs and reservations finish there. `drain_only` (or `elastic.migrate: false`) migrates none.
  2. SWITCHING: a role change switches the worker's role in its process and publishes the new role. A model change
     removes the retired instances from the placement (the launcher stops their processes) and adds the started
     ones as STARTING (the launcher starts their workers on the freed GPUs); once each registered, it waits the
     modelled weight-load time (weights over PCIe from host memory, x the node's time scale), then publishes them
     SERVING.
  A drain that does not end within the drain timeout aborts the reconfiguration: the instances serve again.
  No request is dropped in any phase.
- `BalancerLoop`: every `period_s`, hands the windowed loads to a `Balancer` (the protocol in core/reconfig.py) and
  runs what it plans. Off unless the `elastic` section of the node config names a balancer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import importlib
import json
import logging
import os
import time
import uuid
from collections.abc import Mapping

import grpc

from octoserve.services.core import migration
from octoserve.services.core.migration import DEFAULT_MAX_PAUSE_S
from octoserve.services.core.placement import InstanceConfig, NodeConfig
from octoserve.services.core.reconfig import (
    Phase,
    ReconfigKind,
    Reconfiguration,
    advance,
    check_reconfiguration,
    in_place_role,
)
from octoserve.services.core.types import Role
from octoserve.services.rpc import convert
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import worker_pb2 as w_pb

log = logging.getLogger("octoserve.scheduler.elastic")

DEFAULT_DRAIN_TIMEOUT_S = 60.0
START_TIMEOUT_S = 120.0  # a model change's new worker must register and report load within this
POLL_S = 0.02


class State(str, enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    STARTING = "starting"


STATE_TO_PB = {State.SERVING: s_pb.INSTANCE_SERVING, State.DRAINING: s_pb.INSTANCE_DRAINING,
               State.STARTING: s_pb.INSTANCE_STARTING}


class ReconfigError(Exception):
    """A reconfiguration that cannot start or did not finish; `code` is the gRPC status to answer."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def weight_load_s(config: NodeConfig, inst: InstanceConfig) -> float:
    """Modelled time to load `inst`'s weights from host memory: each GPU copies its shard over its own PCIe link."""
    return config.models[inst.model].weight_bytes_per_gpu(inst.tp) / config.gpu.pcie_bytes_per_s


def instance_from_dict(d: Mapping) -> InstanceConfig:
    return InstanceConfig(**{**d, "role": Role(d["role"]), "gpu_ids": tuple(d["gpu_ids"])})


def instance_to_dict(inst: InstanceConfig) -> dict:
    d = dataclasses.asdict(inst)
    d["role"] = inst.role.value
    d["gpu_ids"] = list(inst.gpu_ids)
    return d


class LivePlacement:
    """`state_file`: the instances are written there after every change and read back at start, so a restarted
    scheduler serves the placement its reconfigurations made (not the config file's)."""

    def __init__(self, config: NodeConfig, state_file: str | None = None) -> None:
        self.config = config
        self.state_file = state_file
        self.instances: dict[str, InstanceConfig] = {i.id: i for i in config.instances}
        if state_file and os.path.exists(state_file):
            with open(state_file, encoding="utf-8") as f:
                saved = [instance_from_dict(d) for d in json.load(f)["instances"]]
            self.instances = {i.id: i for i in saved}
            log.info("placement restored", extra={"fields": {"file": state_file, "instances": list(self.instances)}})
        self.states: dict[str, State] = {i: State.SERVING for i in self.instances}
        # Per instance, grows when a drained role change replaced its worker's engine and servicer (routers open a
        # new session then; an in-place change keeps it). Kept in `state_file` too.
        self.generations: dict[str, int] = {i: 1 for i in self.instances}
        if state_file and os.path.exists(state_file):
            with open(state_file, encoding="utf-8") as f:
                self.generations.update({k: int(v) for k, v in json.load(f).get("generations", {}).items()
                                         if k in self.instances})
        self.version = 1
        self._changed = asyncio.Condition()

    def node_config(self) -> NodeConfig:
        return dataclasses.replace(self.config, instances=tuple(self.instances.values()))

    async def publish(self) -> None:
        self.version += 1
        if self.state_file:
            tmp = f"{self.state_file}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump({"instances": [instance_to_dict(i) for i in self.instances.values()],
                           "generations": {i: self.generations.get(i, 1) for i in self.instances}}, f)
            os.replace(tmp, self.state_file)
        async with self._changed:
            self._changed.notify_all()

    async def wait_change(self, seen: int) -> None:
        async with self._changed:
            await self._changed.wait_for(lambda: self.version != seen)

    def snapshot(self, addresses: Mapping[str, str]) -> s_pb.Placement:
        instances = [
            s_pb.InstancePlacement(
                instance_id=i.id, model=i.model, role=convert.ROLE_TO_PB[i.role], gpu_ids=i.gpu_ids,
                tensor_parallel=i.tp, address=addresses.get(i.id, ""),
                context_window=self.config.models[i.model].max_context_len, state=STATE_TO_PB[self.states[i.id]],
                instance_config_json=json.dumps(instance_to_dict(i)), engine_generation=self.generations.get(i.id, 1),
            )
            for i in self.instances.values()
        ]
        return s_pb.Placement(instances=instances, complete=all(p.address for p in instances), version=self.version)


def reconfiguration_from_pb(request: s_pb.ReconfigureRequest, current: Mapping[str, InstanceConfig],
                            config: NodeConfig) -> Reconfiguration:
    """The admin request as a `Reconfiguration`; raises ReconfigError (INVALID_ARGUMENT) naming what to change."""
    rid = uuid.uuid4().hex[:8]
    reason = request.reason or "requested by an operator"
    which = request.WhichOneof("change")
    if which == "role_change":
        rc = request.role_change
        if rc.instance_id not in current:
            raise ReconfigError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"no instance {rc.instance_id!r}; choose one of {', '.join(current)}")
        role = convert.ROLE_FROM_PB.get(rc.role)
        if role is None:
            raise ReconfigError(grpc.StatusCode.INVALID_ARGUMENT, "role_change.role is not a role; send colocated, prefill or decode")
        inst = dataclasses.replace(current[rc.instance_id], role=role)
        if rc.in_place and not in_place_role(current[rc.instance_id].role, role):
            raise ReconfigError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"role_change.in_place: only decode <-> colocated runs in place, not "
                                f"{current[rc.instance_id].role.value} -> {role.value}; send in_place false to drain")
        return Reconfiguration(rid, ReconfigKind.ROLE, (inst.id,), (inst,), reason, in_place=rc.in_place)
    if which == "model_change":
        mc = request.model_change
        missing = [i for i in mc.retire if i not in current]
        if not mc.retire or missing:
            raise ReconfigError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"model_change.retire must name instances of this node (unknown: {missing}); choose from "
                                f"{', '.join(current)}")
        if mc.model not in config.models:
            raise ReconfigError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"unknown model {mc.model!r}; choose one of {', '.join(config.models)}")
        role = convert.ROLE_FROM_PB.get(mc.role, Role.COLOCATED)
        tp = mc.tensor_parallel or 1
        gpus = sorted(g for i in mc.retire for g in current[i].gpu_ids)
        if len(gpus) % tp:
            raise ReconfigError(grpc.StatusCode.INVALID_ARGUMENT,
                                f"the retired instances free {len(gpus)} GPUs, not a multiple of tensor_parallel {tp}; "
                                "choose a tensor_parallel that divides it")
        like = next((i for i in current.values() if i.model == mc.model), None)
        base = {} if like is None else {k: getattr(like, k) for k in (
            "max_num_seqs", "max_num_batched_tokens", "gpu_memory_utilization", "block_size", "enable_prefix_caching")}
        start = tuple(
            InstanceConfig(id=f"{mc.model}-e{rid}-{n}", model=mc.model, role=role, tp=tp,
                           gpu_ids=tuple(gpus[n * tp:(n + 1) * tp]), **base)
            for n in range(len(gpus) // tp))
        load_s = max(weight_load_s(config, inst) for inst in start)
        return Reconfiguration(rid, ReconfigKind.MODEL, tuple(mc.retire), start, reason, load_s=load_s)
    raise ReconfigError(grpc.StatusCode.INVALID_ARGUMENT, "send a role_change or a model_change")


@dataclasses.dataclass
class Outcome:
    reconfig: Reconfiguration
    phase: Phase = Phase.PLANNED
    drain_s: float = 0.0
    switch_s: float = 0.0
    drained_requests: int = 0
    migrated_requests: int = 0
    kept_by_reason: dict = dataclasses.field(default_factory=dict)  # running decodes that did not migrate, why
    error: str = ""


class ElasticRunner:
    """Carries out reconfigurations on the scheduler `s` (its placement, worker stubs, addresses, loads)."""

    def __init__(self, scheduler, time_scale: float = 1.0, drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S, *,
                 migrate: bool = True, max_migration_pause_s: float = DEFAULT_MAX_PAUSE_S) -> None:
        self.s = scheduler
        self.time_scale = time_scale
        self.drain_timeout_s = drain_timeout_s
        self.migrate = migrate
        self.max_migration_pause_s = max_migration_pause_s
        self.in_flight: dict[str, Reconfiguration] = {}
        self.history: list[Outcome] = []

    @property
    def placement(self) -> LivePlacement:
        return self.s.placement

    async def run(self, r: Reconfiguration, drain_timeout_s: float | None = None, drain_only: bool = False) -> Outcome:
        current = self.placement.instances
        problems = check_reconfiguration(current, r)
        busy = sorted({i for f in self.in_flight.values() for i in f.retire} & set(r.retire))
        not_serving = [i for i in r.retire if self.placement.states[i] is not State.SERVING or i not in self.s.addresses]
        if problems or busy or not_serving:
            raise ReconfigError(grpc.StatusCode.FAILED_PRECONDITION, "; ".join(
                problems + ([f"instances {busy} are already being reconfigured; retry when that ends"] if busy else [])
                + ([f"instances {not_serving} are not serving yet; retry when they are"] if not_serving else [])))
        out = Outcome(r)
        self.in_flight[r.reconfig_id] = r
        t0 = time.monotonic()
        log.info("reconfiguration planned", extra={"fields": {
            "id": r.reconfig_id, "kind": r.kind.value, "retire": list(r.retire), "start": [i.id for i in r.start],
            "reason": r.reason}})
        try:
            if r.in_place:
                return await self._in_place(r, out)
            out.phase = advance(out.phase, Phase.DRAINING)
            for i in r.retire:
                self.placement.states[i] = State.DRAINING
            await self.placement.publish()
            timeout_s = drain_timeout_s or self.drain_timeout_s
            role = r.start[0].role if r.kind is ReconfigKind.ROLE else None
            migrate = self.migrate and not drain_only
            replies = await asyncio.gather(*(self._set_role(i, role, timeout_s, migrate, set(r.retire))
                                             for i in r.retire), return_exceptions=True)
            if failed := [(i, e) for i, e in zip(r.retire, replies) if isinstance(e, BaseException)]:
                await self._abort(r, out, "; ".join(f"{i}: {e}" for i, e in failed))
                raise ReconfigError(grpc.StatusCode.ABORTED, out.error)
            out.drained_requests = sum(rep.drained_requests for rep in replies)
            out.migrated_requests = sum(rep.migrated_requests for rep in replies)
            for rep in replies:
                for reason, n in rep.kept_by_reason.items():
                    out.kept_by_reason[reason] = out.kept_by_reason.get(reason, 0) + n
            # A role change switches inside SetRole: the drain is what the workers measured, the rest is switching.
            out.drain_s = max(rep.drain_s for rep in replies)
            out.phase = advance(out.phase, Phase.SWITCHING)
            t1 = t0 + out.drain_s
            if r.kind is ReconfigKind.ROLE:
                inst = r.start[0]
                self.placement.instances[inst.id] = inst
                self.placement.states[inst.id] = State.SERVING
                self.placement.generations[inst.id] = self.placement.generations.get(inst.id, 1) + 1  # new servicer
                await self.placement.publish()
            else:
                await self._switch_model(r)
            out.switch_s = time.monotonic() - t1
            out.phase = advance(out.phase, Phase.DONE)
            log.info("reconfiguration done", extra={"fields": {
                "id": r.reconfig_id, "drain_s": round(out.drain_s, 3), "switch_s": round(out.switch_s, 3),
                "drained_requests": out.drained_requests, "migrated_requests": out.migrated_requests,
                "kept_by_reason": out.kept_by_reason}})
            return out
        finally:
            self.in_flight.pop(r.reconfig_id, None)
            self.history.append(out)

    async def _in_place(self, r: Reconfiguration, out: Outcome) -> Outcome:
        """Decode <-> colocated in place: the instance stays SERVING throughout; the worker sets its engine's role
        where it runs (nothing drains), then the placement names the new role under the same engine generation,
        so routers keep their sessions to it (router/placement_watch.py)."""
        inst = r.start[0]
        out.phase = advance(out.phase, Phase.SWITCHING)
        t0 = time.monotonic()
        request = w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[inst.role], in_place=True)
        try:
            await self.s._stub(inst.id).SetRole(request, timeout=self.drain_timeout_s)
        except grpc.aio.AioRpcError as e:
            await self._abort(r, out, f"{inst.id}: {e.code().name} {e.details()}")
            raise ReconfigError(e.code() if e.code() in (grpc.StatusCode.INVALID_ARGUMENT,
                                                          grpc.StatusCode.FAILED_PRECONDITION)
                                else grpc.StatusCode.ABORTED, out.error) from None
        self.placement.instances[inst.id] = inst
        await self.placement.publish()
        out.switch_s = time.monotonic() - t0
        out.phase = advance(out.phase, Phase.DONE)
        log.info("reconfiguration done in place", extra={"fields": {
            "id": r.reconfig_id, "instance": inst.id, "role": inst.role.value, "switch_s": round(out.switch_s, 3)}})
        return out

    async def _set_role(self, instance_id: str, role: Role | None, timeout_s: float, migrate: bool = False,
                        retiring: set[str] = frozenset()):
        request = w_pb.SetRoleRequest(role=convert.ROLE_TO_PB[role] if role else w_pb.ROLE_UNSPECIFIED,
                                      drain_timeout_ms=int(timeout_s * 1000),
                                      max_migration_pause_s=self.max_migration_pause_s)
        if migrate and self.placement.instances[instance_id].role is not Role.PREFILL:  # prefills have no decodes
            request.migration_targets.extend(self.migration_targets(instance_id, retiring))
            request.migration_itl_budget_s = self.s.config.slo.itl_ms / 1000.0  # the targets' step, moves added
        return await self.s._stub(instance_id).SetRole(request, timeout=timeout_s + 10.0)

    def migration_targets(self, instance_id: str, retiring: set[str]) -> list[w_pb.MigrationTarget]:
        """The instances that may take `instance_id`'s running decodes: same model, serving, not retiring, decoding
        (colocated or decode role), healthy, with their last reported headroom, batch and KV in use."""
        model = self.placement.instances[instance_id].model
        targets = []
        for iid, inst in self.placement.instances.items():
            load = self.s.loads.get(iid)
            if (iid in retiring or inst.model != model or inst.role is Role.PREFILL or load is None or not load.healthy
                    or self.placement.states.get(iid) is not State.SERVING or iid not in self.s.addresses):
                continue
            slots = max(0, load.max_num_seqs - load.num_running) if load.max_num_seqs else 1 << 16
            targets.append(w_pb.MigrationTarget(instance_id=iid, address=self.s.addresses[iid],
                                                free_blocks=load.num_free_blocks, block_size=load.block_size,
                                                free_slots=slots, decode_batch=load.num_running,
                                                kv_tokens=migration.kv_tokens_in_use(load), tensor_parallel=inst.tp))
        return targets

    async def _abort(self, r: Reconfiguration, out: Outcome, why: str) -> None:
        out.phase, out.error = advance(out.phase, Phase.ABORTED), f"reconfiguration {r.reconfig_id} aborted: {why}"
        log.warning("reconfiguration aborted", extra={"fields": {"id": r.reconfig_id, "why": why}})
        for i in r.retire:
            self.placement.states[i] = State.SERVING
        await self.placement.publish()

    async def _switch_model(self, r: Reconfiguration) -> None:
        for i in r.retire:
            self.placement.instances.pop(i, None)
            self.placement.states.pop(i, None)
            self.s.forget_worker(i)
        for inst in r.start:
            self.placement.instances[inst.id] = inst
            self.placement.states[inst.id] = State.STARTING
        await self.placement.publish()  # the launcher stops the retired workers and starts the new ones
        deadline = time.monotonic() + START_TIMEOUT_S
        while not all(i.id in self.s.addresses and (ld := self.s.loads.get(i.id)) is not None and ld.healthy
                      for i in r.start):
            if time.monotonic() > deadline:
                raise ReconfigError(grpc.StatusCode.DEADLINE_EXCEEDED,
                                    f"{[i.id for i in r.start]} did not start within {START_TIMEOUT_S:g} s: is the "
                                    "node run by the launcher (octoserve up), which starts workers for new instances?")
            await asyncio.sleep(POLL_S)
        await asyncio.sleep(r.load_s * self.time_scale)  # the weights load over PCIe: the GPUs serve nothing
        for inst in r.start:
            self.placement.states[inst.id] = State.SERVING
        await self.placement.publish()


def outcome_to_pb(out: Outcome) -> s_pb.ReconfigureReply:
    return s_pb.ReconfigureReply(
        reconfig_id=out.reconfig.reconfig_id, started=[i.id for i in out.reconfig.start], drain_s=out.drain_s,
        switch_s=out.switch_s, total_s=out.drain_s + out.switch_s, drained_requests=out.drained_requests,
        migrated_requests=out.migrated_requests)


class BalancerLoop:
    """Calls `balancer.plan(now_s, loads, in_flight)` every `period_s` (modelled seconds x time scale) and runs
    each planned reconfiguration; a refused or aborted one is logged with its reason and skipped."""

    def __init__(self, runner: ElasticRunner, balancer, period_s: float) -> None:
        self.runner, self.balancer, self.period_s = runner, balancer, period_s
        self._task: asyncio.Task | None = None
        self._running: set[asyncio.Task] = set()

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="elastic-balancer")

    async def close(self) -> None:
        for t in [self._task, *self._running]:
            if t is not None:
                t.cancel()

    async def _loop(self) -> None:
        scale = self.runner.time_scale
        while True:
            await asyncio.sleep(self.period_s * scale)
            try:
                now_s = time.monotonic() / scale
                view, in_flight = self.runner.s.live_view(now_s), list(self.runner.in_flight.values())
                # Off the event loop: a forward ranker plays moves forward for up to a second or so, while the
                # scheduler keeps answering (the view and the in-flight list are this moment's copies).
                plans = await asyncio.to_thread(self.balancer.plan, now_s, view, in_flight)
            except Exception:
                log.exception("balancer failed; no reconfiguration this period")
                continue
            for r in plans:
                task = asyncio.create_task(self._run(r))
                self._running.add(task)
                task.add_done_callback(self._running.discard)

    async def _run(self, r: Reconfiguration) -> None:
        try:
            await self.runner.run(r)
        except ReconfigError as e:
            log.warning("planned reconfiguration not carried out", extra={"fields": {
                "id": r.reconfig_id, "reason": r.reason, "why": str(e)}})


def balancer_from_section(section: Mapping | None, config: NodeConfig):
    """(balancer, period_s) from the node config's `elastic` section, or None when no balancer is configured.

    elastic:
      balancer: elastic                  # the ElasticBalancer (services/core/live_balancer.py), or
                                         # package.module:factory, called with the NodeConfig
      period_s: 10                       # modelled seconds between plans
      window_s: 10                       # modelled seconds of demand the balancer sees (elastic only)
      ranker: forward                    # rank moves by playing them forward (elastic only; default none)
      min_dwell_s: 20                    # ... and any BalancerPolicy field (elastic only)
    The balancer's plan gets a `live_balancer.LiveView` each period. (`migrate` and `max_migration_pause_s`
    configure the runner, with or without a balancer: see `migration_settings`.)
    """
    if not section or not section.get("balancer"):
        return None
    name = str(section["balancer"])
    period_s = float(section.get("period_s", 10.0))
    if period_s <= 0:
        raise ValueError(f"elastic.period_s must be > 0, got {period_s}")
    if name == "elastic":
        from octoserve.services.sim.live_ranker import elastic_balancer

        return elastic_balancer(config, section), period_s
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"elastic.balancer {name!r} must be 'elastic' or package.module:factory")
    return getattr(importlib.import_module(module), attr)(config), period_s


def migration_settings(section: Mapping | None) -> dict:
    """ElasticRunner keyword arguments from the node config's `elastic` section.

    elastic:
      migrate: true                      # a draining instance hands running decodes to other instances of its model
                                         # by KV hand-off when that is faster than finishing them (false: drain only)
      max_migration_pause_s: 1.0         # modelled seconds one hand-off may stall a request's stream
    """
    section = section or {}
    pause_s = float(section.get("max_migration_pause_s", DEFAULT_MAX_PAUSE_S))
    if pause_s <= 0:
        raise ValueError(f"elastic.max_migration_pause_s must be > 0, got {pause_s}")
    migrate = section.get("migrate", True)
    if not isinstance(migrate, bool):
        raise ValueError(f"elastic.migrate must be true or false, got {migrate!r}")
    return {"migrate": migrate, "max_migration_pause_s": pause_s}
