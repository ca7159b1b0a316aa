"""The node configuration: which model instances run on which GPUs, the SLOs and the policies, as frozen values.

`node_config_from_dict(d)` builds a `NodeConfig` from a plain dict (YAML is read outside the core, in
`services/config.py`) and validates it as a whole: every problem is collected and raised together as one
`PlacementError`, each line saying what to change.

Invariants of a `NodeConfig` that passed validation:
- every instance serves a model in `models`, has `len(gpu_ids) == tp`, GPU ids in [0, num_gpus), weights that fit
  its GPUs at its TP and at least one KV block left (in its `gpu_memory_utilization` share of each GPU);
- no GPU is shared between instances, except inside a gang group (`gang.groups`): one LM instance and SM instances
  whose GPUs lie within the LM's, no two SMs on one GPU; there each GPU's shares add up to at most
  `MAX_SHARED_UTILIZATION`, so both models' weights, activation reserves and both KV pools fit it together, and
  the gang's starvation bounds are provable for the members' step floors (`gang.check_bounds`);
- every model with a PREFILL instance has a DECODE instance and vice versa; every model has an instance;
- policy names are ones the batcher and the router know; `cost_profile` names one of `COST_PROFILES`, and every
  CostModel built from the config (`NodeConfig.cost_model`) uses that profile's constants.
`SloConfig` tier defaults: INTERACTIVE 200 ms (seed 003's latency tier), STANDARD 250 ms (seed 000's SLO), BATCH
10,000 ms (seed 003's background tier: it queues rather than being shed). A request's own `ttft_slo_ms` wins.

Why one module past 600 lines: the node config's schema and every validation rule, so one error lists them all.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from octoserve.services.core.cost_model import COST_PROFILES, CostModel, cost_constants
from octoserve.services.core.gang import GangPolicy, check_bounds, with_shared_steps
from octoserve.services.core.specs import (
    GPU_PRESETS,
    MODEL_PRESETS,
    GpuSpec,
    ModelSpec,
    SpecError,
    gpu_spec_from_dict,
    model_spec_from_dict,
    num_kv_blocks,
)
from octoserve.services.core.types import Priority, RequestSpec, Role

# Names the batcher (queues.py, reservation.py, preemption.py) and the router (routing.py) register.
QUEUE_POLICIES = ("edf", "fcfs", "priority")
RESERVATION_POLICIES = ("full", "predicted", "watermark")
PREEMPTION_POLICIES = ("recompute", "swap")
ROUTING_FILTERS = ("healthy", "kv_headroom", "model")
ROUTING_SCORERS = ("kv_headroom", "queue", "ttft")
ROUTING_PICKERS = ("lowest_cost", "round_robin")

GIB = 1 << 30
# A GPU shared inside a gang group: the members' gpu_memory_utilization add up to at most this (the margin a lone
# instance keeps at its default 0.9, for CUDA contexts and fragmentation).
MAX_SHARED_UTILIZATION = 0.9


class PlacementError(ValueError):
    """A node config that cannot run; `problems` lists every problem, each saying what to change."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = tuple(problems)
        super().__init__("invalid node config:\n" + "\n".join(f"  - {p}" for p in self.problems))


def _default_tier_ttft_ms() -> dict[Priority, float]:
    return {Priority.INTERACTIVE: 200.0, Priority.STANDARD: 250.0, Priority.BATCH: 10_000.0}


def _default_tier_queue_bound() -> dict[Priority, int]:
    # Outstanding (admitted, no first token yet) requests per model and tier: a backstop behind the TTFT check,
    # sized well above what a 250 ms TTFT allows at seed 000's peak (~20 for the 70B, ~60 for the 8B).
    return {Priority.INTERACTIVE: 128, Priority.STANDARD: 256, Priority.BATCH: 2048}


def _default_scorer_weights() -> dict[str, float]:
    return {"ttft": 1.0, "kv_headroom": 0.2, "queue": 0.1}


@dataclass(frozen=True, slots=True)
class SloConfig:
    ttft_ms: float = 250.0  # default TTFT SLO (P95) when neither the request nor its tier says otherwise
    itl_ms: float = 30.0  # ITL SLO (P95); decode steps are sized against it
    tier_ttft_ms: Mapping[Priority, float] = field(default_factory=_default_tier_ttft_ms)  # tier -> TTFT SLO
    # Served model -> its own SLOs, resolved (the node values where the model sets none); a model not here has the
    # node's. Every per-model decision (sizing, the ITL tail, admission, the reports) reads `for_model(model)`.
    models: Mapping[str, SloConfig] = field(default_factory=dict)

    def for_model(self, model: str) -> SloConfig:
        return self.models.get(model, self)

    def ttft_ms_for(self, tier: Priority) -> float:
        return self.tier_ttft_ms.get(tier, self.ttft_ms)

    def ttft_ms_for_request(self, spec: RequestSpec) -> float:
        return spec.ttft_slo_ms if spec.ttft_slo_ms is not None else self.ttft_ms_for(spec.priority)


@dataclass(frozen=True, slots=True)
class PolicyConfig:
    queue: str = "edf"  # batcher waiting-queue order
    reservation: str = "predicted"  # how much KV a request reserves for its output
    preemption: str = "recompute"  # what happens to a preempted request's KV
    admission: bool = True  # False: route everything, shed nothing (for comparisons)
    # With admission: while a model's tier is refused part of its arrivals, that tier admits its shortest uncached
    # prompts first (services/core/admission.py, ShortestFirst). False: whichever the queue lets in.
    shortest_first: bool = True
    tier_queue_bound: Mapping[Priority, int] = field(default_factory=_default_tier_queue_bound)
    ttft_slack: float = 1.0  # the TTFT prior: refuse when predicted TTFT > tier SLO x slack, until calibrated
    # ...and add this relative error of the step model to the queued part of each prediction until calibrated: the
    # default profile under-predicts published step times by up to ~17 % (docs/COST_MODEL.md).
    ttft_prior_error: float = 0.2
    # Online TTFT calibration and the admission risk budget (services/core/admission.py TtftCalibrator): a request
    # is admitted while its miss probability (the share of the last `ttft_window` prediction errors of its model and
    # tier above its slack) is at most 1 - `ttft_quantile`, or at most `ttft_max_risk` while the mean over the
    # key's last `ttft_window` admissions stays within 1 - `ttft_quantile` (3 %: inside the 95 % promise).
    ttft_quantile: float = 0.97
    ttft_max_risk: float = 0.25
    ttft_window: int = 256
    ttft_min_samples: int = 32
    # Tiers under saturation: a waiting request preempts running requests of less urgent tiers at iteration
    # boundaries, but BATCH keeps at least this share of an instance's decode slots (1.0: no tier preemption).
    batch_min_share: float = 0.1
    predicted_output_tokens: int = 512  # admission's KV reservation under "predicted" (capped by max_tokens)
    kv_watermark: float = 0.01  # fraction of an instance's blocks kept free under "watermark"
    min_retry_after_ms: int = 50  # floor of every retry hint: retrying sooner cannot help
    routing_filters: tuple[str, ...] = ("model", "healthy", "kv_headroom")
    # "lowest_cost": the weighted scorers decide; "round_robin": each model's entry instances in turn, skipping
    # those the filters drop (vLLM's and most gateways' default, kept for comparisons).
    picker: str = "lowest_cost"
    # False: the router ignores its prefix index (predicts no cache hit anywhere); the engines still cache.
    prefix_aware_routing: bool = True
    scorer_weights: Mapping[str, float] = field(default_factory=_default_scorer_weights)  # scorer -> weight
    swap_space_bytes: int = 16 * GIB  # host memory per instance for swapped-out KV
    # Size each instance's step budget and decode batch from its cost model so a step fits the ITL SLO
    # (services/core/slo_sizing.py); only ever tightens the configured max_num_seqs / max_num_batched_tokens.
    slo_sizing: bool = True
    # With slo_sizing: a step may run longer than the ITL target (up to max_step_factor x it) while every running
    # decode keeps its mean time per output token on target (services/core/step_budget.py, slack_budget).
    slack_chunking: bool = True
    max_step_factor: float = 10.0
    # ...counting a long step's delay as paid back over each decode's next `tpot_horizon_tokens` tokens at the
    # current step pace (TPOT is a mean over the whole output; 0: the mean so far stays on target at every step).
    # 256: under a quarter of a seed-000 request's median output (~1,100 tokens); where decodes run close to the
    # target (the 70B at TP=4 under the pessimistic profile: 26.6-28.5 ms a step) a shorter horizon leaves no step
    # long enough for a prompt.
    tpot_horizon_tokens: int = 256
    # With slack_chunking, the ITL tail budget (services/core/tail_budget.py): a step past the ITL SLO (a whole
    # prompt at once) runs only while the slow share of the instance's last `tail_window_gaps` inter-token gaps
    # stays within `tail_budget_fraction`. The ITL SLO is a P95, so 5 % of gaps may be slow; every instance of a
    # model keeping its own share within 4 % keeps the model's pooled share there too, and the last point is for the
    # step model's error (a free step that runs past the SLO).
    tail_budget_fraction: float = 0.04
    # The window is long so that long steps follow the prompts that need them: arrivals come in bursts, and the
    # ITL P95 is judged over minutes of streams, not seconds. 32,000 gaps are ~30 s of the 70B's decodes at TP=4
    # at 11 req/s of seed 000; with 4,000 (~4 s) a burst of long prompts found the tail spent and was refused while
    # the minutes around it had slow gaps to spare (the 70B's per-model capacity 9.5 -> 11.4 req/s, its ITL P95
    # unchanged at 27.5 ms). A wide batch and a gang member keep 4,000 (services/core/instance.py,
    # short_tail_window_gaps).
    tail_window_gaps: int = 32000
    # A request whose instance is lost after it streamed tokens is continued on another instance of its model (its
    # prompt plus the tokens streamed, max_tokens less them) at most this many times; past it, it fails (0: never).
    max_continuations: int = 2


@dataclass(frozen=True, slots=True)
class InstanceConfig:
    id: str
    model: str  # a key of NodeConfig.models
    role: Role
    tp: int
    gpu_ids: tuple[int, ...]
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048  # default 8192 for PREFILL instances (see _instance_from_dict)
    gpu_memory_utilization: float = 0.9
    block_size: int = 16
    enable_prefix_caching: bool = True


@dataclass(frozen=True, slots=True)
class GangGroup:
    lm: str  # the instance that takes every GPU of the group for its steps (any TP and role)
    sms: tuple[str, ...]  # instances resident on the LM's GPUs that step on their own GPUs between LM steps


@dataclass(frozen=True, slots=True)
class GangConfig:
    groups: tuple[GangGroup, ...]
    policy: GangPolicy = GangPolicy()  # shape, the two bounds, fair-share weights (services/core/gang.py)
    # While both sides have work, an LM step is capped at lm_step_share of the sized ITL target and an SM step at
    # the rest, so one step of each fits one ITL (GangPolicy.lm/sm_shared_step_ms); a side alone steps in full.
    lm_step_share: float = 0.6

    def group_of(self, instance_id: str) -> GangGroup | None:
        for g in self.groups:
            if instance_id == g.lm or instance_id in g.sms:
                return g
        return None


@dataclass(frozen=True, slots=True)
class NodeConfig:
    gpu: GpuSpec
    num_gpus: int
    models: Mapping[str, ModelSpec]  # served name -> spec (name and max_context_len already applied)
    instances: tuple[InstanceConfig, ...]
    slo: SloConfig = SloConfig()
    policies: PolicyConfig = PolicyConfig()
    cost_profile: str = "default"  # a key of cost_model.COST_PROFILES: the constants every CostModel of it uses
    gang: GangConfig | None = None  # time-shared GPUs (gang leases); None: every GPU belongs to one instance

    def step_itl_ms(self, instance: InstanceConfig) -> float:
        """An instance's share of the ITL while it time-shares its GPUs: the SLO alone, its step share in a gang
        group (the planner's estimate and the router's prefill rate use it; batchers are sized to the full SLO)."""
        group = self.gang.group_of(instance.id) if self.gang else None
        if group is None:
            return self.slo.for_model(instance.model).itl_ms
        share = self.gang.lm_step_share if instance.id == group.lm else 1.0 - self.gang.lm_step_share
        return self.slo.for_model(instance.model).itl_ms * share  # its own ITL: the duty is `share` of the GPUs

    def cost_model(self, instance: InstanceConfig) -> CostModel:
        """The step-time model of `instance` under this config's cost profile (the one way to build it)."""
        return CostModel(self.models[instance.model], self.gpu, instance.tp, cost_constants(self.cost_profile))

    def instances_of(self, model: str, roles: tuple[Role, ...] = tuple(Role)) -> tuple[InstanceConfig, ...]:
        return tuple(i for i in self.instances if i.model == model and i.role in roles)

    def instance(self, instance_id: str) -> InstanceConfig:
        for inst in self.instances:
            if inst.id == instance_id:
                return inst
        raise KeyError(instance_id)

    def model_spec(self, instance: InstanceConfig) -> ModelSpec:
        return self.models[instance.model]

    def max_context_len(self, model: str) -> int:
        return self.models[model].max_context_len

    def is_disaggregated(self, model: str) -> bool:
        return bool(self.instances_of(model, (Role.PREFILL,)))

    def num_kv_blocks_for(self, instance: InstanceConfig) -> int:
        return num_kv_blocks_for(self, instance)


def gang_itl_ms(slo: SloConfig, models: Mapping[str, Any]) -> float:
    """The ITL one shared cycle (one LM step and one SM step) must fit: the tightest served model's ITL SLO (the
    node's own with per-model SLOs unset). An SM token gap that an LM step falls into holds one step of each."""
    return min((slo.for_model(m).itl_ms for m in models), default=slo.itl_ms)


def num_kv_blocks_for(config: NodeConfig, instance: InstanceConfig) -> int:
    """KV blocks of `instance` on `config.gpu` (the batcher's pool size)."""
    return num_kv_blocks(
        config.models[instance.model],
        config.gpu,
        instance.tp,
        instance.gpu_memory_utilization,
        instance.max_num_batched_tokens,
        instance.block_size,
    )


def instances_of(config: NodeConfig, model: str) -> tuple[InstanceConfig, ...]:
    return config.instances_of(model)


# --- building from a dict ----------------------------------------------------------------------------------------

_TOP_KEYS = ("gpu", "num_gpus", "models", "instances", "slo", "policies", "cost_profile", "gang")
_GANG_KEYS = ("groups", "lm_step_share",
              *(k for k in GangPolicy.__dataclass_fields__ if k not in ("lm_shared_step_ms", "sm_shared_step_ms")))
_INSTANCE_KEYS = tuple(f.name for f in dataclasses.fields(InstanceConfig))
_SLO_KEYS = ("ttft_ms", "itl_ms", "tier_ttft_ms", "models")
_MODEL_SLO_KEYS = ("ttft_ms", "itl_ms", "tier_ttft_ms")
_POLICY_KEYS = tuple(f.name for f in dataclasses.fields(PolicyConfig))


def node_config_from_dict(d: Mapping[str, Any]) -> NodeConfig:
    """Build and validate a NodeConfig; raise one `PlacementError` listing every problem found."""
    problems: list[str] = []
    _unknown_keys(d, _TOP_KEYS, "the node config", problems)
    gpu = _gpu(d.get("gpu", "h100-sxm-80gb"), problems)
    num_gpus = _int(d.get("num_gpus", 8), "num_gpus", problems, minimum=1)
    models = _models(d.get("models"), problems)
    instances = tuple(
        inst for i, raw in enumerate(d.get("instances") or ()) if (inst := _instance(i, raw, problems)) is not None
    )
    slo = _slo(d.get("slo") or {}, problems, models)
    policies = _policies(d.get("policies") or {}, problems)
    cost_profile = _cost_profile(d.get("cost_profile", "default"), problems)
    gang = _gang(d["gang"], gang_itl_ms(slo, models), problems) if d.get("gang") is not None else None
    if problems:
        raise PlacementError(problems)
    config = NodeConfig(gpu, num_gpus, models, instances, slo, policies, cost_profile, gang)
    problems += check_placement(config)
    if problems:
        raise PlacementError(problems)
    return config


def check_placement(config: NodeConfig) -> list[str]:
    """Every problem of an already-typed NodeConfig (used by the planner for the configs it builds, too)."""
    problems: list[str] = []
    if not config.instances:
        problems.append("no instances: add at least one entry under `instances`")
    _check_ids(config, problems)
    _check_gpus(config, problems)
    for inst in config.instances:
        if inst.model not in config.models:
            known = ", ".join(sorted(config.models)) or "(none)"
            problems.append(f"instance {inst.id}: model {inst.model!r} is not under `models`; use one of: {known}")
            continue
        _check_fit(config, inst, problems)
    _check_roles(config, problems)
    if config.gang is not None and not problems:
        _check_gang(config, problems)
    return problems


def _unknown_keys(d: Mapping[str, Any], known: tuple[str, ...], where: str, problems: list[str]) -> None:
    for key in d:
        if key not in known:
            problems.append(f"unknown key {key!r} in {where}; known keys: {', '.join(known)}")


def _int(value: Any, where: str, problems: list[str], minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        problems.append(f"{where} is {value!r}; set it to an integer >= {minimum}")
        return minimum
    return value


def _cost_profile(raw: Any, problems: list[str]) -> str:
    if not isinstance(raw, str) or raw not in COST_PROFILES:
        problems.append(f"cost_profile: unknown profile {raw!r}; choose one of: {', '.join(COST_PROFILES)}")
    return raw


def _gpu(raw: Any, problems: list[str]) -> GpuSpec:
    if isinstance(raw, str):
        if raw in GPU_PRESETS:
            return GPU_PRESETS[raw]
        problems.append(f"gpu: unknown preset {raw!r}; choose one of: {', '.join(sorted(GPU_PRESETS))}")
    elif isinstance(raw, Mapping):
        try:
            return gpu_spec_from_dict(dict(raw))
        except (TypeError, ValueError) as e:
            problems.append(f"gpu: {e}")
    else:
        problems.append(f"gpu is {raw!r}; give a preset name or a full GPU spec mapping")
    return next(iter(GPU_PRESETS.values()))


def _models(raw: Any, problems: list[str]) -> dict[str, ModelSpec]:
    if isinstance(raw, (list, tuple)):
        raw = {name: name for name in raw}
    if not isinstance(raw, Mapping) or not raw:
        problems.append("models is missing or empty; list the served models, e.g. `models: {llama-3-70b: llama-3-70b}`")
        return {}
    models: dict[str, ModelSpec] = {}
    for name, value in raw.items():
        spec = _model(str(name), value, problems)
        if spec is not None:
            models[str(name)] = spec
    return models


def _model(name: str, value: Any, problems: list[str]) -> ModelSpec | None:
    """A preset name, `{preset: P, max_context_len: N}`, or `{spec: {...full ModelSpec...}, max_context_len: N}`."""
    if value is None or isinstance(value, str):
        value = {"preset": value or name}
    if not isinstance(value, Mapping):
        problems.append(f"models.{name} is {value!r}; give a preset name or a mapping with `preset` or `spec`")
        return None
    _unknown_keys(value, ("preset", "spec", "max_context_len"), f"models.{name}", problems)
    if "spec" in value:
        try:
            spec = model_spec_from_dict(dict(value["spec"]))
        except (TypeError, ValueError) as e:
            problems.append(f"models.{name}.spec: {e}")
            return None
    else:
        preset = value.get("preset", name)
        if preset not in MODEL_PRESETS:
            problems.append(f"models.{name}: unknown preset {preset!r}; choose one of: {', '.join(sorted(MODEL_PRESETS))}")
            return None
        spec = MODEL_PRESETS[preset]
    context = value.get("max_context_len", spec.max_context_len)
    context = _int(context, f"models.{name}.max_context_len", problems, minimum=2)
    return dataclasses.replace(spec, name=name, max_context_len=context)


def _instance(index: int, raw: Any, problems: list[str]) -> InstanceConfig | None:
    where = f"instances[{index}]"
    if not isinstance(raw, Mapping):
        problems.append(f"{where} is {raw!r}; give a mapping with id, model, role, tp, gpu_ids")
        return None
    where = f"instance {raw.get('id', where)}"
    _unknown_keys(raw, _INSTANCE_KEYS, where, problems)
    missing = [k for k in ("id", "model", "gpu_ids") if k not in raw]
    if missing:
        problems.append(f"{where}: missing {', '.join(missing)}; every instance needs id, model and gpu_ids")
        return None
    role = _role(raw.get("role", "colocated"), where, problems)
    gpu_ids = raw["gpu_ids"]
    if not isinstance(gpu_ids, (list, tuple)) or not all(isinstance(g, int) for g in gpu_ids):
        problems.append(f"{where}: gpu_ids is {gpu_ids!r}; give a list of GPU indices, e.g. [0, 1, 2, 3]")
        gpu_ids = ()
    default_tokens = 8192 if role is Role.PREFILL else 2048
    util = raw.get("gpu_memory_utilization", 0.9)
    if not isinstance(util, (int, float)) or not 0 < util <= 1:
        problems.append(f"{where}: gpu_memory_utilization is {util!r}; set it in (0, 1], e.g. 0.9")
        util = 0.9
    return InstanceConfig(
        id=str(raw["id"]),
        model=str(raw["model"]),
        role=role,
        tp=_int(raw.get("tp", len(gpu_ids) or 1), f"{where}: tp", problems, minimum=1),
        gpu_ids=tuple(gpu_ids),
        max_num_seqs=_int(raw.get("max_num_seqs", 256), f"{where}: max_num_seqs", problems, minimum=1),
        max_num_batched_tokens=_int(
            raw.get("max_num_batched_tokens", default_tokens), f"{where}: max_num_batched_tokens", problems, minimum=1
        ),
        gpu_memory_utilization=float(util),
        block_size=_int(raw.get("block_size", 16), f"{where}: block_size", problems, minimum=1),
        enable_prefix_caching=bool(raw.get("enable_prefix_caching", True)),
    )


def _role(raw: Any, where: str, problems: list[str]) -> Role:
    try:
        return Role(raw)
    except ValueError:
        problems.append(f"{where}: unknown role {raw!r}; choose one of: {', '.join(r.value for r in Role)}")
        return Role.COLOCATED


def _tier(raw: Any, where: str, problems: list[str]) -> Priority | None:
    if isinstance(raw, Priority):
        return raw
    try:
        return Priority[str(raw).upper()]
    except KeyError:
        names = ", ".join(p.name.lower() for p in Priority)
        problems.append(f"{where}: unknown tier {raw!r}; choose one of: {names}")
        return None


def _tier_map(raw: Any, where: str, problems: list[str], base: dict[Priority, Any], cast: type) -> dict[Priority, Any]:
    if not isinstance(raw, Mapping):
        problems.append(f"{where} is {raw!r}; give a mapping of tier -> value, e.g. {{interactive: 200}}")
        return base
    out = dict(base)
    for key, value in raw.items():
        tier = _tier(key, where, problems)
        if tier is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            problems.append(f"{where}.{tier.name.lower()} is {value!r}; set a positive number")
            continue
        out[tier] = cast(value)
    return out


def _slo(raw: Mapping[str, Any], problems: list[str], models: Mapping[str, Any] | None = None) -> SloConfig:
    _unknown_keys(raw, _SLO_KEYS, "slo", problems)
    node = _slo_values(raw, "slo", SloConfig(), problems)
    per_model = raw.get("models") or {}
    if not isinstance(per_model, Mapping):
        problems.append(f"slo.models is {per_model!r}; give a mapping of served model -> {{ttft_ms, itl_ms, "
                        "tier_ttft_ms}}")
        return node
    resolved = {}
    for name, entry in per_model.items():
        where = f"slo.models.{name}"
        if models is not None and name not in models:
            problems.append(f"{where}: {name!r} is not a served model; choose one of: {', '.join(models) or 'none'}")
            continue
        if not isinstance(entry, Mapping):
            problems.append(f"{where} is {entry!r}; give a mapping with ttft_ms, itl_ms and/or tier_ttft_ms")
            continue
        _unknown_keys(entry, _MODEL_SLO_KEYS, where, problems)
        resolved[name] = _slo_values(entry, where, node, problems)
    return dataclasses.replace(node, models=resolved)


def _slo_values(raw: Mapping[str, Any], where: str, base: SloConfig, problems: list[str]) -> SloConfig:
    """ttft_ms, itl_ms and tier_ttft_ms of `raw` over `base`. A model's own ttft_ms is its STANDARD tier's SLO too
    (unless its tier_ttft_ms says otherwise): the node's tier map would otherwise hide it."""
    values = {}
    for key in ("ttft_ms", "itl_ms"):
        value = raw.get(key, getattr(base, key))
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            problems.append(f"{where}.{key} is {value!r}; set a positive number of milliseconds")
            value = 1.0
        values[key] = float(value)
    tier_base = dict(base.tier_ttft_ms)
    if where != "slo" and "ttft_ms" in raw:
        tier_base[Priority.STANDARD] = values["ttft_ms"]
    tiers = _tier_map(raw.get("tier_ttft_ms", {}), f"{where}.tier_ttft_ms", problems, tier_base, float)
    return SloConfig(values["ttft_ms"], values["itl_ms"], tiers)


def _policies(raw: Mapping[str, Any], problems: list[str]) -> PolicyConfig:
    _unknown_keys(raw, _POLICY_KEYS, "policies", problems)
    base = PolicyConfig()
    for key, known in (("queue", QUEUE_POLICIES), ("reservation", RESERVATION_POLICIES), ("preemption", PREEMPTION_POLICIES)):
        if key in raw and raw[key] not in known:
            problems.append(f"policies.{key}: unknown policy {raw[key]!r}; choose one of: {', '.join(known)}")
    filters = tuple(raw.get("routing_filters", base.routing_filters))
    for name in filters:
        if name not in ROUTING_FILTERS:
            problems.append(f"policies.routing_filters: unknown filter {name!r}; choose from: {', '.join(ROUTING_FILTERS)}")
    weights = dict(raw.get("scorer_weights", base.scorer_weights))
    for name, w in weights.items():
        if name not in ROUTING_SCORERS:
            problems.append(f"policies.scorer_weights: unknown scorer {name!r}; choose from: {', '.join(ROUTING_SCORERS)}")
        elif isinstance(w, bool) or not isinstance(w, (int, float)) or w < 0:
            problems.append(f"policies.scorer_weights.{name} is {w!r}; set a weight >= 0")
    picker = raw.get("picker", base.picker)
    if picker not in ROUTING_PICKERS:
        problems.append(f"policies.picker: unknown picker {picker!r}; choose one of: {', '.join(ROUTING_PICKERS)}")
    bounds = _tier_map(raw.get("tier_queue_bound", {}), "policies.tier_queue_bound", problems, _default_tier_queue_bound(), int)
    scalars = {k: raw[k] for k in ("ttft_slack", "ttft_prior_error", "predicted_output_tokens", "kv_watermark", "min_retry_after_ms",
                                   "swap_space_bytes", "max_step_factor", "ttft_quantile", "ttft_max_risk", "ttft_window",
                                   "ttft_min_samples", "batch_min_share", "tail_budget_fraction",
                                   "tail_window_gaps", "tpot_horizon_tokens", "max_continuations") if k in raw}
    for key, value in scalars.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            problems.append(f"policies.{key} is {value!r}; set a number >= 0")
    for key in ("ttft_quantile", "batch_min_share"):
        value = scalars.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and not 0 < value <= 1:
            problems.append(f"policies.{key} is {value!r}; set a fraction in (0, 1]")
    risk = scalars.get("ttft_max_risk")
    if isinstance(risk, (int, float)) and not isinstance(risk, bool) and not 0 <= risk <= 1:
        problems.append(f"policies.ttft_max_risk is {risk!r}; set a probability in [0, 1]: the largest chance of "
                        "missing its TTFT SLO one admitted request may carry")
    fraction = scalars.get("tail_budget_fraction")
    if isinstance(fraction, (int, float)) and not isinstance(fraction, bool) and not 0 <= fraction < 0.05:
        problems.append(f"policies.tail_budget_fraction is {fraction!r}; set a fraction in [0, 0.05): the share of "
                        "inter-token gaps a P95 ITL SLO lets run slow is 5 %, and the budget must stay inside it")
    gaps = scalars.get("tail_window_gaps")
    if isinstance(gaps, (int, float)) and not isinstance(gaps, bool) and gaps < 1:
        problems.append(f"policies.tail_window_gaps is {gaps!r}; set a count of gaps >= 1")
    window, min_samples = scalars.get("ttft_window", base.ttft_window), scalars.get("ttft_min_samples", base.ttft_min_samples)
    if isinstance(window, (int, float)) and isinstance(min_samples, (int, float)) and not 1 <= min_samples <= window:
        problems.append(f"policies.ttft_min_samples is {min_samples!r}; set it between 1 and ttft_window ({window!r})")
    for key in ("ttft_window", "ttft_min_samples", "tail_window_gaps", "tpot_horizon_tokens", "max_continuations"):
        if isinstance(scalars.get(key), float):
            scalars[key] = int(scalars[key])
    return PolicyConfig(
        queue=raw.get("queue", base.queue),
        reservation=raw.get("reservation", base.reservation),
        preemption=raw.get("preemption", base.preemption),
        admission=bool(raw.get("admission", base.admission)),
        shortest_first=bool(raw.get("shortest_first", base.shortest_first)),
        slo_sizing=bool(raw.get("slo_sizing", base.slo_sizing)),
        slack_chunking=bool(raw.get("slack_chunking", base.slack_chunking)),
        picker=picker,
        prefix_aware_routing=bool(raw.get("prefix_aware_routing", base.prefix_aware_routing)),
        tier_queue_bound=bounds,
        routing_filters=filters,
        scorer_weights={k: float(v) for k, v in weights.items() if isinstance(v, (int, float))},
        **scalars,
    )


# --- whole-config checks -------------------------------------------------------------------------------------------


def _check_ids(config: NodeConfig, problems: list[str]) -> None:
    seen: set[str] = set()
    for inst in config.instances:
        if inst.id in seen:
            problems.append(f"instance id {inst.id!r} is used twice; give every instance its own id")
        seen.add(inst.id)


def _may_share(config: NodeConfig, a: str, b: str) -> bool:
    """Only an LM and an SM of the same gang group may share a GPU."""
    group = config.gang.group_of(a) if config.gang else None
    return group is not None and group is config.gang.group_of(b) and group.lm in (a, b)


def _check_gpus(config: NodeConfig, problems: list[str]) -> None:
    owner: dict[int, list[str]] = {}
    for inst in config.instances:
        if len(inst.gpu_ids) != inst.tp:
            problems.append(
                f"instance {inst.id}: tp={inst.tp} but {len(inst.gpu_ids)} gpu_ids {list(inst.gpu_ids)}; "
                f"give exactly {inst.tp} GPU ids or set tp={len(inst.gpu_ids)}"
            )
        if len(set(inst.gpu_ids)) != len(inst.gpu_ids):
            problems.append(f"instance {inst.id}: gpu_ids {list(inst.gpu_ids)} lists a GPU twice; list each GPU once")
        outside = [g for g in sorted(set(inst.gpu_ids)) if not 0 <= g < config.num_gpus]
        if outside:
            problems.append(
                f"instance {inst.id}: gpu ids {outside} are out of range; this node has GPUs 0..{config.num_gpus - 1}"
            )
        for g in sorted(set(inst.gpu_ids) - set(outside)):
            for other in owner.get(g, []):
                if not _may_share(config, other, inst.id):
                    problems.append(
                        f"GPU {g} is given to both {other} and {inst.id}; give each GPU to one instance, or put "
                        f"them in one gang group (gang.groups: an LM and the SMs that share its GPUs)"
                    )
            owner.setdefault(g, []).append(inst.id)


def _check_fit(config: NodeConfig, inst: InstanceConfig, problems: list[str]) -> None:
    model = config.models[inst.model]
    try:
        model.check_tp(inst.tp)
    except SpecError as e:
        detail = str(e).removeprefix(f"{e.field}: ")
        problems.append(f"instance {inst.id}: {detail}; use a tp that splits the heads evenly (1, 2, 4 or 8)")
        return
    usable = config.gpu.memory_bytes * inst.gpu_memory_utilization
    weights = model.weight_bytes_per_gpu(inst.tp)
    if weights >= usable:
        problems.append(
            f"instance {inst.id}: {inst.model} weights need {weights / 1e9:.1f} GB per GPU at TP={inst.tp} but "
            f"{config.gpu.name} x {inst.gpu_memory_utilization:g} leaves {usable / 1e9:.1f} GB; raise tp or "
            f"gpu_memory_utilization"
        )
    elif num_kv_blocks_for(config, inst) <= 0:
        problems.append(
            f"instance {inst.id}: no room for KV cache: {inst.model} weights take {weights / 1e9:.1f} of "
            f"{usable / 1e9:.1f} GB per GPU at TP={inst.tp} and the activations of {inst.max_num_batched_tokens} "
            f"batched tokens take the rest; raise tp or lower max_num_batched_tokens"
        )


def _check_roles(config: NodeConfig, problems: list[str]) -> None:
    for model in config.models:
        roles = {i.role for i in config.instances_of(model)}
        if not roles:
            problems.append(f"model {model} has no instance; add one or remove it from `models`")
        if Role.PREFILL in roles and Role.DECODE not in roles:
            problems.append(f"model {model} has prefill instances but no decode instance; add a role: decode instance")
        if Role.DECODE in roles and Role.PREFILL not in roles:
            problems.append(f"model {model} has decode instances but no prefill instance; add a role: prefill instance")


# --- gang groups ---------------------------------------------------------------------------------------------------


def _gang(raw: Any, itl_ms: float, problems: list[str]) -> GangConfig | None:
    if not isinstance(raw, Mapping):
        problems.append(f"gang is {raw!r}; give a mapping with groups and the lease policy keys")
        return None
    _unknown_keys(raw, _GANG_KEYS, "gang", problems)
    groups = []
    for i, g in enumerate(raw.get("groups") or ()):
        if not isinstance(g, Mapping) or "lm" not in g or not isinstance(g.get("sms"), (list, tuple)) or not g["sms"]:
            problems.append(f"gang.groups[{i}] is {g!r}; give {{lm: <instance id>, sms: [<instance id>, ...]}}")
            continue
        groups.append(GangGroup(str(g["lm"]), tuple(str(x) for x in g["sms"])))
    if not groups:
        problems.append("gang.groups is missing or empty; list at least one {lm: ID, sms: [IDs]} group, or drop `gang`")
    share = raw.get("lm_step_share", 0.6)
    if isinstance(share, bool) or not isinstance(share, (int, float)) or not 0 < share < 1:
        problems.append(f"gang.lm_step_share is {share!r}; set a fraction in (0, 1), e.g. 0.6")
        share = 0.6
    policy_keys = {k: raw[k] for k in _GANG_KEYS if k in raw and k not in ("groups", "lm_step_share")}
    for key, value in policy_keys.items():
        if key != "shape" and (isinstance(value, bool) or not isinstance(value, (int, float))):
            problems.append(f"gang.{key} is {value!r}; set a number")
            return None
    policy = GangPolicy(**{k: (str(v) if k == "shape" else float(v)) for k, v in policy_keys.items()})
    problems += policy.problems()
    return GangConfig(tuple(groups), with_shared_steps(policy, float(share), itl_ms), float(share))


def _check_gang(config: NodeConfig, problems: list[str]) -> None:
    gang = config.gang
    ids = {inst.id: inst for inst in config.instances}
    seen: set[str] = set()
    for group in gang.groups:
        for member in (group.lm, *group.sms):
            if member not in ids:
                problems.append(f"gang group of {group.lm}: no instance {member!r}; use ids from `instances`")
                return
            if member in seen:
                problems.append(f"instance {member} is in two gang groups (or twice in one); list it once")
            seen.add(member)
        lm = ids[group.lm]
        on_gpu: dict[int, list[str]] = {}
        for sm_id in group.sms:
            sm = ids[sm_id]
            outside = sorted(set(sm.gpu_ids) - set(lm.gpu_ids))
            if outside:
                problems.append(f"gang group of {lm.id}: {sm_id} uses GPUs {outside} outside {lm.id}'s "
                                f"{list(lm.gpu_ids)}; an SM must sit on its LM's GPUs")
            for g in sm.gpu_ids:
                on_gpu.setdefault(g, []).append(sm_id)
        for g, sms in sorted(on_gpu.items()):
            if len(sms) > 1:
                problems.append(f"gang group of {lm.id}: GPU {g} holds {', '.join(sms)}; give each SM its own GPU")
            _check_shared_memory(config, g, [lm, *(ids[x] for x in sms)], problems)
    if not config.policies.slo_sizing or not config.policies.slack_chunking:
        problems.append("gang groups need policies.slo_sizing and policies.slack_chunking on: the lease caps cut "
                        "steps by the step model they build")
    if not problems:
        _check_gang_bounds(config, ids, problems)


def _check_shared_memory(config: NodeConfig, gpu: int, members: list[InstanceConfig], problems: list[str]) -> None:
    """Each member fits in its own share (`_check_fit`); the shares must fit the GPU together."""
    total = sum(m.gpu_memory_utilization for m in members)
    if total > MAX_SHARED_UTILIZATION + 1e-9:
        mem_gb = config.gpu.memory_bytes / 1e9
        parts = " + ".join(
            f"{m.id} {m.gpu_memory_utilization:g} ({config.models[m.model].weight_bytes_per_gpu(m.tp) / 1e9:.1f} GB "
            f"weights, the rest activations and KV)" for m in members
        )
        problems.append(
            f"GPU {gpu} is shared by a gang group: gpu_memory_utilization {parts} = {total:.2f} of {mem_gb:.1f} GB "
            f"exceeds {MAX_SHARED_UTILIZATION:g}; lower the members' gpu_memory_utilization (their KV split)"
        )


def gang_step_floor_s(config: NodeConfig, inst: InstanceConfig) -> float:
    """The longest step floor of a gang member: its SLO-sized full decode batch alone, by its cost model."""
    from octoserve.services.core.slo_sizing import size_for_slo

    cost = config.cost_model(inst)
    sized = size_for_slo(cost, inst.role, itl_slo_ms=config.slo.for_model(inst.model).itl_ms,
                         max_num_seqs=inst.max_num_seqs,
                         max_num_batched_tokens=inst.max_num_batched_tokens)  # gang members: no tail sizing
    table = sized.decode_step_s_by_num_decodes
    return table[-1] if table else cost.decode_step_time_s(sized.max_num_seqs, sized.context_tokens or 1200)


def _check_gang_bounds(config: NodeConfig, ids: Mapping[str, InstanceConfig], problems: list[str]) -> None:
    for group in config.gang.groups:
        lm_floor = gang_step_floor_s(config, ids[group.lm])
        sm_floor = max(gang_step_floor_s(config, ids[x]) for x in group.sms)
        for p in check_bounds(config.gang.policy, sm_floor, lm_floor):
            problems.append(f"gang group of {group.lm}: {p}")
