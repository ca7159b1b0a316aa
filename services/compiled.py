"""Which build of the simulator's hot modules runs: their mypyc C extensions, or their .py sources.

`make compiled` (scripts/build_compiled.py) compiles a few modules to C extensions beside their sources and records
in `_compiled.json` the SHA-256 of each source it compiled. Python imports an extension in preference to the .py
next to it, so an edited source would otherwise run as its old compiled self. `octoserve.services` calls `activate()`
when it is imported, before any compiled module is: if a recorded source changed since its build, an extension is
missing, or the build is for another Python, every compiled module is imported from its .py instead, with a
warning that says how to rebuild. OCTOSERVE_PURE_PYTHON=1 asks for the sources without a warning.

The modules compile as one group whose members call each other natively (a compiled module checks the classes of
the others by identity), so they are used all together or not at all.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import sysconfig
import warnings
from pathlib import Path

PURE_ENV = "OCTOSERVE_PURE_PYTHON"
MANIFEST = Path(__file__).resolve().parent / "_compiled.json"
REBUILD = "make compiled"

# What `activate` found: "compiled" (the extensions run), "pure" (asked for, or no compiled build present),
# "stale" (a compiled build is present but out of date: the sources run).
state = "pure"


class _SourceFinder:
    """Imports the named modules from their .py files, ahead of the extensions beside them. A meta path finder needs
    only `find_spec`: no `importlib.abc` base, whose import pulls in importlib.resources and tempfile (~8 ms of
    every command's start)."""

    def __init__(self, sources: dict[str, Path]) -> None:
        self.sources = sources

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> importlib.machinery.ModuleSpec | None:
        source = self.sources.get(fullname)
        if source is None:
            return None
        return importlib.util.spec_from_file_location(fullname, source)


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def stale_reasons(manifest: dict, root: Path) -> list[str]:
    """Why the compiled build recorded in `manifest` (sources relative to `root`) must not run; empty if it may."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    if manifest.get("ext_suffix") != suffix:
        return [f"it was built for {manifest.get('ext_suffix')}, this Python loads {suffix}"]
    reasons = []
    for entry in manifest["modules"].values():
        source = root / entry["source"]
        if not source.exists():
            reasons.append(f"{entry['source']} is gone")
        elif _sha256(source) != entry["sha256"]:
            reasons.append(f"{entry['source']} changed since it was compiled")
        if not source.with_name(source.stem + suffix).exists():
            reasons.append(f"the extension of {entry['source']} is missing")
    return reasons


def activate(manifest_path: Path = MANIFEST, root: Path | None = None) -> str:
    """Decide, before any compiled module is imported, whether the extensions or the sources run (`state`).
    `root`: where the recorded sources are (default: beside the manifest)."""
    global state
    if not manifest_path.exists():
        state = "pure"
        return state
    manifest = json.loads(manifest_path.read_text())
    root = manifest_path.parent if root is None else root
    sources = {name: root / entry["source"] for name, entry in manifest["modules"].items()}
    if os.environ.get(PURE_ENV, "") not in ("", "0"):
        state = "pure"
    else:
        reasons = stale_reasons(manifest, root)
        if not reasons:
            state = "compiled"
            return state
        state = "stale"
        warnings.warn(
            "octoserve: the compiled simulator modules are out of date (" + "; ".join(reasons) + "), so all of "
            f"them run from their .py sources (same results, slower). Rebuild them with `{REBUILD}`, or remove "
            "them with `make clean-compiled`.",
            RuntimeWarning,
            stacklevel=3,
        )
    loaded = [name for name in sources if name in sys.modules]
    if loaded:  # too late to choose: say so rather than run a mix
        raise ImportError(f"octoserve: {', '.join(loaded)} imported before octoserve.services chose its build")
    sys.meta_path.insert(0, _SourceFinder(sources))
    return state
