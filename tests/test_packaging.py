"""The installed package: one import root (`octoserve`), the SDK installable alone, the public .proto shipped.

Both tests build real packages with pip (offline-capable: pip's configured indexes and cache); both are slow.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PIP_TIMEOUT_S = 600
NODE_CONFIG = REPO / "scripts" / "bench_router_node.yaml"  # one 8B instance: the smallest live node

pytestmark = pytest.mark.slow


def _copy_sources(dest: Path, folders: tuple[str, ...], files: tuple[str, ...] = ()) -> Path:
    """The package sources without build outputs, so building never writes into the checkout."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build", "dist", ".venv")
    for folder in folders:
        shutil.copytree(REPO / folder, dest / folder, ignore=ignore)
    for name in files:
        shutil.copy2(REPO / name, dest / name)
    return dest


def _wheel(source: Path, out: Path) -> Path:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(out), str(source)],
                          capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("*.whl")
    return wheel


def _top_level(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as z:
        return {name.split("/")[0] for name in z.namelist() if not name.split("/")[0].endswith(".dist-info")}


def test_full_wheel_has_one_top_level_name_and_ships_the_proto(tmp_path):
    src = _copy_sources(tmp_path / "src", ("sdk", "services", "router", "prefill_worker", "decode_worker", "http_front"),
                        ("pyproject.toml", "README.md"))
    wheel = _wheel(src, tmp_path / "dist")
    assert _top_level(wheel) == {"octoserve"}
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    for required in ("octoserve/v1/generate.proto", "octoserve/v1/generate_pb2.py", "octoserve/client.py",
                     "octoserve/services/cli.py", "octoserve/services/configs/node-default.yaml",
                     "octoserve/router/servicer.py", "octoserve/decode_worker/servicer.py",
                     "octoserve/prefill_worker/servicer.py", "octoserve/http_front/app.py"):
        assert required in names, required
    assert not any(n.startswith(("services/", "router/", "prefill_worker/", "decode_worker/", "http_front/"))
                   for n in names)


def _client_examples(target: str) -> list[str]:
    """The SDK examples a user reads: the README's tour and the clients page."""
    text = (REPO / "README.md").read_text() + (REPO / "docs" / "CLIENTS.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    client_blocks = [b for b in blocks if "from octoserve import" in b]
    assert len(client_blocks) >= 4  # the sync and the async client, an API key, a resumed stream
    return [b.replace("127.0.0.1:50051", target) for b in client_blocks]


def _start_node(run_dir: Path) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "octoserve"), "up", "--config", str(NODE_CONFIG), "--port", "0",
         "--http-port", "0", "--time-scale", "1", "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    deadline = time.monotonic() + 120
    seen = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if m := re.match(r"router\s+(127\.0\.0\.1:\d+)\s", line):
            return proc, m.group(1)
    _stop(proc)
    raise AssertionError("the node did not start:\n" + "".join(seen))


def _stop(proc: subprocess.Popen) -> None:
    """By PID: SIGINT (the launcher stops its services), then SIGKILL to its own process group if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def test_sdk_alone_in_a_fresh_venv_runs_the_client_examples_next_to_a_user_services_package(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    sdk = _copy_sources(tmp_path / "src", ("sdk",))
    done = subprocess.run([str(py), "-m", "pip", "install", "-q", str(sdk / "sdk")], capture_output=True,
                          text=True, timeout=PIP_TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    installed = subprocess.run([str(py), "-m", "pip", "list", "--format=freeze"], capture_output=True, text=True,
                               timeout=120).stdout
    names = {line.split("==")[0].lower() for line in installed.split()}
    assert {"octoserve-client", "grpcio", "protobuf", "googleapis-common-protos"} <= names
    assert not names & {"octoserve", "grpcio-tools", "numpy", "matplotlib", "prometheus-client", "pyyaml", "uvloop"}

    # The user's own project has a package named `services` (the name the node's library had at the top level).
    project = tmp_path / "project"
    (project / "services").mkdir(parents=True)
    (project / "services" / "__init__.py").write_text("OWNER = 'the user'\n")
    proc, target = _start_node(tmp_path / "run")
    try:
        for i, example in enumerate(_client_examples(target)):
            script = project / f"example_{i}.py"
            script.write_text("import services\nassert services.OWNER == 'the user'\n" + example)
            ran = subprocess.run([str(py), script.name], cwd=project, capture_output=True, text=True, timeout=120,
                                 env={**os.environ, "PYTHONPATH": str(project)})
            assert ran.returncode == 0, ran.stderr
            assert ran.stdout.strip(), f"example {i} printed nothing"
            lines = ran.stdout.splitlines()
            if "async with AsyncClient" in example:
                assert lines[0] == "['llama-3-8b']"
                assert lines[1].startswith("FinishReason."), ran.stdout
            elif "api_key=" in example:  # the node here asks for no key: the client's key is sent and ignored
                assert lines[0] == "['llama-3-8b']" and not any(line.startswith("refused") for line in lines)
            else:
                assert all(line.startswith("(") for line in ran.stdout.splitlines())
        proto = subprocess.run([str(py), "-c", "import importlib.resources as r; print(r.files('octoserve.v1')"
                                ".joinpath('generate.proto').read_text())"], capture_output=True, text=True,
                               timeout=60)
        assert "service Generation" in proto.stdout
    finally:
        _stop(proc)
    assert proc.returncode is not None
