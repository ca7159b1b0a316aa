"""The named policy configurations the benchmark suite compares: octoserve, the systems it replaces, and ablations.

Each baseline is the same simulated node and the same core objects, configured the way the system it stands for
behaves; nothing here is a separate scheduler. A `Baseline` is data: which placement it runs on and which node
policies and instance knobs it sets. `configure(baseline, placement)` applies it to a placement's `NodeConfig`.

What each one models, and from where (read in their docs and papers, not copied):
- `vllm-default`: vLLM v1 serving with its defaults on an 80 GB H100 (`EngineArgs.get_batch_defaults`: an
  OpenAI-API server on a >= 70 GiB GPU that is not an A100 gets max_num_batched_tokens 8192 and max_num_seqs
  1024); chunked prefill always on in v1, decodes scheduled first, FCFS waiting queue, prefix caching on, KV
  allocated on demand, preemption by recompute of the latest-arrived running request ("Optimization and Tuning"
  docs); no admission control (requests wait in an unbounded queue); one engine per model replica behind a
  round-robin load balancer; a static split of the GPUs between the two models (the default placement).
- `sarathi`: Sarathi-Serve (Agrawal et al., OSDI 2024): stall-free batching, i.e. decodes first, then ongoing
  prefill chunks, then new prefills, under a token budget chosen offline from profiled iteration times so that
  every hybrid step fits the TBT (ITL) SLO; FCFS, no admission control. Colocated, same static split and
  round-robin routing as vLLM, since Sarathi-Serve is an engine-level scheduler. The budget is `sarathi_budget`.
- `distserve`: DistServe (Zhong et al., OSDI 2024): prefill and decode on separate instances per model, the
  placement chosen for goodput (here the planner's best fully disaggregated placement by its SLO-aware estimate),
  FCFS queues, requests dispatched to the prefill instance with the shortest queue, decode batches sized so a
  step fits the TPOT SLO, KV moved over NVLink; no admission control (the only refusals are decode reservations
  the simulator cannot make).
- `octoserve`: every octoserve policy: admission with early refusal at half the TTFT SLO, EDF queues, prefix- and
  load-aware routing by predicted TTFT, predicted-output KV reservation, ITL-sized step budgets and batches, on
  the placement the planner recommends after simulating its best candidates.
- `octoserve-gang`: every octoserve policy on the time-shared placement (`node-gang.yaml`): the 70B at TP=8 on
  all eight GPUs in a gang group with eight 8B replicas, the GPUs leased step by step by the gang arbiter.
- ablations: octoserve without early refusal (`admission: false`), without prefix-aware routing
  (`prefix_aware_routing: false`), and with `full` reservation (prompt + max_tokens held from admission).

Invariants: a baseline never changes the node's GPUs, models or SLOs, only policies and per-instance knobs;
`configure` returns a config that passed `check_placement`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from octoserve.services.core.cost_model import CostModel
from octoserve.services.core.placement import NodeConfig, PlacementError, PolicyConfig, check_placement
from octoserve.services.core.slo_sizing import CHUNK_QUANTUM, WIDE_BATCH_AT, size_for_slo
from octoserve.services.core.tail_budget import FREE_STEP_SHARE
from octoserve.services.core.types import Role

# Placement kinds a baseline runs on (the suite resolves each to a NodeConfig).
STATIC_SPLIT = "static-split"  # the embedded default: 70B TP=4 colocated + four 8B replicas
BEST_DISAGGREGATED = "best-disaggregated"  # planner: best SLO-aware estimate among placements with every model split P/D
PLANNER = "planner"  # planner: top candidates simulated; the suite uses the SLO-capacity or goodput winner
GANG = "gang"  # the embedded node-gang.yaml: 70B TP=8 time-shared with eight 8B replicas

VLLM_H100_MAX_NUM_BATCHED_TOKENS = 8192  # vLLM v1, OpenAI API server, GPU >= 70 GiB and not A100
VLLM_H100_MAX_NUM_SEQS = 1024
SARATHI_CONTEXT_TOKENS = 1200  # typical decode context the budget is profiled at (seed 000: ~1,000 + 400 / 2)


@dataclass(frozen=True, slots=True)
class Baseline:
    name: str
    placement: str  # STATIC_SPLIT | BEST_DISAGGREGATED | PLANNER | GANG
    policies: Mapping[str, Any] = field(default_factory=dict)  # PolicyConfig field -> value
    max_num_batched_tokens: int | None = None  # every non-prefill instance; None keeps the placement's
    max_num_seqs: int | None = None
    sarathi_budget: bool = False  # size each colocated instance's budget with `sarathi_budget`
    description: str = ""


_VLLM_POLICIES = dict(queue="fcfs", reservation="watermark", preemption="recompute", admission=False,
                      slo_sizing=False, picker="round_robin")
_OCTOSERVE_POLICIES = dict(queue="edf", reservation="predicted", preemption="recompute", admission=True,
                           slo_sizing=True, picker="lowest_cost", )

BASELINES: dict[str, Baseline] = {b.name: b for b in (
    Baseline("vllm-default", STATIC_SPLIT, _VLLM_POLICIES, VLLM_H100_MAX_NUM_BATCHED_TOKENS, VLLM_H100_MAX_NUM_SEQS,
             description="vLLM v1 defaults: 8,192-token budget, FCFS, admit all, recompute, round-robin"),
    Baseline("sarathi", STATIC_SPLIT, _VLLM_POLICIES, None, VLLM_H100_MAX_NUM_SEQS, sarathi_budget=True,
             description="Sarathi-Serve: stall-free chunked prefill, budget sized for the ITL SLO, FCFS, admit all"),
    Baseline("distserve", BEST_DISAGGREGATED,
             dict(queue="fcfs", reservation="watermark", preemption="recompute", admission=False, slo_sizing=True,
                  picker="lowest_cost", scorer_weights={"queue": 1.0}),
             description="DistServe: prefill/decode split per model, FCFS, shortest prefill queue, admit all"),
    Baseline("octoserve", PLANNER, _OCTOSERVE_POLICIES,
             description="all octoserve policies on the planner's placement"),
    Baseline("octoserve-gang", GANG, _OCTOSERVE_POLICIES,
             description="all octoserve policies with gang leases: 70B TP=8 time-shared with eight 8B replicas"),
    Baseline("octoserve-no-refusal", PLANNER, {**_OCTOSERVE_POLICIES, "admission": False},
             description="octoserve without admission control (no early refusal)"),
    Baseline("octoserve-no-prefix-routing", PLANNER, {**_OCTOSERVE_POLICIES, "prefix_aware_routing": False},
             description="octoserve with a cache-blind router"),
    Baseline("octoserve-full-reservation", PLANNER, {**_OCTOSERVE_POLICIES, "reservation": "full"},
             description="octoserve reserving prompt + max_tokens of KV at admission"),
)}

MAIN_POLICIES = ("vllm-default", "sarathi", "distserve", "octoserve", "octoserve-gang")


def sarathi_budget(cost: CostModel, itl_slo_ms: float, *, context_tokens: int = SARATHI_CONTEXT_TOKENS,
                   headroom: float = 0.85, cap_tokens: int = VLLM_H100_MAX_NUM_BATCHED_TOKENS) -> int:
    """Sarathi-Serve's token budget: the largest multiple of CHUNK_QUANTUM tokens such that a step of that many
    tokens fits `itl_slo_ms x headroom` whatever its mix of decodes (at `context_tokens`) and prefill chunk:
    stall-free batching promises every hybrid step the TBT SLO, so the budget is set for the worst mix. The same
    headroom as octoserve's sizing gives the instance (slo_sizing.py: 0.85, FREE_STEP_SHARE for a wide batch) keeps
    the comparison about policy, not margins."""
    target_s = itl_slo_ms / 1000.0 * headroom

    def fits(tokens: int) -> bool:
        mixes = sorted({0, tokens // 4, tokens // 2, 3 * tokens // 4, tokens})
        return all(cost.step_time_s([(tokens - d, 0)] * (d < tokens) + [(1, context_tokens)] * d) <= target_s
                   for d in mixes)

    best = 0
    for quanta in range(1, cap_tokens // CHUNK_QUANTUM + 1):
        if not fits(quanta * CHUNK_QUANTUM):
            break
        best = quanta * CHUNK_QUANTUM
    return max(CHUNK_QUANTUM, best)


def configure(baseline: Baseline, placement: NodeConfig) -> NodeConfig:
    """`placement` with the baseline's policies and per-instance knobs; raises PlacementError if it cannot run."""
    policies = dataclasses.replace(PolicyConfig(), **dict(baseline.policies))
    instances = tuple(_instance_knobs(baseline, placement, inst) for inst in placement.instances)
    config = dataclasses.replace(placement, policies=policies, instances=instances)
    problems = check_placement(config)
    if problems:
        raise PlacementError(problems)
    return config


def _instance_knobs(baseline: Baseline, node: NodeConfig, inst):
    if inst.role is Role.PREFILL:
        return inst  # a prefill instance keeps its large chunk: no ITL to protect there
    changes: dict[str, int] = {}
    if baseline.max_num_seqs is not None:
        changes["max_num_seqs"] = baseline.max_num_seqs
    if baseline.max_num_batched_tokens is not None:
        changes["max_num_batched_tokens"] = baseline.max_num_batched_tokens
    if baseline.sarathi_budget and inst.role is Role.COLOCATED:
        cost = node.cost_model(inst)
        # The headroom octoserve's sizing gives this instance: FREE_STEP_SHARE where its plain batch is wide.
        plain = size_for_slo(cost, inst.role, itl_slo_ms=node.slo.itl_ms, max_num_seqs=inst.max_num_seqs,
                             max_num_batched_tokens=inst.max_num_batched_tokens)
        headroom = FREE_STEP_SHARE if plain.max_num_seqs >= WIDE_BATCH_AT else 0.85
        changes["max_num_batched_tokens"] = sarathi_budget(cost, node.slo.itl_ms, headroom=headroom)
    return dataclasses.replace(inst, **changes)


def describe_instances(config: NodeConfig) -> str:
    """One line per model: role, TP, count and step budget, e.g. 'llama-3-8b: 4 x colocated TP1 (budget 8192)'."""
    parts = []
    for model in sorted(config.models):
        groups: dict[tuple, int] = {}
        for inst in config.instances_of(model):
            key = (inst.role.value, inst.tp, inst.max_num_batched_tokens)
            groups[key] = groups.get(key, 0) + 1
        desc = " + ".join(f"{n} x {role} TP{tp} (budget {budget})" for (role, tp, budget), n in sorted(groups.items()))
        parts.append(f"{model}: {desc}")
    return "; ".join(parts)
