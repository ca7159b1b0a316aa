"""The mypyc-compiled simulator modules (`make compiled`): same output as the sources, never run when stale.

The compiled build must print exactly what the pure-Python sources print (every table and figure; only the
wall-time line differs) and write the same per-request records to the last bit of each float, on several
workloads, placements and both cost profiles. The pure run is a subprocess
with OCTOSERVE_PURE_PYTHON=1, which imports every compiled module from its .py. The guard (services/compiled.py)
must refuse a build whose recorded source hash no longer matches, and fall back to the sources with a warning.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from octoserve.services import compiled
from octoserve.services.compiled import PURE_ENV, stale_reasons

needs_build = pytest.mark.skipif(
    compiled.state != "compiled", reason=f"no up-to-date compiled build (state {compiled.state!r}): make compiled"
)


def _env(pure: bool) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != PURE_ENV}
    if pure:
        env[PURE_ENV] = "1"
    return env


def _simulate(args: list[str], pure: bool, out: Path) -> tuple[str, dict]:
    """The printed report (less the wall-time line) and the JSON of every record at full float precision."""
    json_path = out / ("pure.json" if pure else "compiled.json")
    done = subprocess.run(
        [sys.executable, "-m", "octoserve.services.cli", "simulate", *args, "--json", str(json_path)],
        env=_env(pure), capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RuntimeWarning" not in done.stderr, done.stderr[-3000:]  # neither run fell back on its own
    lines = [line for line in done.stdout.splitlines() if not line.startswith("simulator speed:")]
    assert len(lines) > 15 and any(line.startswith("all ") for line in lines), done.stdout
    payload = json.loads(json_path.read_text())
    del payload["wall_s"]
    assert len(payload["records"]) > 500
    return "\n".join(lines), payload


def _which_files(pure: bool) -> list[str]:
    code = (
        "import json, octoserve.services.compiled as c, importlib\n"
        "names = json.loads(c.MANIFEST.read_text())['modules']\n"
        "print(c.state, *[importlib.import_module(n).__file__ for n in names])\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=_env(pure), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


@needs_build
def test_the_build_runs_compiled_and_the_variable_runs_the_sources():
    state, *files = _which_files(pure=False)
    assert state == "compiled" and files and all(f.endswith(sysconfig.get_config_var("EXT_SUFFIX")) for f in files)
    state, *files = _which_files(pure=True)
    assert state == "pure" and files and all(f.endswith(".py") for f in files)


@needs_build
@pytest.mark.parametrize(
    "args",
    [
        ["--profile", "seed-000", "--duration", "8s"],
        ["--profile", "seed-000", "--duration", "8s", "--cost-profile", "pessimistic"],
        ["--profile", "seed-003", "--duration", "6s"],
        ["--profile", "seed-003", "--duration", "6s", "--cost-profile", "pessimistic"],
        ["--profile", "seed-000", "--duration", "6s", "--config", "services/configs/node-disagg.yaml"],
        ["--profile", "seed-000", "--duration", "6s", "--config", "services/configs/node-gang.yaml"],
    ],
    ids=["seed-000", "seed-000-pessimistic", "seed-003", "seed-003-pessimistic", "disagg", "gang"],
)
def test_compiled_and_pure_runs_print_the_same_report(args, tmp_path):
    compiled_report, compiled_json = _simulate(args, pure=False, out=tmp_path)
    pure_report, pure_json = _simulate(args, pure=True, out=tmp_path)
    assert compiled_report == pure_report
    assert compiled_json == pure_json  # every record and figure, to the last bit of each float


@needs_build
def test_a_changed_source_falls_back_to_the_sources_with_a_warning(tmp_path):
    manifest = json.loads(compiled.MANIFEST.read_text())
    name = "octoserve.services.core.kv_cache"
    manifest["modules"][name]["sha256"] = "0" * 64  # as if kv_cache.py had been edited since the build
    edited = tmp_path / "_compiled.json"
    edited.write_text(json.dumps(manifest))
    code = (
        "import pathlib, octoserve.services.compiled as c\n"
        f"state = c.activate(pathlib.Path({str(edited)!r}), root=c.MANIFEST.parent)\n"
        f"import {name} as k, octoserve.services.core.batcher as b\n"
        "print(state, k.__file__, b.__file__)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=_env(pure=False), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    state, kv_file, batcher_file = done.stdout.split()
    assert state == "stale"
    assert kv_file.endswith("kv_cache.py") and batcher_file.endswith("batcher.py")  # all of them, not a mix
    assert "core/kv_cache.py changed since it was compiled" in done.stderr
    assert "make compiled" in done.stderr


def _record(root: Path, source: str, text: bytes) -> dict:
    path = root / source
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text)
    return {"source": source, "sha256": hashlib.sha256(text).hexdigest()}


def test_stale_reasons_name_each_changed_missing_or_foreign_piece(tmp_path):
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    modules = {"pkg.a": _record(tmp_path, "core/a.py", b"x = 1\n"), "pkg.b": _record(tmp_path, "b.py", b"y = 2\n")}
    for entry in modules.values():
        (tmp_path / entry["source"]).with_suffix(suffix).write_bytes(b"")  # the extensions beside the sources
    manifest = {"ext_suffix": suffix, "modules": modules}
    assert stale_reasons(manifest, tmp_path) == []

    (tmp_path / "core" / "a.py").write_bytes(b"x = 2\n")
    (tmp_path / "b.py").with_suffix(suffix).unlink()
    assert stale_reasons(manifest, tmp_path) == [
        "core/a.py changed since it was compiled", "the extension of b.py is missing",
    ]
    (tmp_path / "b.py").unlink()
    assert "b.py is gone" in stale_reasons(manifest, tmp_path)
    other = dict(manifest, ext_suffix=".cpython-99-x.so")
    assert stale_reasons(other, tmp_path) == [f"it was built for .cpython-99-x.so, this Python loads {suffix}"]


def test_without_a_record_nothing_compiled_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(compiled, "state", compiled.state)  # restored after the test
    assert compiled.activate(tmp_path / "absent.json") == "pure"
