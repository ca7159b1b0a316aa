"""The `octoserve` command in a new user's first hour, run as a subprocess from a directory outside the checkout:
what it prints and its exit status for the inputs the first-hour issue reported."""

from __future__ import annotations

import subprocess
import sys

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


def octoserve(*argv: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "octoserve.services.cli", *argv], capture_output=True, text=True,
                          timeout=300, cwd=cwd)


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
