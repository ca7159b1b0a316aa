"""The `octoserve` command as a new user meets it: bad input prints one message (no traceback) and exits 2."""

from __future__ import annotations

import subprocess
import sys

import pytest

SINGLE_8B = """\
gpu: h100-sxm-80gb
num_gpus: 8
models: {llama-3-8b: llama-3-8b}
instances:
  - {id: a, model: llama-3-8b, role: colocated, tp: 1, gpu_ids: [0]}
  - {id: b, model: llama-3-8b, role: colocated, tp: 1, gpu_ids: [0]}
"""


def octoserve(*argv: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "octoserve.services.cli", *argv], capture_output=True, text=True,
                          timeout=120, cwd=cwd)


CASES = {
    "invalid YAML": ("models: [1,\n", ["bad.yaml is not valid YAML", 'in "bad.yaml", line 2']),
    "typo'd key": ("plicies: {}\n" + SINGLE_8B, ["unknown key 'plicies'", "known keys:"]),
    "shared GPU": (SINGLE_8B, ["GPU 0"]),
    "TP too small": (SINGLE_8B.replace("llama-3-8b", "llama-3-70b"), ["llama-3-70b"]),
    "unknown preset": ("gpu: h999\n" + SINGLE_8B.replace("gpu: h100-sxm-80gb\n", ""),
                       ["unknown preset 'h999'", "h100-sxm-80gb"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("command", ["simulate", "plan"])
def test_config_errors_print_the_message_alone_and_exit_2(tmp_path, case, command):
    text, expected = CASES[case]
    (tmp_path / "bad.yaml").write_text(text)
    done = octoserve(command, "--config", "bad.yaml", "--duration", "1", cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith(f"octoserve {command}: error: invalid node config:")
    for fragment in expected:
        assert fragment in done.stderr
    assert "<unicode string>" not in done.stderr


def test_missing_config_file_names_it(tmp_path):
    done = octoserve("simulate", "--config", "nowhere.yaml", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (2, "octoserve simulate: error: nowhere.yaml: no such file\n")


def test_debug_adds_the_traceback_after_or_before_the_subcommand(tmp_path):
    (tmp_path / "bad.yaml").write_text("models: [1,\n")
    for argv in (["--debug", "simulate", "--config", "bad.yaml"], ["simulate", "--config", "bad.yaml", "--debug"]):
        done = octoserve(*argv, cwd=tmp_path)
        assert done.returncode == 2
        assert done.stderr.startswith("Traceback (most recent call last):")
        assert "octoserve simulate: error: invalid node config:" in done.stderr


def test_bad_set_override_is_bad_input(tmp_path):
    done = octoserve("simulate", "--set", "ttft_slack=1", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (
        2, "octoserve simulate: error: --set 'ttft_slack=1': use policies.KEY=VALUE or slo.KEY=VALUE\n")


def test_a_config_shipped_with_octoserve_is_found_by_name_outside_a_checkout(tmp_path):
    """tmp_path holds no `services/configs`: the docs' commands resolve to the configs installed with the package."""
    for given in ("node-gang", "node-gang.yaml", "services/configs/node-gang.yaml"):
        done = octoserve("simulate", "--config", given, "--duration", "2s", "--warmup", "0", cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        assert "gang lm-0" in done.stdout  # the gang config's own report line
    done = octoserve("simulate", "--config", "elsewhere/node-gang.yaml", cwd=tmp_path)
    assert (done.returncode, done.stderr) == (2, "octoserve simulate: error: elsewhere/node-gang.yaml: no such file\n")
    workload = ("simulate", "--config", "node-seed003", "--workload", "workload-seed003", "--rate", "20",
                "--duration", "2s", "--warmup", "0")
    done = octoserve(*workload, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "dense-180b" in done.stdout
