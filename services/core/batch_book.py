"""The batcher's book of requests: where each one is, and the calls that move requests in and out between steps.

A request is in exactly one of waiting / running / swapped / reserved / handoff (`RequestStatus`), and the book keeps
the lists that say which: the waiting queue in queue-policy order, the running batch and the swapped-out requests in
victim order, the count of reservations. Its calls:
- intake: `add_request` queues a request (a typed refusal when this instance can never hold it), `abort` drops one
  wherever it is and frees its KV;
- the hand-off between a prefill and a decode instance: `reserve` (decode role: hold KV for the prompt and the
  reservation policy's output share before the prefill starts elsewhere), `commit_handoff` (the KV arrived: the
  request joins the batch after its first token), `release_reservation`, and `release_handoff` (prefill role: the
  KV was sent, free it);
- live migration (services/core/migration.py): `suspend_running` takes a running decode out of the batch with its
  KV, `resume_suspended` puts it back, `reserve_migrated` / `commit_migrated` take one in on the other side;
- what the router and the simulator read: `load`, the queue and batch sizes, the queued prefill tokens.

The iteration planner (`Batcher`, services/core/batcher.py) extends the book with `schedule` and `update`. Every call
that may change the queues, the batch or the KV bumps `state_version`, the key of any cached view of the batcher.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence

from octoserve.services.core.batch_state import BatcherConfig, Request, RequestStatus
from octoserve.services.core.kv_cache import KVCacheManager
from octoserve.services.core.preemption import VICTIM_POLICIES
from octoserve.services.core.queues import QUEUE_POLICIES, WaitingQueue
from octoserve.services.core.reservation import OutputLengthPredictor, ReservationContext, make_reservation_policy
from octoserve.services.core.step_budget import StepBudget
from octoserve.services.core.types import (
    EngineLoad,
    FinishReason,
    HandoffReady,
    RequestOutput,
    RequestSpec,
    Role,
)


class BatchBook:
    """One instance's requests and KV, between steps (the planner is `Batcher`)."""

    def __init__(self, config: BatcherConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.block_size = kv.block_size
        self._queue_key = QUEUE_POLICIES.get(config.queue_policy)
        self._victim_key = VICTIM_POLICIES.get(config.victim_policy)
        self._reservation = make_reservation_policy(config.reservation_policy)
        self.predictor = OutputLengthPredictor(config.predictor_quantile, prior_tokens=config.predictor_prior_tokens)
        self._requests: dict[str, Request] = {}
        self._waiting: WaitingQueue[Request] = WaitingQueue()
        self._running: list[Request] = []  # sorted by victim key: most important first
        self._swapped: list[Request] = []  # sorted by victim key
        self._num_reserved = 0
        self._truncated: list[Request] = []  # out of KV while alone in the batch: finished at the next update
        self.budget = StepBudget(config)
        self._num_swap_blocks_used = 0
        self._run_seq = 0
        # Bumped by every call that may change the queues, the batch or the KV: whoever caches a view of this
        # batcher (the simulator's load snapshots) keys it on this.
        self.state_version = 0

    # ---- intake -------------------------------------------------------------------------------------------

    def add_request(self, spec: RequestSpec, now: float) -> None:
        """Queue a request. Raises ValueError for a duplicate id or a request this instance can never hold."""
        self.state_version += 1
        if spec.request_id in self._requests:
            raise ValueError(f"request id {spec.request_id!r} is already in this batcher")
        self._check_fits(spec)
        req = self._new_request(spec)
        self._requests[req.request_id] = req
        self._waiting.push(req.queue_key, req)

    def _check_fits(self, spec: RequestSpec) -> None:
        ctx = self._reservation_context()
        num_tokens = min(self.config.max_model_len, self._reservation.initial_tokens(spec, spec.num_prompt_tokens + 1, ctx))
        num_blocks = -(-num_tokens // self.block_size)
        if num_blocks > self.kv.num_total_blocks:
            raise ValueError(
                f"request {spec.request_id} needs {num_blocks} KV blocks at admission ({num_tokens} tokens) but the "
                f"instance has {self.kv.num_total_blocks}; shorten the prompt or lower max_tokens"
            )

    def _new_request(self, spec: RequestSpec) -> Request:
        prefill_s = spec.num_prompt_tokens * self.config.prefill_s_per_token  # 0 when no cost estimate is given
        req = Request(spec, self._queue_key(spec, self.config.tier_ttft_slo_ms, prefill_s), self._victim_key(spec))
        req.stop_len = min(req.stop_len, self.config.max_model_len)
        return req

    def request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def _reservation_context(self) -> ReservationContext:
        # Positional: the context's __init__ is interpreted (services/core/reservation.py), where keywords cost more.
        return ReservationContext(
            self.kv.num_free_blocks,  # num_free_blocks
            self.kv.num_total_blocks,  # num_total_blocks
            self.block_size,  # block_size
            self.predictor.predict(),  # predicted_output_tokens
        )

    def _stop_reason(self, req: Request, token_id: int) -> FinishReason | None:
        spec = req.spec
        if token_id == self.config.eos_token_id and not spec.sampling.ignore_eos:
            return FinishReason.STOP
        if req.num_output_tokens >= spec.max_tokens or req.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH
        if self.config.role is Role.PREFILL:
            return FinishReason.HANDOFF
        return None

    def _output(self, req: Request, token_ids: tuple[int, ...], finish: FinishReason | None) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id,
            new_token_ids=token_ids,
            finish_reason=finish,
            num_prompt_tokens=req.num_prompt_tokens,
            num_cached_prompt_tokens=req.num_cached_tokens,
            num_output_tokens=req.num_output_tokens,
        )

    def _hold_for_handoff(self, req: Request, first_token_id: int) -> HandoffReady:
        self._running.remove(req)
        req.status = RequestStatus.HANDOFF
        return HandoffReady(req.request_id, self.kv.block_ids(req.request_id), req.num_prompt_tokens, first_token_id)

    def _finish(self, req: Request, *, observe: bool) -> None:
        if req.status is RequestStatus.RUNNING:
            self._running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self._waiting.remove(req)
        elif req.status is RequestStatus.SWAPPED:
            self._swapped.remove(req)
            self._num_swap_blocks_used -= req.num_swapped_blocks
        elif req.status is RequestStatus.RESERVED:
            self._num_reserved -= 1
        if observe:
            self.predictor.observe(req.num_output_tokens)
        req.status = RequestStatus.FINISHED
        self.kv.free(req.request_id)
        del self._requests[req.request_id]

    def abort(self, request_id: str) -> bool:
        """Drop a request wherever it is and free its KV. False if the batcher does not know it."""
        self.state_version += 1
        req = self._requests.get(request_id)
        if req is None:
            return False
        self._finish(req, observe=False)
        return True

    # ---- disaggregation ----------------------------------------------------------------------------------

    def release_handoff(self, request_id: str) -> bool:
        """Prefill role: the KV was sent (or will never be); free the blocks (they stay prefix-cached)."""
        return self._release(request_id, RequestStatus.HANDOFF, observe=True)

    def _release(self, request_id: str, status: RequestStatus, observe: bool) -> bool:
        """Finish a request held in `status` (False, changing nothing, when it is not)."""
        self.state_version += 1
        req = self._requests.get(request_id)
        if req is None or req.status is not status:
            return False
        self._finish(req, observe=observe)
        return True

    def reserve(self, spec: RequestSpec, now: float) -> bool:
        """Decode role: hold KV for the prompt (plus the reservation policy's output share) before prefill."""
        return self._reserve(spec, (), must_fit_next=False)

    def _reserve(self, spec: RequestSpec, output_token_ids: Sequence[int], must_fit_next: bool) -> bool:
        """Hold KV for a request that will arrive by hand-off: its prompt, the tokens it already produced and the
        reservation policy's output share. `must_fit_next`: refuse when that leaves no room for one more token."""
        self.state_version += 1
        if spec.request_id in self._requests or self._num_active() >= self.config.max_num_seqs:
            return False
        req = self._new_request(spec)
        req.token_ids.extend(output_token_ids)
        ctx = self._reservation_context()
        num_tokens = min(self.config.max_model_len, self._reservation.initial_tokens(spec, req.num_tokens + 1, ctx))
        if must_fit_next and num_tokens < req.num_tokens + 1:
            return False
        if not self._reservation.may_admit(-(-num_tokens // self.block_size), ctx):
            return False
        if self.kv.allocate(req.request_id, req.token_ids, num_tokens) is None:
            return False
        req.capacity_tokens = len(self.kv.block_ids(req.request_id)) * self.block_size
        req.num_cached_tokens = self.kv.num_cached_tokens(req.request_id)
        req.status = RequestStatus.RESERVED
        self._requests[req.request_id] = req
        self._num_reserved += 1
        return True

    def commit_handoff(self, request_id: str, first_token_id: int, now: float) -> RequestOutput | None:
        """Decode role: the prompt KV arrived; the request joins the running batch after its first token.

        Returns a final (empty) output when the first token already ends the request, else None.
        """
        self.state_version += 1
        req = self._requests.get(request_id)
        if req is None or req.status is not RequestStatus.RESERVED:
            raise KeyError(f"no reservation for request {request_id!r}")
        self._num_reserved -= 1
        req.num_computed_tokens = req.num_prompt_tokens
        req.token_ids.append(first_token_id)
        req.first_token_s = req.last_token_s = now
        self.kv.cache_computed(req.request_id, req.token_ids, req.num_computed_tokens)
        self._set_running(req)
        finish = self._stop_reason(req, first_token_id)
        if finish is None:
            return None
        self._finish(req, observe=True)
        return self._output(req, (), finish)

    def release_reservation(self, request_id: str) -> bool:
        """Decode role: the hand-off will not come; free the reserved blocks."""
        return self._release(request_id, RequestStatus.RESERVED, observe=False)

    # ---- live migration (services/core/migration.py): a running decode leaves one batcher for another -------

    def suspend_running(self, request_id: str) -> tuple[int, ...] | None:
        """Migration out, at an iteration boundary: a running decode leaves the batch and keeps its KV (HANDOFF,
        freed by `release_handoff`, or back in the batch by `resume_suspended`). Returns its output tokens so far,
        or None when it is not a running decode (unknown, queued, or still prefilling)."""
        req = self._requests.get(request_id)
        if req is None or req.status is not RequestStatus.RUNNING or req.num_uncomputed_tokens != 1 \
                or req.num_output_tokens < 1:
            return None
        self.state_version += 1
        self._running.remove(req)
        req.status = RequestStatus.HANDOFF
        return tuple(req.token_ids[req.num_prompt_tokens:])

    def resume_suspended(self, request_id: str) -> bool:
        """A migration that did not happen: the suspended request rejoins the batch where it stopped."""
        req = self._requests.get(request_id)
        if req is None or req.status is not RequestStatus.HANDOFF:
            return False
        self.state_version += 1
        self._set_running(req)
        return True

    def reserve_migrated(self, spec: RequestSpec, output_token_ids: Sequence[int], now: float) -> bool:
        """Migration in: as `reserve`, for a request that already produced `output_token_ids` elsewhere."""
        return self._reserve(spec, output_token_ids, must_fit_next=True)

    def commit_migrated(self, request_id: str, now: float) -> None:
        """Migration in: the KV arrived (all but the last output token's); the request decodes on from there."""
        self.state_version += 1
        req = self._requests.get(request_id)
        if req is None or req.status is not RequestStatus.RESERVED:
            raise KeyError(f"no reservation for request {request_id!r}")
        self._num_reserved -= 1
        req.num_computed_tokens = req.num_tokens - 1
        req.first_token_s = req.last_token_s = now
        self.kv.cache_computed(req.request_id, req.token_ids, req.num_computed_tokens)
        self._set_running(req)

    # ---- state ---------------------------------------------------------------------------------------------

    def _set_running(self, req: Request) -> None:
        req.status = RequestStatus.RUNNING
        self._run_seq += 1
        req.run_seq = self._run_seq
        bisect.insort(self._running, req, key=_victim_order)

    def _num_active(self) -> int:
        return len(self._running) + self._num_reserved

    @property
    def has_work(self) -> bool:
        return bool(self._running or self._waiting or self._swapped or self._truncated)

    @property
    def has_pending_outputs(self) -> bool:
        """Outputs that the next `update` emits even for an empty plan (requests stopped for lack of KV)."""
        return bool(self._truncated)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + len(self._swapped)

    def num_future_decodes(self) -> int:
        """The decodes its steps carry once every request it holds has started: running, reserved, waiting and
        swapped, at most `max_num_seqs`."""
        return min(self.config.max_num_seqs, self._num_active() + self.num_waiting)

    def running_length_tokens(self) -> int:
        """Tokens the running requests hold, prompt and output (their decodes' contexts)."""
        return sum(len(r.token_ids) for r in self._running)

    def running_context_tokens(self) -> int:
        """KV tokens the running requests hold computed (what a checkpoint to host would copy)."""
        return sum(r.num_computed_tokens for r in self._running)

    def queued_prefill_tokens(self) -> int:
        """Prompt tokens admitted and not computed, less those of the step in flight (its wait is
        `busy_until_s`)."""
        waiting = sum(r.num_uncomputed_tokens for r in self._waiting)
        # Asked for at every routing decision over the whole running batch: one pass, no property calls.
        partial = sum(u for r in self._running if (u := len(r.token_ids) - r.num_computed_tokens) > 1)
        return max(0, waiting + partial - self.budget.inflight_prefill_tokens)

    def decode_slots(self) -> int:
        """Sequences the instance runs at once: `max_num_seqs`, or with context-aware slots the most decodes of the
        running set's mean context whose step fits `decode_slot_target_s` (never fewer than are running)."""
        cfg = self.config
        if cfg.decode_slot_target_s <= 0 or not self._running:
            return cfg.max_num_seqs
        mean = self.running_length_tokens() / len(self._running)
        lo, hi = 1, cfg.max_num_seqs
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.budget.decode_step_s(mid, int(mid * mean)) <= cfg.decode_slot_target_s:
                lo = mid
            else:
                hi = mid - 1
        return max(lo, len(self._running))

    def load(self, instance_id: str, model: str, prefill_tokens_per_s: float, decode_step_time_s: float,
             long_prefill_tokens_per_s: float = 0.0, long_step_wait_s: float = 0.0, long_burst_tokens: float = 0.0,
             long_sustained_tokens_per_s: float = 0.0) -> EngineLoad:
        return EngineLoad(
            instance_id=instance_id,
            model=model,
            role=self.config.role,
            num_running=len(self._running),
            num_waiting=self.num_waiting,
            num_total_blocks=self.kv.num_total_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            block_size=self.block_size,
            queued_prefill_tokens=self.queued_prefill_tokens(),
            prefill_tokens_per_s=prefill_tokens_per_s,
            decode_step_time_s=decode_step_time_s,
            max_num_seqs=self.decode_slots(),
            mean_output_tokens=self.predictor.mean(),
            num_reserved=self._num_reserved,
            long_prefill_tokens_per_s=long_prefill_tokens_per_s,
            busy_until_s=self.budget.busy_until_s,
            long_step_wait_s=long_step_wait_s,
            long_burst_tokens=long_burst_tokens,
            long_sustained_tokens_per_s=long_sustained_tokens_per_s,
        )


def _victim_order(req: Request) -> tuple:
    return req.victim_key
