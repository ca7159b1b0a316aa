"""A worker whose role can change without a process restart (elastic pools): the gRPC server holds this object,
which forwards every Worker RPC to the servicer of the current role (decode_worker's for colocated/decode,
prefill_worker's for prefill), and swaps that servicer on SetRole.

SetRole: the current servicer stops taking new work (its start RPCs answer UNAVAILABLE, so the router places
those requests elsewhere; Decode of an existing reservation is still served), the running decodes that the
scheduler's migration targets should take move there by KV hand-off (services/rpc/migration.py), the other running
requests, held hand-offs and reservations finish (bounded by `drain_timeout_ms`; past it the role is kept, the instance takes
requests again and the call fails DEADLINE_EXCEEDED), then the worker serves in the new role. A sim engine is
rebuilt: a fresh engine of the new role for the same model is started in this process, and the old one stopped. A
vLLM engine started flippable (`--flippable`: KV connector role kv_both) keeps running: its role is set and it is
wrapped in the new role's servicer, with no engine stop or start (services/engine/vllm_reconfig.py). The old
servicer's load stream and token sessions end with it: peers reconnect to the new one (the router opens new ones
when the placement shows the new role).
ROLE_UNSPECIFIED drains and stays retired (a model change: the launcher then stops the process).

SetRole with `in_place` (decode <-> colocated only): no drain and no new servicer. Both roles are the decode
worker's, so the engine's role is set where it runs (`set_role_in_place`) and everything it holds stays: running
requests stream on over the same sessions, reservations made as a decode instance are still served (their Decode),
and prompts queued as a colocated one still run. From then on new work is taken in the new role (a Generate that
reaches a decode instance answers UNAVAILABLE, so the router places it elsewhere).

Any other engine (a vLLM engine not started flippable, a plug-in engine, a gang member) answers
FAILED_PRECONDITION to a role change.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable

import grpc

from octoserve.services.core.migration import DEFAULT_MAX_PAUSE_S
from octoserve.services.core.reconfig import in_place_role
from octoserve.services.core.types import Role
from octoserve.services.rpc import convert, submit
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc
from octoserve.services.rpc.migration import migrate_out, targets_problem

log = logging.getLogger("octoserve.worker")

DEFAULT_DRAIN_TIMEOUT_MS = 60_000
IDLE_POLL_S = 0.01


def is_idle(servicer) -> bool:
    """No running request, held hand-off (both in `in_flight`) or decode reservation."""
    return servicer.in_flight == 0 and not getattr(servicer, "reservations", None)


class _Calls:
    """Work-starting RPCs in progress on one servicer: one that passed its draining check may still be awaiting
    the engine (a reservation not yet recorded), so the drain waits for it too."""

    def __init__(self) -> None:
        self.count = 0


class RoleSwitch(w_grpc.WorkerServicer):
    """`rebuild(role)` returns a new, not yet started servicer (with its engine) of that role, or None when this
    worker's engine cannot change role in place."""

    def __init__(self, inner, rebuild: Callable[[Role], object | None]) -> None:
        self.inner = inner
        self._rebuild = rebuild
        self._calls: dict[int, _Calls] = {id(inner): _Calls()}
        self._lock = asyncio.Lock()
        self.retired = False
        self.role_changes = 0

    # ---- lifecycle (ServiceSpec hooks) and attributes the process reads ----------------------------------------

    @property
    def metrics(self):
        return self.inner.metrics

    async def start(self) -> None:
        await self.inner.start()

    async def drain(self, grace_s: float) -> None:
        await self.inner.drain(grace_s)

    async def close(self) -> None:
        await self.inner.close()

    # ---- SetRole ------------------------------------------------------------------------------------------------

    async def SetRole(self, request, context):
        role = convert.ROLE_FROM_PB.get(request.role)  # None: retire
        async with self._lock:
            old = self.inner
            if role is not None and role is old.engine.role and not old.draining:
                return w_pb.SetRoleReply()
            if request.in_place:
                return await self._in_place(old, role, context)
            timeout_s = (request.drain_timeout_ms or DEFAULT_DRAIN_TIMEOUT_MS) / 1000.0
            if (problem := targets_problem(old.engine, request.migration_targets)) is not None:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)  # before it drains: nothing changed
            old.draining = True
            drained = old.in_flight + len(getattr(old, "reservations", ()) or ())
            t0 = time.monotonic()
            migrated, kept = 0, {}
            if request.migration_targets:  # running decodes that should move go by KV hand-off first
                migrated, kept = await migrate_out(old, list(request.migration_targets),
                                                   request.max_migration_pause_s or DEFAULT_MAX_PAUSE_S,
                                                   request.migration_itl_budget_s)
            while not self._idle(old):
                if time.monotonic() - t0 > timeout_s:
                    old.draining = False
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        f"{old.engine.instance_id} still ran {old.in_flight} requests after "
                                        f"{timeout_s:g} s; it keeps its role and takes requests again: raise "
                                        "drain_timeout_ms or retry when the load is lower")
                await asyncio.sleep(IDLE_POLL_S)
            drain_s = time.monotonic() - t0
            if role is None:
                self.retired = True
                log.info("worker retired", extra={"fields": {"drained": drained, "drain_s": round(drain_s, 3)}})
                return w_pb.SetRoleReply(drained_requests=drained, drain_s=drain_s, migrated_requests=migrated,
                                         kept_by_reason=kept)
            old_role = old.engine.role
            new = self._rebuild(role)
            if new is None:
                old.draining = False
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"{old.engine.instance_id} runs an engine that cannot change role in place "
                                    "(a vllm worker needs --flippable); use a model change (drained stop and "
                                    "start) instead")
            same_engine = new.engine is old.engine  # a flippable vLLM engine: it keeps running
            if not same_engine:
                await new.start()
            while not self._idle(old):  # nothing may have started on the old servicer while the new one started
                await asyncio.sleep(IDLE_POLL_S)
            self._calls[id(new)] = _Calls()
            self.inner = new  # no await between the last idle check and here
            self.role_changes += 1
            self._calls.pop(id(old), None)
            for session in list(getattr(old, "sessions", {}).values()):
                session.close()  # ends the old token streams: routers re-attach to the new servicer
            if not same_engine:
                await old.close()
            log.info("worker role changed", extra={"fields": {
                "from": old_role.value, "to": role.value, "drained": drained, "drain_s": round(drain_s, 3),
                "same_engine": same_engine}})
            return w_pb.SetRoleReply(drained_requests=drained, drain_s=drain_s, migrated_requests=migrated,
                                     kept_by_reason=kept)

    async def _in_place(self, servicer, role: Role | None, context):
        old_role = servicer.engine.role
        if role is None or not in_place_role(old_role, role):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"only decode <-> colocated changes run in place, not {old_role.value} -> "
                                f"{role.value if role else 'retired'}; send in_place false to drain")
        set_role = getattr(servicer.engine, "set_role_in_place", None)
        if set_role is None or not set_role(role):
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                f"{servicer.engine.instance_id} runs an engine that cannot change role in place (a "
                                "vllm worker needs --flippable); send in_place false to drain")
        self.role_changes += 1
        log.info("worker role changed in place", extra={"fields": {
            "from": old_role.value, "to": role.value, "running": servicer.in_flight,
            "reservations": len(getattr(servicer, "reservations", ()) or ())}})
        return w_pb.SetRoleReply()

    # ---- forwarded RPCs -----------------------------------------------------------------------------------------

    def _idle(self, servicer) -> bool:
        calls = self._calls.get(id(servicer))
        return is_idle(servicer) and (calls is None or calls.count == 0)

    async def _starting(self, name: str, request, context):
        inner = self.inner
        if self.role_changes and not serves(name, request, inner.engine.role) and not _reserved_here(name, request, inner):
            # A router whose placement still shows the old role (a drain can now end within milliseconds, before the
            # placement update reached it): UNAVAILABLE before any token, so it places the request elsewhere.
            await context.abort(grpc.StatusCode.UNAVAILABLE,
                                f"{inner.engine.instance_id} now serves the {inner.engine.role.value} role; route "
                                "elsewhere (the placement changed)")
        calls = self._calls[id(inner)]
        calls.count += 1
        try:
            return await getattr(inner, name)(request, context)
        finally:
            calls.count -= 1

    async def Attach(self, request, context):
        result = self.inner.Attach(request, context)
        if not inspect.isasyncgen(result):  # a role without token streams answers FAILED_PRECONDITION
            await result
            return
        async for batch in result:
            yield batch

    async def WatchLoad(self, request, context):
        async for report in self.inner.WatchLoad(request, context):
            yield report

    async def Generate(self, request, context):
        return await self._starting("Generate", request, context)

    def Submit(self, request_iterator, context):
        return submit.serve_submit(self.Generate, request_iterator, context)  # each through the gate above

    async def Prefill(self, request, context):
        return await self._starting("Prefill", request, context)

    async def Reserve(self, request, context):
        return await self._starting("Reserve", request, context)

    async def Decode(self, request, context):
        return await self._starting("Decode", request, context)

    async def Release(self, request, context):
        return await self.inner.Release(request, context)

    async def Abort(self, request, context):
        return await self.inner.Abort(request, context)

    async def Pause(self, request, context):
        return await self.inner.Pause(request, context)

    async def Resume(self, request, context):
        return await self.inner.Resume(request, context)

    async def GetLoad(self, request, context):
        return await self.inner.GetLoad(request, context)

    def __getattr__(self, name: str):  # fields tests and the process read (engine, sessions, in_flight, ...)
        return getattr(self.__dict__["inner"], name)


def serves(rpc: str, request, role: Role) -> bool:
    """Whether a worker of `role` serves this work-starting RPC (a migration's Reserve / Decode: colocated too)."""
    if rpc == "Generate":
        return role is Role.COLOCATED
    if rpc == "Prefill":
        return role is Role.PREFILL
    migrated = bool(request.output_token_ids) if rpc == "Reserve" else bool(request.handoff.output_token_ids)
    return role is Role.DECODE or (migrated and role is Role.COLOCATED)


def _reserved_here(rpc: str, request, servicer) -> bool:
    """A Decode whose reservation this servicer holds: it was made before an in-place role change, and is served."""
    return rpc == "Decode" and request.spec.request_id in (getattr(servicer, "reservations", None) or {})


def servicer_for_role(role: Role, engine, like=None):
    """A new servicer of `role` around `engine`; keeps the fault plan of `like` (a decode servicer) when it has one."""
    if role is Role.PREFILL:
        from octoserve.prefill_worker.servicer import PrefillWorkerServicer

        return PrefillWorkerServicer(engine)
    from octoserve.decode_worker.servicer import DecodeWorkerServicer

    faults = getattr(like, "faults", None)
    return DecodeWorkerServicer(engine, **({"faults": faults} if faults is not None else {}))


def elastic_node(config_path: str | None) -> bool:
    """Whether the node config's `elastic` section names a balancer (its workers may be told to change role)."""
    from octoserve.services.config import load_service_sections

    section = load_service_sections(config_path).get("elastic") or {}
    return bool(section.get("balancer"))


def rebuilder(node_cfg, args, first) -> Callable[[Role], object | None]:
    """SetRole's factory for a worker process started with `args` (worker_main): a sim engine of the new role for
    the same instance and model; for a flippable vLLM engine, the same running engine in the new role; None for
    any other engine and for gang members (their GPUs are time-shared)."""
    import dataclasses

    from octoserve.services.engine.factory import make_engine

    def rebuild(role: Role):
        if node_cfg.gang is not None and node_cfg.gang.group_of(args.instance) is not None:
            return None
        if args.engine == "vllm":
            engine = first.engine
            if not getattr(engine, "flippable", False):
                return None
            engine.role = role  # the caller drained: nothing runs on the engine while its role changes
            return _wrap(servicer_for_role(role, engine, like=first), first)
        if args.engine != "sim":
            return None
        inst = dataclasses.replace(node_cfg.instance(args.instance), role=role)
        cfg = dataclasses.replace(node_cfg, instances=tuple(inst if i.id == inst.id else i for i in node_cfg.instances))
        engine = make_engine(cfg, args.instance, engine="sim", time_scale=args.time_scale)
        return _wrap(servicer_for_role(role, engine, like=first), first)

    return rebuild


def _wrap(servicer, first):
    servicer.model_spec = first.model_spec
    servicer.metrics = first.metrics  # one registry for the process: the /metrics endpoint keeps its series
    return servicer
