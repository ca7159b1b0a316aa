"""The router follows the scheduler's placement live (`Scheduler.WatchPlacement`), with no restart:

- An instance that appears (with an address) gets a worker session (`WorkerClient`) and, once SERVING, joins
  routing, admission and the prefix index.
- A DRAINING instance leaves routing at once; its session stays open so its running requests stream to the end.
- A role change replaces the session (a prefill instance has no token stream; a new decode one needs one) and
  drops the instance's prefix-index entries (the new engine starts with an empty cache). A role change in place
  (decode <-> colocated, the instance's `engine_generation` unchanged) keeps both: the same engine and servicer
  serve on, and its running requests stream on over the same session.
- A removed instance leaves routing, its prefix-index entries are dropped, and its session is closed after
  `RETIRE_GRACE_S` (cleanup RPCs of requests that just finished there still find it).
- After a role change or a removal the old session is read until the worker ends it (or the grace passes): the
  last tokens of requests that finished in the drain can arrive after the placement change that follows it.
- The routing view is `config` with the SERVING instances only: `policy.config` and `servicer.config` are
  replaced together, between two requests (one event loop).
If the stream breaks (the scheduler died or restarts), the router keeps serving on the last placement and
subscribes again with backoff. A snapshot only adds or changes what it names with an address: a restarted
scheduler that has not heard every worker's heartbeat yet does not take instances away.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
from collections.abc import Callable

import grpc

from octoserve.services import trust
from octoserve.services.core.placement import InstanceConfig, NodeConfig
from octoserve.services.core.reconfig import in_place_role
from octoserve.services.core.types import Role
from octoserve.services.rpc import convert
from octoserve.services.rpc.gen import scheduler_pb2 as s_pb
from octoserve.services.rpc.gen import scheduler_pb2_grpc as s_grpc

log = logging.getLogger("octoserve.router.placement")

RESUBSCRIBE_BACKOFF_S = (0.1, 0.2, 0.5, 1.0)
RETIRE_GRACE_S = 5.0
POLL_S = 0.05


def instance_from_pb(p: s_pb.InstancePlacement, config: NodeConfig) -> InstanceConfig:
    if p.instance_config_json:
        d = json.loads(p.instance_config_json)
        return InstanceConfig(**{**d, "role": Role(d["role"]), "gpu_ids": tuple(d["gpu_ids"])})
    base = config.instance(p.instance_id)  # a scheduler that does not send the full config: the file's
    return dataclasses.replace(base, role=convert.ROLE_FROM_PB[p.role])


class PlacementFollower:
    """make_client(instance: InstanceConfig, address) -> a started-later WorkerClient for the pool."""

    def __init__(self, address: str, config: NodeConfig, policy, pool, servicer,
                 make_client: Callable[[InstanceConfig, str], object]) -> None:
        self.address = address
        self.base = config
        self.policy, self.pool, self.servicer = policy, pool, servicer
        self.make_client = make_client
        self.instances: dict[str, InstanceConfig] = {}
        self.generations: dict[str, int] = {}  # instance id -> the engine generation its session was opened on
        self.states: dict[str, int] = {}
        self.version = 0
        self.applied = 0  # snapshots applied (tests and the log)
        self._task: asyncio.Task | None = None
        self._retiring: set[asyncio.Task] = set()

    async def first(self, timeout_s: float) -> None:
        """Waits (bounded) for a complete placement and builds the pool from it; the clients are not started."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        async with trust.channel(self.address) as channel:
            stub = s_grpc.SchedulerStub(channel)
            while True:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    raise TimeoutError(f"the scheduler at {self.address} did not report a complete placement in "
                                       f"{timeout_s:g} s")
                placement = await stub.GetPlacement(s_pb.GetPlacementRequest(), timeout=remaining, wait_for_ready=True)
                if placement.complete:
                    self.apply(placement, start_clients=False)
                    return
                await asyncio.sleep(POLL_S)

    def follow(self) -> None:
        self._task = asyncio.create_task(self._follow(), name="placement-watch")

    async def close(self) -> None:
        for task in [self._task, *self._retiring]:
            if task is not None:
                task.cancel()
        await asyncio.gather(*(t for t in [self._task, *self._retiring] if t is not None), return_exceptions=True)

    async def _follow(self) -> None:
        attempt = 0
        while True:
            try:
                async with trust.channel(self.address) as channel:
                    async for placement in s_grpc.SchedulerStub(channel).WatchPlacement(s_pb.WatchPlacementRequest()):
                        attempt = 0
                        self.apply(placement)
            except grpc.aio.AioRpcError as e:
                if attempt == 0:
                    log.warning("placement stream down; serving on the last placement", extra={"fields": {
                        "scheduler": self.address, "code": e.code().name}})
            except Exception:
                log.exception("applying a placement failed; subscribing again")
            await asyncio.sleep(RESUBSCRIBE_BACKOFF_S[min(attempt, len(RESUBSCRIBE_BACKOFF_S) - 1)])
            attempt += 1

    def apply(self, placement: s_pb.Placement, *, start_clients: bool = True) -> None:
        seen: dict[str, InstanceConfig] = {}
        states: dict[str, int] = {}
        for p in placement.instances:
            inst = instance_from_pb(p, self.base)
            seen[inst.id], states[inst.id] = inst, p.state
            client = self.pool.clients.get(inst.id)
            old = self.instances.get(inst.id)
            generation = p.engine_generation
            in_place = (generation != 0 and self.generations.get(inst.id) == generation and old is not None
                        and in_place_role(old.role, inst.role))
            role_changed = old is not None and old.role is not inst.role and not in_place
            self.generations[inst.id] = generation
            if p.address and (client is None or client.address != p.address or role_changed):
                if client is not None:
                    self._retire_client(inst.id, graceful=client.address == p.address)
                if role_changed:
                    self.policy.forget_instance(inst.id)
                new = self.make_client(inst, p.address)
                self.pool.clients[inst.id] = new
                if start_clients:
                    new.start()
        for iid in [i for i in self.pool.clients if i not in seen]:
            self.policy.forget_instance(iid)
            self._retire_client(iid, graceful=True)
        for iid, inst in seen.items():
            if iid not in self.policy.cost_models:
                self.policy.cost_models[iid] = self.base.cost_model(inst)
        serving = tuple(inst for iid, inst in seen.items()
                        if states[iid] == s_pb.INSTANCE_SERVING and iid in self.pool.clients)
        routing = dataclasses.replace(self.base, instances=serving)
        self.policy.config = routing
        self.servicer.config = routing
        changed = (seen != self.instances or states != self.states)
        self.instances, self.states, self.version = seen, states, placement.version
        self.applied += 1
        if changed:
            log.info("placement applied", extra={"fields": {
                "version": placement.version, "serving": [i.id for i in serving],
                "draining": [i for i, s in states.items() if s == s_pb.INSTANCE_DRAINING],
                "starting": [i for i, s in states.items() if s == s_pb.INSTANCE_STARTING]}})

    def _retire_client(self, instance_id: str, graceful: bool) -> None:
        """graceful: the instance drained (a role change, a removal), its last tokens may still be on the way; else
        (a new address: the worker restarted) its old streams are dead and end now."""
        client = self.pool.clients.pop(instance_id)
        if graceful:
            client.retire()
        else:
            client.stop_streams()
        client.mark_down()
        self.pool.retired[instance_id] = client

        async def close_later() -> None:
            await asyncio.sleep(RETIRE_GRACE_S)
            if self.pool.retired.get(instance_id) is client:
                del self.pool.retired[instance_id]
            await client.close()

        task = asyncio.create_task(close_later())
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
