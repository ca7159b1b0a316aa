"""Reconfiguring one real engine slot in place: a role flip without a restart, a model change as a drained stop/start.

Job: carry out a `Reconfiguration` (services/core/reconfig.py) on one instance slot of a live node, whatever
drives it (the elastic scheduler through a worker RPC, a test, the benchmark script). `ReconfigurableInstance`
wraps the slot's engine behind the same `Engine` protocol the workers call, and adds an admission gate:
- ROLE (prefill <-> decode <-> colocated, same model): the engine must have been started with `flippable=True`
  (its vLLM KV connector runs as "kv_both", so it can both produce and consume KV). The gate closes, the requests
  in flight finish, then only the way the worker uses the engine changes: a PREFILL instance runs prompts with
  max_tokens 1 and leaves the KV for a decode instance (`prefill`), a DECODE instance reserves capacity and continues
  from received KV (`reserve` + `decode`). No restart, no weight reload.
- MODEL (another model on the same GPUs): the gate closes, the requests in flight finish, the engine shuts down
  (its processes get `stop_timeout_s` to exit: nothing runs any more) and an engine for the new instance config
  starts on the same slot (`build(config)`). Other instances of the old model
  keep serving meanwhile, so that model has no downtime; this slot's downtime is reported.

Phases follow `Phase`: DRAINING (new requests refused with `DrainingError`, running ones finish), SWITCHING, DONE.
A drain that does not finish within its timeout ends ABORTED: the gate opens again in the old role and nothing is
dropped. A model change whose new engine fails to start puts the old config back (ABORTED) when it can.

Invariants:
- Nothing admitted is lost: a request is admitted (counted in flight) before the gate can close behind it, and a
  switch begins only when the in-flight count is 0. A decode hand-off whose capacity was reserved before the drain
  began is still admitted during the drain (the reservation was a promise); `release` of an unused reservation
  ends it.
- A refusal is a typed `DrainingError` (a `CapacityError`: RESOURCE_EXHAUSTED at the worker edge), raised before
  anything runs, so the caller can send the request to another instance of the model. `reserve` answers False.
- Release and abort are never gated: they free KV and reservations.
- Times are `time.monotonic()` seconds (`clock` in tests).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import inspect
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from octoserve.services.core.placement import InstanceConfig
from octoserve.services.core.reconfig import Phase, ReconfigKind, Reconfiguration, advance, check_reconfiguration
from octoserve.services.core.types import EngineLoad, RequestOutput, RequestSpec, Role
from octoserve.services.engine import vllm_kv
from octoserve.services.engine.base import CapacityError, Engine, EngineError, KVHandoff

EngineBuilder = Callable[[InstanceConfig], Engine]


class DrainingError(CapacityError):
    """The instance is draining for a reconfiguration and takes no new request: send it to another instance."""


class ReconfigError(EngineError):
    """A reconfiguration that cannot be carried out on this slot; the message says what to change."""


@dataclass(frozen=True, slots=True)
class ReconfigReport:
    """What one reconfiguration of a slot did and how long the slot took no new request."""

    reconfig_id: str
    kind: ReconfigKind
    old_instance: InstanceConfig
    new_instance: InstanceConfig
    drained: tuple[str, ...]  # request ids in flight when the drain began; every one finished before the switch
    num_refused: int  # new requests refused during the drain and the switch (sent elsewhere by the caller)
    drain_s: float  # gate closed -> nothing in flight
    stop_s: float  # old engine shut down (MODEL only)
    start_s: float  # new engine started and warmed up (MODEL only)
    switch_s: float  # nothing in flight -> the gate opens in the new role / on the new model
    closed_at_s: float  # when the gate closed (the clock's time)
    opened_at_s: float  # when it opened again

    @property
    def num_drained(self) -> int:
        return len(self.drained)

    @property
    def downtime_s(self) -> float:
        """How long this instance took no new request (the model's other instances kept serving)."""
        return self.drain_s + self.switch_s


class ReconfigurableInstance:
    """One engine slot whose role or model can change while the node serves (see the module docstring)."""

    def __init__(
        self,
        engine: Engine,
        config: InstanceConfig,
        *,
        build: EngineBuilder | None = None,
        stop_timeout_s: float | None = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if (engine.instance_id, engine.model, engine.role) != (config.id, config.model, config.role):
            raise ValueError(f"engine {engine.instance_id}/{engine.model}/{engine.role.value} does not match its "
                             f"config {config.id}/{config.model}/{config.role.value}")
        self.engine = engine
        self.config = config
        self.phase = Phase.DONE
        self.reconfig_id = ""
        self.num_refused = 0  # since start
        self._build = build
        # How long a drained engine's processes get to exit before they are killed (VllmEngine.stop's timeout_s;
        # vLLM's own default, 5 s, is always used up by the CPU engine core). None: the engine's default.
        self.stop_timeout_s = stop_timeout_s
        self._clock = clock
        self._accepting = True
        self._in_flight: collections.Counter[str] = collections.Counter()  # request id -> admissions running
        self._reserved: set[str] = set()  # decode reservations admitted before a drain: they count as in flight
        self._idle = asyncio.Event()
        self._idle.set()
        self._lock = asyncio.Lock()  # one reconfiguration at a time

    # ----------------------------------------------------------------- Engine protocol

    @property
    def instance_id(self) -> str:
        return self.engine.instance_id

    @property
    def model(self) -> str:
        return self.engine.model

    @property
    def role(self) -> Role:
        return self.engine.role

    @property
    def accepting(self) -> bool:
        """False while a reconfiguration drains or switches this slot."""
        return self._accepting

    @property
    def num_in_flight(self) -> int:
        return sum(self._in_flight.values())

    @property
    def in_flight_ids(self) -> tuple[str, ...]:
        return tuple(sorted(self._in_flight))

    async def start(self) -> None:
        await self.engine.start()

    async def stop(self) -> None:
        await self.engine.stop()

    def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        self._admit(spec.request_id)
        return self._counted(self.engine.generate, spec)

    async def prefill(self, spec: RequestSpec) -> KVHandoff:
        self._admit(spec.request_id)
        try:
            return await self.engine.prefill(spec)
        finally:
            self._done(spec.request_id)

    async def reserve(self, spec: RequestSpec) -> bool:
        if not self._accepting:
            self.num_refused += 1
            return False
        self._enter(spec.request_id)
        try:
            ok = await self.engine.reserve(spec)
        except BaseException:
            self._done(spec.request_id)
            raise
        if ok:
            self._reserved.add(spec.request_id)  # stays in flight until decode() or release()
        else:
            self._done(spec.request_id)
        return ok

    def decode(self, spec: RequestSpec, handoff: KVHandoff) -> AsyncIterator[RequestOutput]:
        if spec.request_id in self._reserved:
            self._reserved.discard(spec.request_id)  # its in-flight count moves to the stream
        else:
            self._admit(spec.request_id)
        return self._counted(lambda s: self.engine.decode(s, handoff), spec)

    async def release(self, request_id: str) -> None:
        if request_id in self._reserved:
            self._reserved.discard(request_id)
            self._done(request_id)
        await self.engine.release(request_id)

    async def abort(self, request_id: str) -> None:
        await self.engine.abort(request_id)

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    def load(self) -> EngineLoad:
        return self.engine.load()

    # ----------------------------------------------------------------- reconfiguration

    async def apply(
        self, r: Reconfiguration, *, current: Mapping[str, InstanceConfig] | None = None, drain_timeout_s: float = 60.0
    ) -> ReconfigReport:
        """Carry out `r` on this slot: it must retire this instance and start exactly one instance in its place.

        `current` (the node's instances, id -> config) is checked with `check_reconfiguration` first when given.
        """
        if current is not None and (problems := check_reconfiguration(current, r)):
            raise ReconfigError("; ".join(problems))
        if r.retire != (self.instance_id,) or len(r.start) != 1:
            raise ReconfigError(f"{r.reconfig_id}: a slot carries out a reconfiguration that retires exactly its own "
                                f"instance {self.instance_id!r} and starts one; got retire={list(r.retire)}, "
                                f"start={[i.id for i in r.start]} (split it into one reconfiguration per slot)")
        new = r.start[0]
        if r.kind is ReconfigKind.ROLE:
            if new.id != self.instance_id or new.model != self.model:
                raise ReconfigError(f"{r.reconfig_id}: a role change keeps the instance id and the model")
            return await self.change_role(new.role, reconfig_id=r.reconfig_id, drain_timeout_s=drain_timeout_s)
        return await self.change_model(new, reconfig_id=r.reconfig_id, drain_timeout_s=drain_timeout_s)

    async def change_role(self, role: Role, *, reconfig_id: str = "", drain_timeout_s: float = 60.0) -> ReconfigReport:
        """Drain, then serve as `role` on the same running engine (no restart)."""
        if not getattr(self.engine, "flippable", False):
            raise ReconfigError(f"{self.instance_id} was not started flippable: build its engine with "
                                "flippable=True (KV connector role kv_both) to change its role without a restart")
        async with self._lock:
            old = self.config
            new = dataclasses.replace(old, role=role)
            refused_before = self.num_refused
            closed, drained = self._clock(), await self._drain(reconfig_id, drain_timeout_s)
            t0 = self._clock()
            self.phase = advance(self.phase, Phase.SWITCHING)
            self.engine.role = role
            self.config = new
            self._open()
            opened = self._clock()
            return ReconfigReport(reconfig_id, ReconfigKind.ROLE, old, new, drained, self.num_refused - refused_before,
                                  t0 - closed, 0.0, 0.0, opened - t0, closed, opened)

    async def change_model(
        self, new: InstanceConfig, *, reconfig_id: str = "", drain_timeout_s: float = 60.0
    ) -> ReconfigReport:
        """Drain, shut the engine down, start one for `new` on the same slot (weights load)."""
        if self._build is None:
            raise ReconfigError(f"{self.instance_id} has no engine builder: pass build= to change its model")
        if tuple(new.gpu_ids) != tuple(self.config.gpu_ids):
            raise ReconfigError(f"{reconfig_id}: the new instance must use this slot's GPUs {list(self.config.gpu_ids)}"
                                f", not {list(new.gpu_ids)}")
        async with self._lock:
            old = self.config
            refused_before = self.num_refused
            closed, drained = self._clock(), await self._drain(reconfig_id, drain_timeout_s)
            t0 = self._clock()
            self.phase = advance(self.phase, Phase.SWITCHING)
            await self._stop_drained()
            t_stopped = self._clock()
            try:
                engine = self._build(new)
                await engine.start()
            except BaseException as e:
                await self._restore(old)
                raise ReconfigError(f"{reconfig_id}: starting {new.id} ({new.model}) failed, {old.id} "
                                    f"({old.model}) is back: {type(e).__name__}: {e}") from e
            t_started = self._clock()
            self.engine, self.config = engine, new
            self._open()
            opened = self._clock()
            return ReconfigReport(reconfig_id, ReconfigKind.MODEL, old, new, drained, self.num_refused - refused_before,
                                  t0 - closed, t_stopped - t0, t_started - t_stopped, opened - t0, closed, opened)

    # ----------------------------------------------------------------- internals

    async def _drain(self, reconfig_id: str, timeout_s: float) -> tuple[str, ...]:
        """Close the gate and wait until nothing is in flight; the ids of the requests that were."""
        self.reconfig_id = reconfig_id
        self.phase = advance(self.phase, Phase.DRAINING)
        self._accepting = False
        drained = self.in_flight_ids
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            self.phase = advance(self.phase, Phase.ABORTED)
            self._accepting = True
            raise ReconfigError(f"{reconfig_id}: {self.num_in_flight} requests still ran on {self.instance_id} "
                                f"after {timeout_s:g} s of drain; aborted, the instance serves in its old role") from None
        return drained

    async def _stop_drained(self) -> None:
        stop = self.engine.stop
        if self.stop_timeout_s is not None and "timeout_s" in inspect.signature(stop).parameters:
            await stop(timeout_s=self.stop_timeout_s)  # nothing runs any more: no need to wait long
        else:
            await stop()

    def _open(self) -> None:
        self.phase = advance(self.phase, Phase.DONE)
        self._accepting = True

    async def _restore(self, old: InstanceConfig) -> None:
        """After a failed start: the old config again (ABORTED), or no engine at all when that fails too."""
        assert self._build is not None
        self.phase = advance(self.phase, Phase.ABORTED)
        try:
            engine = self._build(old)
            await engine.start()
        except BaseException:
            return  # the gate stays closed: the slot serves nothing rather than something half-started
        self.engine = engine
        self._accepting = True

    def _admit(self, request_id: str) -> None:
        if not self._accepting:
            self.num_refused += 1
            raise DrainingError(f"{self.instance_id} is {self.phase.value} for reconfiguration {self.reconfig_id}; "
                                f"send {request_id} to another instance of {self.model}")
        self._enter(request_id)

    def _enter(self, request_id: str) -> None:
        self._in_flight[request_id] += 1
        self._idle.clear()

    def _done(self, request_id: str) -> None:
        self._in_flight[request_id] -= 1
        if self._in_flight[request_id] <= 0:
            del self._in_flight[request_id]
        if not self._in_flight:
            self._idle.set()

    async def _counted(
        self, open_stream: Callable[[RequestSpec], AsyncIterator[RequestOutput]], spec: RequestSpec
    ) -> AsyncIterator[RequestOutput]:
        """The engine's stream, counted in flight from admission (already done) until it ends or is closed.

        The caller must iterate it (the workers do at once): a stream never started stays counted, and a drain
        then waits for it until its timeout."""
        try:
            async for out in open_stream(spec):
                yield out
        finally:
            self._done(spec.request_id)


def vllm_builder(model_paths: Mapping[str, str], **engine_kwargs: Any) -> EngineBuilder:
    """An EngineBuilder of VllmEngines: the model directory from `model_paths[config.model]`, the rest from the
    instance config (make_vllm_engine) and `engine_kwargs` (VllmEngine keyword arguments, e.g. kv_transfer,
    flippable=True, kv_cache_space_gib). An example connector's folder gets one subfolder per model
    (`vllm_kv.for_model`): a slot that changes model never loads the other model's KV."""
    def build(config: InstanceConfig) -> Engine:
        from octoserve.services.engine.vllm_engine import make_vllm_engine

        if config.model not in model_paths:
            raise ReconfigError(f"no model directory for {config.model!r}: known {sorted(model_paths)}")
        kwargs = dict(engine_kwargs)
        kv_transfer = kwargs.pop("kv_transfer", None)
        if kv_transfer is not None:
            kv_transfer = vllm_kv.for_model(kv_transfer, config.model)  # models never share stored KV
            if kv_transfer.connector == vllm_kv.EXAMPLE:
                os.makedirs(kv_transfer.storage_path, exist_ok=True)
        return make_vllm_engine(config, model_paths[config.model], kv_transfer=kv_transfer, **kwargs)

    return build


__all__ = ["DrainingError", "EngineBuilder", "ReconfigError", "ReconfigReport", "ReconfigurableInstance",
           "vllm_builder"]
