"""`octoserve up` run outside the checkout: every path the user gives (--config, --model, --run-dir) means what it
means in their shell, although the node's processes run with the checkout as their working directory.

Unit level: `start_node`'s children are started with absolute paths, resolved against the caller's working
directory (the spawn is recorded, nothing runs). Process level: `octoserve up --config node.yaml --run-dir run`
from a temporary directory starts, serves and stops.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from octoserve.services.node import launcher
from octoserve.services.node.launcher import REPO_ROOT, user_path
from tests.service_fixtures import small_config_dict


def test_user_path_is_absolute_against_the_callers_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert user_path("tenants.yaml") == str(tmp_path / "tenants.yaml")
    assert user_path("models/tiny-llama") == str(tmp_path / "models" / "tiny-llama")
    assert user_path("../x/node.yaml") == str(tmp_path.parent / "x" / "node.yaml")
    assert user_path("/etc/octoserve/node.yaml") == "/etc/octoserve/node.yaml"  # absolute: unchanged
    assert user_path(Path("run")) == str(tmp_path / "run")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_path("~/node.yaml") == str(tmp_path / "home" / "node.yaml")
    assert user_path(None) is None


class _Stop(Exception):
    """Ends the recorded start once the router would be spawned."""


class _NoProcess:
    pid = (1 << 22) + 1  # above the kernel's largest pid: no process group has this number

    def poll(self):
        return 0

    def wait(self, timeout=None):
        return 0


def test_start_node_hands_its_children_absolute_paths(tmp_path, monkeypatch):
    """Relative --config, --model and --run-dir from a directory outside the checkout reach every child resolved
    against that directory (the children run in the checkout, where the relative names mean something else)."""
    here = tmp_path / "elsewhere"
    here.mkdir()
    (here / "node.yaml").write_text(yaml.safe_dump(small_config_dict()))
    monkeypatch.chdir(here)
    spawned: list[tuple[str, list[str], Path]] = []

    def spawn(name, module, args, run_dir, env):
        spawned.append((name, list(args), run_dir))
        if name == "router":
            raise _Stop
        return launcher.ServiceProcess(name, _NoProcess(), run_dir / f"{name}.ready.json", run_dir / f"{name}.log")

    monkeypatch.setattr(launcher, "spawn", spawn)
    monkeypatch.setattr(launcher, "wait_ready", lambda sp, deadline: None)
    with pytest.raises(_Stop):
        launcher.start_node("node.yaml", model_path="models/tiny-llama", run_dir="run", http_port=0)

    config, model, run_dir = str(here / "node.yaml"), str(here / "models" / "tiny-llama"), here / "run"
    assert [name for name, _, _ in spawned] == ["scheduler", "worker:c0", "worker:p0", "worker:d0", "router"]
    assert all(d == run_dir for _, _, d in spawned) and run_dir.is_dir()

    def flag(args: list[str], name: str) -> str:
        return args[args.index(name) + 1]

    for name, args, _ in spawned:
        assert flag(args, "--config") == config, name
    scheduler_args = spawned[0][1]
    assert flag(scheduler_args, "--placement-file") == str(run_dir / "placement.json")
    for name, args, _ in spawned[1:4]:
        assert flag(args, "--model") == model, name
    router_args = spawned[4][1]
    assert flag(router_args, "--http-model") == model
    assert flag(router_args, "--http-ready-file") == str(run_dir / "http_front.ready.json")


def test_up_from_another_directory_with_a_relative_config_and_run_dir(tmp_path):
    """The reported failure: `cd elsewhere && octoserve up --config node.yaml` ended "scheduler exited with code 1
    while starting" (FileNotFoundError: 'node.yaml' in its log)."""
    (tmp_path / "node.yaml").write_text(yaml.safe_dump(small_config_dict()))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "octoserve.services.cli", "up", "--config", "node.yaml", "--run-dir", "run",
           "--port", "0", "--no-http", "--grace-s", "2"]
    assert tmp_path.resolve() != REPO_ROOT.resolve()
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines: list[str] = []
        while not any(line.startswith("logs") for line in lines):  # bounded by the launcher's startup timeout
            line = proc.stdout.readline()
            assert line, f"octoserve up exited early: {''.join(lines)}"
            lines.append(line)
        run_dir = tmp_path / "run"
        assert lines[-1].startswith(f"logs       {run_dir}  ")
        assert sorted(p.name for p in run_dir.glob("*.ready.json")) == [
            "router.ready.json", "scheduler.ready.json", "worker-c0.ready.json", "worker-d0.ready.json",
            "worker-p0.ready.json"]
        assert not (REPO_ROOT / "run").exists()
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert out.endswith("stopped (signal); exit codes: all 0\n")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
