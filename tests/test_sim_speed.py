"""The simulator's fast path (compact steps, reused load snapshots, no per-token messages) against the plain path.

The fast path is an exact speed-up: every record, instance figure and time series must be identical to the plain
path's, on the default, disaggregated and gang placements, under KV pressure (preemption, swap, tier preemption)
and with an instance lost mid-run. At the batcher level, `schedule_compact` / `update_compact` must plan and apply
the same steps as `schedule` / `update`.
"""

from __future__ import annotations

import dataclasses
import random

import pytest

from octoserve.services.config import default_config_text, node_config_from_text
from octoserve.services.core.batch_state import BatcherConfig
from octoserve.services.core.batcher import Batcher
from octoserve.services.core.kv_cache import KVCacheManager
from octoserve.services.core.placement import node_config_from_dict
from octoserve.services.core.types import Priority, RequestSpec, SamplingParams, StepResult
from octoserve.services.sim.driver import NodeSimulator, fast_path_default, run_simulation
from octoserve.services.sim.faults import parse_fault
from octoserve.services.workload import PROFILES, generate_trace, scaled


def both_paths(config, trace, **kwargs):
    fast = run_simulation(config, trace, fast=True, **kwargs)
    plain = run_simulation(config, trace, fast=False, **kwargs)
    return fast, plain


def assert_identical(fast, plain):
    assert len(fast.records) == len(plain.records) > 0
    for a, b in zip(fast.records, plain.records):
        assert a == b, a.request_id
    assert fast.instances == plain.instances
    assert fast.timeseries == plain.timeseries
    assert fast.summary == plain.summary
    assert fast.virtual_s == plain.virtual_s
    assert fast.fault_counts == plain.fault_counts
    assert fast.gangs == plain.gangs


def short_trace(profile: str, duration_s: float, rate_rps: float, seed: int = 0):
    return list(generate_trace(scaled(PROFILES[profile], duration_s=duration_s, rate_rps=rate_rps), seed))


@pytest.mark.parametrize("config_name", ["node-default.yaml", "node-disagg.yaml", "node-gang.yaml"])
def test_fast_and_plain_paths_give_identical_records(config_name):
    config = node_config_from_text(default_config_text(config_name))
    fast, plain = both_paths(config, short_trace("seed-000", 4.0, 150.0), drain_s=30.0)
    assert_identical(fast, plain)
    assert sum(r.num_output_tokens for r in fast.records) > 1000  # decode batches, not only prefills


@pytest.mark.parametrize("cost_profile", ["default", "pessimistic"])
def test_fast_and_plain_paths_agree_where_the_decode_slots_bind(cost_profile):
    # At the seed-000 peak every instance runs its decode slots full, and they are counted from the running
    # requests' lengths: a steady request's `token_ids` run ahead of its length, so the fast path counts c + s.
    config = dataclasses.replace(node_config_from_text(default_config_text()), cost_profile=cost_profile)
    fast, plain = both_paths(config, short_trace("seed-000", 12.0, 300.0), drain_s=30.0)
    assert_identical(fast, plain)


def test_fast_and_plain_paths_agree_under_kv_pressure_preemption_and_swap():
    # A small KV pool, swap preemption, and tier preemption with BATCH traffic: `_make_room` and `_preempt`
    # run inside compact steps (victims taken back out of a half-built step).
    def config(preemption):
        return node_config_from_dict({
            "gpu": "h100-sxm-80gb", "num_gpus": 8, "models": {"llama-3-8b": {"preset": "llama-3-8b"}},
            "instances": [{"id": "sm-0", "model": "llama-3-8b", "role": "colocated", "tp": 1, "gpu_ids": [0],
                           "max_num_seqs": 64, "gpu_memory_utilization": 0.25}],
            "policies": {"preemption": preemption, "swap_space_bytes": 400_000_000, "reservation": "watermark",
                         "admission": False, "batch_min_share": 0.25},
        })

    rng = random.Random(5)
    trace = short_trace("seed-003", 3.0, 60.0, seed=3)
    trace = [t for t in trace if t.model == "llama-3-8b"]
    trace = [_with_priority(t, rng.choice(list(Priority))) for t in trace]
    for preemption in ("recompute", "swap"):
        fast, plain = both_paths(config(preemption), trace, drain_s=60.0)
        assert_identical(fast, plain)
        assert sum(r.num_preemptions for r in fast.records) > 0, preemption


def _with_priority(t, priority):
    import dataclasses

    return dataclasses.replace(t, priority=priority)


def test_fast_and_plain_paths_agree_when_an_instance_is_lost():
    config = node_config_from_text(default_config_text("node-disagg.yaml"))
    faults = [parse_fault(f"{config.instances[-1].id}@1.5+1")]
    fast, plain = both_paths(config, short_trace("seed-000", 3.0, 150.0), drain_s=30.0, faults=faults)
    assert_identical(fast, plain)
    assert fast.fault_counts["rerouted"] + fast.fault_counts["lost"] > 0


def test_the_switch_turns_the_fast_path_off(monkeypatch):
    monkeypatch.delenv("OCTOSERVE_SIM_FAST", raising=False)
    assert fast_path_default() is True
    config = node_config_from_text(default_config_text())
    assert NodeSimulator(config).fast is True
    monkeypatch.setenv("OCTOSERVE_SIM_FAST", "0")
    assert fast_path_default() is False
    assert NodeSimulator(config).fast is False
    assert NodeSimulator(config, fast=True).fast is True


# ---- the batcher's two APIs in lockstep ---------------------------------------------------------------------

def _spec(rid, prompt_len, max_tokens, priority, first):
    return RequestSpec(rid, "m", tuple(range(first, first + prompt_len)), SamplingParams(max_tokens=max_tokens),
                       arrival_s=0.0, priority=priority)


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_schedule_compact_plans_and_applies_the_same_steps_as_schedule(preemption_mode):
    def make():
        cfg = BatcherConfig(max_num_seqs=8, max_num_batched_tokens=24, reservation_policy="watermark",
                            preemption_mode=preemption_mode, num_swap_blocks=6, batch_min_share=0.25)
        return Batcher(cfg, KVCacheManager(16, 4, extra_key="m"))

    plain, compact = make(), make()
    rng = random.Random(11)
    specs = [_spec(f"r{i:02d}", rng.randint(2, 20), rng.randint(1, 30), rng.choice(list(Priority)),
                   rng.choice([100, 100, 500 + i])) for i in range(24)]
    num_preempted = 0
    for step_no in range(400):
        now = step_no * 0.01
        if step_no % 2 == 0 and specs:
            s = specs.pop()
            plain.add_request(s, now)
            compact.add_request(s, now)
        plan = plain.schedule(now)
        step = compact.schedule_compact(now)
        assert step.to_plan() == plan
        num_preempted += len(plan.preempted_ids)
        sampled = {c.request_id: rng.choice([7] * 30 + [2]) for c in plan.chunks if c.samples}
        out = plain.update(plan, StepResult(sampled), now + 0.005)
        fast = compact.update_compact(step, [sampled.get(r.request_id) if s else None
                                             for r, s in zip(step.reqs, step.samples)], now + 0.005)
        # Plain tokens lose only their message: together with the outputs they are exactly `update`'s outputs.
        plain_ids = {r.request_id for r in fast.plain}
        assert [o for o in out.outputs if o.request_id not in plain_ids] == list(fast.outputs)
        assert all(o.new_token_ids and o.finish_reason is None for o in out.outputs if o.request_id in plain_ids)
        assert len(plain_ids) + len(fast.outputs) == len(out.outputs)
        assert fast.handoffs == out.handoffs and fast.kv_events == out.kv_events
        assert plain.load("i", "m", 1.0, 0.01) == compact.load("i", "m", 1.0, 0.01)
        assert plain.kv.free_block_ids() == compact.kv.free_block_ids()
        if not plain.has_work and not specs:
            break
    assert not plain.has_work and not compact.has_work
    assert num_preempted > 0


# ---- the router's lazy prompt hashing -----------------------------------------------------------------------

def test_prompt_overlap_blocks_equals_overlap_of_every_prompt_hash():
    from octoserve.services.core.kv_cache import PrefixIndex, prefix_block_hashes
    from octoserve.services.core.types import BlockRemoved, BlockStored

    rng = random.Random(5)
    index = PrefixIndex()
    # up to 20 blocks of 4: past the 4 + 8 blocks that prompt_overlap_blocks packs first
    prompts = [[rng.randint(0, 3) for _ in range(rng.randint(0, 80))] for _ in range(60)]
    for round_no in range(40):
        # Instances cache random prefixes of random prompts, and drop random blocks (holes in a chain).
        for _ in range(5):
            iid = f"i{rng.randint(0, 4)}"
            hashes = prefix_block_hashes(rng.choice(prompts), 4, "m")
            if hashes:
                index.apply(iid, BlockStored(tuple(hashes[: rng.randint(1, len(hashes))]), None))
                if rng.random() < 0.3:
                    index.apply(iid, BlockRemoved((rng.choice(hashes),)))
        for prompt in prompts:
            expected = index.overlap_blocks(prefix_block_hashes(prompt, 4, "m"))
            assert index.prompt_overlap_blocks(prompt, 4, "m") == expected
            assert index.prompt_overlap_blocks(prompt, 4, "other") == index.overlap_blocks(
                prefix_block_hashes(prompt, 4, "other"))
    assert any(index.prompt_overlap_blocks(p, 4, "m") for p in prompts)


def test_lazy_prompt_hashing_routes_as_hashing_every_block():
    # A router given a hasher of its own hashes every block of every prompt (the code before the lazy path).
    from octoserve.services.core.kv_cache import prefix_block_hashes
    from octoserve.services.core.routing import RouterPolicy

    config = node_config_from_text(default_config_text())
    trace = short_trace("seed-000", 3.0, 150.0)
    lazy = NodeSimulator(config, seed=3)
    assert lazy.router._lazy_overlap is not None
    sim = NodeSimulator(config, seed=3)
    sim.router = RouterPolicy(config, {iid: inst.cost for iid, inst in sim.instances.items()}, random.Random(3),
                              block_hasher=lambda *args: prefix_block_hashes(*args))
    assert sim.router._lazy_overlap is None
    a, b = lazy.run(trace, drain_s=30.0), sim.run(trace, drain_s=30.0)
    assert_identical(a, b)
    assert sum(r.num_cached_prompt_tokens for r in a.records) > 0


def test_the_cycle_collector_is_paused_inside_and_left_as_it_was_after():
    import gc

    from octoserve.services.sim.driver import cycle_collector_paused

    assert gc.isenabled()
    with cycle_collector_paused():
        assert not gc.isenabled()
        with cycle_collector_paused():  # nested: the outer pause stays
            assert not gc.isenabled()
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(ValueError), cycle_collector_paused():
        raise ValueError("an error inside still restores it")
    assert gc.isenabled()
    gc.disable()
    try:
        with cycle_collector_paused():
            pass
        assert not gc.isenabled()  # it was off before: it stays off
    finally:
        gc.enable()


def test_the_simulate_command_runs_with_the_cycle_collector_paused_and_turns_it_back_on(capsys, monkeypatch):
    import gc

    from octoserve.services.cli import main
    from octoserve.services.sim import cli_simulate

    seen = []

    def observed_run(*args, **kwargs):
        seen.append(gc.isenabled())
        return run_simulation(*args, **kwargs)

    monkeypatch.setattr(cli_simulate, "run_simulation", observed_run)
    assert main(["simulate", "--profile", "seed-000", "--duration", "1s"]) == 0
    assert "simulator speed" in capsys.readouterr().out
    assert seen == [False] and gc.isenabled()


def test_simulate_as_the_whole_process_ends_itself_with_its_output_and_files_complete(tmp_path):
    # Run as the process's own command (no argv given to `main`), `simulate` leaves through `exit_process`
    # (no freeing of the run, no atexit handlers): stdout piped, the report must still be whole, the JSON
    # written, and the same as the in-process command's; the exit code stays 0.
    import json
    import subprocess
    import sys

    from octoserve.services.cli import main

    args = ["simulate", "--profile", "seed-000", "--duration", "2s"]
    code = ("import atexit, sys; atexit.register(lambda: print('atexit ran', file=sys.stderr)); "
            "from octoserve.services.cli import main; sys.exit(main())")
    done = subprocess.run([sys.executable, "-c", code, *args, "--json", str(tmp_path / "a.json")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "atexit ran" not in done.stderr  # it did end through os._exit
    out = done.stdout.splitlines()
    assert out[-1].startswith("simulator speed:") and any(line.startswith("instance ") for line in out)
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main([*args, "--json", str(tmp_path / "b.json")]) == 0
    strip = lambda text: [line for line in text.splitlines() if not line.startswith("simulator speed:")]  # noqa: E731
    assert strip(done.stdout) == strip(buf.getvalue())
    a, b = (json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")
    del a["wall_s"], b["wall_s"]
    assert a == b
