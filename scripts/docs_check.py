"""`make docs-check`: the user docs hold inside the repository.

Checks README.md, BENCHMARKS.md, docs/**/*.md and examples/*:
- every relative Markdown link `[text](path)` points at a file or folder that exists, and its `#anchor`, if any, at a
  heading of that page (GitHub's heading anchors);
- a page with a contents list (a paragraph starting "Contents", before its first `## ` heading) lists every one of
  its `## ` headings;
- every repository path quoted in backticks (`docs/COST_MODEL.md`, `docs/bench/cdf_peak_<policy>.png`) exists
  (`<...>` placeholders match any name);
- no absolute machine paths or temporary files (/work/, /home/, /tmp/, ...), no links outside the repository
  (../shared), no issue numbers;
- every figure under docs/ (PNG) is named in a Markdown section that states the command reproducing it, every
  results page under docs/bench/ states its command, and so does every section of BENCHMARKS.md with a table of
  figures.

Prints one line per problem and exits 1 when there is any; `problems(root)` returns them for the test.
"""

from __future__ import annotations

import fnmatch
import re
import sys
from pathlib import Path

TOP_DIRS = ("docs", "services", "scripts", "router", "sdk", "protos", "examples", "tests", "decode_worker",
            "prefill_worker")
FORBIDDEN = (
    (re.compile(r"\.\./shared\b"), "a pointer outside the repository"),
    (re.compile(r"(?<![\w.~-])/(?:work|home|tmp|Users|root|mnt|private)/"),
     "an absolute machine path or temporary file"),
    (re.compile(r"\b[Ii]ssue\s+#?\d+|\bissues/\d+"), "an issue number"),
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
QUOTED_PATH = re.compile(
    r"`((?:%s)/[\w./<>*-]+\.(?:md|py|yaml|yml|proto|png|json|jsonl|sh|toml))`" % "|".join(TOP_DIRS))
COMMAND = re.compile(r"(?:^|`|\n)\s*(?:\$ )?(?:octoserve |make |python3? |\.venv/bin/|PYTHONPATH=|OCTOSERVE_)", re.M)


def doc_files(root: Path) -> list[Path]:
    files = [root / "README.md", root / "BENCHMARKS.md", *sorted((root / "docs").rglob("*.md"))]
    files += sorted(p for p in (root / "examples").rglob("*") if p.is_file()) if (root / "examples").is_dir() else []
    return [p for p in files if p.is_file()]


def _exists(root: Path, rel: str) -> bool:
    if "..." in rel:
        return True  # an elided path in prose ("`.../Llama-2-7b-hf/mlp.csv`")
    pattern = re.sub(r"<[^>]+>", "*", rel)
    if "*" not in pattern:
        return (root / pattern).exists()
    return any(fnmatch.fnmatch(str(p.relative_to(root)), pattern) for p in root.glob(pattern.split("*")[0] + "*"))


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(text: str) -> list[tuple[int, str]]:
    """(level, title) of each Markdown heading outside code fences."""
    out, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"(#{1,6}) (.+)", line)):
            out.append((len(m.group(1)), m.group(2)))
    return out


def anchors(text: str) -> set[str]:
    """Every heading anchor of a page; a repeated heading's later anchors end in -1, -2, ... as on GitHub."""
    seen: dict[str, int] = {}
    out = set()
    for _, title in _headings(text):
        slug = _slug(title)
        out.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
        seen[slug] = seen.get(slug, 0) + 1
    return out


def _contents_problems(rel: Path, text: str) -> list[str]:
    first = re.search(r"^## ", text, re.M)
    head = text[: first.start()] if first else text
    start = re.search(r"^Contents", head, re.M)
    if start is None:
        return []
    listed = set(re.findall(r"\]\(#([^)\s]+)\)", head[start.start():]))
    return [f"{rel}: its contents list leaves out the heading '## {title}'"
            for level, title in _headings(text) if level == 2 and _slug(title) not in listed]


def _sections(text: str) -> list[str]:
    return re.split(r"\n(?=#{1,2} )", text)


def problems(root: Path) -> list[str]:
    root = root.resolve()
    found: list[str] = []
    texts = {}
    for path in doc_files(root):
        rel = path.relative_to(root)
        text = path.read_text(encoding="utf-8", errors="replace")
        texts[rel] = text
        for number, line in enumerate(text.splitlines(), start=1):
            for pattern, what in FORBIDDEN:
                if m := pattern.search(line):
                    found.append(f"{rel}:{number}: {what}: {m.group(0)!r}")
            if path.suffix != ".md":
                continue
            for target in LINK.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue
                target_path, _, anchor = target.partition("#")
                page = path.parent / target_path if target_path else path
                if target_path and not page.exists():
                    found.append(f"{rel}:{number}: link to a missing file: {target}")
                elif anchor and page.suffix == ".md" and anchor not in anchors(page.read_text(encoding="utf-8")):
                    found.append(f"{rel}:{number}: link to a missing heading: {target}")
            for quoted in QUOTED_PATH.findall(line):
                if not _exists(root, quoted):
                    found.append(f"{rel}:{number}: names a missing file: {quoted}")
    md = {rel: t for rel, t in texts.items() if rel.suffix == ".md"}
    for rel, text in md.items():
        found += _contents_problems(rel, text)
    for figure in sorted((root / "docs").rglob("*.png")):
        rel = str(figure.relative_to(root))
        stated = False
        for text in md.values():
            for section in _sections(text):
                names = [re.sub(r"<[^>]+>", "*", q) for q in re.findall(r"[\w./<>-]+\.png", section)]
                if any(fnmatch.fnmatch(rel, n) or fnmatch.fnmatch(figure.name, n) for n in names) \
                        and COMMAND.search(section):
                    stated = True
        if not stated:
            found.append(f"{rel}: a figure no Markdown section names next to the command that reproduces it")
    for rel, text in md.items():
        if rel.parts[:2] == ("docs", "bench") and not COMMAND.search(text):
            found.append(f"{rel}: a results page without the command that reproduces it")
    for section in _sections(md.get(Path("BENCHMARKS.md"), "")):
        if re.search(r"^\|.*\d.*\|\s*$", section, re.M) and not COMMAND.search(section):
            title = section.strip().splitlines()[0]
            found.append(f"BENCHMARKS.md: section {title!r} has measured figures but no command that reproduces them")
    return found


def main() -> int:
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1]
    found = problems(root)
    for line in found:
        print(line)
    print(f"docs-check: {len(found)} problem(s) in {len(doc_files(root))} files", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
