"""A relative `tls.dir` in a node config file names a folder next to the config file, for every process of the node
(each runs with its own working directory; the node's children run in the checkout), never per process.

Unit level: `load_service_sections` resolves it against the file's folder; a config given as a dict to
`start_node` is resolved against the caller's working directory before it is written to the run directory.
Process level: `octoserve certs conf/certs` and `octoserve up --config conf/node.yaml` (with `tls: {dir: certs}`)
from a temporary directory outside the checkout start a node whose internal servers require those certificates.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import yaml

from octoserve.services.node import launcher
from octoserve.services.config import load_service_sections
from octoserve.services.node.launcher import REPO_ROOT

ONE_8B = yaml.safe_load((REPO_ROOT / "scripts" / "bench_router_node.yaml").read_text())
ENV = {**os.environ, "OCTOSERVE_PURE_PYTHON": "1",
       "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}


def test_a_relative_tls_dir_is_read_from_the_config_files_folder(tmp_path, monkeypatch):
    conf = tmp_path / "conf"
    conf.mkdir()
    for given, expected in (("certs", str(conf / "certs")), ("../shared/certs", str(tmp_path / "shared" / "certs")),
                            ("/etc/octoserve/tls", "/etc/octoserve/tls")):
        (conf / "node.yaml").write_text(yaml.safe_dump({**ONE_8B, "tls": {"dir": given}}))
        for cwd in (tmp_path, conf, REPO_ROOT):  # the same wherever the reading process runs
            monkeypatch.chdir(cwd)
            assert load_service_sections("conf/node.yaml" if cwd == tmp_path else conf / "node.yaml")["tls"] == {
                "dir": expected}
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (conf / "node.yaml").write_text(yaml.safe_dump({**ONE_8B, "tls": {"dir": "~/certs"}}))
    assert load_service_sections(conf / "node.yaml")["tls"] == {"dir": str(tmp_path / "home" / "certs")}


def test_a_config_dict_names_its_tls_dir_from_the_callers_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    written = launcher._config_path({**ONE_8B, "tls": {"dir": "certs"}}, run_dir)
    assert written == str(run_dir / "node.yaml")
    assert load_service_sections(written)["tls"] == {"dir": str(tmp_path / "certs")}


def _octoserve(*argv: str, cwd: Path, **kw):
    return [sys.executable, "-m", "octoserve.services.cli", *argv], dict(cwd=cwd, env=ENV, text=True, **kw)


def test_up_from_another_directory_finds_the_certificates_next_to_its_config(tmp_path):
    """Before: every child looked for `certs` in the checkout; the scheduler exited 1 ("tls.dir certs lacks ...")."""
    assert tmp_path.resolve() != REPO_ROOT.resolve()
    (tmp_path / "conf").mkdir()
    cmd, kw = _octoserve("certs", "conf/certs", cwd=tmp_path, capture_output=True, timeout=60)
    made = subprocess.run(cmd, **kw)
    assert made.returncode == 0, made.stderr
    certs = tmp_path / "conf" / "certs"
    assert made.stdout.splitlines()[-1] == (f"set `tls: {{dir: {certs}}}` in the node config to require these "
                                            "certificates between services (a relative dir is read from the config "
                                            "file's folder)")
    (tmp_path / "conf" / "node.yaml").write_text(yaml.safe_dump({**ONE_8B, "tls": {"dir": "certs"}}))
    cmd, kw = _octoserve("up", "--config", "conf/node.yaml", "--run-dir", "run", "--port", "0", "--no-http",
                         "--grace-s", "2", cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    proc = subprocess.Popen(cmd, **kw)
    try:
        lines: list[str] = []
        while not any(line.startswith("logs") for line in lines):  # bounded by the launcher's startup timeout
            line = proc.stdout.readline()
            assert line, f"octoserve up exited early: {''.join(lines)}"
            lines.append(line)
        scheduler_port = json.loads((tmp_path / "run" / "scheduler.ready.json").read_text())["port"]

        def health(*extra: str) -> int:
            cmd, kw = _octoserve("health", "--port", str(scheduler_port), *extra, cwd=tmp_path, capture_output=True,
                                 timeout=60)
            return subprocess.run(cmd, **kw).returncode

        assert health("--tls-dir", "conf/certs", "--cert", "router") == 0  # mTLS with the node's CA: SERVING
        assert health() != 0  # plaintext: the scheduler requires a client certificate
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
        assert out.endswith("stopped (signal); exit codes: all 0\n")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
