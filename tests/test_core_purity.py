"""The scheduling core is pure and clock-free: no module under services/core imports I/O or clocks."""

import ast
import pathlib

import pytest

BANNED = {"time", "asyncio", "grpc", "torch", "random", "socket", "threading", "datetime", "os", "subprocess"}
CORE = pathlib.Path(__file__).resolve().parents[1] / "services" / "core"


def _imports(path: pathlib.Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names.append(node.module or "")
    return names


@pytest.mark.parametrize("path", sorted(CORE.glob("*.py")), ids=lambda p: p.name)
def test_core_module_imports_no_clock_or_io(path):
    bad = [n for n in _imports(path) if n.split(".")[0] in BANNED]
    assert bad == [], f"{path.name} imports {bad}: pass `now` / a seeded random.Random in instead"


def test_purity_check_catches_a_banned_import(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import time\nfrom asyncio import sleep\n")
    assert [n for n in _imports(probe) if n.split(".")[0] in BANNED] == ["time", "asyncio"]
