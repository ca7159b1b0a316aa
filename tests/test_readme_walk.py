"""A new user's first hour, scripted: the README's commands and examples run as subprocesses from a temporary
directory outside the checkout, against a node this test starts with `octoserve up` and stops by its PID.

What runs: `make run`'s command (`octoserve demo`, shortened), the simulator commands as the README's tour writes
them (with the examples folder beside them), `octoserve up` and `octoserve bench` against it, every SDK example of
the README and docs/CLIENTS.md (blocking, asyncio, an API key, a resumed stream), the curl command and the `openai`
example, with the node's address in place of the defaults. The SDK installed alone in a fresh virtual environment is
tests/test_packaging.py's part; the vLLM block is tests/test_vllm_node.py's.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.test_packaging import NODE_CONFIG, _client_examples

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()
OCTOSERVE = str(Path(sys.executable).parent / "octoserve")
ENV = {**os.environ, "OCTOSERVE_PURE_PYTHON": "1"}


def sh_blocks() -> list[str]:
    return re.findall(r"```sh\n(.*?)```", README, re.S)


def run(argv: list[str], cwd: Path, timeout_s: float = 240) -> subprocess.CompletedProcess:
    done = subprocess.run(argv, cwd=cwd, env=ENV, capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"{argv}: {done.stderr[-3000:]}"
    return done


def test_make_run_is_octoserve_demo_and_a_short_one_reports(tmp_path):
    assert "make run" in sh_blocks()[0]
    make_run = re.search(r"^run: .*\n\t(.*)$", (REPO / "Makefile").read_text(), re.M).group(1)
    assert make_run == "$(BIN)/octoserve demo --profile $(PROFILE)"
    out = run([OCTOSERVE, "demo", "--profile", "seed-000", "--duration", "1s", "--max-output", "16",
               "--time-scale", "10"], tmp_path).stdout
    assert out.count("\ngroup ") >= 2  # the live report and the simulator's, each with its column header


def test_the_tours_simulator_commands_run_as_written(tmp_path):
    shutil.copytree(REPO / "examples", tmp_path / "examples")
    (block,) = [b for b in sh_blocks() if "examples/workload-chat.yaml" in b]
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert [c[:2] for c in commands] == [["octoserve", "simulate"], ["octoserve", "simulate"], ["octoserve", "plan"]]
    for command in commands:
        out = run([OCTOSERVE, *command[1:]], tmp_path).stdout
        assert ("\ngroup " in out) if command[1] == "simulate" else out.startswith("Sizing")


def _start_up(tmp_path: Path) -> tuple[subprocess.Popen, str, str]:
    proc = subprocess.Popen([OCTOSERVE, "up", "--config", str(NODE_CONFIG), "--port", "0", "--http-port", "0",
                             "--time-scale", "1", "--run-dir", "run"], cwd=tmp_path, env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    while not any(line.startswith("logs ") for line in lines):  # bounded by up's own startup timeout
        line = proc.stdout.readline()
        if not line:
            proc.wait(30)
            raise AssertionError("octoserve up exited early:\n" + "".join(lines))
        lines.append(line)
    router = next(re.match(r"router\s+(\S+)", line).group(1) for line in lines if line.startswith("router "))
    http = next(re.match(r"http\s+(\S+)", line).group(1) for line in lines if line.startswith("http "))
    return proc, router, http


def _stop_up(proc: subprocess.Popen) -> str:
    """By its PID: SIGINT as Ctrl-C would; SIGKILL only if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate(timeout=30)
    return out


def test_up_bench_and_every_client_example_of_the_readme(tmp_path):
    assert tmp_path.resolve() != REPO.resolve()
    proc, router, http = _start_up(tmp_path)
    try:
        bench = run([OCTOSERVE, "bench", "--target", router, "--only-served", "--rate", "5", "--duration", "6s",
                     "--warmup", "0s", "--no-progress"], tmp_path).stdout
        assert "\ngroup " in bench and "llama-3-8b" in bench

        for i, example in enumerate(_client_examples(router)):
            script = tmp_path / f"example_{i}.py"
            script.write_text(example)
            out = run([sys.executable, script.name], tmp_path, timeout_s=120).stdout.splitlines()
            if "async with AsyncClient" in example:
                assert out[0] == "['llama-3-8b']" and out[1].startswith("FinishReason."), out
            elif "api_key=" in example:
                assert out[0] == "['llama-3-8b']" and not any(line.startswith("refused") for line in out), out
            else:
                assert out and all(line.startswith("(") for line in out), out

        (curl_block,) = [b for b in sh_blocks() if b.startswith("curl ")]
        curl = shlex.split(curl_block.replace("\\\n", " ").replace("127.0.0.1:8000", http.removeprefix("http://")))
        if shutil.which("curl"):
            body = run(curl, tmp_path, timeout_s=60).stdout
            assert '"object": "text_completion"' in body or '"object":"text_completion"' in body, body

        (openai_example,) = [b for b in re.findall(r"```python\n(.*?)```", README, re.S) if "from openai" in b]
        script = tmp_path / "openai_example.py"
        script.write_text(openai_example.replace("http://127.0.0.1:8000", http))
        run([sys.executable, script.name], tmp_path, timeout_s=120)
    finally:
        out = _stop_up(proc)
    assert proc.returncode == 0 and out.endswith("stopped (signal); exit codes: all 0\n"), out[-2000:]
