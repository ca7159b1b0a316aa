"""The sim engine: octoserve's own iteration-level engine over a virtual GPU, on the real clock.

Each step runs the core batcher (`schedule` -> `SimExecutor.execute` -> `update`) and waits the step's modelled
duration multiplied by `time_scale` (k). With k > 1 a 2-core machine runs the full 8-GPU node at 1/k speed, and
the harness divides measured latencies by k. Step end times are absolute (start + duration * k), so the Python work
of scheduling is hidden inside the modelled step rather than added to it.

Gang members (services/scheduler/gang_live.py): with a `gate`, every step waits for the group arbiter's grant and
is cut to its cap; the gate hears when the step started and ended.

Invariants: one step loop task per engine; every batcher call happens on that loop (no locks needed); a caller that
stops iterating `generate` or `decode` (cancellation) aborts its request, freeing its KV; `pause()` returns only at an
iteration boundary, after which no step runs until `resume()`.

No tokenizer: the engine sees token ids only. The router turns a text prompt into one id per UTF-8 byte
(`rpc.convert.text_to_token_ids`), so a text prompt counts one token per byte, and outputs are token ids with no
text (the response's `text` is empty). The output length is the request's `sim_output_len` when a harness sends it
(`x-octoserve-sim-output-len`), else it runs to max_tokens.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import replace
from collections.abc import AsyncIterator, Callable

from octoserve.services.core.batch_state import BatcherConfig
from octoserve.services.core.batcher import Batcher
from octoserve.services.core.reconfig import in_place_role
from octoserve.services.core.cost_model import CostModel
from octoserve.services.core.instance import GangShare, LoadReporter
from octoserve.services.core.kv_cache import KVCacheManager
from octoserve.services.core.sim_executor import SimExecutor
from octoserve.services.core.types import EngineLoad, FinishReason, RequestOutput, RequestSpec, Role
from octoserve.services.engine.base import CapacityError, HandoffError, KVHandoff

class SimEngine:
    def __init__(
        self,
        instance_id: str,
        model: str,
        batcher_config: BatcherConfig,
        kv: KVCacheManager,
        cost_model: CostModel,
        *,
        time_scale: float = 1.0,
        gang: GangShare | None = None,
    ) -> None:
        if time_scale <= 0:
            raise ValueError(f"time_scale must be > 0, got {time_scale}")
        self.instance_id = instance_id
        self.model = model
        self.role = batcher_config.role
        self.time_scale = time_scale
        self.batcher = Batcher(batcher_config, kv)
        self.cost_model = cost_model
        self.executor = SimExecutor(cost_model, kv.block_size, batcher_config.eos_token_id)
        self.reporter = LoadReporter(instance_id, model, self.batcher, cost_model, gang)
        self.gate = None  # a gang member's step gate (GangGate): set before start()
        # role -> this instance's batcher config in that role (services/engine/factory.py), for in-place changes
        self.batcher_config_for: Callable[[Role], BatcherConfig] | None = None
        self._streams: dict[str, asyncio.Queue[RequestOutput]] = {}
        self._handoffs: dict[str, asyncio.Future[KVHandoff]] = {}
        self._wakeup = asyncio.Event()
        self._running = asyncio.Event()  # set while not paused
        self._running.set()
        self._idle_at_boundary = asyncio.Event()
        self._loop_task: asyncio.Task[None] | None = None
        self.kv_events: list = []  # drained by the worker for the router's prefix index
        self.num_steps = 0
        self.stall_after_steps: int | None = None  # an injected fault (services/faults.py): the loop stops here

    # ---- lifecycle -----------------------------------------------------------------------------------------

    async def start(self) -> None:
        if self.gate is not None:
            await self.gate.open(self.batcher)  # the group's arbiter runs once every member is connected
        if self._loop_task is None:
            self._loop_task = asyncio.create_task(self._step_loop(), name=f"step-loop-{self.instance_id}")

    async def stop(self) -> None:
        if self._loop_task is not None:
            self._loop_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._loop_task
            self._loop_task = None
        if self.gate is not None:
            await self.gate.close()
        for request_id in list(self._streams):
            self.batcher.abort(request_id)
            self._streams.pop(request_id).put_nowait(RequestOutput(request_id, (), FinishReason.ABORT))

    async def pause(self) -> None:
        """Stop at the next iteration boundary, keeping every request and its KV (gang-lease primitive)."""
        self._idle_at_boundary.clear()
        self._running.clear()
        self._wakeup.set()
        await self._idle_at_boundary.wait()

    async def resume(self) -> None:
        self._running.set()
        self._wakeup.set()

    @property
    def paused(self) -> bool:
        return not self._running.is_set()

    # ---- the step loop -------------------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        loop = asyncio.get_running_loop()
        granted: float | None = None  # a gang grant that came while idle after NOTHING: the next step's cap
        while True:
            if not self._running.is_set():
                self._idle_at_boundary.set()
                await self._running.wait()
            if not self.batcher.has_work:
                if granted is not None:  # the work went (aborted) before the grant could be used
                    self.gate.nothing(self.batcher)
                    granted = None
                self._idle_at_boundary.set()
                self._wakeup.clear()
                await self._wakeup.wait()
                continue
            if self.gate is None:
                cap_s = None
            elif granted is not None:
                cap_s, granted = granted, None
            else:
                cap_s = await self.gate.turn(self.batcher, self._wakeup)
            start = loop.time()
            plan = self.batcher.schedule(start / self.time_scale, cap_s)
            if plan.is_empty and not self.batcher.has_pending_outputs:  # nothing fits the cap, or all wait on KV
                self._wakeup.clear()
                if self.gate is not None:
                    # Still a member with work: the arbiter may grant it again (a longer cap) before anything
                    # arrives here, and every grant must be answered, so wait for a grant as well as for new work.
                    self.gate.nothing(self.batcher)
                    granted = await self.gate.idle(self._wakeup)
                else:
                    await self._wakeup.wait()
                continue
            result = self.executor.execute(plan, self.batcher)
            if self.gate is not None:
                self.gate.started(result.step_time_s)
            delay = start + result.step_time_s * self.time_scale - loop.time()
            await asyncio.sleep(max(0.0, delay))
            out = self.batcher.update(plan, result, loop.time() / self.time_scale)
            self.num_steps += 1
            if self.num_steps == self.stall_after_steps:
                await asyncio.Event().wait()  # injected: stuck for good, everything else in the process carries on
            self.reporter.note_step(plan, result.step_time_s)
            self.kv_events.extend(out.kv_events)
            for output in out.outputs:
                self._deliver(output)
            if self.gate is not None:
                self.gate.ended(self.batcher)

    def _deliver(self, output: RequestOutput) -> None:
        if output.finish_reason is FinishReason.HANDOFF:
            future = self._handoffs.pop(output.request_id, None)
            if future is not None and not future.done():
                future.set_result(self._handoff_of(output))
            return
        queue = self._streams.get(output.request_id)
        if queue is not None:
            queue.put_nowait(output)
        if output.finish_reason is not None:
            self._streams.pop(output.request_id, None)
            future = self._handoffs.pop(output.request_id, None)  # prefill role: finished before any hand-off
            if future is not None and not future.done():
                future.set_result(self._handoff_of(output))

    def _handoff_of(self, output: RequestOutput) -> KVHandoff:
        kv_bytes = output.num_prompt_tokens * self.cost_model.model.kv_bytes_per_token
        return KVHandoff(
            request_id=output.request_id,
            source_instance_id=self.instance_id,
            num_prompt_tokens=output.num_prompt_tokens,
            first_token_id=output.new_token_ids[0] if output.new_token_ids else -1,
            num_kv_bytes=kv_bytes,
            num_cached_prompt_tokens=output.num_cached_prompt_tokens,
            finish_reason=output.finish_reason.value if output.finish_reason is not FinishReason.HANDOFF else "",
        )

    # ---- requests ------------------------------------------------------------------------------------------

    async def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._add(spec)
        self._streams[spec.request_id] = queue
        self._wakeup.set()
        async for output in self._drain(spec.request_id, queue):
            yield output

    def _add(self, spec: RequestSpec) -> None:
        try:
            self.batcher.add_request(spec, asyncio.get_running_loop().time() / self.time_scale)
        except ValueError as e:  # a duplicate id, or a request larger than this instance's whole KV pool
            raise CapacityError(str(e)) from None

    async def _drain(self, request_id: str, queue: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                output = await queue.get()
                finished = output.finish_reason is not None
                yield output
        finally:
            if not finished:
                await self.abort(request_id)

    async def prefill(self, spec: RequestSpec) -> KVHandoff:
        if self.role is not Role.PREFILL:
            raise HandoffError(f"instance {self.instance_id} is {self.role.value}, not a prefill instance")
        future: asyncio.Future[KVHandoff] = asyncio.get_running_loop().create_future()
        self._add(spec)
        self._handoffs[spec.request_id] = future
        self._wakeup.set()
        try:
            return await future
        except asyncio.CancelledError:
            await self.abort(spec.request_id)
            raise

    def set_role_in_place(self, role: Role) -> bool:
        """Decode <-> colocated with no drain (services/rpc/role_switch.py): both decode, so the batcher keeps
        everything it holds; only the work this engine takes from now on changes. False for any other pair."""
        if not in_place_role(self.role, role):
            return False
        self.role = role
        # The budgets are sized per role (`batcher_config_for`, set by the factory); else the same ones, new role.
        self.batcher.reconfigure(self.batcher_config_for(role) if self.batcher_config_for is not None
                                 else replace(self.batcher.config, role=role))
        return True

    async def reserve(self, spec: RequestSpec) -> bool:
        if self.role is not Role.DECODE:
            raise HandoffError(f"instance {self.instance_id} is {self.role.value}, not a decode instance")
        return self.batcher.reserve(spec, asyncio.get_running_loop().time() / self.time_scale)

    async def transfer_time_s(self, handoff: KVHandoff) -> float:
        """Modelled wall time of moving the hand-off's KV over NVLink (already dilated by time_scale)."""
        num_tokens = handoff.num_prompt_tokens + max(0, len(handoff.output_token_ids) - 1)
        return self.cost_model.kv_transfer_time_s(num_tokens) * self.time_scale

    # ---- live migration (services/rpc/migration.py drives these) ---------------------------------------------

    async def suspend_for_migration(self, request_ids) -> dict[str, tuple[int, ...]]:
        """Stops the given running decodes at an iteration boundary, keeping their KV; returns the output tokens
        of each one that was a running decode (the others carry on)."""
        await self.pause()
        try:
            return {rid: toks for rid in request_ids if (toks := self.batcher.suspend_running(rid)) is not None}
        finally:
            await self.resume()

    def resume_suspended(self, request_id: str) -> None:
        """The migration did not happen: the request decodes on here."""
        if self.batcher.resume_suspended(request_id):
            self._wakeup.set()

    def hand_over(self, request_id: str) -> None:
        """The target reserved room: the request's stream here ends with a HANDOFF output (after every token it
        produced here); its KV stays until `release`."""
        queue = self._streams.pop(request_id, None)
        if queue is not None:
            queue.put_nowait(RequestOutput(request_id, (), FinishReason.HANDOFF))

    def migration_handoff(self, request_id: str, output_token_ids: tuple[int, ...]) -> KVHandoff:
        req = self.batcher.request(request_id)
        num_prompt = req.num_prompt_tokens if req is not None else 0
        return KVHandoff(
            request_id=request_id, source_instance_id=self.instance_id, num_prompt_tokens=num_prompt,
            first_token_id=output_token_ids[0],
            num_kv_bytes=(num_prompt + len(output_token_ids) - 1) * self.cost_model.model.kv_bytes_per_token,
            num_cached_prompt_tokens=req.num_cached_tokens if req is not None else 0,
            output_token_ids=output_token_ids)

    async def reserve_migrated(self, spec: RequestSpec, output_token_ids: tuple[int, ...]) -> bool:
        return self.batcher.reserve_migrated(spec, output_token_ids, asyncio.get_running_loop().time() / self.time_scale)

    async def decode(self, spec: RequestSpec, handoff: KVHandoff) -> AsyncIterator[RequestOutput]:
        request = self.batcher.request(spec.request_id)
        if request is None:
            raise CapacityError(f"no KV reservation for {spec.request_id} on {self.instance_id}: call reserve first")
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._streams[spec.request_id] = queue
        now = asyncio.get_running_loop().time() / self.time_scale
        if handoff.output_token_ids:  # a migrated running decode: it carries on from its last token
            self.batcher.commit_migrated(spec.request_id, now)
            done = None
        else:
            done = self.batcher.commit_handoff(spec.request_id, handoff.first_token_id, now)
        if done is not None:
            self._streams.pop(spec.request_id, None)
            yield done
            return
        self._wakeup.set()
        async for output in self._drain(spec.request_id, queue):
            yield output

    async def release(self, request_id: str) -> None:
        if self.batcher.release_handoff(request_id) or self.batcher.release_reservation(request_id):
            self._wakeup.set()

    async def abort(self, request_id: str) -> None:
        if self.batcher.abort(request_id):
            self._wakeup.set()
        self._streams.pop(request_id, None)
        future = self._handoffs.pop(request_id, None)
        if future is not None and not future.done():
            future.cancel()

    def load(self) -> EngineLoad:
        load = self.reporter.load()
        return replace(load, paused=True) if self.paused else load
