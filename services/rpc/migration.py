"""Live migration of running decodes off a draining worker (the source side), by the disaggregated path's KV hand-off.

When `SetRole` names migration targets (instances of the same model, with their headroom as the scheduler saw it),
the draining worker, before it waits for its running requests:
1. plans, per running decode, drain or migrate (services/core/migration.py: remaining decode vs the modelled KV
   transfer of its context, the target's free slots and KV blocks, and, when the SetRole gives an ITL budget, the
   target's decode step by the cost model with the moved requests added to its batch and KV), and logs each
   decision with its reason (`octoserve_worker_migration_decisions_total{decision=...}`);
2. stops the chosen ones at an iteration boundary, keeping their KV (`SimEngine.suspend_for_migration`);
3. asks each one's target to reserve room for it (`Worker.Reserve` with the output tokens so far). A target that
   says no (its headroom changed, or it drains too) leaves the request here: it decodes on and the drain waits for it
   (`target_refused`);
4. for a reserved one, ends its stream here with a migration marker on its router's session (after every token it
   produced here) naming the target and carrying the hand-off (`TokenDelta.migration`). The router then does what it
   does for a disaggregated request: `Decode` on the target (the KV transfer, modelled in the cost model's NVLink
   time, and the commit; the target decodes on from the last token, on the same router session, so the client's
   stream continues with the same request id) and `Release` here, which frees the KV and ends the request's work
   here. The drain waits for that Release (bounded by `HANDOVER_TTL_S`), as it waits for a held prefill hand-off.

Only engines with the migration hooks (the sim engine) migrate; any other engine drains (`engine_cannot_migrate`).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from dataclasses import dataclass

import grpc
import prometheus_client as prom

from octoserve.services import trust
from octoserve.services.core import migration
from octoserve.services.core.batch_state import RequestStatus
from octoserve.services.core.cost_model import CostModel
from octoserve.services.core.specs import SpecError
from octoserve.services.rpc import convert
from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.gen import worker_pb2_grpc as w_grpc

log = logging.getLogger("octoserve.worker.migration")

HANDOVER_TTL_S = 30.0  # a hand-off nobody released (the router went away) frees its KV after this long
RESERVE_TIMEOUT_S = 5.0


@dataclass
class Handover:
    """A request this worker handed to another: the marker its router gets, and when the router released it."""

    delta: w_pb.TokenDelta
    released: asyncio.Future


def _decisions_counter(metrics):
    counter = getattr(metrics, "migration_decisions", None)
    if counter is None:
        counter = prom.Counter("octoserve_worker_migration_decisions",
                               "running decodes of a draining worker: migrated, or kept here and why, count",
                               ["instance", "decision"], registry=metrics.registry)
        metrics.migration_decisions = counter
    return counter


def targets_problem(engine, targets) -> str | None:
    """What is wrong with a SetRole's migration targets (a TP degree the model cannot be split into), or None."""
    cost = getattr(engine, "cost_model", None)
    for t in targets:
        if t.tensor_parallel and cost is not None:
            try:
                cost.model.check_tp(t.tensor_parallel)
            except SpecError as e:
                return (f"migration target {t.instance_id!r}: {e}; send the target's own tensor_parallel (0: the "
                        "source's)")
    return None


def target_step_model(cost, targets: list[w_pb.MigrationTarget]):
    """`target_step_s` for `migration.plan`: each target's decode step by the cost model of its own TP degree (the
    source's model, GPU and cost profile: the targets serve the same model on the same node)."""
    models = {}
    for t in targets:
        tp = t.tensor_parallel or cost.tp
        models[t.instance_id] = cost if tp == cost.tp else CostModel(cost.model, cost.gpu, tp, cost.constants)
    return lambda instance_id, batch, kv_tokens: migration.batch_step_s(models[instance_id], batch, kv_tokens)


async def migrate_out(servicer, targets: list[w_pb.MigrationTarget], max_pause_s: float,
                      itl_budget_s: float = 0.0) -> tuple[int, Counter]:
    """Hands the running decodes that should move to `targets`; returns (how many moved, the kept ones by reason).
    `itl_budget_s` (> 0): the targets' decode step with the moved requests added must stay within it."""
    engine = servicer.engine
    counter = _decisions_counter(servicer.metrics)
    kept: Counter[str] = Counter()
    batcher = getattr(engine, "batcher", None)
    if not hasattr(engine, "suspend_for_migration") or batcher is None or not hasattr(servicer, "migrating"):
        if servicer.in_flight:
            kept[migration.ENGINE_CANNOT] += servicer.in_flight
            counter.labels(engine.instance_id, migration.ENGINE_CANNOT).inc(servicer.in_flight)
        return 0, kept
    running = []
    specs = {}
    for rid in list(servicer.tasks):
        req = batcher.request(rid)
        if req is None or req.status is not RequestStatus.RUNNING or req.num_uncomputed_tokens != 1:
            continue
        specs[rid] = req.spec
        running.append(migration.RunningDecode(rid, req.num_tokens,
                                               migration.expected_remaining_tokens(req.spec, req.num_output_tokens)))
    by_id = {t.instance_id: t for t in targets}
    checked = itl_budget_s > 0
    decisions = migration.plan(
        running, [migration.Target(t.instance_id, t.free_blocks, t.block_size, t.free_slots, t.decode_batch,
                                   t.kv_tokens) for t in targets],
        step_s=engine.load().decode_step_time_s, transfer_s=engine.cost_model.kv_transfer_time_s,
        max_pause_s=max_pause_s, target_step_s=target_step_model(engine.cost_model, targets) if checked else None,
        itl_budget_s=itl_budget_s if checked else math.inf)
    for d in decisions:
        log.info("migration decision", extra={"fields": {
            "request_id": d.request_id, "decision": d.reason, "target": d.target,
            "remaining_s": round(d.remaining_s, 4), "transfer_s": round(d.transfer_s, 4)}})
        if not d.migrate:
            kept[d.reason] += 1
            counter.labels(engine.instance_id, d.reason).inc()
    chosen = {d.request_id: d.target for d in decisions if d.migrate}
    if not chosen:
        return 0, kept
    suspended = await engine.suspend_for_migration(list(chosen))
    channels = {t: trust.channel(by_id[t].address) for t in set(chosen.values())}
    try:
        results = await asyncio.gather(*(
            _hand_over(servicer, rid, specs[rid], tokens, chosen[rid], channels[chosen[rid]])
            for rid, tokens in suspended.items()))
    finally:
        for ch in channels.values():
            await ch.close()
    moved = sum(results)
    refused = len(results) - moved
    if moved:
        counter.labels(engine.instance_id, migration.MIGRATE).inc(moved)
    if refused:
        kept[migration.TARGET_REFUSED] += refused
        counter.labels(engine.instance_id, migration.TARGET_REFUSED).inc(refused)
    log.info("migration out", extra={"fields": {"moved": moved, "kept": dict(kept)}})
    return moved, kept


async def _hand_over(servicer, rid: str, spec, tokens: tuple[int, ...], target: str, channel) -> bool:
    engine = servicer.engine
    try:
        reply = await w_grpc.WorkerStub(channel).Reserve(w_pb.ReserveRequest(
            spec=convert.spec_to_pb(spec), ttl_ms=int(HANDOVER_TTL_S * 1000), output_token_ids=tokens),
            timeout=RESERVE_TIMEOUT_S)
        reserved, why = reply.reserved, "no room"
    except grpc.aio.AioRpcError as e:
        reserved, why = False, f"{e.code().name} {e.details()}"
    if not reserved:
        log.info("migration refused by the target; the request drains here", extra={"fields": {
            "request_id": rid, "target": target, "why": why}})
        engine.resume_suspended(rid)
        return False
    handoff = convert.handoff_to_pb(engine.migration_handoff(rid, tokens))
    servicer.migrating[rid] = Handover(
        w_pb.TokenDelta(request_id=rid, migration=handoff, migration_target=target),
        asyncio.get_running_loop().create_future())
    engine.hand_over(rid)
    return True


async def wait_released(servicer, session, rid: str) -> None:
    """The source's part of a handed-over request: send the marker, hold the KV until the router's Release."""
    handover = servicer.migrating.get(rid)
    try:
        if handover is None:
            return
        session.push(handover.delta)
        try:
            await asyncio.wait_for(asyncio.shield(handover.released), HANDOVER_TTL_S)
        except TimeoutError:
            log.warning("migrated request never released; freeing its KV", extra={"fields": {"request_id": rid}})
    finally:
        servicer.migrating.pop(rid, None)
        await servicer.engine.release(rid)


def released(servicer, rid: str) -> None:
    handover = getattr(servicer, "migrating", {}).get(rid)
    if handover is not None and not handover.released.done():
        handover.released.set_result(None)
