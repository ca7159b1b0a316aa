"""Markdown pages whose sections the measuring commands rewrite in place (BENCHMARKS.md): each command owns the
sections under its own `## ` headings and leaves every other line of the page as it was."""

from __future__ import annotations


def replace_section(text: str, heading: str, body: str) -> str:
    """`text` with the section under `heading` (up to the next '## ' heading) replaced by `body`, or appended."""
    lines = text.splitlines()
    new = [heading, "", *body.strip("\n").splitlines(), ""]
    if heading not in lines:
        return "\n".join([*lines, "", *new]).strip("\n") + "\n"
    start = lines.index(heading)
    end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")), len(lines))
    return "\n".join([*lines[:start], *new, *lines[end:]]).rstrip("\n") + "\n"
