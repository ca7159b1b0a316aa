"""The docs hold inside the repository (`make docs-check`), and the README's client examples are the SDK's."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_check", REPO / "scripts" / "docs_check.py")
docs_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(docs_check)


def test_the_repository_docs_pass():
    assert docs_check.problems(REPO) == []


def test_the_check_catches_each_kind_of_problem(tmp_path):
    (tmp_path / "docs" / "bench").mkdir(parents=True)
    (tmp_path / "docs" / "present.md").write_text(
        "# ok\nContents: [One](#one) · [a `code` one, too](#a-code-one-too) · [gone](#nowhere) · "
        "[up](../README.md#plots)\n## One\n## A `code` one, too\n## Left out\n")
    (tmp_path / "README.md").write_text(
        "# x\n"
        "See [design](../shared/DESIGN.md) and [here](docs/present.md) and [gone](docs/gone.md#part).\n"
        "Built in /work/main/models, logs in /tmp/run.log; fixes issue 3.\n"
        "Config: `docs/bench/missing.yaml`; plots `docs/bench/cdf_<policy>.png`.\n"
        "## Plots\n"
        "Regenerate with `octoserve bench-suite`: `docs/bench/cdf_<policy>.png`.\n")
    (tmp_path / "BENCHMARKS.md").write_text("## Results\nA figure: `docs/bench/orphan.png`.\n\n| rate | 12.5 |\n")
    for name in ("cdf_a.png", "orphan.png"):
        (tmp_path / "docs" / "bench" / name).write_bytes(b"\x89PNG")
    (tmp_path / "docs" / "bench" / "page.md").write_text("# Numbers\n| a | 1 |\n")
    assert docs_check.problems(tmp_path) == [
        "README.md:2: a pointer outside the repository: '../shared'",
        "README.md:2: link to a missing file: ../shared/DESIGN.md",
        "README.md:2: link to a missing file: docs/gone.md#part",
        "README.md:3: an absolute machine path or temporary file: '/work/'",
        "README.md:3: an issue number: 'issue 3'",
        "README.md:4: names a missing file: docs/bench/missing.yaml",
        "docs/present.md:2: link to a missing heading: #nowhere",
        "docs/present.md: its contents list leaves out the heading '## Left out'",
        "docs/bench/orphan.png: a figure no Markdown section names next to the command that reproduces it",
        "docs/bench/page.md: a results page without the command that reproduces it",
        "BENCHMARKS.md: section '## Results' has measured figures but no command that reproduces them",
    ]


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, re.S)


def test_readme_shows_both_clients_imported_from_octoserve():
    blocks = _python_blocks((REPO / "README.md").read_text())
    imported = set()
    for code in blocks:
        for node in ast.walk(ast.parse(code)):
            if isinstance(node, ast.ImportFrom) and node.module.startswith("octoserve"):
                assert node.module == "octoserve", f"README imports from {node.module}; use `from octoserve import`"
                imported |= {a.name for a in node.names}
    assert {"Client", "AsyncClient", "OverloadedError"} <= imported
    import octoserve

    assert all(hasattr(octoserve, name) for name in imported)


_spec = importlib.util.spec_from_file_location("cli_reference", REPO / "scripts" / "cli_reference.py")
cli_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(cli_reference)


def test_the_cli_reference_is_what_the_definitions_give():
    text = cli_reference.render()
    assert (REPO / "docs" / "CLI.md").read_text() == text, "docs/CLI.md is stale: run `make docs`"
    from octoserve.services.cli import SUBCOMMANDS

    assert [line[len("## `octoserve "):-1] for line in text.splitlines() if line.startswith("## `octoserve ")] == \
        list(SUBCOMMANDS)
    assert "| `--fault INSTANCE@T[+DOWN]` |" in text and "| `make test-fast` |" in text


def test_the_makefile_targets_are_read_with_their_comments(tmp_path):
    (tmp_path / "Makefile").write_text(
        "X := 1\n## Runs it.\nrun: venv\n\tdo\n\n## Two lines\n## of text.\nN ?= 2\ntwo:\n\tdo\nbare:\n\tdo\n"
        "## A stamp's comment is not the next target's.\n$(VENV)/.stamp: x\n\ttouch $@\nnext:\n")
    assert cli_reference.make_targets(tmp_path / "Makefile") == [("run", "Runs it."), ("two", "Two lines of text.")]


def test_the_readme_stays_a_tour():
    lines = (REPO / "README.md").read_text().splitlines()
    assert len(lines) <= 150, "the README is the tour; details go to a page under docs/ that it links"
