"""The step-time arithmetic of one batcher and the ITL tail it spends.

`StepBudget` answers, by the step model (`BatcherConfig.decode_step_s_by_num_decodes` and the per-token prefill
time), how many tokens a step may carry: the configured budget, the *free* budget whose step ends within
FREE_STEP_SHARE x the ITL SLO (no slow gap), the *slack* budget that keeps every running decode's time per output
token on target, and the budget a gang cap leaves. It keeps the state those answers need between steps: the tail of
slow inter-token gaps (`TailBudget`), the TPOT slack left at the latest plan, and the step in flight (its decodes,
its prefill tokens, when the step model ends it). From them it derives the long-step figures of the load report
(`long_prefill_tokens_per_s`, `long_step_wait_s`, `long_burst_tokens`, `long_sustained_tokens_per_s`), which
admission plans with.

The `Batcher` owns one (`batcher.budget`) and decides with it which prompts a long step is spent on; nothing here
reads the batcher's queues.
"""

from __future__ import annotations

import math

from octoserve.services.core.batch_state import BatcherConfig, Request
from octoserve.services.core.tail_budget import FREE_STEP_SHARE, TailBudget
from octoserve.services.core.types import Priority

CHUNK_FLOOR_TOKENS = 16  # prefill tokens a step keeps however long its decodes' contexts are
CAP_KEPT = 0.002  # share of a gang cap left unplanned, for the step model's rounding (microseconds a step)


class StepBudget:
    def __init__(self, config: BatcherConfig) -> None:
        self.config = config
        self.tail = TailBudget(config.tail_budget_fraction, config.tail_window_gaps)
        self.idle_step_s = config.tier_ttft_slo_ms.get(Priority.STANDARD, 0.0) / 1000.0  # longest step, no decodes
        self._planned_gaps = (0.0, 0)  # (gaps start, decodes) of the step in flight: its gaps, judged at update
        self.num_decodes = 0  # decodes of the latest step (steady decodes' token lists may run ahead: not counted)
        self.slack_chunk = 1 << 30  # prefill tokens the TPOT slack allowed a step at the latest plan
        self.slack_tokens = 1 << 30  # ...and the slack's prefill tokens in all, before max_step_s bounds a step
        # When the step in flight ends by the step model (on the clock `now` is on; 0: none planned yet): a prompt
        # arriving during a long step waits for it (admission reads it from the load snapshot).
        self.busy_until_s = 0.0
        # Prefill tokens of the step in flight: still uncomputed until its update, but already paid for by the wait
        # until `busy_until_s`, so the load snapshot leaves them out of the queue (no double count in admission).
        self.inflight_prefill_tokens = 0
        self.inflight_slow = 0  # slow gaps the long step in flight will add to the tail at its update

    def reconfigure(self, config: BatcherConfig) -> None:
        self.config = config
        self.idle_step_s = config.tier_ttft_slo_ms.get(Priority.STANDARD, 0.0) / 1000.0

    def step_budget(self, num_decodes: int) -> int:
        table = self.config.budget_by_num_decodes
        if not table:
            return self.config.max_num_batched_tokens
        return table[min(num_decodes, len(table) - 1)]

    def long_s(self, num_tokens: int, long_chunk: int, base_s: float) -> float:
        """The step model's time of `num_tokens` prefill tokens in steps of at most `long_chunk` beside the
        running decodes (whose step time is `base_s`)."""
        return -(-num_tokens // long_chunk) * base_s + num_tokens * self.config.prefill_s_per_token

    def free_budget(self, num_decodes: int, extra_kv_s: float = 0.0) -> int:
        """The largest budget whose step the step model ends within FREE_STEP_SHARE x the ITL SLO (no slow gap)."""
        cfg = self.config
        if not cfg.decode_step_s_by_num_decodes or cfg.prefill_s_per_token <= 0 or cfg.itl_slo_s <= 0:
            return 0
        base_s = self.base_step_s(num_decodes) + extra_kv_s
        spare = int((FREE_STEP_SHARE * cfg.itl_slo_s - base_s) / cfg.prefill_s_per_token + 1e-9)
        return num_decodes + max(0, spare)

    def free_prefill_tokens_per_s(self) -> float:
        """The prefill rate of steps that end within the free share of the ITL SLO beside the running decodes, by
        the step model (0: no step model); what `Batcher._long_step_tokens` plans with, and what admission is told."""
        d = self.num_decodes
        chunk = self.free_budget(d) - d
        return self.step_rate(d, chunk) if chunk > 0 else 0.0

    def long_prefill_tokens_per_s(self) -> float:
        """The prefill rate of a step past the ITL SLO (as long as `max_step_s` and the token ceiling allow); 0 when
        the tail budget can never afford one over the running decodes (`long_step_wait_s` says when it can)."""
        chunk = self.long_chunk()
        return self.step_rate(self.num_decodes, chunk) if chunk > 0 else 0.0

    def long_chunk(self) -> int:
        """Prefill tokens one step past the ITL SLO takes beside the running decodes (0: none ever affordable)."""
        cfg = self.config
        if cfg.tpot_target_s <= 0 or cfg.prefill_s_per_token <= 0 or not cfg.decode_step_s_by_num_decodes:
            return 0
        d = self.num_decodes
        if self.tail.gaps_until_affordable(d) < 0:
            return 0
        room = int((cfg.max_step_s - self.base_step_s(d)) / cfg.prefill_s_per_token + 1e-9)
        # The running decodes' TPOT slack at the latest plan bounds it too (it grows again as they bank time).
        return max(0, min(cfg.max_num_batched_tokens - d, room, self.slack_chunk))

    def long_burst_tokens(self) -> float:
        """Prefill tokens the long steps the tail budget affords back to back take, from when the first is
        affordable: every one it affords now (one when it must wait); inf with no decodes (a step delays no gap)."""
        chunk = self.long_chunk()
        d = self.num_decodes
        if chunk <= 0:
            return 0.0
        if d == 0:
            return math.inf
        tail = self.tail
        steps = int((tail.slow_room() - self.inflight_slow) // d)
        return float(max(chunk, min(chunk * steps, self.slack_tokens)))

    def long_sustained_tokens_per_s(self) -> float:
        """The prefill rate of long steps once the burst is spent: a window of gaps holds `fraction` of them slow, so
        one step in 1 / fraction may be long, the rest free ones (each also carrying its free chunk); and the
        decodes' TPOT slack grows by the target less the step time a step, which a long step spends."""
        chunk = self.long_chunk()
        d = self.num_decodes
        if chunk <= 0:
            return 0.0
        if d == 0 or self.tail.fraction <= 0:
            return self.step_rate(d, chunk) if d == 0 else 0.0
        cfg = self.config
        base_s = self.base_step_s(d)
        free_chunk, free_step_s = self.free_step(d)
        free_steps = 1.0 / self.tail.fraction - 1.0
        period_s = free_steps * free_step_s + base_s + chunk * cfg.prefill_s_per_token
        tail_rate = (chunk + free_steps * free_chunk) / period_s
        regain = max(0.0, cfg.tpot_target_s - free_step_s) / free_step_s  # slack seconds a second of free steps
        tpot_rate = free_chunk / free_step_s + regain / cfg.prefill_s_per_token
        return min(tail_rate, tpot_rate)

    def long_step_wait_s(self) -> float:
        """Modelled seconds until the tail budget affords a step past the ITL SLO over the running decodes (0: now):
        the fast gaps it needs, at one a decode a step, each step a free one (prompts wait, so steps carry the free
        chunk); inf when it never will. A long step in flight has spent its slow gaps already (they reach the tail
        at its end): counted as the step before it, a prompt that arrived during a long step was promised another
        at its end that the tail could not afford, and waited 160 ms of free steps instead of 66 ms of one."""
        d = self.num_decodes
        gaps = self.tail.gaps_until_affordable(d + self.inflight_slow)
        if gaps < 0 and self.inflight_slow and self.tail.gaps_until_affordable(d) >= 0:
            gaps = self.tail.window_gaps  # affordable once the step in flight has left the window
        if gaps <= 0:
            return 0.0 if gaps == 0 else math.inf
        return -(-gaps // d) * self.free_step(d)[1]

    def free_step(self, num_decodes: int) -> tuple[int, float]:
        """(prefill tokens, step-model time) of a step beside `num_decodes` decodes that ends within the free share
        of the ITL SLO."""
        free_chunk = max(0, self.free_budget(num_decodes) - num_decodes)
        return free_chunk, self.base_step_s(num_decodes) + free_chunk * self.config.prefill_s_per_token

    def base_step_s(self, num_decodes: int) -> float:
        table = self.config.decode_step_s_by_num_decodes
        return table[min(num_decodes, len(table) - 1)]

    def decode_step_s(self, num_decodes: int, num_context_tokens: int) -> float:
        """Step-model time of `num_decodes` decodes alone whose contexts sum to `num_context_tokens`: the table's
        time at the sized context, plus (or less) the KV read of the difference."""
        cfg = self.config
        excess = num_context_tokens - num_decodes * cfg.sized_context_tokens
        return self.base_step_s(num_decodes) + excess * cfg.kv_s_per_context_token

    def working_step_s(self, num_decodes: int) -> float:
        """`base_step_s` for a step that runs something: one with no decodes still pays the fixed cost of any
        step (weights streamed, overheads), i.e. one decode's."""
        table = self.config.decode_step_s_by_num_decodes
        return table[min(max(num_decodes, 1), len(table) - 1)]

    def step_rate(self, num_decodes: int, chunk: int) -> float:
        if chunk <= 0:
            return 0.0
        return chunk / (self.base_step_s(num_decodes) + chunk * self.config.prefill_s_per_token)

    def note_plan(self, now: float, num_decodes: int, num_tokens: int, extra_kv_s: float,
                  shared: bool = False) -> None:
        """The planned step's decodes (their gaps are judged at its update) and when the step model ends it.
        `shared`: a gang member's step, granted after the other side's: its decodes' gaps run from their previous
        tokens (the latest update), so the wait for the grant counts, as their clients see it; elsewhere a step with
        decodes starts as the last one ends, and its gaps run from the plan."""
        self._planned_gaps = (self._planned_gaps[0] if shared else now, num_decodes)
        cfg = self.config
        if cfg.decode_step_s_by_num_decodes and cfg.prefill_s_per_token > 0 and num_tokens:
            self.busy_until_s = (now + self.base_step_s(num_decodes) + extra_kv_s
                                 + (num_tokens - num_decodes) * cfg.prefill_s_per_token)
            self.inflight_prefill_tokens = max(0, num_tokens - num_decodes)
            long_tokens = self.inflight_prefill_tokens - max(0, self.free_budget(num_decodes, extra_kv_s) - num_decodes)
            if long_tokens > 0 and num_decodes:  # a long step spends the decodes' TPOT slack and, at its end, the tail
                self.slack_tokens = max(0, self.slack_tokens - long_tokens)
                self.slack_chunk = min(self.slack_chunk, self.slack_tokens)
                self.inflight_slow = num_decodes

    def gaps_waited_s(self, now: float) -> float:
        """How long the running decodes' gaps have already run at `now`: a gang member's step is granted after the
        other side's, and its decodes' gaps run from their previous tokens (`note_plan`); 0 elsewhere."""
        return max(0.0, now - self._planned_gaps[0])

    def observe_gaps(self, now: float) -> None:
        """The in-flight step's decode tokens arrive now: one gap each, slow when it outlasted the ITL SLO (from the
        gaps' start: the plan, or a gang step's previous tokens; `note_plan`)."""
        start_s, num_decodes = self._planned_gaps
        if num_decodes and self.config.itl_slo_s > 0:
            self.tail.observe(num_decodes, num_decodes if now - start_s > self.config.itl_slo_s else 0)
        self._planned_gaps = (now, 0)
        self.num_decodes = num_decodes
        self.busy_until_s = now
        self.inflight_prefill_tokens = 0
        self.inflight_slow = 0

    def extra_kv_read_s(self, decodes: list[Request], num_decode_tokens: int | None = None) -> float:
        """Step time the decodes' context beyond the sized one adds (0 when shorter or when off).
        `num_decode_tokens`: the decodes' total length when the caller has it (`_split_running_counted`)."""
        cfg = self.config
        if cfg.kv_s_per_context_token <= 0 or not decodes:
            return 0.0
        if num_decode_tokens is None:
            num_decode_tokens = sum(len(r.token_ids) for r in decodes)
        excess = num_decode_tokens - len(decodes) * cfg.sized_context_tokens
        return max(0.0, excess * cfg.kv_s_per_context_token)

    def shrunk(self, budget: int, num_decodes: int, extra_kv_s: float) -> int:
        """The budget less the prefill tokens whose time long contexts already take; every step keeps a block of
        prefill so prompts still progress."""
        if extra_kv_s <= 0 or self.config.prefill_s_per_token <= 0:
            return budget
        cut = int(extra_kv_s / self.config.prefill_s_per_token)
        return max(min(budget, num_decodes + CHUNK_FLOOR_TOKENS), budget - cut)

    def slack_budget(self, decodes: list[Request], now: float, extra_kv_s: float = 0.0) -> int:
        """The largest budget whose step keeps every running decode's mean time per output token on target.

        A decode that has produced k tokens after its first at `first_token_s` meets the TPOT target after this
        step and H more at the current pace `base_s` (H = `tpot_horizon_tokens`) if the step ends by
        first_token_s + (k + 1 + H) x target - H x base_s. The tightest request bounds the step; with no decodes
        only `max_step_s`, or the STANDARD tier's TTFT SLO when longer, does (nobody waits on this step but the
        prompts in it, and a prompt prefilled in one step gets its first token sooner than in two).
        """
        cfg = self.config
        table = cfg.decode_step_s_by_num_decodes
        if not table or cfg.prefill_s_per_token <= 0:
            return 0
        base_s = table[min(len(decodes), len(table) - 1)] + extra_kv_s
        payback_s = cfg.tpot_horizon_tokens * (cfg.tpot_target_s - base_s)
        tpot_s = math.inf
        for r in decodes:
            if r.first_token_s is not None:
                k = len(r.token_ids) - r.num_prompt_tokens - 1
                tpot_s = min(tpot_s, r.first_token_s + (k + 1) * cfg.tpot_target_s - now + payback_s)
        self.note_slack(tpot_s, base_s, len(decodes))
        allowed_s = min(tpot_s, cfg.max_step_s if decodes else max(cfg.max_step_s, self.idle_step_s))
        extra_tokens = int((allowed_s - base_s) / cfg.prefill_s_per_token + 1e-9)  # no float round-down
        return min(cfg.max_num_batched_tokens, len(decodes) + max(0, extra_tokens))

    def note_slack(self, tpot_s: float, base_s: float, num_decodes: int) -> None:
        """The prefill tokens the running decodes' TPOT slack affords in all, past the step's own decodes (what
        long steps may take back to back before the slack runs out), for the load report. Counted as if one more
        decode had joined: the prompt a long step rescues becomes one, and a decode more slows every later step,
        so each running decode pays its delay back more slowly (the payback term of `slack_budget`; where the
        decodes nearly fill the step, one more takes tens of ms of slack from the tightest)."""
        if tpot_s == math.inf:
            self.slack_tokens = 1 << 30
            return
        cfg = self.config
        table = cfg.decode_step_s_by_num_decodes
        slower_s = cfg.tpot_horizon_tokens * (table[min(num_decodes + 1, len(table) - 1)]
                                              - table[min(num_decodes, len(table) - 1)])
        self.slack_tokens = max(0, int((tpot_s - slower_s - base_s) / cfg.prefill_s_per_token + 1e-9))

    def capped_budget(self, num_decodes: int, cap_s: float, extra_kv_s: float, context: int = 0,
                      read_tokens: int | None = None) -> int:
        """The step's token budget under a gang cap: its decodes plus the prefill tokens that fit the spare time.
        `context`: the longest computed context of the running prefills, whose chunk attends over it;
        `read_tokens`: their contexts in all, whose KV the step reads (default: `context`)."""
        cfg = self.config
        table = cfg.decode_step_s_by_num_decodes
        if not table or cfg.prefill_s_per_token <= 0:
            return cfg.max_num_batched_tokens  # no step model: the cap cannot be honoured (placement refuses this)
        base_s = self.working_step_s(num_decodes) + extra_kv_s
        # A chunk reads its context's KV once, beside the decodes' reads (a few tokens over a long context cost that
        # read more than their attention), and attends over it. With both counted, the step model over-predicts
        # the cost model's step (by 0-10 % for chunks of 16 tokens or more), so the whole spare time is spent.
        spare_s = (cap_s * (1.0 - CAP_KEPT) - base_s
                   - cfg.kv_s_per_context_token * (context if read_tokens is None else read_tokens))
        chunk = spare_s / cfg.prefill_s_per_token
        if cfg.attn_s_per_pair > 0 and chunk > 0:
            # A chunk of n tokens over `context` computed ones attends to n x (context + n / 2) pairs: solve
            # n x (per_token + attn x context) + attn x n^2 / 2 = spare for n.
            a = cfg.attn_s_per_pair / 2.0
            b = cfg.prefill_s_per_token + cfg.attn_s_per_pair * context
            chunk = (math.sqrt(b * b + 4.0 * a * spare_s) - b) / (2.0 * a)
        return num_decodes + max(0, int(chunk + 1e-9))

    def capped_fit(self, room: float, cached: int, left: int) -> int:
        """Tokens of a new prompt that fit `room`, a gang cap's spare time in prefill tokens at the per-token time
        over no context (`capped_budget`): the prompt's first `cached` tokens are cached, `left` are to compute."""
        read, per_new = self._context_terms(cached)
        fit = int((room - read) / per_new)
        if fit >= left:  # the last chunk samples (`capped_cost`), or it stops one token short
            fit = max(left - 1, int((room - read - 1.0) / per_new))
        return fit

    def capped_cost(self, cached: int, num_new: int, left: int) -> float:
        """The room (`capped_fit`) `num_new` tokens of such a prompt take: each attends over the cached prefix,
        whose KV the step reads once, and a chunk that ends the prompt samples through the LM head, which the
        per-token time (fitted on long chunks) spreads thin: one token's time stands for it."""
        read, per_new = self._context_terms(cached)
        return read + num_new * per_new + (1.0 if num_new == left else 0.0)

    def _context_terms(self, cached: int) -> tuple[float, float]:
        """(the read of `cached` tokens' KV, one new token's time over them), in prefill tokens."""
        cfg = self.config
        return (cached * cfg.kv_s_per_context_token / cfg.prefill_s_per_token,
                1.0 + cached * cfg.attn_s_per_pair / cfg.prefill_s_per_token)

    def prefill_left_s(self, num_tokens: int, context: int) -> float:
        """The step model's time for a prompt's `num_tokens` uncomputed tokens over `context` computed ones: each
        costs the per-token time and attends over the tokens before it (on the 180B, a 32k-token prompt's
        attention adds 18-20 % to its prefill)."""
        cfg = self.config
        return num_tokens * cfg.prefill_s_per_token + cfg.attn_s_per_pair * num_tokens * (context + num_tokens / 2.0)

    def chunk_s(self, num_tokens: int, context: int) -> float:
        """The step model's time for a chunk of `num_tokens` prompt tokens over `context` computed ones: their
        prefill (`prefill_left_s`) and one read of the context's KV, as `capped_budget` prices a chunk."""
        return self.prefill_left_s(num_tokens, context) + self.config.kv_s_per_context_token * context

    def capped_prefill_tokens(self, cap_s: float, num_decodes: int = -1) -> int:
        """Prefill tokens a step capped at `cap_s` carries beside `num_decodes` decodes (default: its latest step's)
        (a gang member's shared step, as `schedule(step_cap_s=...)` cuts it; 0 when the decodes alone fill the cap)."""
        d = self.num_decodes if num_decodes < 0 else num_decodes
        return max(0, min(self.capped_budget(d, cap_s, 0.0), self.config.max_num_batched_tokens) - d)
