"""Wall and CPU time of `octoserve simulate`, compiled (make compiled) against pure Python, side by side.

Each repetition runs the command once per build, interleaved, as a fresh process timed from start to exit; the
pure run sets OCTOSERVE_PURE_PYTHON=1. The timed runs are the plain command; one more run per build with --json
(writing the records costs seconds, so it is not timed) checks that the two print the same report (less the
wall-time line) and write the same records. Prints a Markdown table of medians.

    python scripts/bench_compiled.py --reps 5
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def _run(args: list[str], pure: bool, json_path: Path | None) -> tuple[float, float, str, dict]:
    env = {k: v for k, v in os.environ.items() if k != "OCTOSERVE_PURE_PYTHON"}
    if pure:
        env["OCTOSERVE_PURE_PYTHON"] = "1"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    extra = [] if json_path is None else ["--json", str(json_path)]
    done = subprocess.run([sys.executable, "-m", "octoserve.services.cli", "simulate", *args, *extra],
                          env=env, capture_output=True, text=True, check=True)
    wall_s = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    report = "\n".join(line for line in done.stdout.splitlines() if not line.startswith("simulator speed:"))
    payload = {}
    if json_path is not None:
        payload = json.loads(json_path.read_text())
        del payload["wall_s"]
    return wall_s, cpu_s, report, payload


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="seed-000")
    parser.add_argument("--duration", default="60s")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cost-profiles", default="default,pessimistic")
    args = parser.parse_args()
    from octoserve.services import compiled

    if compiled.state != "compiled":
        print(f"no up-to-date compiled build (state {compiled.state!r}): run `make compiled` first", file=sys.stderr)
        return 1
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for cost_profile in args.cost_profiles.split(","):
            cmd = ["--profile", args.profile, "--duration", args.duration, "--cost-profile", cost_profile]
            times: dict[bool, list[tuple[float, float]]] = {True: [], False: []}
            outputs: dict[bool, tuple[str, dict]] = {}
            for pure in (True, False):
                _, _, report, payload = _run(cmd, pure, Path(tmp) / f"{pure}.json")
                outputs[pure] = (report, payload)
            for rep in range(args.reps):
                for pure in (True, False):
                    wall_s, cpu_s, report, _ = _run(cmd, pure, None)
                    times[pure].append((wall_s, cpu_s))
                    assert report == outputs[pure][0], "a timed run printed another report than its --json run"
                    print(f"{cost_profile} rep {rep + 1}/{args.reps} {'pure' if pure else 'compiled'}: "
                          f"{wall_s:.2f} s wall, {cpu_s:.2f} s CPU", file=sys.stderr)
            identical = outputs[True] == outputs[False]
            med = {pure: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
                   for pure, t in times.items()}
            rows.append((cost_profile, med[True], med[False], identical))
    print(f"| profile | cost profile | pure wall s | pure CPU s | compiled wall s | compiled CPU s | "
          f"wall pure / compiled | identical |")
    print("|---|---|---|---|---|---|---|---|")
    for cost_profile, (pw, pc), (cw, cc), identical in rows:
        print(f"| {args.profile} {args.duration} | {cost_profile} | {pw:.2f} | {pc:.2f} | {cw:.2f} | {cc:.2f} | "
              f"{pw / cw:.2f}x | {'yes' if identical else 'NO'} |")
    return 0 if all(row[3] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
