"""docs/REPORT.md explains every column the report prints, what `make run` caps, and `--time-scale`: checked
against the code's column list and against the header of a real short run."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from octoserve.services import metrics
from octoserve.services.lab import demo

REPO = Path(__file__).resolve().parents[1]


def section() -> str:
    return (REPO / "docs" / "REPORT.md").read_text()


def explained_columns() -> set[str]:
    """The names in backticks in the first cell of each row of the section's column table."""
    names: set[str] = set()
    for line in section().splitlines():
        if line.startswith("| `"):
            names |= set(re.findall(r"`([^`]+)`", line.split(" | ")[0]))
    return names


def test_every_column_of_the_code_is_explained():
    columns = [name for name, _ in metrics._COLUMNS]
    assert {"att_adm%", "att_off%", "p95ok"} <= set(columns)
    assert set(columns) - explained_columns() == set()


def test_every_column_of_a_real_run_is_explained_with_its_window_line(tmp_path):
    done = subprocess.run([sys.executable, "-m", "octoserve.services.cli", "simulate", "--rate", "20", "--duration",
                           "8s"], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "OCTOSERVE_PURE_PYTHON": "1"})
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    header = next(line for line in lines if line.startswith("group "))
    assert header.split() == [name for name, _ in metrics._COLUMNS]
    assert set(header.split()) - explained_columns() == set()
    first = lines[0]
    rule = re.search(r"warm-up [\d.]+ s \((MSER-5|floor|stated|none)", first).group(1)
    steady = re.search(r"\| steady (yes|NO|\?)", first).group(1)
    text = section()
    assert f"`{rule}`" in text and f"`{steady}`" in text and "`steady`" in text
    for word in ("errors", "unfinished", "throughput", "goodput", "prefix"):
        assert word in lines[1] and word in text


def test_the_make_run_cap_and_the_time_scale_are_the_codes():
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    defaults = parser.parse_args([])
    text = section()
    assert f"output at {defaults.max_output} tokens (`--max-output`" in text
    assert f"{defaults.duration:g} modelled seconds of the seed-000 peak at `--time-scale {defaults.time_scale:g}`" in text
    assert "`make run` uses 15" in text and defaults.time_scale == 15
    assert "**`--time-scale K`**" in text and "give `bench` the same K" in text
