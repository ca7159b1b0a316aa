"""Users' own workloads (--workload YAML, --trace JSONL) and the served-model check, through the real command."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from octoserve.services.core.types import Priority
from octoserve.services.loadgen import build_trace, served_models
from octoserve.services.usage import UsageError
from octoserve.services.workload import PROFILES, generate_trace
from octoserve.services.workload_io import (
    dump_workload,
    load_trace,
    load_workload,
    profile_of_trace,
    workload_from_dict,
)

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"
TP8_ONLY = REPO / "docs" / "bench" / "node-70b-tp8-only.yaml"


def octoserve(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "octoserve.services.cli", *argv], capture_output=True, text=True,
                          timeout=300, cwd=REPO)


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_seed_profiles_round_trip_through_yaml(tmp_path, name):
    path = tmp_path / f"{name}.yaml"
    path.write_text(dump_workload(PROFILES[name]))
    loaded = load_workload(path)
    assert loaded == PROFILES[name]
    assert generate_trace(loaded, 3, duration_s=2.0) == generate_trace(PROFILES[name], 3, duration_s=2.0)


def test_example_workload_loads_with_every_field():
    p = load_workload(EXAMPLES / "workload-chat.yaml")
    assert (p.name, p.rate_rps, p.arrival, p.burstiness, p.max_tokens_factor) == (
        "chat-and-summaries", 40, "gamma", 0.5, 2.0)
    sm, lm = p.traffic
    assert (sm.model, sm.prefix_hit_rate, sm.num_prefix_groups, [t.priority for t in sm.tiers]) == (
        "llama-3-8b", 0.7, 2, [Priority.INTERACTIVE, Priority.STANDARD])
    assert (lm.output_len.kind, lm.output_len.value, lm.tiers[0].ttft_slo_ms) == ("fixed", 200, 10000)


@pytest.mark.parametrize(("data", "fragment"), [
    ({"rate_rps": 1, "duration_s": 1, "traffic": [], "rat": 1}, "unknown key(s) 'rat'"),
    ({"rate_rps": 1, "duration_s": 1}, "missing key 'traffic'"),
    ({"rate_rps": 1, "duration_s": 1, "traffic": [{"model": "m", "share": 1, "prompt_len": {"kind": "zipf"},
                                                   "output_len": {"kind": "fixed", "value": 1}}]},
     "traffic[0].prompt_len: LengthDist kind must be one of"),
    ({"rate_rps": 1, "duration_s": 1, "traffic": [{"model": "m", "share": 1,
                                                   "prompt_len": {"kind": "fixed", "value": 9},
                                                   "output_len": {"kind": "fixed", "value": 1},
                                                   "tiers": [{"tier": "URGENT", "share": 1}]}]},
     "traffic[0].tiers[0]: 'URGENT' is not a tier; use one of INTERACTIVE, STANDARD, BATCH"),
    ({"rate_rps": -1, "duration_s": 1, "traffic": [{"model": "m", "share": 1,
                                                    "prompt_len": {"kind": "fixed", "value": 9},
                                                    "output_len": {"kind": "fixed", "value": 1}}]},
     "rate_rps and duration_s must be > 0"),
])
def test_workload_errors_name_the_place(data, fragment):
    with pytest.raises(UsageError) as info:
        workload_from_dict(data, "w.yaml")
    assert str(info.value).startswith("w.yaml")
    assert fragment in str(info.value)


def test_example_trace_loads_every_prompt_form():
    trace = load_trace(EXAMPLES / "trace.jsonl")
    assert [r.arrival_s for r in trace] == [0.0, 0.05, 0.12, 0.2, 0.31, 0.45]
    text = "Summarise the meeting notes below in three bullet points."
    first = trace[0]
    assert (first.prompt_text, first.prompt_token_ids, first.output_len, first.max_tokens, first.priority,
            first.ttft_slo_ms) == (text, tuple(text.encode()), 60, 128, Priority.INTERACTIVE, 200.0)
    assert len(trace[1].prompt_token_ids) == 900 and all(1000 <= t < 30000 for t in trace[1].prompt_token_ids)
    assert (trace[1].priority, trace[1].ttft_slo_ms) == (Priority.STANDARD, 250.0)
    assert (trace[2].priority, trace[2].ttft_slo_ms, trace[2].max_tokens) == (Priority.BATCH, 10000.0, 300)
    assert (trace[3].prompt_token_ids[:2], trace[3].output_len, trace[3].max_tokens) == ((1201, 3301), 32, 32)
    assert load_trace(EXAMPLES / "trace.jsonl") == trace  # prompt_len ids are the same on every load


@pytest.mark.parametrize(("line", "fragment"), [
    ('{"arrival_s": 0, "model": "m", "output_len": 4}', "give exactly one of prompt (text), prompt_token_ids"),
    ('{"arrival_s": 0, "model": "m", "prompt_len": 4}', "give output_len (tokens generated) or max_tokens"),
    ('{"arrival_s": -1, "model": "m", "prompt_len": 4, "max_tokens": 4}', "arrival_s must be a number"),
    ('{"arrival_s": 0, "model": "m", "prompt_len": 4, "max_tokens": 4, "tier": "URGENT"}', "'URGENT' is not a tier"),
    ('{"arrival_s": 0, "model": "m", "prompt_len": 4, "max_tokens": 4, "maxtokens": 4}', "unknown key(s) 'maxtokens'"),
    ('{"arrival_s": 0, "model": "m", "prompt_len": 4, "output_len": 9, "max_tokens": 4}',
     "output_len 9 exceeds max_tokens 4"),
    ('{"arrival_s": 0, "model": "m", "prompt_token_ids": [1, -2], "max_tokens": 4}', "prompt_token_ids must be"),
    ("{arrival_s: 0}", "not valid JSON"),
])
def test_trace_errors_name_the_line(tmp_path, line, fragment):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival_s": 0, "model": "m", "prompt": "ok", "max_tokens": 2}\n\n' + line + "\n")
    with pytest.raises(UsageError) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert fragment in str(info.value)


def test_profile_fitted_to_a_trace_keeps_shares_and_tiers():
    trace = load_trace(EXAMPLES / "trace.jsonl")
    p = profile_of_trace(trace, "t")
    assert [(t.model, round(t.share, 3)) for t in p.traffic] == [("llama-3-70b", 0.333), ("llama-3-8b", 0.667)]
    assert p.rate_rps == pytest.approx(6 / 0.45)
    assert [(x.priority.name, x.share, x.ttft_slo_ms) for x in p.traffic[1].tiers] == [
        ("INTERACTIVE", 0.5, 200.0), ("STANDARD", 0.5, 250.0)]
    assert (p.traffic[0].prompt_len.min_tokens, p.traffic[0].prompt_len.max_tokens) == (700, 2500)


def test_simulate_replays_the_trace_and_the_workload():
    done = octoserve("simulate", "--trace", "examples/trace.jsonl", "--warmup", "0s")
    assert done.returncode == 0, done.stderr
    assert "simulating 6 requests of trace" in done.stderr
    all_row = next(line for line in done.stdout.splitlines() if line.startswith("all "))
    assert all_row.split()[1] == "6"  # every request of the trace offered (warm-up 0)
    done = octoserve("simulate", "--workload", "examples/workload-chat.yaml", "--duration", "3s", "--warmup", "0s")
    assert done.returncode == 0, done.stderr
    assert "of chat-and-summaries at 40 req/s for 3 s" in done.stderr


@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_unserved_model_is_an_error_before_the_run(command):
    done = octoserve(command, "--config", str(TP8_ONLY), "--duration", "5", "--top", "0"
                     ) if command == "plan" else octoserve(command, "--config", str(TP8_ONLY), "--duration", "5s")
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and done.stdout == ""
    assert done.stderr == (
        f"octoserve {command}: error: workload seed-000 asks for llama-3-8b, which the node does not serve (it "
        "serves llama-3-70b); serve them in the config, give a workload with only served models (--workload / "
        "--trace), or pass --only-served to drop their requests\n")


def test_only_served_drops_the_requests_and_says_so():
    done = octoserve("simulate", "--config", str(TP8_ONLY), "--duration", "5s", "--rate", "8", "--only-served")
    assert done.returncode == 0, done.stderr
    assert "--only-served: dropping the requests for llama-3-8b (not served)" in done.stderr
    assert "llama-3-8b" not in done.stdout
    assert "at 2 req/s" in done.stderr  # the 70B keeps its own 25 % of 8 req/s


def test_plan_works_for_a_single_model_config(tmp_path):
    workload = tmp_path / "only-70b.yaml"
    workload.write_text(yaml.safe_dump({"rate_rps": 4, "duration_s": 10, "traffic": [
        {"model": "llama-3-70b", "share": 1, "prompt_len": {"kind": "lognormal", "mean": 1000, "sigma": 0.8},
         "output_len": {"kind": "fixed", "value": 300}}]}))
    done = octoserve("plan", "--config", str(TP8_ONLY), "--workload", str(workload), "--top", "0")
    assert done.returncode == 0, done.stderr
    assert "recommend llama-3-70b" in done.stdout
    assert "llama-3-8b" not in done.stdout


def test_bench_suite_takes_a_trace():
    done = octoserve("bench-suite", "--trace", "examples/trace.jsonl", "--cost-profiles", "default",
                     "--policies", "vllm-default,octoserve")
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| default |")]
    assert [r.split("|")[2].strip() for r in rows] == ["vllm-default", "octoserve"]


def test_bench_checks_the_targets_models_before_the_run():
    args = argparse.Namespace(profile="seed-000", workload=None, trace=None, only_served=False, rate=20.0,
                              duration=2.0, burstiness=None, seed=0, max_requests=None)
    with pytest.raises(UsageError, match="asks for llama-3-8b, which the node does not serve"):
        build_trace(args, ["llama-3-70b"])
    trace, profile = build_trace(argparse.Namespace(**{**vars(args), "only_served": True}), ["llama-3-70b"])
    assert {r.model for r in trace} == {"llama-3-70b"} and [t.model for t in profile.traffic] == ["llama-3-70b"]


def test_bench_without_a_router_is_a_usage_error():
    with pytest.raises(UsageError, match=r"--target 127.0.0.1:1: no router answered ListModels"):
        served_models("127.0.0.1:1", timeout_s=2.0)


def test_trace_written_by_trace_to_jsonl_loads_back(tmp_path):
    from octoserve.services.workload import trace_to_jsonl

    trace = generate_trace(PROFILES["seed-003"], 1, duration_s=0.05)
    trace_to_jsonl(trace, tmp_path / "t.jsonl")
    assert load_trace(tmp_path / "t.jsonl") == trace
    assert json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])["priority"] in ("INTERACTIVE", "BATCH")


def test_plan_fits_a_trace_and_sizes_it_at_the_rate_asked_for():
    done = octoserve("plan", "--trace", "examples/trace.jsonl", "--rate", "50", "--top", "0")
    assert done.returncode == 0, done.stderr
    rates = {line.split()[0]: line.split()[1] for line in done.stdout.splitlines() if " req/s x " in line}
    assert rates == {"llama-3-70b": "16.7", "llama-3-8b": "33.3"}  # the trace's 2:4 split of 50 req/s
    assert "ignored" not in done.stderr
