"""The installed package's layers, drawn from its imports (what may import what), and its module sizes.

Each source file is named as it is installed (`pyproject.toml`'s packages and package-dir: `services/core/batcher.py`
is `octoserve.services.core.batcher`), and every import in it counts, module level or inside a function, except under
`if TYPE_CHECKING:` (annotations only: it never runs). The layers:
- the SDK (`octoserve`, `octoserve.v1`, everything outside the node's folders) imports nothing of the node;
- the core (`octoserve.services.core`) imports only the core and the SDK: it is the policy, on no clock;
- the simulator (`octoserve.services.sim`) imports no process of the node (router, workers, HTTP front, scheduler,
  engines, RPC plumbing, launcher, cluster tier) and not the command line's root;
- the lab (`octoserve.services.lab`: bench suite and report, baselines, harnesses, agreement checks, calibration,
  demo; and the cluster tier's live harness and bench) is imported by
  nothing but the lab and the command line's root (`octoserve.services.cli`);
- no two modules import each other, directly or around a loop;
- no module is longer than 600 lines without a paragraph in its docstring that says why (`LONG_REASON`).
What breaks a rule today is listed below with what it waits for; the test fails on anything new, and on a listed
exception that no longer exists (so the list only shrinks). The graph is drawn here rather than by grimp or
import-linter: those walk the import root's own folder (sdk/octoserve), and this package maps five folders into it.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NODE = ("octoserve.services", "octoserve.router", "octoserve.prefill_worker", "octoserve.decode_worker",
        "octoserve.http_front")
CORE = "octoserve.services.core"
SIM = "octoserve.services.sim"
CLI = "octoserve.services.cli"
PROCESSES = ("octoserve.router", "octoserve.prefill_worker", "octoserve.decode_worker", "octoserve.http_front",
             "octoserve.services.scheduler", "octoserve.services.engine", "octoserve.services.rpc",
             "octoserve.services.cluster", "octoserve.services.node")
LAB = ("octoserve.services.lab", "octoserve.services.cluster.live", "octoserve.services.cluster.bench")

# (importer, imported) -> what it waits for.
KNOWN_EXCEPTIONS: dict[tuple[str, str], str] = {
}
KNOWN_CYCLES = {
}


def modules(root: Path = ROOT) -> dict[str, Path]:
    """Import name -> source file, for every module the wheel installs."""
    setuptools = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = setuptools["package-dir"]
    out = {}
    for package in setuptools["packages"]:
        base = max((p for p in dirs if package == p or package.startswith(p + ".")), key=len)
        folder = root / dirs[base] / package[len(base):].lstrip(".").replace(".", "/")
        for path in sorted(folder.glob("*.py")):
            out[package if path.stem == "__init__" else f"{package}.{path.stem}"] = path
    return out


def imports(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the package modules it imports (`from a.b import c` counts `a.b.c` when that is a module)."""
    graph = {}
    for name, path in mods.items():
        found = set()
        tree = ast.parse(path.read_text(encoding="utf-8"))
        typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block) for stmt in block.body
                       for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parts = name.split(".") if path.stem == "__init__" else name.split(".")[:-1]
                    base = ".".join(parts[: len(parts) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                # `from a.b import c` imports the module a.b.c when there is one, else a name of a.b
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                while target and target not in mods:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.add(target)
        graph[name] = found
    return graph


def _is_type_checking(node: ast.AST) -> bool:
    """An `if TYPE_CHECKING:` block: its imports are for annotations and never run."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _in(name: str, prefixes) -> bool:
    prefixes = (prefixes,) if isinstance(prefixes, str) else prefixes
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def broken_rules(graph: dict[str, set[str]]) -> dict[tuple[str, str], str]:
    """(importer, imported) -> the rule it breaks."""
    out = {}
    for a, targets in graph.items():
        for b in targets:
            if not _in(a, NODE) and _in(b, NODE):
                out[a, b] = "the SDK imports the node"
            elif _in(a, CORE) and _in(b, NODE) and not _in(b, CORE):
                out[a, b] = "the core imports outside the core"
            elif _in(a, SIM) and (_in(b, PROCESSES) or b == CLI):
                out[a, b] = "the simulator imports a process of the node"
            elif _in(b, LAB) and not _in(a, LAB) and a != CLI:
                out[a, b] = "the product imports the lab"
    return out


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The import loops: strongly connected groups of two or more modules (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.add(member)
                    if member == node:
                        break
                if len(group) > 1:
                    out.append(frozenset(group))
    return out


def test_every_layer_imports_only_what_it_may():
    graph = imports(modules())
    broken = broken_rules(graph)
    assert sorted(set(broken) - set(KNOWN_EXCEPTIONS)) == [], broken
    assert sorted(set(KNOWN_EXCEPTIONS) - set(broken)) == [], "fixed: remove it from KNOWN_EXCEPTIONS"


def test_no_import_loops_beyond_the_known_ones():
    found = set(cycles(imports(modules())))
    assert sorted(map(sorted, found - set(KNOWN_CYCLES))) == []
    assert sorted(map(sorted, set(KNOWN_CYCLES) - found)) == [], "gone: remove it from KNOWN_CYCLES"


def test_the_rules_catch_each_kind_of_import(tmp_path):
    """A package with one import of each forbidden kind and two loops: each is found, nothing else (an import for
    annotations only does not count)."""
    (tmp_path / "pyproject.toml").write_text(
        '[tool.setuptools]\npackages = ["octoserve", "octoserve.services", "octoserve.services.core", '
        '"octoserve.services.sim", "octoserve.services.lab", "octoserve.router"]\n'
        '[tool.setuptools.package-dir]\noctoserve = "sdk/octoserve"\n"octoserve.services" = "services"\n'
        '"octoserve.router" = "router"\n')
    files = {
        "sdk/octoserve/__init__.py": "",
        "sdk/octoserve/client.py": "from octoserve.services.core import policy\n",
        "services/__init__.py": "",
        "services/core/__init__.py": "",
        "services/core/policy.py": "def f():\n    from octoserve.services import metrics\n",
        "services/metrics.py": "from .lab import bench_suite\n",
        "services/lab/__init__.py": "",
        "services/lab/bench_suite.py": "from octoserve.services import metrics\n",
        "services/cli.py": "from octoserve.services.lab import bench_suite\n",
        "services/sim/__init__.py": "",
        "services/sim/driver.py": "import octoserve.router.app\nfrom octoserve.services.core.policy import f\n",
        "router/__init__.py": "",
        "router/app.py": ("from typing import TYPE_CHECKING\nfrom octoserve.services.sim import driver\n"
                          "if TYPE_CHECKING:\n    from octoserve.services.lab import bench_suite\n"),
    }
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    graph = imports(modules(tmp_path))
    assert broken_rules(graph) == {
        ("octoserve.client", "octoserve.services.core.policy"): "the SDK imports the node",
        ("octoserve.services.core.policy", "octoserve.services.metrics"): "the core imports outside the core",
        ("octoserve.services.sim.driver", "octoserve.router.app"): "the simulator imports a process of the node",
        ("octoserve.services.metrics", "octoserve.services.lab.bench_suite"): "the product imports the lab",
    }
    assert set(cycles(graph)) == {frozenset({"octoserve.services.metrics", "octoserve.services.lab.bench_suite"}),
                                  frozenset({"octoserve.services.sim.driver", "octoserve.router.app"})}


# Modules past MAX_LINES, each with why it stays one module (or what it waits for); anything new past it fails, and
# so does a listed one that has shrunk below it (remove it).
MAX_LINES = 600
LONG_REASON = "Why one module past 600 lines:"


def test_long_modules_say_why():
    sources = [p for folder in ("services", "router", "decode_worker", "prefill_worker", "http_front", "sdk")
               for p in (ROOT / folder).rglob("*.py") if "gen" not in p.parts]
    reasons = {}
    for p in sources:
        text = p.read_text(encoding="utf-8")
        doc = ast.get_docstring(ast.parse(text)) or ""
        reasons[str(p.relative_to(ROOT))] = (len(text.splitlines()) > MAX_LINES, LONG_REASON in doc)
    unexplained = sorted(name for name, (long, said) in reasons.items() if long and not said)
    assert unexplained == [], f"past {MAX_LINES} lines: split it, or say why in its docstring ('{LONG_REASON} ...')"
    stale = sorted(name for name, (long, said) in reasons.items() if said and not long)
    assert stale == [], f"now short enough: drop '{LONG_REASON}' from its docstring"
