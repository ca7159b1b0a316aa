"""A batcher for the simulator that advances requests in steady decode implicitly: O(events) work per step.

In a large decode batch almost every request does the same thing every step: it computes one token, samples one
(deterministic, `sim_executor.token_key`) and goes on. `SteadyBatcher` runs the same policy as `Batcher` (it is
one, with the same `schedule_compact` / `update_compact` calls) but keeps such requests, the *steady* set, off the
per-step path: a steady request's length is `c + s`, where `s` counts this batcher's updates (`self._times`, the
end time of each) and `c` is fixed while it stays steady. Work for it happens only at its events, each found in
advance and bucketed by step:
- at planning: its KV blocks are full (it needs one more block: `_grow`, as the plain path does);
- at update: a block became full (the block is hashed into the prefix cache: a block of output tokens from the
  formula's packed bytes, `KVCacheManager.cache_next_block_bytes`, one holding prompt tokens or EOS from its tokens,
  written into `token_ids` up to there), or its token ends it (EOS, length), where the plain path's code
  (`_apply_chunks`) runs for it alone.
Its `num_computed_tokens`, `last_token_s` and token times are written out (`_sync`) when it stops and whenever
anything else is about to read or change it (preemption, abort, a fallback step, the caller's `sync_all`); until
then they are stale (its `token_ids` may run ahead of them), so `queued_prefill_tokens` and the plan read only the
explicit requests. The step's context totals come from `sum(c) + n * s`, so the cost model sees the same integers
and gives the same float.

Exactness: every decision the plain batcher makes, in the same order. Steady requests at an event are handled in
running-list order (victim key, then `run_seq`) before the step's explicit chunks, as the plain path handles
decodes first. A step that the implicit form cannot reproduce without replaying per-request order (a decode that
needs a block the pool lacks, a budget smaller than the decode count, a one-token prefill among the decodes)
first writes every steady request out and runs the base class's plan; they become steady again at the next plan.

Token times: a request's implicit tokens are reported by `drain_token_times()` as (request id, times) at each
write-out, in order; the caller appends them before the step's outputs (services/sim/driver.py).

For the simulator only: it assumes the executor is `SimExecutor` (tokens from `token_key`) and no gang arbiter
(`earliest_deadline_s` and `step_floor_s` write every request out first, to stay correct, not fast).
"""

from __future__ import annotations

import math

import bisect
from collections.abc import Sequence

from octoserve.services.core.batch_state import Request, RequestStatus, SteadyState
from octoserve.services.core.batcher import Batcher
from octoserve.services.core.step_builders import CompactBuilder, CompactOutputs, CompactStep, StepUnderConstruction
from octoserve.services.core.sim_executor import sim_token_bytes, sim_tokens, token_key
from octoserve.services.core.types import HandoffReady, RequestOutput, Role

SLACK_TIE_S = 1e-6  # keys closer than this to the smallest are evaluated exactly (float rounding is ~1e-14 s)


class _Steady(SteadyState):
    """A steady request's state: its length is c + s at the plan of step s (s0 <= s)."""

    __slots__ = ("c", "s0", "order", "stop_step", "next_update", "next_grow", "slack_key")

    def __init__(self, c: int, s0: int, order: tuple) -> None:
        self.c = c  # length minus step count: fixed while steady
        self.s0 = s0  # step up to which its tokens and times are written out
        self.order = order  # (victim key, run_seq): its place in the running list
        self.stop_step = 0  # step whose sampled token ends it (EOS or length)
        self.next_update = 0  # step whose update has an event for it (block full, stop)
        self.next_grow = 0  # step whose plan finds its KV full
        self.slack_key: tuple = ()  # its entry in SteadyBatcher._slack


class SteadyBatcher(Batcher):
    def __init__(self, config, kv) -> None:
        super().__init__(config, kv)
        self._times: list[float] = []  # end time of each update so far; step s is the (s+1)-th
        self._num_steady = 0
        self._sum_c = 0  # sum of the steady requests' c: their lengths sum to _sum_c + _num_steady * s
        # step -> (request, its steady state) whose plan needs a block / with an event in its update; an entry of an
        # earlier steady spell, or one moved to another step, is stale and skipped (`_due`)
        self._grow_at: dict[int, list[tuple[Request, _Steady]]] = {}
        self._update_at: dict[int, list[tuple[Request, _Steady]]] = {}
        # (first_token_s + (c - prompt) * tpot target, run order, request) of every steady request, sorted: the
        # smallest keys give the tightest TPOT deadline (`StepBudget.slack_budget`) without a pass over the batch.
        self._slack: list[tuple] = []
        self._flushed: list[tuple[str, list[float]]] = []
        # Between a plan with steady decodes and its update: requests written out meanwhile still get the step's
        # token, explicitly, at the update (an abort drops it, as on the plain path).
        self._in_flight = False
        self._left_in_flight: list[Request] = []
        self._steady_ok = config.role is not Role.PREFILL  # prefill-role requests stop at their first token
        # Every running request that is not steady, and maybe some that left the running list since (their status
        # says so): what `queued_prefill_tokens` reads, at each routing decision, instead of the whole batch.
        self._explicit: set[Request] = set()

    # ---- write-out -------------------------------------------------------------------------------------------

    def drain_token_times(self) -> list[tuple[str, list[float]]]:
        """(request id, times of its tokens made implicitly) since the last drain, in order."""
        flushed, self._flushed = self._flushed, []
        return flushed

    def _sync(self, req: Request, upto: int) -> None:
        """Write out `req`'s tokens, computed count and token times up to the plan of step `upto`."""
        st = _state(req)  # only steady requests are written out
        s0 = st.s0
        if upto <= s0:
            return
        tokens = req.token_ids
        end = st.c + upto
        tokens.extend(self._tokens(req, len(tokens), end))
        req.num_computed_tokens = end - 1
        times = self._times[s0:upto]
        req.last_token_s = times[-1]
        self._flushed.append((req.request_id, times))
        st.s0 = upto

    def _tokens(self, req: Request, start: int, end: int) -> list[int]:
        """The tokens `req` samples at lengths start..end-1 (SimExecutor's formula; EOS past eos_at, which only
        an ignore_eos request reaches)."""
        assert req.executor_key is not None  # set when it joined (`_join`)
        eos_at, offset = req.executor_key
        plain_end = end if end <= eos_at else max(start, int(eos_at))
        tokens = sim_tokens(start, plain_end, offset)
        if plain_end < end:
            tokens.extend([self.config.eos_token_id] * (end - plain_end))
        return tokens

    def _leave(self, req: Request) -> None:
        """Write `req` out (up to now) and make it explicit again."""
        st = _state(req)
        self._sync(req, len(self._times))
        self._num_steady -= 1
        self._sum_c -= st.c
        slack = self._slack
        del slack[bisect.bisect_left(slack, st.slack_key)]
        req.steady = None
        self._explicit.add(req)

    def sync_all(self) -> None:
        """Make every request explicit (before anything reads or changes them request by request)."""
        for req in self._running:
            if req.steady is not None:
                self._leave(req)
                if self._in_flight:
                    self._left_in_flight.append(req)

    def _join(self, req: Request, s: int) -> None:
        num_tokens = len(req.token_ids)
        st = req.steady = _Steady(num_tokens - s, s, (req.victim_key, req.run_seq))
        self._explicit.discard(req)
        if req.executor_key is None:
            req.executor_key = token_key(req.spec, req.num_prompt_tokens)
        eos_at = req.executor_key[0]
        # Update of step k samples at length c + k: EOS from eos_at on, and the length stop at stop_len - 1.
        stop = req.stop_len - 1 - st.c
        if not req.spec.sampling.ignore_eos and eos_at != float("inf"):
            stop = min(stop, int(eos_at) - st.c)
        st.stop_step = max(s, stop)
        self._num_steady += 1
        self._sum_c += st.c
        assert req.first_token_s is not None  # only a decode joins
        st.slack_key = (req.first_token_s + (st.c - req.num_prompt_tokens) * self.config.tpot_target_s,
                        req.run_seq, req)
        bisect.insort(self._slack, st.slack_key)
        self._plan_update(req, st, s)
        self._plan_grow(req, st)

    def _plan_update(self, req: Request, st: _Steady, s: int) -> None:
        """Bucket `req`'s next update event from step `s` on: the first of a block filling and its stop."""
        # Update of step k: its computed count reaches c + k; a multiple of the block size fills a block.
        k = s + (-(st.c + s)) % self.block_size
        if k > st.stop_step:
            k = st.stop_step
        st.next_update = k
        self._update_at.setdefault(k, []).append((req, st))

    def _plan_grow(self, req: Request, st: _Steady) -> None:
        """Bucket the plan at which `req` has filled the KV it holds: its computed count c + k - 1 reaches it."""
        k = st.next_grow = req.capacity_tokens + 1 - st.c
        self._grow_at.setdefault(k, []).append((req, st))

    @staticmethod
    def _due(bucket: dict[int, list[tuple[Request, _Steady]]], s: int, grow: bool) -> list[Request]:
        """The steady requests whose event at step `s` is still current (same tenure, same step: `next_grow` when
        `grow`, else `next_update`), in running-list order."""
        entries = bucket.pop(s, None)
        if not entries:
            return []
        # Two comprehensions, not getattr(st, name): a named attribute is a direct slot read when compiled.
        if grow:
            due = [r for r, st in entries if r.steady is st and st.next_grow == s]
        else:
            due = [r for r, st in entries if r.steady is st and st.next_update == s]
        if len(due) > 1:
            due.sort(key=_steady_order)  # orders are unique: the order of the running list
        return due

    # ---- hooks: everything that reads or changes a request one by one writes a steady one out first ----------

    def _preempt(self, req: Request, step: StepUnderConstruction) -> None:
        if req.steady is not None:
            self._leave(req)
            if isinstance(step, _SteadyBuilder):
                step.budget += 1  # its implicit chunk leaves the step
        super()._preempt(req, step)

    def _finish(self, req: Request, *, observe: bool) -> None:
        if req.steady is not None:
            self._leave(req)
        self._explicit.discard(req)
        super()._finish(req, observe=observe)

    def _set_running(self, req: Request) -> None:
        super()._set_running(req)
        self._explicit.add(req)

    def _make_room(self, req: Request, num_tokens: int, step: StepUnderConstruction) -> bool:
        fits = super()._make_room(req, num_tokens, step)
        if not fits and self._truncated and self._truncated[-1] is req:
            self._explicit.discard(req)  # off the running list, still marked running until the update ends it
        return fits

    def queued_prefill_tokens(self) -> int:
        waiting = sum(r.num_uncomputed_tokens for r in self._waiting)
        running = RequestStatus.RUNNING
        gone = [r for r in self._explicit if r.status is not running]
        for r in gone:
            self._explicit.discard(r)
        # A steady request has exactly one token to compute: it adds nothing here.
        partial = sum(u for r in self._explicit if (u := len(r.token_ids) - r.num_computed_tokens) > 1)
        return max(0, waiting + partial - self.budget.inflight_prefill_tokens)

    def schedule(self, now: float, step_cap_s: float | None = None):
        self.sync_all()
        return super().schedule(now, step_cap_s)

    def step_floor_s(self) -> float:
        self.sync_all()
        return super().step_floor_s()

    def earliest_deadline_s(self, itl_s: float, prefill_share: float = 1.0) -> float | None:
        self.sync_all()
        return super().earliest_deadline_s(itl_s, prefill_share)

    def running_context_tokens(self) -> int:
        self.sync_all()
        return super().running_context_tokens()

    def running_length_tokens(self) -> int:
        # a steady request's `token_ids` may run ahead of its length (written to its block's end): c + s is exact
        running = RequestStatus.RUNNING
        explicit = sum(len(r.token_ids) for r in self._explicit if r.status is running and _state_or_none(r) is None)
        return explicit + self._sum_c + self._num_steady * len(self._times)

    # ---- plan ------------------------------------------------------------------------------------------------

    def schedule_compact(self, now: float, step_cap_s: float | None = None) -> CompactStep:
        step = self._plan_steady(now) if self._steady_ok and step_cap_s is None else None
        if step is None:  # the plain plan, every request explicit
            self.sync_all()
            return super().schedule_compact(now, step_cap_s)
        s = len(self._times)
        self._in_flight = True
        return CompactStep(self._step_id, tuple(step.reqs), tuple(step.num_new), tuple(step.contexts),
                           tuple(step.samples), tuple(step.preempted_ids), step.swap_out_blocks, step.swap_in_blocks,
                           self._num_steady, self._sum_c + self._num_steady * s)

    def _plan_steady(self, now: float) -> _SteadyBuilder | None:
        """`_plan_step` with the decodes implicit; None (nothing changed) where it cannot reproduce it."""
        s = len(self._times)
        prefills: list[Request] = []
        if len(self._running) != self._num_steady:
            running = RequestStatus.RUNNING
            explicit = [r for r in self._explicit if r.status is running]
            explicit.sort(key=_run_order)  # the running list's order, without a pass over the batch
            for r in explicit:
                if len(r.token_ids) - r.num_computed_tokens != 1:
                    prefills.append(r)
                elif r.first_token_s is not None:
                    self._join(r, s)
                else:
                    return None  # a one-token prefill among the decodes: their order matters
        n = self._num_steady
        cfg = self.config
        num_decode_tokens = self._sum_c + n * s
        extra_kv_s = 0.0
        if cfg.kv_s_per_context_token > 0 and n:
            extra_kv_s = max(0.0, (num_decode_tokens - n * cfg.sized_context_tokens) * cfg.kv_s_per_context_token)
        self._demote_lost_heads(now, n)
        budget = self.budget.shrunk(self.budget.step_budget(n), n, extra_kv_s)
        if cfg.tpot_target_s > 0 and (prefills or self._waiting):
            budget = self._spend_tail(budget, self._steady_slack_budget(n, s, now, extra_kv_s), n, extra_kv_s,
                                      prefills, now)
        elif cfg.tpot_target_s > 0:  # nothing to prefill: only the load report's long-step figures stay current
            self.budget.slack_chunk = self._steady_slack_budget(n, s, now, extra_kv_s) - n
        if budget < n:
            return None
        growing = self._due(self._grow_at, s, grow=True)
        if len(growing) > self.kv.num_free_blocks:
            return None  # some decode would preempt: the plain plan (every request explicit) decides whom
        self.state_version += 1
        for req in growing:  # one block each, in running order, as the plain plan's decode loop takes them
            st = _state(req)  # `_due` keeps only current steady requests
            self._grow(req, st.c + s)
            self._plan_grow(req, st)
        step = _SteadyBuilder(budget, self)
        step.budget -= n
        first, deferred = self._prefills_before_waiting(prefills)
        self._schedule_running_compact(step, first)
        if not step.preempted_ids:
            self._schedule_swapped(step)
        if not step.preempted_ids and not self._swapped:
            self._schedule_waiting(step)
        if deferred:
            self._schedule_running(step, deferred)
        self.budget.note_plan(now, n, step.used, extra_kv_s)
        self._step_id += 1
        return step

    def _steady_slack_budget(self, n: int, s: int, now: float, extra_kv_s: float) -> int:
        """`StepBudget.slack_budget` over the steady decodes: the same float minimum, from the few smallest keys."""
        cfg = self.config
        table = cfg.decode_step_s_by_num_decodes
        if not table or cfg.prefill_s_per_token <= 0:
            return 0
        base_s = table[min(n, len(table) - 1)] + extra_kv_s
        payback_s = cfg.tpot_horizon_tokens * (cfg.tpot_target_s - base_s)
        tpot_s = math.inf
        target = cfg.tpot_target_s
        slack = self._slack
        if slack:
            limit = slack[0][0] + SLACK_TIE_S
            for key in slack:
                if key[0] > limit:
                    break
                r = key[2]
                tpot_s = min(tpot_s, r.first_token_s + (_state(r).c + s - r.num_prompt_tokens) * target - now
                             + payback_s)
        self.budget.note_slack(tpot_s, base_s, n)
        allowed_s = min(tpot_s, cfg.max_step_s if n else max(cfg.max_step_s, self.budget.idle_step_s))
        extra_tokens = int((allowed_s - base_s) / cfg.prefill_s_per_token + 1e-9)  # no float round-down
        return min(cfg.max_num_batched_tokens, n + max(0, extra_tokens))

    # ---- update ----------------------------------------------------------------------------------------------

    def update_compact(self, step: CompactStep, sampled: Sequence[int | None], now: float) -> CompactOutputs:
        self.state_version += 1
        self.budget.observe_gaps(now)
        outputs: list[RequestOutput] = []
        handoffs: list[HandoffReady] = []
        plain: list[Request] = []
        self._finish_truncated(outputs)
        k = len(self._times)
        left, self._left_in_flight, self._in_flight = self._left_in_flight, [], False
        if step.num_steady:
            self._steady_events(k, now, outputs, handoffs, plain, left)
        self._times.append(now)  # after the events: a request written out there stops before step k
        self._apply_chunks(step.reqs, step.num_new, sampled, now, outputs, handoffs, plain)
        return CompactOutputs(tuple(outputs), tuple(handoffs), tuple(self.kv.drain_events()), tuple(plain))

    def _steady_events(self, k: int, now: float, outputs: list[RequestOutput], handoffs: list[HandoffReady],
                       plain: list[Request], left: list[Request]) -> None:
        """The update of step `k` for the steady requests with an event in it, and those of its decodes written
        out since its plan, in running-list order."""
        block_size = self.block_size
        due = self._due(self._update_at, k, grow=False)
        if left:
            due = sorted(due + left, key=_run_order)
        kv = self.kv
        for req in due:
            st = _state_or_none(req)
            if st is None:  # written out since the plan: the plain path's update, for it alone
                num_tokens = len(req.token_ids)
                self._apply_chunks((req,), (1,), self._tokens(req, num_tokens, num_tokens + 1), now, outputs,
                                   handoffs, plain)
                continue
            num_tokens = st.c + k  # its length at this step's plan; its computed count reaches it now
            if k == st.stop_step:
                self._leave(req)
                self._apply_chunks((req,), (1,), self._tokens(req, num_tokens, num_tokens + 1), now, outputs,
                                   handoffs, plain)
                continue
            # A block became full: the one thing of this step's update that is not implicit. Its tokens come
            # from the formula where not written out yet; the request itself stays as it was.
            tokens = req.token_ids
            start = num_tokens - block_size
            num_full = num_tokens // block_size
            assert req.executor_key is not None  # set when it joined
            eos_at, offset = req.executor_key
            if start >= req.num_prompt_tokens and num_tokens <= eos_at:
                # Output tokens only, none of them EOS: the formula's packed bytes, no token objects
                cached = kv.cache_next_block_bytes(req.request_id, num_full, sim_token_bytes(start, num_tokens, offset))
            else:  # the block holds prompt tokens (or EOS): its tokens, written out
                if len(tokens) < num_tokens:
                    # Written out ahead of the request's count, once: `_sync` carries on from the end of the list.
                    tokens.extend(self._tokens(req, len(tokens), num_tokens))
                cached = kv.cache_next_block(req.request_id, num_full, tokens[start:num_tokens])
            if not cached:
                self._sync(req, k)
                req.num_computed_tokens = num_tokens
                kv.cache_computed(req.request_id, tokens, num_tokens)
            next_update = k + block_size
            st.next_update = next_update if next_update < st.stop_step else st.stop_step
            self._update_at.setdefault(st.next_update, []).append((req, st))


class _SteadyBuilder(CompactBuilder):
    """A step under construction whose steady decodes are all in it, implicitly (one token each)."""

    __slots__ = ("batcher",)

    def __init__(self, budget: int, batcher: SteadyBatcher) -> None:
        super().__init__(budget)
        self.batcher = batcher

    @property
    def scheduled_ids(self) -> set[str]:
        ids = {r.request_id for r in self.reqs}
        ids.update(r.request_id for r in self.batcher._running if r.steady is not None)
        return ids


def _state(req: Request) -> _Steady:
    """A steady request's state (`Request.steady`, opaque to the base batcher)."""
    st = req.steady
    assert isinstance(st, _Steady)  # only steady requests get here
    return st


def _state_or_none(req: Request) -> _Steady | None:
    st = req.steady
    assert st is None or isinstance(st, _Steady)
    return st


def _steady_order(req: Request) -> tuple:
    """A steady request's place in the running list (`_Steady.order`)."""
    st = _state(req)  # `_due` sorts current steady requests only
    return st.order


def _run_order(req: Request) -> tuple:
    return req.victim_key, req.run_seq

