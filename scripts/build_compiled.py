"""Compile the simulator's hot modules to C extensions with mypyc, next to their sources (`make compiled`).

The modules below are plain typed Python; mypyc turns each into a C extension (`kv_cache.cpython-311-...so` beside
`kv_cache.py`) that Python's import system prefers to the .py. The build is optional: without a C compiler, the
Python headers or mypyc, it prints a WARNING and leaves the package pure Python (same results, slower).

Every build writes `services/_compiled.json`: each compiled module with the SHA-256 of the exact source it was
compiled from. `octoserve.services` checks it at import (services/compiled.py): if a source changed since, or
OCTOSERVE_PURE_PYTHON=1, every compiled module is imported from its .py instead, so an edit is never shadowed by an
old extension. `--clean` removes the extensions and the record.

The modules compile as one group (one shared library, services/_compiled__mypyc.*.so): compiled modules call each
other natively, so they are all used or all left out together.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ROOT / "services"
MANIFEST = SERVICES / "_compiled.json"
GROUP = "octoserve.services._compiled"  # the shared library: services/_compiled__mypyc.<ext>
MYPY_VERSION = "2.4.1"  # pinned with the dev extra in pyproject.toml

# octoserve.services.<name> -> services/<name with / for .>.py
MODULES = (
    "core.types",
    "core.kv_cache",
    "core.cost_model",
    "core.sim_executor",
    "core.routing",
    "core.tail_budget",
    "core.batch_state",
    "core.step_builders",
    "core.step_budget",
    "core.batch_book",
    "core.batcher",
    "sim.steady_batcher",
    "core.admission",
    "workload",
    "sim.driver",
)


def _warn(message: str) -> None:
    print(f"WARNING: {message}\nWARNING: octoserve stays pure Python (identical results, slower simulator).",
          file=sys.stderr)


def clean() -> None:
    """Remove every extension a build of these modules left (for any Python version) and the record."""
    for name in MODULES:
        source = SERVICES / (name.replace(".", "/") + ".py")
        for path in source.parent.glob(source.stem + ".*.so"):
            path.unlink()
    for path in SERVICES.glob("_compiled__mypyc.*.so"):
        path.unlink()
    MANIFEST.unlink(missing_ok=True)


def _missing_toolchain() -> str | None:
    try:
        import mypyc  # noqa: F401
        from mypy.version import __version__
    except ImportError:
        return f"mypyc is not installed (pip install mypy=={MYPY_VERSION})"
    if __version__ != MYPY_VERSION:
        return f"mypy {__version__} is installed, the build is pinned to {MYPY_VERSION}"
    cc = (os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc").split()[0]  # setuptools' choice
    if shutil.which(cc) is None:
        return f"no C compiler ({cc!r} is not on PATH)"
    if not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        return f"no Python headers ({sysconfig.get_paths()['include']}/Python.h is missing)"
    return None


def _stage(stage: Path) -> None:
    """The installed import layout (octoserve/, octoserve/services/), so mypyc names the modules as they import."""
    ignore = shutil.ignore_patterns("__pycache__", "*.so", "*.json", "configs")
    shutil.copytree(ROOT / "sdk" / "octoserve", stage / "octoserve", ignore=ignore)
    shutil.copytree(SERVICES, stage / "octoserve" / "services", ignore=ignore)


_SETUP = """
from setuptools import setup
from mypyc.build import mypycify
extensions = mypycify({paths!r}, opt_level="3", group_name={group!r})
for extension in extensions:
    # Floats exactly as CPython computes them: no fused multiply-add, whatever -march the flags carry.
    extension.extra_compile_args.append("-ffp-contract=off")
setup(name="octoserve-compiled", script_args=["build_ext", "--inplace"], ext_modules=extensions)
"""


def build() -> int:
    problem = _missing_toolchain()
    if problem is not None:
        clean()
        _warn(f"the simulator's hot modules were not compiled: {problem}.")
        return 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="octoserve-mypyc-") as tmp:
        stage = Path(tmp)
        _stage(stage)
        # Imported modules that are not compiled are read for their types only (their own errors do not matter).
        paths = ["--ignore-missing-imports", "--follow-imports=silent"]
        paths += [f"octoserve/services/{name.replace('.', '/')}.py" for name in MODULES]
        (stage / "setup.py").write_text(_SETUP.format(paths=paths, group=GROUP))
        print(f"compiling {len(MODULES)} modules with mypyc {MYPY_VERSION} (about a minute) ...", file=sys.stderr)
        env = dict(os.environ, MYPY_FORCE_COLOR="0")
        done = subprocess.run([sys.executable, "setup.py", "-q"], cwd=stage, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            clean()
            sys.stderr.write(done.stdout[-6000:] + done.stderr[-6000:])
            _warn("mypyc could not compile the simulator's hot modules (output above).")
            return 0
        clean()
        suffix = sysconfig.get_config_var("EXT_SUFFIX")
        record: dict[str, dict[str, str]] = {}
        for name in MODULES:
            rel = name.replace(".", "/")
            shutil.copy2(stage / "octoserve" / "services" / (rel + suffix), SERVICES / (rel + suffix))
            source = (stage / "octoserve" / "services" / (rel + ".py")).read_bytes()
            record[f"octoserve.services.{name}"] = {
                "source": rel + ".py",
                "sha256": hashlib.sha256(source).hexdigest(),
            }
        for lib in (stage / "octoserve" / "services").glob("_compiled__mypyc*.so"):
            shutil.copy2(lib, SERVICES / lib.name)
    MANIFEST.write_text(json.dumps({"ext_suffix": suffix, "mypy": MYPY_VERSION, "modules": record}, indent=1) + "\n")
    print(f"compiled {len(MODULES)} modules in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clean", action="store_true", help="remove the compiled extensions (pure Python)")
    parser.add_argument("--list", action="store_true", help="print the compiled modules' sources (for make)")
    args = parser.parse_args()
    if args.list:
        print(" ".join(f"services/{name.replace('.', '/')}.py" for name in MODULES))
        return 0
    if args.clean:
        clean()
        return 0
    return build()


if __name__ == "__main__":
    sys.exit(main())
