"""SLO sizing: the step token budget and batch size of an instance, derived from its cost model and the ITL SLO.

Every token of a running request waits for one whole step, so the step time IS the inter-token latency. A
colocated instance that mixes a 2,048-token prefill chunk into a decode batch stretches that step to ~60 ms on an
8B and ~170 ms on a 70B at TP=4: the default budget of a throughput-tuned engine breaks a 30 ms ITL SLO by
construction. Sarathi-Serve's answer is a budget sized so that a mixed step stays under the SLO; octoserve sizes
the decode batch the same way, because past some batch size even a pure decode step is too slow.

Per role, with `target_s = itl_slo × headroom` (headroom < 1 leaves room for the P95 tail and the cost model's error):
- decode: `max_num_seqs` = the largest batch whose decode step (at the typical context) fits `target_s`; the budget
  is that batch (decodes only).
- colocated: decodes get `decode_share` of the target (the rest is for prefill chunks): `max_num_seqs` = the
  largest batch whose decode step fits `decode_share × target_s`; the budget = that batch + the largest prefill
  chunk that still fits the full target next to it. The budget is also tabulated per number of decodes in the
  step (`budget_by_num_decodes`), so an instance with few decodes prefills in bigger chunks at the same ITL.
- prefill: no ITL to protect; keep the configured budget (large chunks are the most efficient prefill).
Never larger than what the config asked for: sizing only tightens.

The per-step cap is what pooled ITL needs; the per-request SLO (TPOT, as DistServe and `vllm bench serve` judge
goodput) is an average, so the batcher may run a longer step when every running decode has banked enough slack
(its steps so far were faster than the target): see `StepBudget.slack_budget`. The linear step model below
(`decode_step_s_by_num_decodes` + tokens x `prefill_s_per_token`) sizes those longer steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from octoserve.services.core.cost_model import CostModel
from octoserve.services.core.tail_budget import FREE_STEP_SHARE
from octoserve.services.core.types import Role

CHUNK_QUANTUM = 16  # budgets are multiples of a block
# With the ITL tail budget (`tail_budget=True`: slack chunking on), prompts past the free chunk of a step run in long
# steps the budget pays for, so decodes may take nearly all of a step that ends within FREE_STEP_SHARE of the ITL
# SLO: a batch sized to leave room for prefill chunks holds the 70B at TP=4 to one sequence under the pessimistic
# profile (26.4 ms alone). The 3 % they leave is the TPOT slack a long step spends (a decode batch at the target
# could never pay one back).
TAIL_DECODE_SHARE = 0.97
# ...but only where the plain sizing starves the model: a decode batch under this many sequences (the 70B at TP=4
# under the pessimistic profile gets one). Above it the plain batch keeps room for prefill chunks in free steps,
# which an overloaded node needs: with decodes filling every step, seed 003 at 625 req/s left 78 % of the admitted
# INTERACTIVE requests good against 97 % with the plain batch (`octoserve simulate --profile seed-003 --rate 625
# --duration 30s --warmup 10s`).
TAIL_SIZING_BELOW = 16
# At the other end, a model whose plain batch holds this many sequences or more (the 8B under the default profile:
# 184) is sized with FREE_STEP_SHARE headroom instead of 0.85, its decode share unchanged: the tail budget counts any
# step that ends past the ITL, and the 0.85 left its ITL P95 at 24 ms of 30. At the seed-000 peak (`octoserve
# simulate --duration 60s`) goodput goes from 87.6 to 92.2 req/s, every model's admitted requests still >= 96 % good;
# seed 003 at 625 req/s keeps its INTERACTIVE promise (95.8 % of admitted good). Not below it: at 112 sequences (the
# 8B under the pessimistic profile) the planner's pessimistic placement with two 8B replicas left seed-003
# INTERACTIVE at 93.6 % of admitted good (96.2 % at 0.85); at 38 (the 70B at TP=4) the seed-003 70B fell to 93.6 %.
# Headroom 1.0 broke seed 003 (82 %).
WIDE_BATCH_AT = 128
# Context-aware decode slots, for a colocated model (slack chunking on, outside a gang) whose plain batch is narrow
# but not starved: from TAIL_SIZING_BELOW up to NARROW_BATCH_BELOW sequences (the 70B at TP=4 under the default
# profile: 38; its decode step is mostly the fixed cost of reading its weights, 17.7 ms of a 25.5 ms step at batch
# 1). A batch sized at one context (`context_tokens`, 1,200) held it to 38 sequences whose contexts averaged ~880 at
# the seed-000 peak. The step tables stay at that context but reach the most decodes that fit at this short one (the
# ceiling, never above the configured max_num_seqs), and a request joins the running set while the decode step at
# the running requests' actual contexts (the table plus the KV read of the difference) fits NARROW_DECODE_SHARE of
# the step. Below the peak the slots do not bind, and the instance steps and admits exactly as the fixed batch did.
# At the seed-000 peak (`octoserve simulate --duration 60s --warmup 20s`) the 70B served 6.0 req/s instead of 3.7,
# its admitted requests 96.8 % good. Wider and starved batches keep their fixed batch: the variants measured (every
# model by context, other shares) are in BENCHMARKS.md, "ITL tail budget".
# The whole step (1.0), not 0.95 of it: at the seed-000 peak over seeds 0-7 (`--warmup 20s --seed S`) the goodput
# went from 94.8 to 95.3 req/s (95.5 with lost heads demoted, batcher.py `_demote_lost_heads`), the 70B's admitted
# requests 99.6-100 % good instead of 97-98.6 %; at seed 003's 625 req/s its 70B's admitted requests stay 96.7-98.5 %
# good (98.1-100 % at 0.95) while the node serves more. Below the peak the slots do not bind: 12, 16 and 24 req/s ran
# identically.
SLOT_CEILING_CONTEXT = 256
NARROW_BATCH_BELOW = 64
NARROW_DECODE_SHARE = 1.0


@dataclass(frozen=True, slots=True)
class SloSizing:
    max_num_seqs: int
    max_num_batched_tokens: int
    step_target_s: float
    # Colocated only: index d = number of decodes in the step -> token budget (decodes included) that keeps the
    # step under the target. A lightly loaded instance prefills in large chunks, a full one in small ones.
    budget_by_num_decodes: tuple[int, ...] = ()
    # Colocated only, for slack-aware chunking (see Batcher): index d -> time of a step of d decodes alone, and
    # the marginal time of one more prefill token; a linear model of longer steps.
    decode_step_s_by_num_decodes: tuple[float, ...] = ()
    prefill_s_per_token: float = 0.0
    context_tokens: int = 0  # the decode context the tables assume
    kv_s_per_context_token: float = 0.0  # step time one more token of decode context adds (KV read)


def _largest(ok, lo: int, hi: int) -> int:
    """Largest n in [lo, hi] with ok(n), assuming ok is monotone (True then False); lo - 1 if none."""
    if hi < lo or not ok(lo):
        return lo - 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ok(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def size_for_slo(
    cost: CostModel,
    role: Role,
    *,
    itl_slo_ms: float,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    context_tokens: int = 1200,
    headroom: float = 0.85,
    decode_share: float = 0.85,
    tail_budget: bool = False,
    num_slots: int = 0,
) -> SloSizing:
    if tail_budget:
        headroom, decode_share = FREE_STEP_SHARE, TAIL_DECODE_SHARE
    target_s = itl_slo_ms / 1000.0 * headroom
    if role is Role.PREFILL:
        return SloSizing(max_num_seqs, max_num_batched_tokens, target_s)

    # `decode_step_time_s(d, c)` and `chunks_time_s` are `step_time_s` of d chunks (1, c) (plus one prefill chunk)
    # from the same integer totals, so the same floats, without building and summing a list per probe.
    def decode_fits(budget_s: float):
        return lambda b: cost.decode_step_time_s(b, context_tokens) <= budget_s

    share = 1.0 if role is Role.DECODE else decode_share
    batch = max(1, _largest(decode_fits(target_s * share), 1, max_num_seqs))
    if role is Role.DECODE:
        return SloSizing(batch, min(max_num_batched_tokens, batch), target_s)

    max_quanta = max(1, max_num_batched_tokens // CHUNK_QUANTUM)

    def budget_with(num_decodes: int) -> int:
        decode_tokens = num_decodes * (context_tokens + 1)

        def chunk_fits(n: int) -> bool:
            step_s = cost.chunks_time_s((n * CHUNK_QUANTUM,), (0,), 1, num_steady=num_decodes,
                                        steady_tokens=decode_tokens)
            return step_s <= target_s

        chunk = max(1, _largest(chunk_fits, 1, max_quanta)) * CHUNK_QUANTUM
        return min(max_num_batched_tokens, num_decodes + chunk)

    batch = max(batch, min(num_slots, max_num_seqs))  # the tables reach every slot the caller will fill
    table = tuple(budget_with(d) for d in range(batch + 1))
    base = tuple(cost.decode_step_time_s(d, context_tokens) for d in range(batch + 1))
    # Marginal cost of prefill tokens measured between two large chunks: compute-bound, so close to linear.
    big = max(CHUNK_QUANTUM * 2, max_num_batched_tokens)
    per_token = (cost.step_time_s([(big, 0)]) - cost.step_time_s([(big // 2, 0)])) / (big - big // 2)
    # KV read per context token, measured on the full batch between the sized context and twice it.
    kv_per_token = (
        cost.decode_step_time_s(batch, 2 * context_tokens) - cost.decode_step_time_s(batch, context_tokens)
    ) / (batch * context_tokens)
    return SloSizing(batch, table[-1], target_s, table, base, per_token, context_tokens, kv_per_token)
