"""The iteration-level batcher of one engine instance: `schedule(now) -> StepPlan`, `update(plan, result, now)`.

One engine step is three calls, as in vLLM v1: `plan = batcher.schedule(now)`, `result = executor(plan)`,
`outputs = batcher.update(plan, result, now)`. There is no prefill phase and decode phase: every request has
`num_computed_tokens` catching up with `num_tokens`, so chunked prefill, prefix hits and recompute after preemption
need no flags. `schedule` is three named steps in a fixed order:

1. running requests, decodes first (they bound ITL), then unfinished prefill chunks, under the step token budget;
   a request that needs a block the pool lacks preempts the least important running request (policy) until it fits
   or is itself the victim; with tier preemption on, the prefill chunks of less urgent tiers queued after the
   waiting head run after step 3, not before;
2. swapped-out requests come back when blocks are free (only in steps that preempted nothing);
3. waiting requests are admitted in queue-policy order while the token budget, `max_num_seqs` and the reservation
   policy allow; the head of the queue is never overtaken (no starvation of large requests), though under EDF a
   head that can no longer meet its TTFT deadline is first demoted behind those that can (`_demote_lost_heads`),
   as the queue demotes a prompt infeasible from the start. A head that finds
   no slot or no KV preempts running requests of strictly less urgent tiers (tier preemption, on when
   `batch_min_share` < 1), least urgent and least advanced first, but never below BATCH's floor of
   `batch_min_share` x `max_num_seqs` running BATCH requests: the latency tier gets the capacity first, and
   background work keeps a minimum share (and its EDF deadline ages it to the head, so it is never starved).

Invariants: a request is in exactly one of waiting / running / swapped / reserved / handoff; every token a plan
schedules has a KV slot it holds (blocks come only from `KVCacheManager.allocate`, which returns None rather than
over-allocate), so a step can never run out of memory; at most `max_num_seqs` requests run; at most
`max_num_batched_tokens` tokens are scheduled per step.

Roles: `colocated` runs requests to completion; `prefill` stops a request after its first sampled token and holds
its KV for the hand-off (`release_handoff` frees it); `decode` reserves KV before prefill starts elsewhere
(`reserve`) and starts from the received KV (`commit_handoff`).

Why one module past 600 lines: the step plan and the long-step rule it applies on every step, compiled as one
module (mypyc: calls inside a module are native, across modules they are not).

The book of requests this planner steps (the waiting / running / swapped lists, intake, `abort`, the hand-off and
migration API, the load report) is `BatchBook` (batch_book); its config and per-request state (batch_state), step
builders (step_builders) and step-time budget arithmetic (step_budget) live apart too.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import overload

from octoserve.services.core.batch_book import BatchBook, _victim_order
from octoserve.services.core.batch_state import DEFAULT_TIER_TTFT_SLO_MS, BatcherConfig, Request, RequestStatus
from octoserve.services.core.kv_cache import KVCacheManager
from octoserve.services.core.preemption import tier_victim
from octoserve.services.core.queues import demoted_key
from octoserve.services.core.step_builders import (
    CompactBuilder,
    CompactOutputs,
    CompactStep,
    StepBuilder,
    StepUnderConstruction,
)
from octoserve.services.core.types import (
    FinishReason,
    HandoffReady,
    Priority,
    RequestOutput,
    Role,
    StepOutputs,
    StepPlan,
    StepResult,
)

NEEDS_LONG_SCAN = 4  # waiting prompts `_long_step_tokens` looks at, past the running prefills
DEMOTE_SCAN = 16  # waiting prompts `_demote_lost_heads` looks at behind a lost head
UNCAPPED = 1 << 30  # `_long_step_tokens`: the long step takes all the running decodes' TPOT slack allows

class Batcher(BatchBook):
    """The book of requests, stepped: `schedule` plans the next step, `update` applies its result."""

    def __init__(self, config: BatcherConfig, kv: KVCacheManager) -> None:
        super().__init__(config, kv)
        self._step_id = 0
        self.num_preemptions_total = 0
        # Whether the step being planned is under a gang cap: it must end in time, so a new prompt's cached context
        # is paid for (`_schedule_waiting`).
        self._capped = False

    # ---- schedule ------------------------------------------------------------------------------------------

    def schedule(self, now: float, step_cap_s: float | None = None) -> StepPlan:
        """`step_cap_s`: a gang lease's cap on this step (services/core/gang.py): the prefill chunk shrinks so the
        step fits by the linear step model; the decodes always run (the step floor, `step_floor_s`)."""
        step = self._plan_step(now, step_cap_s, StepBuilder)
        return StepPlan(
            step_id=self._step_id,
            chunks=tuple(step.chunks),
            preempted_ids=tuple(step.preempted_ids),
            swap_out_blocks=step.swap_out_blocks,
            swap_in_blocks=step.swap_in_blocks,
        )

    def schedule_compact(self, now: float, step_cap_s: float | None = None) -> CompactStep:
        """`schedule` for an in-process executor: the same decisions (one code path), but the step is returned as
        parallel lists holding the `Request` objects instead of one `ScheduledChunk` message per request, which
        is most of a large decode batch's cost in the simulator. Pair it with `update_compact`;
        `CompactStep.to_plan()` gives the equal `StepPlan`."""
        step = self._plan_step(now, step_cap_s, CompactBuilder)
        return CompactStep(self._step_id, tuple(step.reqs), tuple(step.num_new), tuple(step.contexts),
                           tuple(step.samples), tuple(step.preempted_ids), step.swap_out_blocks, step.swap_in_blocks)

    @overload
    def _plan_step(self, now: float, step_cap_s: float | None, builder: type[StepBuilder]) -> StepBuilder: ...
    @overload
    def _plan_step(self, now: float, step_cap_s: float | None, builder: type[CompactBuilder]) -> CompactBuilder: ...

    def _plan_step(self, now: float, step_cap_s: float | None,
                   builder: type[StepBuilder] | type[CompactBuilder]) -> StepBuilder | CompactBuilder:
        self.state_version += 1
        decodes, prefills, num_decode_tokens = self._split_running_counted()
        extra_kv_s = self.budget.extra_kv_read_s(decodes, num_decode_tokens)
        self._demote_lost_heads(now, len(decodes))
        budget = self.budget.shrunk(self.budget.step_budget(len(decodes)), len(decodes), extra_kv_s)
        if self.config.tpot_target_s > 0 and (prefills or self._waiting):
            budget = self._spend_tail(budget, self.budget.slack_budget(decodes, now, extra_kv_s), len(decodes), extra_kv_s,
                                      prefills, now)
        elif self.config.tpot_target_s > 0:  # nothing to prefill: only the load report's long-step figures stay current
            self.budget.slack_chunk = self.budget.slack_budget(decodes, now, extra_kv_s) - len(decodes)
        self._capped = step_cap_s is not None and self.config.prefill_s_per_token > 0
        if step_cap_s is not None:
            contexts = [r.num_computed_tokens for r in prefills]
            budget = min(budget, self.budget.capped_budget(len(decodes), step_cap_s, extra_kv_s, max(contexts, default=0),
                                                           sum(contexts)))
            if decodes and not self.budget.tail.affordable(len(decodes)):
                # A gang step starts after the other side's: its decodes' gaps already ran while they waited for
                # the grant. With no tail left to spend, the step ends within the free share of the ITL SLO
                # counted from their previous tokens, as their clients see the gaps.
                waited_s = self.budget.gaps_waited_s(now)
                budget = min(budget, self.budget.free_budget(len(decodes), extra_kv_s + waited_s))
        step = builder(budget)
        first, deferred = self._prefills_before_waiting(prefills)
        if isinstance(step, CompactBuilder):
            self._schedule_decodes_compact(step, decodes)
            self._schedule_running_compact(step, first)
        else:
            self._schedule_running(step, decodes + first)
        if not step.preempted_ids:
            self._schedule_swapped(step)
        if not step.preempted_ids and not self._swapped:
            self._schedule_waiting(step)
        if deferred:
            self._schedule_running(step, deferred)
        self.budget.note_plan(now, len(decodes), step.used, extra_kv_s, step_cap_s is not None)
        self._step_id += 1
        return step

    def reconfigure(self, config: BatcherConfig) -> None:
        """Another config (an in-place role change: decode <-> colocated) on the same KV and requests: budgets and
        step model from now on; the tail of gaps already seen is kept."""
        self.config = config
        self.budget.reconfigure(config)

    def _prefills_before_waiting(self, prefills: list[Request]) -> tuple[list[Request], list[Request]]:
        """(prefill chunks that go before waiting admissions, those that go after): a running prefill of a less
        urgent tier whose queue key is later than the waiting head's gives its budget to the head first, so a long
        BATCH prompt mid-prefill cannot hold an INTERACTIVE request at the door (only with tier preemption on)."""
        if self.config.batch_min_share >= 1.0 or not self._waiting or not prefills:
            return prefills, []
        head = self._waiting.peek()
        tier = head.spec.priority
        first = [r for r in prefills if r.spec.priority <= tier or r.queue_key <= head.queue_key]
        if len(first) == len(prefills):
            return prefills, []
        return first, [r for r in prefills if not (r.spec.priority <= tier or r.queue_key <= head.queue_key)]

    def _spend_tail(self, budget: int, slack_budget: int, num_decodes: int, extra_kv_s: float,
                    prefills: list[Request], now: float) -> int:
        """The step's budget once the ITL tail is spent: the slack-extended budget (every decode's TPOT on
        target) when its step ends within the free share of the ITL SLO, or when the tail budget affords a slow
        gap per decode and some prompt needs a long step (`_long_step_tokens`, which may cap its prefill tokens);
        else as much of it as ends within the free share."""
        self.budget.slack_chunk = slack_budget - num_decodes
        if slack_budget <= budget:
            return budget
        free = self.budget.free_budget(num_decodes, extra_kv_s)
        if slack_budget <= free or num_decodes == 0:  # a step without decodes delays no gap
            return slack_budget
        if self.budget.tail.affordable(num_decodes):
            tokens = self._long_step_tokens(prefills, free - num_decodes, now)
            if tokens > 0:
                return max(free, min(slack_budget, num_decodes + tokens))
        return max(budget, free)

    def _long_step_tokens(self, prefills: list[Request], free_chunk: int, now: float) -> int:
        """0 when no prompt needs a step past the ITL SLO now; else the most prefill tokens that step may take
        (UNCAPPED: all the decodes' TPOT slack allows).

        A prompt needs one when it would reach its first token after its TTFT deadline in steps that end within
        the free share of the ITL SLO (each carrying `free_chunk` prefill tokens, one step kept for the step
        model's error), long steps starting now would still make it, and long steps starting after the free steps
        it can wait for (with one step to spare) would not. The running prefills in order, then the first
        NEEDS_LONG_SCAN waiting prompts in queue order, each behind the tokens of those before it (a long step
        takes them in that order). A prompt those steps serve in time leaves the tail to one they cannot; a
        prompt already lost spends none, but one behind it may still be saved.

        A long step that can wait does, for the prompts ahead that free steps make in time: the one the next free
        step finishes gets its first token first, and one that the long step would carry past its own deadline
        (its first token comes only when the whole long step ends) finishes in free steps before the long step
        starts. Admission promised those prompts their free steps; carried by a later prompt's long step, a
        519-token prompt three free steps from its first token got it 253 ms after arrival instead of ~150. When
        the late prompt cannot wait for them, the long step ends with them (a capped first long step, their
        first tokens at its end) and a second takes the rest, if the tail affords both and the late prompt still
        makes it; else one long step saves the late prompt."""
        cfg = self.config
        if free_chunk <= 0:
            return UNCAPPED
        base_s = self.budget.base_step_s(self.budget.num_decodes)
        step_s = base_s + free_chunk * cfg.prefill_s_per_token
        long_chunk = max(1, self.budget.long_chunk())
        ahead = 0
        in_time: list[tuple[int, float]] = []  # (tokens up to its first, deadline) of the prompts free steps make
        for r in (*prefills, *self._waiting.head(NEEDS_LONG_SCAN)) if self._waiting else prefills:
            ahead += self._tokens_to_first(r)
            deadline_s = self._ttft_deadline_s(r)
            if now + (1 - (-ahead // free_chunk)) * step_s <= deadline_s:
                in_time.append((ahead, deadline_s))
                continue  # free steps make it
            if deadline_s < now + self.budget.long_s(ahead, long_chunk, base_s):
                continue  # lost either way
            wait, owed, num_owed = self._free_steps_owed(in_time, ahead, free_chunk, long_chunk, base_s, now)
            if wait == 0:
                return UNCAPPED
            if deadline_s >= now + (wait + 1) * step_s + self.budget.long_s(ahead - wait * free_chunk, long_chunk,
                                                                             base_s):
                continue  # it can wait for them
            two_steps_s = self.budget.long_s(owed, long_chunk, base_s) + self.budget.long_s(ahead - owed, long_chunk,
                                                                                            base_s)
            # The second step's decodes are the first's and the prompts that it gave their first tokens.
            if owed and self.budget.tail.affordable(2 * self.budget.num_decodes + num_owed) \
                    and deadline_s >= now + two_steps_s:
                return owed
            return UNCAPPED
        return 0

    def _free_steps_owed(self, in_time: list[tuple[int, float]], ahead: int, free_chunk: int, long_chunk: int,
                         base_s: float, now: float) -> tuple[int, int, int]:
        """(free steps, tokens, prompts): the free steps a long step starting now (carrying `ahead` tokens) waits
        for the prompts ahead that free steps make in time, until the last of them that the next free step
        finishes or that the long step would make late has its first token (0: none); the tokens up to the first
        token of the last one it would make late (0: none), and how many of those prompts have their first token
        by then."""
        wait = owed = num_owed = 0
        for i, (tokens, deadline_s) in enumerate(in_time):
            # Its first token comes when the long step holding its last token ends, that step full.
            late = deadline_s < now + self.budget.long_s(min(ahead, -(-tokens // long_chunk) * long_chunk),
                                                         long_chunk, base_s)
            if late:
                owed, num_owed = tokens, i + 1
            if late or tokens <= free_chunk:
                wait = max(wait, -(-tokens // free_chunk))
        return wait, owed, num_owed

    def _demote_lost_heads(self, now: float, num_decodes: int) -> None:
        """EDF: a waiting head that can no longer have its first token by its TTFT deadline, not even from one step
        of its whole prompt starting now, goes behind every prompt that still can (`queues.demoted_key`, as the
        queue's own demotion of a prompt infeasible from the start): still served, as BATCH work. Only when a
        prompt of its tier or a more urgent one waiting behind it (among the first DEMOTE_SCAN) can still make its
        own: less urgent work has slack to spare and is not what a late head delays. Left at the head, it took
        the next decode slot and the prefill steps after it from prompts that could still make theirs, and they
        missed in turn: at the seed-000 peak, 8B instances at their slot limit missed six first tokens in a row
        this way, each waiting behind one already late. Demoted behind BATCH prompts too, an INTERACTIVE 180B
        prompt on seed 003's node waited ~10 s, counted by the router as queued ahead of every newcomer, and the
        180B alone at 100 req/s (pessimistic) served 3.1 req/s instead of 5.6."""
        cfg = self.config
        if not self._waiting or cfg.queue_policy != "edf" or cfg.prefill_s_per_token <= 0:
            return  # only EDF demotes, and only with a step model to judge a prompt lost by
        step_s = self.budget.working_step_s(num_decodes) if cfg.decode_step_s_by_num_decodes else 0.0
        while self._waiting:
            head = self._waiting.peek()
            demoted = demoted_key(head.spec, cfg.tier_ttft_slo_ms)
            # BATCH-ordered already (so is all behind it), past its first token (a preempted one), or still in time
            if head.queue_key >= demoted or head.first_token_s is not None or not self._lost(head, now, step_s):
                return
            tier = head.spec.priority
            if not any(r.spec.priority <= tier and r.first_token_s is None and not self._lost(r, now, step_s)
                       for r in self._waiting.head(DEMOTE_SCAN)[1:]):
                return  # nobody behind it that it would make late: it keeps its place
            self._waiting.pop()
            head.queue_key = demoted
            self._waiting.push(demoted, head)
            self.state_version += 1

    def _lost(self, req: Request, now: float, step_s: float) -> bool:
        """`req`, waiting, cannot have its first token by its TTFT deadline even from one step of its whole
        uncached prompt beside the running decodes (`step_s`) starting `now`."""
        per_token = self.config.prefill_s_per_token
        deadline_s = self._ttft_deadline_s(req)
        if now + step_s + len(req.token_ids) * per_token <= deadline_s:
            return False
        return now + step_s + self._tokens_to_first(req) * per_token > deadline_s

    def _tokens_to_first(self, r: Request) -> int:
        """Tokens `r` computes before its first token. A waiting prompt skips its cached prefix when it is admitted
        (`_admit`), as the router's prediction already counts: counted whole, a prompt that a long step can still
        save looked lost, and was left to free steps until it was."""
        if r.status is RequestStatus.WAITING and r.num_computed_tokens == 0:
            return len(r.token_ids) - self.kv.find_cached_prefix(r.token_ids)
        return len(r.token_ids) - r.num_computed_tokens

    def step_floor_s(self) -> float:
        """The shortest step this batcher can run now: its running decodes alone (0 with none), by the step model."""
        decodes, prefills = self._split_running()
        table = self.config.decode_step_s_by_num_decodes
        if not table:
            return 0.0
        if not decodes:
            return self.budget.working_step_s(0) if (prefills or self._waiting) else 0.0
        return self.budget.base_step_s(len(decodes)) + self.budget.extra_kv_read_s(decodes)

    def earliest_deadline_s(self, itl_s: float, prefill_share: float = 1.0) -> float | None:
        """For a gang arbiter: the latest time this batcher's next step may start and still meet its most urgent
        deadline: a running decode's next token within `itl_s` of its last one, or a prefill's first token by its
        TTFT deadline (its remaining tokens at the step model's prefill rate, each attending over the prompt's
        tokens before it, of which its steps get `prefill_share` of the GPUs' time while the other side has work),
        each less one step floor; None when it has nothing to run."""
        best: float | None = None
        for r in self._running:
            if r.last_token_s is not None and len(r.token_ids) - r.num_computed_tokens == 1:
                t = r.last_token_s + itl_s
            else:
                t = self._ttft_deadline_s(r) - self.budget.prefill_left_s(r.num_uncomputed_tokens, r.num_computed_tokens) / prefill_share
            best = t if best is None else min(best, t)
        if self._waiting:
            head = self._waiting.peek()
            t = self._ttft_deadline_s(head) - self.budget.prefill_left_s(head.num_uncomputed_tokens, head.num_computed_tokens) / prefill_share
            best = t if best is None else min(best, t)
        return None if best is None else best - self.step_floor_s()

    def lends_tail(self) -> bool:
        """For a gang arbiter: whether the other side of the group may step past this batcher's deadlines: it only
        decodes (a prompt of its own, running or waiting, would pay the other side's long step in TTFT, and a loaded
        member has one) and its ITL tail budget affords one slow gap on each running decode (those of a long step
        in flight counted)."""
        if self._waiting:
            return False
        decodes, prefills = self._split_running()
        return not prefills and self.budget.tail.affordable(len(decodes) + self.budget.inflight_slow)

    def due_prefill_s(self, now: float, horizon_s: float) -> float:
        """For a gang arbiter: the step, by the step model, that carries beside the running decodes the prefill of
        every prompt whose first token is due within `horizon_s` of `now` (running prefills, then the first
        NEEDS_LONG_SCAN waiting prompts in queue order), up to the step's token ceiling; 0 when none is due (or
        without a step model)."""
        cfg = self.config
        if cfg.prefill_s_per_token <= 0 or not cfg.decode_step_s_by_num_decodes:
            return 0.0
        decodes, prefills = self._split_running()
        room = cfg.max_num_batched_tokens - len(decodes)
        tokens, chunks_s = 0, 0.0
        for r in (*prefills, *self._waiting.head(NEEDS_LONG_SCAN)) if self._waiting else prefills:
            if self._ttft_deadline_s(r) - now <= horizon_s:
                left = self._tokens_to_first(r)
                n = min(left, room - tokens)
                if n <= 0:
                    break
                chunks_s += self.budget.chunk_s(n, len(r.token_ids) - left)
                tokens += n
        if tokens <= 0:
            return 0.0
        return self.budget.working_step_s(len(decodes)) + self.budget.extra_kv_read_s(decodes) + chunks_s

    def _ttft_deadline_s(self, req: Request) -> float:
        tier_slo = self.config.tier_ttft_slo_ms.get(req.spec.priority, DEFAULT_TIER_TTFT_SLO_MS[Priority.STANDARD])
        return req.spec.ttft_deadline_s(tier_slo)

    def _split_running(self) -> tuple[list[Request], list[Request]]:
        """Running requests as (decodes, unfinished prefills), each in importance order. The hot path of a step:
        one pass, no property calls."""
        decodes: list[Request] = []
        prefills: list[Request] = []
        for r in self._running:
            (decodes if len(r.token_ids) - r.num_computed_tokens == 1 else prefills).append(r)
        return decodes, prefills

    def _split_running_counted(self) -> tuple[list[Request], list[Request], int]:
        """`_split_running` plus the decodes' total length (tokens), in the same pass."""
        decodes: list[Request] = []
        prefills: list[Request] = []
        num_decode_tokens = 0
        for r in self._running:
            num_tokens = len(r.token_ids)
            if num_tokens - r.num_computed_tokens == 1:
                decodes.append(r)
                num_decode_tokens += num_tokens
            else:
                prefills.append(r)
        return decodes, prefills, num_decode_tokens

    def _schedule_running(self, step: StepUnderConstruction, ordered: list[Request]) -> None:
        if type(step) is CompactBuilder:
            self._schedule_running_compact(step, ordered)
            return
        running = RequestStatus.RUNNING
        for req in ordered:
            if step.budget <= 0:
                return
            if req.status is not running:  # preempted earlier in this step
                continue
            num_new = min(len(req.token_ids) - req.num_computed_tokens, step.budget)
            # The common case first: the held blocks already cover the chunk (what `_grow` checks first).
            if req.num_computed_tokens + num_new <= req.capacity_tokens or \
                    self._make_room(req, req.num_computed_tokens + num_new, step):
                step.add(req, num_new)

    def _schedule_running_compact(self, step: CompactBuilder, ordered: list[Request]) -> None:
        """`_schedule_running` with `CompactBuilder.add` inlined: the same decisions, once per running request
        per step (the simulator's hottest loop)."""
        running = RequestStatus.RUNNING
        reqs, num_new_col, contexts, samples = step.reqs, step.num_new, step.contexts, step.samples
        for req in ordered:
            budget = step.budget
            if budget <= 0:
                return
            if req.status is not running:  # preempted earlier in this step
                continue
            computed = req.num_computed_tokens
            num_tokens = len(req.token_ids)
            num_new = num_tokens - computed
            if num_new > budget:
                num_new = budget
            if computed + num_new <= req.capacity_tokens or self._make_room(req, computed + num_new, step):
                reqs.append(req)
                num_new_col.append(num_new)
                contexts.append(computed)
                samples.append(computed + num_new == num_tokens)
                step.budget -= num_new  # `_make_room` may have handed a victim's tokens back

    def _schedule_decodes_compact(self, step: CompactBuilder, decodes: list[Request]) -> None:
        """`_schedule_running_compact` over the decodes of `_split_running`: each has exactly one token to compute
        (a decode preempted earlier in the step is skipped by its status; the others are untouched), and the
        budget is positive whenever one is added, so its chunk is one sampled token. The loop appends only the
        request and its context; the constant columns are filled up to them before `_make_room` (which may take
        chunks back out of every column) and at the end."""
        running = RequestStatus.RUNNING
        reqs, num_new_col, contexts, samples = step.reqs, step.num_new, step.contexts, step.samples
        append_req, append_context = reqs.append, contexts.append
        budget = step.budget
        for req in decodes:
            if budget <= 0:
                break
            if req.status is not running:
                continue
            computed = req.num_computed_tokens
            if computed < req.capacity_tokens:
                append_req(req)
                append_context(computed)
                budget -= 1
                continue
            missing = len(reqs) - len(num_new_col)
            num_new_col.extend([1] * missing)
            samples.extend([True] * missing)
            step.budget = budget
            if self._make_room(req, computed + 1, step):
                reqs.append(req)
                num_new_col.append(1)
                contexts.append(computed)
                samples.append(True)
                step.budget -= 1  # `_make_room` may have handed a victim's tokens back
            budget = step.budget
        missing = len(reqs) - len(num_new_col)
        num_new_col.extend([1] * missing)
        samples.extend([True] * missing)
        step.budget = budget

    def _make_room(self, req: Request, num_tokens: int, step: StepUnderConstruction) -> bool:
        """Ensure `req` holds KV for `num_tokens`, preempting less important running requests if needed."""
        while not self._grow(req, num_tokens):
            if len(self._running) == 1:
                # Alone and still out of KV: the pool cannot hold this sequence. Stop it at its current length
                # rather than preempt it forever.
                self._truncated.append(req)
                self._running.remove(req)
                return False
            victim = self._pick_victim(step.scheduled_ids)
            self._preempt(victim, step)
            if victim is req:
                return False
        return True

    def _grow(self, req: Request, num_tokens: int) -> bool:
        if num_tokens <= req.capacity_tokens:
            return True
        if self.kv.allocate(req.request_id, req.token_ids, num_tokens) is None:
            return False
        req.capacity_tokens = len(self.kv.block_ids(req.request_id)) * self.block_size
        return True

    def _pick_victim(self, scheduled_ids: set[str]) -> Request:
        for req in reversed(self._running):
            if req.request_id not in scheduled_ids:
                return req
        # Every running request is already scheduled: the least important one gives way.
        return self._running[-1]

    def _schedule_swapped(self, step: StepUnderConstruction) -> None:
        while self._swapped and len(self._running) < self.config.max_num_seqs:
            req = self._swapped[0]
            if self.kv.allocate(req.request_id, req.token_ids, req.num_computed_tokens + 1) is None:
                return
            self._swapped.pop(0)
            self._num_swap_blocks_used -= req.num_swapped_blocks
            step.swap_in_blocks += req.num_swapped_blocks
            req.num_swapped_blocks = 0
            req.capacity_tokens = len(self.kv.block_ids(req.request_id)) * self.block_size
            self._set_running(req)

    def _schedule_waiting(self, step: StepUnderConstruction) -> None:
        # Under a gang cap, `room` is the cap's spare time in prefill tokens; a new prompt over a cached prefix costs
        # more of it than its tokens (`StepBudget.capped_fit`).
        room = float(step.budget)
        slot_s = self.config.decode_slot_target_s
        context = self.running_length_tokens() if slot_s > 0 else 0
        while self._waiting and step.budget > 0:
            req = self._waiting.peek()
            fit, cached, left, prefix = step.budget, 0, 0, None
            if self._capped:
                # the prefix lookup is done once, here, and handed to `_admit`
                prefix = 0 if req.num_computed_tokens else self.kv.find_cached_prefix(req.token_ids)
                cached = req.num_computed_tokens or prefix
                left = len(req.token_ids) - cached
                fit = self.budget.capped_fit(room, cached, left)
                if fit < 1:
                    return  # not one token of it fits the cap
            if (self._num_active() >= self.config.max_num_seqs
                    or (slot_s > 0 and self._running
                        and self.budget.decode_step_s(len(self._running) + 1, context + len(req.token_ids)) > slot_s)
                    or not self._admit(req, prefix)):
                victim = tier_victim(self._running, req, self.config.batch_min_share, self.config.max_num_seqs)
                if victim is None:
                    return  # the head is never overtaken
                self._preempt(victim, step)
                if slot_s > 0:
                    context = self.running_length_tokens()  # the victim's tokens left the running set
                continue
            self._waiting.pop()
            self._set_running(req)
            context += len(req.token_ids)
            num_new = min(req.num_uncomputed_tokens, step.budget, fit)
            if self._capped:
                room -= self.budget.capped_cost(cached, num_new, left)
            step.add(req, num_new)

    def _admit(self, req: Request, cached_prefix: int | None = None) -> bool:
        """`cached_prefix`: the cached prefix of a new prompt, when the caller has already looked it up."""
        if req.num_computed_tokens:
            cached_tokens = 0
        elif cached_prefix is not None:
            cached_tokens = cached_prefix
        else:
            cached_tokens = self.kv.find_cached_prefix(req.token_ids)
        ctx = self._reservation_context()
        num_tokens = min(
            self.config.max_model_len,
            self._reservation.initial_tokens(req.spec, req.num_tokens, ctx),
        )
        num_new_blocks = -(-num_tokens // self.block_size) - cached_tokens // self.block_size
        # An empty batch admits its head whatever the policy says: else a request larger than the watermark
        # allows would wait forever.
        if self._num_active() > 0 and not self._reservation.may_admit(num_new_blocks, ctx):
            return False
        if self.kv.allocate(req.request_id, req.token_ids, num_tokens) is None:
            return False
        req.capacity_tokens = len(self.kv.block_ids(req.request_id)) * self.block_size
        if req.num_computed_tokens == 0:
            req.num_cached_tokens = self.kv.num_cached_tokens(req.request_id)
            req.num_computed_tokens = req.num_cached_tokens
        return True

    # ---- preemption ---------------------------------------------------------------------------------------

    def _preempt(self, req: Request, step: StepUnderConstruction) -> None:
        self._running.remove(req)
        step.unschedule(req.request_id)
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        step.preempted_ids.append(req.request_id)
        num_blocks = len(self.kv.block_ids(req.request_id))
        swap_room = self.config.num_swap_blocks - self._num_swap_blocks_used
        self.kv.free(req.request_id)
        req.capacity_tokens = 0
        if self.config.preemption_mode == "swap" and num_blocks <= swap_room:
            req.status = RequestStatus.SWAPPED
            req.num_swapped_blocks = num_blocks
            self._num_swap_blocks_used += num_blocks
            step.swap_out_blocks += num_blocks
            bisect.insort(self._swapped, req, key=_victim_order)
            return
        # Recompute: the KV is gone; the request re-enters the queue with its original key.
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        self._waiting.push(req.queue_key, req)

    # ---- update ------------------------------------------------------------------------------------------

    def update(self, plan: StepPlan, result: StepResult, now: float) -> StepOutputs:
        self.state_version += 1
        self.budget.observe_gaps(now)
        outputs: list[RequestOutput] = []
        handoffs: list[HandoffReady] = []
        while self._truncated:
            cut = self._truncated.pop()
            cut.status = RequestStatus.RUNNING  # _finish expects it off every queue; it was taken off running
            self._running.append(cut)
            outputs.append(self._output(cut, (), FinishReason.LENGTH))
            self._finish(cut, observe=True)
        for chunk in plan.chunks:
            req = self._requests.get(chunk.request_id)
            if req is None or req.status is not RequestStatus.RUNNING:
                continue  # aborted or preempted while the step ran
            self._advance(req, chunk.num_new_tokens)
            if chunk.samples:
                token_id = result.sampled_token_ids[req.request_id]
                req.token_ids.append(token_id)
                req.last_token_s = now
                if req.first_token_s is None:
                    req.first_token_s = now
                finish = self._stop_reason(req, token_id)
                outputs.append(self._output(req, (token_id,), finish))
                if finish is FinishReason.HANDOFF:
                    handoffs.append(self._hold_for_handoff(req, token_id))
                elif finish is not None:
                    self._finish(req, observe=True)
        return StepOutputs(tuple(outputs), tuple(handoffs), tuple(self.kv.drain_events()))

    def update_compact(self, step: CompactStep, sampled: Sequence[int | None], now: float) -> CompactOutputs:
        """`update` for a `CompactStep`: `sampled[i]` is the token of `step.reqs[i]` (None where it samples none).

        The same state changes, in the same order, as `update` on the equal `StepPlan`. The difference is in what
        comes back: a sampled token that is neither the first this batcher produced for its request nor the last
        (the bulk of a decode batch) gets no `RequestOutput`; its request is listed in `plain` instead."""
        self.state_version += 1
        self.budget.observe_gaps(now)
        outputs: list[RequestOutput] = []
        handoffs: list[HandoffReady] = []
        plain: list[Request] = []
        self._finish_truncated(outputs)
        self._apply_chunks(step.reqs, step.num_new, sampled, now, outputs, handoffs, plain)
        return CompactOutputs(tuple(outputs), tuple(handoffs), tuple(self.kv.drain_events()), tuple(plain))

    def _finish_truncated(self, outputs: list[RequestOutput]) -> None:
        """Requests stopped for lack of KV while planning this step end with LENGTH (first thing in an update)."""
        while self._truncated:
            req = self._truncated.pop()
            req.status = RequestStatus.RUNNING  # _finish expects it off every queue; it was taken off running
            self._running.append(req)
            outputs.append(self._output(req, (), FinishReason.LENGTH))
            self._finish(req, observe=True)

    def _apply_chunks(self, reqs: Sequence[Request], num_new_col: Sequence[int], sampled: Sequence[int | None],
                      now: float, outputs: list[RequestOutput], handoffs: list[HandoffReady],
                      plain: list[Request]) -> None:
        """`update_compact`'s loop over the step's chunks, in step order."""
        running = RequestStatus.RUNNING
        block_size, kv = self.block_size, self.kv
        eos = self.config.eos_token_id
        prefill_role = self.config.role is Role.PREFILL
        for req, num_new, token_id in zip(reqs, num_new_col, sampled):
            if req.status is not running:
                continue  # aborted or preempted while the step ran
            before = req.num_computed_tokens
            after = req.num_computed_tokens = before + num_new
            if after // block_size > before // block_size:
                kv.cache_computed(req.request_id, req.token_ids, after)
            if token_id is None:
                continue
            tokens = req.token_ids
            tokens.append(token_id)
            req.last_token_s = now
            first = req.first_token_s is None
            if first:
                req.first_token_s = now
            # `_stop_reason`, inlined: this loop runs once per token of the whole simulation.
            if token_id == eos and not req.spec.sampling.ignore_eos:
                finish = FinishReason.STOP
            elif len(tokens) >= req.stop_len:  # output >= max_tokens or whole length >= max_model_len
                finish = FinishReason.LENGTH
            elif prefill_role:
                finish = FinishReason.HANDOFF
            else:
                if not first:
                    plain.append(req)
                    continue
                finish = None
            outputs.append(self._output(req, (token_id,), finish))
            if finish is FinishReason.HANDOFF:
                handoffs.append(self._hold_for_handoff(req, token_id))
            elif finish is not None:
                self._finish(req, observe=True)

    def _advance(self, req: Request, num_new_tokens: int) -> None:
        before = req.num_computed_tokens
        req.num_computed_tokens = before + num_new_tokens
        if req.num_computed_tokens // self.block_size > before // self.block_size:
            self.kv.cache_computed(req.request_id, req.token_ids, req.num_computed_tokens)
