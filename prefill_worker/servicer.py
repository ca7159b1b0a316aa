"""Worker RPCs of the prefill role: Prefill (returns the KV hand-off descriptor and the first token) and Release.

A hand-off's KV stays on this instance from Prefill's reply until the router's Release (after the decode side
committed it, or on failure). A hand-off nobody releases within `handoff_ttl_ms` is released here, so a router that
died mid-request cannot leak KV. Held hand-offs count as in-flight work for the drain.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from octoserve.services.core.types import Role
from octoserve.services.engine.base import EngineError
from octoserve.services.rpc import convert
from octoserve.services.rpc import seam_stop
from octoserve.services.rpc import status as rpc_status
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.worker_base import WorkerBase

log = logging.getLogger("octoserve.prefill_worker")

DEFAULT_HANDOFF_TTL_MS = 10_000


class PrefillWorkerServicer(WorkerBase):
    role_name = "prefill_worker"

    def __init__(self, engine, *, handoff_ttl_ms: int = DEFAULT_HANDOFF_TTL_MS) -> None:
        super().__init__(engine)
        self.handoff_ttl_ms = handoff_ttl_ms
        self.held: dict[str, asyncio.TimerHandle] = {}  # request_id -> TTL timer of its held KV

    async def Prefill(self, request, context):
        if self.engine.role is not Role.PREFILL:
            await self._wrong_role(context, "Prefill", "prefill")
        await self._refuse_if_draining(context)
        spec = await self._checked_spec(request.spec, context)
        t0 = time.monotonic()
        self._begin()
        try:
            handoff = await self.engine.prefill(spec)
        except EngineError as e:
            self._end()
            self.metrics.outcome("engine_error")
            await rpc_status.abort(context, e)
        except asyncio.CancelledError:  # the router gave up (client cancel, deadline): free what was computed
            self._end()
            self.metrics.outcome("aborted")
            await self.engine.abort(spec.request_id)
            raise
        self.metrics.prefill_s.observe(time.monotonic() - t0)
        k = seam_stop.seam_tokens(context.invocation_metadata())
        check = seam_stop.checker(self.engine, spec.sampling.stop, spec.prompt_token_ids[len(spec.prompt_token_ids) - k:])
        if check is not None and not handoff.finish_reason and check.feed((handoff.first_token_id,)) == 0:
            handoff = dataclasses.replace(handoff, finish_reason="stop")  # a stop string spanning the seam ends here
        loop = asyncio.get_running_loop()
        self.held[spec.request_id] = loop.call_later(self.handoff_ttl_ms / 1000.0, self._expire, spec.request_id)
        return w_pb.PrefillReply(handoff=convert.handoff_to_pb(handoff))

    def _expire(self, request_id: str) -> None:
        if self.held.pop(request_id, None) is not None:
            log.warning("hand-off expired unreleased", extra={"fields": {"request_id": request_id}})
            self.metrics.outcome("handoff_expired")
            self._end()
            asyncio.get_running_loop().create_task(self.engine.release(request_id))

    async def Release(self, request, context):
        await self.release_handoff(request.request_id, outcome="handed_off")
        return w_pb.ReleaseReply()

    async def release_handoff(self, request_id: str, outcome: str) -> None:
        timer = self.held.pop(request_id, None)
        await self.engine.release(request_id)
        if timer is not None:
            timer.cancel()
            self.metrics.outcome(outcome)
            self._end()

    async def abort_request(self, request_id: str) -> None:
        await self.engine.abort(request_id)
        await self.release_handoff(request_id, outcome="aborted")
