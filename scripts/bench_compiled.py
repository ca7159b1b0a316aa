"""Wall and CPU time of `octoserve simulate`, compiled (make compiled) against pure Python, side by side.

Each repetition runs the command once per build, interleaved, as a fresh process timed from start to exit; the
pure run sets OCTOSERVE_PURE_PYTHON=1. The timed runs are the plain command; one more run per build with --json
(writing the records costs seconds, so it is not timed) checks that the two print the same report (less the
wall-time line) and write the same records. Prints a Markdown table of medians.

    python scripts/bench_compiled.py --reps 5
    python scripts/bench_compiled.py --reps 5 --baseline main   # adds that commit's compiled build as a third variant

With --baseline REV, REV's tree (`git archive`) is compiled with its own scripts/build_compiled.py in a temporary
folder and run from there; "identical" then also requires its report and records to equal this tree's.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _run(
    variant: list[str], env: dict[str, str], args: list[str], json_path: Path | None
) -> tuple[float, float, str, dict]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    extra = [] if json_path is None else ["--json", str(json_path)]
    done = subprocess.run([*variant, "simulate", *args, *extra], env=env, capture_output=True, text=True, check=True)
    wall_s = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    report = "\n".join(line for line in done.stdout.splitlines() if not line.startswith("simulator speed:"))
    payload = {}
    if json_path is not None:
        payload = json.loads(json_path.read_text())
        del payload["wall_s"]
    return wall_s, cpu_s, report, payload


# Runs `octoserve` from the package folder in argv[1] (a baseline tree), checking that it is the one imported and
# that its compiled build is the one that runs.
BASELINE_RUNNER = ("import sys; root = sys.argv.pop(1); sys.path.insert(0, root); import octoserve.services.cli as cli; "
                   "from octoserve.services import compiled; assert cli.__file__.startswith(root), cli.__file__; "
                   "assert compiled.state == 'compiled', compiled.state; sys.exit(cli.main())")
PACKAGE_DIRS = ("services", "router", "prefill_worker", "decode_worker", "http_front")


def baseline_package(rev: str, into: Path) -> Path:
    """Commit `rev`'s tree, its hot modules compiled by its own scripts/build_compiled.py, laid out as the installed
    `octoserve` package under `into / "pkg"` (the folder to put first on the import path)."""
    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(src, filter="data")
    print(f"compiling {rev}'s hot modules ...", file=sys.stderr)
    subprocess.run([sys.executable, "scripts/build_compiled.py"], cwd=src, check=True)
    pkg = into / "pkg" / "octoserve"
    shutil.copytree(src / "sdk" / "octoserve", pkg)
    for folder in PACKAGE_DIRS:
        if (src / folder).is_dir():
            shutil.copytree(src / folder, pkg / folder)
    return into / "pkg"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="seed-000")
    parser.add_argument("--duration", default="60s")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--cost-profiles", default="default,pessimistic")
    parser.add_argument("--baseline", metavar="REV", help="also time that commit's compiled build (a third column)")
    args = parser.parse_args()
    from octoserve.services import compiled

    if compiled.state != "compiled":
        print(f"no up-to-date compiled build (state {compiled.state!r}): run `make compiled` first", file=sys.stderr)
        return 1
    env = {k: v for k, v in os.environ.items() if k != "OCTOSERVE_PURE_PYTHON"}
    octoserve = [sys.executable, "-m", "octoserve.services.cli"]
    variants: dict[str, tuple[list[str], dict[str, str]]] = {  # name -> (command before "simulate", environment)
        "pure": (octoserve, {**env, "OCTOSERVE_PURE_PYTHON": "1"}),
        "compiled": (octoserve, env),
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        if args.baseline:
            pkg = baseline_package(args.baseline, Path(tmp) / "baseline")
            variants[args.baseline] = ([sys.executable, "-c", BASELINE_RUNNER, str(pkg)], env)
        for cost_profile in args.cost_profiles.split(","):
            cmd = ["--profile", args.profile, "--duration", args.duration, "--cost-profile", cost_profile]
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
            outputs: dict[str, tuple[str, dict]] = {}
            for name, (variant, variant_env) in variants.items():
                _, _, report, payload = _run(variant, variant_env, cmd, Path(tmp) / f"{name}.json")
                outputs[name] = (report, payload)
            for rep in range(args.reps):
                for name, (variant, variant_env) in variants.items():
                    wall_s, cpu_s, report, _ = _run(variant, variant_env, cmd, None)
                    times[name].append((wall_s, cpu_s))
                    assert report == outputs[name][0], "a timed run printed another report than its --json run"
                    print(f"{cost_profile} rep {rep + 1}/{args.reps} {name}: {wall_s:.2f} s wall, {cpu_s:.2f} s CPU",
                          file=sys.stderr)
            identical = all(out == outputs["compiled"] for out in outputs.values())
            med = {name: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t))
                   for name, t in times.items()}
            # A rep runs the variants back to back: the median of its CPU ratios is the least disturbed by the load.
            base_ratio = (statistics.median(b[1] / c[1] for b, c in zip(times[args.baseline], times["compiled"]))
                          if args.baseline else None)
            rows.append((cost_profile, med, base_ratio, identical))
    head = "| profile | cost profile | pure wall s | pure CPU s | compiled wall s | compiled CPU s | wall pure / compiled |"
    rule = "|---|---|---|---|---|---|---|"
    if args.baseline:
        head += f" {args.baseline} wall s | {args.baseline} CPU s | CPU {args.baseline} / compiled |"
        rule += "---|---|---|"
    print(head + " identical |")
    print(rule + "---|")
    for cost_profile, med, base_ratio, identical in rows:
        (pw, pc), (cw, cc) = med["pure"], med["compiled"]
        line = (f"| {args.profile} {args.duration} | {cost_profile} | {pw:.2f} | {pc:.2f} | {cw:.2f} | {cc:.2f} | "
                f"{pw / cw:.2f}x |")
        if args.baseline:
            bw, bc = med[args.baseline]
            line += f" {bw:.2f} | {bc:.2f} | {base_ratio:.2f}x |"
        print(line + f" {'yes' if identical else 'NO'} |")
    return 0 if all(row[3] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
