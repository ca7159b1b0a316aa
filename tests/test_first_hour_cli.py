"""The `octoserve` command in a new user's first hour, run as a subprocess from a directory outside the checkout:
what it prints and its exit status for the inputs the first-hour issue reported."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

EIGHT_B_ONLY = """\
name: eight-only
rate_rps: 20
duration_s: 10
traffic:
  - model: llama-3-8b
    share: 1.0
    prompt_len: {kind: fixed, value: 500}
    output_len: {kind: fixed, value: 100}
"""

TWO_8B_REQUESTS = (
    '{"arrival_s": 0.0, "model": "llama-3-8b", "prompt_len": 500, "output_len": 100}\n'
    '{"arrival_s": 1.0, "model": "llama-3-8b", "prompt_len": 700, "output_len": 50}\n'
)


# The sources, not the compiled simulator modules: an extension older than its edited source adds a warning to
# stderr, and these tests compare stderr whole.
ENV = {**os.environ, "OCTOSERVE_PURE_PYTHON": "1"}


def octoserve(*argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "octoserve.services.cli", *argv], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=ENV)


def assert_bad_input(done: subprocess.CompletedProcess, command: str, message: str) -> None:
    """One line on stderr, `octoserve COMMAND: error: MESSAGE`, and exit status 2."""
    assert (done.returncode, done.stderr) == (2, f"octoserve {command}: error: {message}\n")


def sizing_models(stdout: str) -> set[str]:
    """The models of the sizing table (the lines between its header and the first blank line)."""
    lines = stdout.split("\n\n")[0].splitlines()[2:]
    return {line.split()[0] for line in lines}


# --- 1. plan for a workload that uses only some of the served models ---------------------------------------------


def test_plan_sizes_only_the_models_an_8b_only_workload_uses(tmp_path):
    (tmp_path / "my.yaml").write_text(EIGHT_B_ONLY)
    done = octoserve("plan", "--workload", "my.yaml", "--top", "0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr
    assert sizing_models(done.stdout) == {"llama-3-8b"}
    assert "verdict: 20 req/s fits the compute bound" in done.stdout
    assert "\nrecommend " in done.stdout


def test_plan_of_a_one_model_trace_sizes_that_model(tmp_path):
    (tmp_path / "one.jsonl").write_text(TWO_8B_REQUESTS)
    done = octoserve("plan", "--trace", "one.jsonl", "--top", "0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sizing_models(done.stdout) == {"llama-3-8b"}


def test_plan_only_served_sizes_the_models_left(tmp_path):
    other = EIGHT_B_ONLY.replace("share: 1.0", "share: 0.5") + EIGHT_B_ONLY.split("traffic:\n")[1].replace(
        "llama-3-8b", "mistral-7b").replace("share: 1.0", "share: 0.5")
    (tmp_path / "mixed.yaml").write_text(other)
    done = octoserve("plan", "--workload", "mixed.yaml", "--only-served", "--top", "0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "--only-served: dropping the requests for mistral-7b (not served)" in done.stderr
    assert sizing_models(done.stdout) == {"llama-3-8b"}


# --- 11. bad values: one line naming the flag, exit 2, before any work --------------------------------------------

BAD_VALUES = {
    "simulate --rate 0": (["simulate", "--rate", "0"],
                          "--rate 0: the arrival rate (req/s) must be > 0, e.g. --rate 50"),
    "simulate --duration 0": (["simulate", "--duration", "0"],
                              "--duration 0: the arrival window must be > 0, e.g. --duration 30s"),
    "plan --rate 0": (["plan", "--rate", "0", "--top", "0"],
                      "--rate 0: the arrival rate (req/s) must be > 0, e.g. --rate 50"),
    "simulate --burstiness -1": (["simulate", "--burstiness", "-1"],
                                 "--burstiness -1: the gamma shape of the inter-arrivals (1 is Poisson, < 1 burstier) "
                                 "must be > 0, e.g. --burstiness 0.5"),
    "simulate --warmup 100s --duration 5s": (
        ["simulate", "--warmup", "100s", "--duration", "5s"],
        "--warmup 100 s leaves nothing to measure in the 5 s arrival window: give a shorter --warmup or a longer "
        "--duration"),
    "plan --warmup 30": (["plan", "--warmup", "30", "--top", "1"],
                         "--warmup 30 s leaves nothing to measure in the 30 s arrival window: give a shorter "
                         "--warmup or a longer --duration"),
    "simulate --fault xx-9@1+1": (["simulate", "--fault", "xx-9@1+1"],
                                  "--fault 'xx-9@1+1': the node has no instance 'xx-9'; name one of lm-0, sm-0, sm-1, "
                                  "sm-2, sm-3"),
    "simulate --fault nope": (["simulate", "--fault", "nope"],
                              "--fault 'nope': write INSTANCE@T or INSTANCE@T+DOWN, as sm-0@30+5"),
    "up --time-scale 0": (["up", "--time-scale", "0"],
                          "--time-scale 0: the time scale (wall seconds per modelled second) must be > 0, e.g. "
                          "--time-scale 10"),
    "demo --time-scale 0": (["demo", "--time-scale", "0"],
                            "--time-scale 0: the time scale (wall seconds per modelled second) must be > 0, e.g. "
                            "--time-scale 15"),
    # checked before the target is asked for its models: nothing listens on port 1
    "bench --rate 0": (["bench", "--target", "127.0.0.1:1", "--rate", "0"],
                       "--rate 0: the arrival rate (req/s) must be > 0, e.g. --rate 50"),
}


@pytest.mark.parametrize("case", sorted(BAD_VALUES))
def test_a_bad_flag_value_is_one_line_and_exit_2_before_any_work(tmp_path, case):
    argv, message = BAD_VALUES[case]
    done = octoserve(*argv, cwd=tmp_path)
    assert_bad_input(done, argv[0], message)  # the whole stderr: no "simulating ..." line, no progress bar
    assert done.stdout == ""
    assert list(tmp_path.iterdir()) == []  # `up` made no run directory here, `simulate` wrote nothing


def test_plan_top_0_simulates_nothing_so_its_default_warmup_need_not_fit(tmp_path):
    (tmp_path / "my.yaml").write_text(EIGHT_B_ONLY)
    done = octoserve("plan", "--workload", "my.yaml", "--duration", "5", "--top", "0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr


def test_a_non_integer_prefix_group_in_a_trace_names_the_line(tmp_path):
    (tmp_path / "t.jsonl").write_text(TWO_8B_REQUESTS.replace('"output_len": 50}', '"output_len": 50, '
                                                              '"prefix_group": "a"}'))
    done = octoserve("simulate", "--trace", "t.jsonl", cwd=tmp_path)
    assert_bad_input(done, "simulate", "t.jsonl:2: prefix_group must be an integer (a group id >= 0 that requests "
                                       "with the same prompt prefix share, or -1 for none), got 'a'")


def test_a_trace_that_is_not_utf8_names_the_line_and_byte(tmp_path):
    line = TWO_8B_REQUESTS.splitlines()[1].replace('"prompt_len": 700', '"prompt": "caf\xe9"')
    (tmp_path / "t.jsonl").write_bytes((TWO_8B_REQUESTS.splitlines()[0] + "\n" + line + "\n").encode("latin-1"))
    offset = len(TWO_8B_REQUESTS.splitlines()[0]) + 1 + line.index("\xe9")
    done = octoserve("simulate", "--trace", "t.jsonl", cwd=tmp_path)
    assert_bad_input(done, "simulate", f"t.jsonl:2: not UTF-8 text (byte 0xe9 at offset {offset}); save the file as "
                                       "UTF-8")


def test_a_workload_that_is_not_utf8_is_bad_input(tmp_path):
    (tmp_path / "w.yaml").write_bytes(EIGHT_B_ONLY.replace("eight-only", "caf\xe9").encode("latin-1"))
    done = octoserve("plan", "--workload", "w.yaml", "--top", "0", cwd=tmp_path)
    assert_bad_input(done, "plan", "w.yaml:1: not UTF-8 text (byte 0xe9 at offset 9); save the file as UTF-8")


@pytest.fixture
def scheduler_run_dir(tmp_path):
    """A run directory with a live scheduler (the embedded placement; no workers needed to refuse a change)."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ready = run_dir / "scheduler.ready.json"
    proc = subprocess.Popen([sys.executable, "-m", "octoserve.services.scheduler", "--port", "0", "--metrics-port",
                             "0", "--ready-file", str(ready)], cwd=tmp_path, env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the scheduler did not start"
            time.sleep(0.1)
        yield run_dir
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_reconfigure_an_unknown_instance_is_bad_input(scheduler_run_dir):
    cwd = scheduler_run_dir.parent
    done = octoserve("reconfigure", "--run-dir", "run", "--role", "nope=decode", cwd=cwd)
    assert_bad_input(done, "reconfigure", "--role 'nope=decode': no instance 'nope'; choose one of lm-0, sm-0, sm-1, "
                                          "sm-2, sm-3")
    done = octoserve("reconfigure", "--run-dir", "run", "--role", "sm-0=boss", cwd=cwd)
    assert_bad_input(done, "reconfigure", "--role 'sm-0=boss': give ID=ROLE with ROLE one of colocated, prefill, "
                                          "decode, e.g. d1=prefill")


# --- 12. one duration parser for every duration flag ----------------------------------------------------------------


def test_a_duration_is_plain_seconds_or_a_number_with_s_ms_or_m():
    from octoserve.services.flags import parse_duration_s

    assert [parse_duration_s(t) for t in ("10", "10s", "500ms", "2m", "1.5m", " 0.25S ")] == [
        10.0, 10.0, 0.5, 120.0, 90.0, 0.25]
    for bad in ("10x", "ms", "", "inf", "nan", "10 h"):
        with pytest.raises(argparse.ArgumentTypeError) as info:
            parse_duration_s(bad)
        assert str(info.value) == f"duration {bad!r}: use seconds like 90, 90s, 500ms or 2m"


# command -> its duration flags; simulate, plan and bench-suite have theirs in services/sim/cli_simulate.py,
# services/sim/cli_plan.py and services/lab/bench_command.py, which do not use the shared parser yet
DURATION_FLAGS = {
    "demo": ("--duration",),
    "bench": ("--duration", "--warmup", "--drain-timeout", "--request-timeout"),
    "up": ("--grace-s", "--startup-timeout-s"),
    "reconfigure": ("--drain-timeout-s",),
    "health": ("--timeout",),
    "simulate": ("--duration", "--warmup"),
    "plan": ("--duration", "--warmup"),
    "bench-suite": ("--duration", "--warmup", "--drain", "--seed003-duration", "--seed003-warmup"),
}


def duration_flag_cases():
    for command, flags in DURATION_FLAGS.items():
        yield from (pytest.param(command, flag, id=f"{command} {flag}") for flag in flags)


@pytest.mark.parametrize(("command", "flag"), list(duration_flag_cases()))
def test_every_duration_flag_reads_durations_alike(command, flag):
    from octoserve.services.cli import SUBCOMMANDS
    from octoserve.services.flags import parse_duration_s

    parser = argparse.ArgumentParser()
    importlib.import_module(SUBCOMMANDS[command][0]).add_arguments(parser)
    action = next(a for a in parser._actions if flag in a.option_strings)
    assert action.type is parse_duration_s  # so `FLAG 500ms` is half a second here as everywhere


def test_bench_takes_10s_for_duration_as_for_warmup(tmp_path):
    # the arguments are read, then the target (nothing listens on port 1) is asked for its models
    done = octoserve("bench", "--target", "127.0.0.1:1", "--duration", "10s", "--warmup", "500ms", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.startswith("octoserve bench: error: --target 127.0.0.1:1: no router answered ListModels")


def test_a_bad_duration_names_the_flag(tmp_path):
    done = octoserve("demo", "--duration", "10x", cwd=tmp_path)
    assert done.returncode == 2
    assert done.stderr.endswith("octoserve demo: error: argument --duration: duration '10x': use seconds like 90, "
                                "90s, 500ms or 2m\n")


# --- 14. a trace whose requests all arrive at once has no rate --------------------------------------------------------

SIMULTANEOUS = TWO_8B_REQUESTS.replace('"arrival_s": 1.0', '"arrival_s": 0.0')


def test_plan_of_a_trace_arriving_all_at_0_asks_for_the_rate(tmp_path):
    (tmp_path / "t.jsonl").write_text(SIMULTANEOUS)
    done = octoserve("plan", "--trace", "t.jsonl", "--top", "0", cwd=tmp_path)
    assert_bad_input(done, "plan", "--trace t.jsonl: every request arrives at 0 s, so the trace has no arrival rate "
                                   "to plan for; give one with --rate R (req/s)")
    assert done.stdout == ""


def test_plan_of_a_trace_arriving_all_at_0_plans_for_the_rate_given(tmp_path):
    (tmp_path / "t.jsonl").write_text(SIMULTANEOUS)
    done = octoserve("plan", "--trace", "t.jsonl", "--rate", "5", "--top", "0", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "  verdict: 5 req/s fits the compute bound of " in done.stdout


# --- 21. k8s and compose use the embedded config, from any directory --------------------------------------------------


def test_k8s_writes_and_checks_manifests_of_the_embedded_config_from_any_directory(tmp_path):
    done = octoserve("k8s", "--check", cwd=tmp_path)
    assert done.returncode == 1
    assert done.stderr == "".join(
        f"deploy/k8s/default/{name}: missing; write it with `octoserve k8s --out deploy/k8s/default` and the same "
        "--config and --nodes\n" for name in ("octoserve.yaml", "podmonitor.yaml", "inference-pool.yaml"))
    done = octoserve("k8s", "--out", "k", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (0, "")
    assert sorted(p.name for p in (tmp_path / "k").iterdir()) == [
        "inference-pool.yaml", "octoserve.yaml", "podmonitor.yaml"]
    assert (tmp_path / "k" / "octoserve.yaml").read_text().startswith(
        "# Generated by `octoserve k8s --config services/configs/node-default.yaml --nodes 2`")
    done = octoserve("k8s", "--check", "--out", "k", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (0, "k: up to date\n")


def test_compose_writes_and_checks_the_file_of_the_embedded_config_from_any_directory(tmp_path):
    done = octoserve("compose", "--check", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (
        1, "docker-compose.yml: missing; write it with `octoserve compose --out docker-compose.yml`\n")
    done = octoserve("compose", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (0, "")
    done = octoserve("compose", "--check", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (0, "docker-compose.yml: up to date\n")


# --- 22. certs does not replace a CA unless asked -----------------------------------------------------------------------


def test_certs_refuses_to_replace_a_ca_without_force(tmp_path):
    done = octoserve("certs", "tls", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    ca = (tmp_path / "tls" / "ca.pem").read_bytes()
    done = octoserve("certs", "tls", cwd=tmp_path)
    assert_bad_input(done, "certs", "tls/ca.pem exists: a new CA would invalidate the certificates it signed (a "
                                    "running node's too); pass --force to replace it")
    assert done.stdout == ""
    assert (tmp_path / "tls" / "ca.pem").read_bytes() == ca
    done = octoserve("certs", "tls", "--force", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "tls" / "ca.pem").read_bytes() != ca


# --- 3. elastic-day writes plots only where asked ---------------------------------------------------------------------

def test_elastic_day_writes_no_plots_unless_asked(tmp_path):
    done = octoserve("elastic-day", "--cost-profile", "default", "--hours", "1", "--hour-s", "2", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert list(tmp_path.iterdir()) == []


def test_elastic_day_help_shows_the_plot_defaults(tmp_path):
    for flag in ("--plots", "--ranker-plots"):
        assert "(default: none)" in flag_help("elastic-day", flag, tmp_path)  # flag_help: below, with item 24


@pytest.mark.parametrize(("script", "flag"), [("elastic_day.py", "--plots"), ("elastic_forward.py", "--ranker-plots")])
def test_the_scripts_that_regenerate_docs_name_docs_bench_themselves(script, flag):
    text = (Path(__file__).parent.parent / "scripts" / script).read_text()
    assert f'"{flag}", "docs/bench"' in text  # not elastic-day's default, which writes no plots


# --- 24. help text: every flag says what it does and its default -------------------------------------------------------


def flag_help(command: str, flag: str, cwd) -> str:
    """The help of `flag` in `octoserve COMMAND --help`, on one line, without the flag and its metavar."""
    done = octoserve(command, "--help", cwd=cwd)
    assert done.returncode == 0, done.stderr
    entries = re.split(r"\n(?=  -)", done.stdout.split("\noptions:\n")[1])  # each starts "  --flag"
    words = next(e for e in entries if e.split()[0] == flag).split()[1:]
    if words and (words[0].isupper() or words[0].startswith("{")):  # the metavar: TIME_SCALE, {hint,max-tokens}
        words = words[1:]
    return " ".join(words)


HELP = {
    ("up", "--port"): "router port on 127.0.0.1 (default 50051)",
    ("up", "--time-scale"): "dilate modelled time by K (sim engine; default 1: real time)",
    ("up", "--grace-s"): "how long each service drains its in-flight streams after SIGTERM (default 10 s)",
    ("bench", "--channels"): "gRPC channels, each its own HTTP/2 connection, the requests are spread over (default 1)",
    ("bench", "--output-len-mode"): "hint (default): max_tokens as the trace says, the true output length passed as a "
                                    "hint a sim engine stops at; max-tokens: max_tokens = the true length with "
                                    "ignore_eos, for a real engine (as `vllm bench serve`)",
    ("bench", "--seed"): "trace seed (default 0); `simulate --seed` with the same seed runs the same requests",
}


@pytest.mark.parametrize(("command", "flag"), sorted(HELP))
def test_help_says_what_a_flag_does_and_its_default(tmp_path, command, flag):
    assert flag_help(command, flag, tmp_path) == HELP[(command, flag)]
