"""Simulator speed: `octoserve simulate` timed with the fast path on and off (and optionally an older commit).

Each variant runs the same command as a fresh process, start to exit (imports, trace generation, simulation,
summary), several times, interleaved so that a shared machine's load hits every variant alike. The timed runs are
the command as a user types it (no --json); one more run per variant and case writes --json. Reports wall and CPU
(user + sys of the child) seconds per variant, the medians' ratios and the median of each rep's CPU ratio (its
variants ran back to back, under one moment's load), and checks that every run of every variant
printed the same report (the simulator's own speed line aside) and that the --json runs wrote the same records,
instance figures and summary.

    python scripts/bench_sim_speed.py                        # seed-000, 60 s, both cost profiles, 3 reps
    python scripts/bench_sim_speed.py --baseline 6876cbf     # adds the code of that commit as a third variant
    python scripts/bench_sim_speed.py --profiles seed-000,seed-003 --reps 5
    python scripts/bench_sim_speed.py --config services/configs/node-disagg.yaml --cost-profiles default

Variants: `fast` (the default path), `plain` (OCTOSERVE_SIM_FAST=0: the message API the live engine uses) and,
with --baseline REV, `REV` (that commit's tree, extracted with `git archive` into a temporary folder and put first
on the import path; no worktree, no checkout).
"""

from __future__ import annotations

import argparse
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
PACKAGE_DIRS = {"services": "services", "router": "router", "prefill_worker": "prefill_worker",
                "decode_worker": "decode_worker", "http_front": "http_front"}
RUNNER = "import sys; from octoserve.services.cli import main; sys.exit(main())"  # what the `octoserve` script runs
# The same, with the folder in argv[1] first on the import path (a baseline tree; asserts it was the one imported).
BASELINE_RUNNER = ("import sys; root = sys.argv.pop(1); sys.path.insert(0, root); import octoserve.services.cli as cli; "
                   "assert cli.__file__.startswith(root), cli.__file__; sys.exit(cli.main())")


def baseline_tree(rev: str, into: Path) -> Path:
    """An importable `octoserve` package of commit `rev` under `into` (the layout pyproject.toml maps)."""
    src = into / "src"
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", rev], check=True, capture_output=True).stdout
    archive_path = into / "tree.tar"
    archive_path.write_bytes(archive)
    with tarfile.open(archive_path) as tar:
        tar.extractall(src, filter="data")
    pkg = into / "pkg" / "octoserve"
    shutil.copytree(src / "sdk" / "octoserve", pkg)
    for name, folder in PACKAGE_DIRS.items():
        if (src / folder).is_dir():
            shutil.copytree(src / folder, pkg / name)
    return into / "pkg"


def run_once(command: list[str], env: dict[str, str], json_path: Path | None) -> tuple[float, float, str]:
    """(wall s, CPU s, printed report without the speed line) of one run; it writes `json_path` when given."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    json_args = [] if json_path is None else ["--json", str(json_path)]
    proc = subprocess.run(command + json_args, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(command)} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    report = "\n".join(line for line in proc.stdout.splitlines() if not line.startswith("simulator speed:"))
    return wall, cpu, report


def results_of(json_path: Path) -> tuple:
    payload = json.loads(json_path.read_text())
    return payload["summary"], payload["records"], payload["instances"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--profiles", default="seed-000", help="workload profiles, comma-separated")
    parser.add_argument("--cost-profiles", default="default,pessimistic", help="cost profiles, comma-separated")
    parser.add_argument("--duration", default="60s", help="arrival window passed to simulate")
    parser.add_argument("--reps", type=int, default=3, help="runs per variant and case")
    parser.add_argument("--baseline", metavar="REV", help="also time the code of this commit")
    parser.add_argument("--no-plain", action="store_true", help="skip the OCTOSERVE_SIM_FAST=0 variant")
    parser.add_argument("--config", help="node config passed to simulate (default: its default placement)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="bench_sim_speed_") as tmp_name:
        tmp = Path(tmp_name)
        base_env = {k: v for k, v in os.environ.items() if k != "OCTOSERVE_SIM_FAST"}
        here = [sys.executable, "-c", RUNNER]  # the installed (editable) package: this tree
        variants: dict[str, tuple[list[str], dict[str, str]]] = {"fast": (here, base_env)}
        if not args.no_plain:
            variants["plain"] = (here, {**base_env, "OCTOSERVE_SIM_FAST": "0"})
        if args.baseline:
            pkg = baseline_tree(args.baseline, tmp / "baseline")
            variants[args.baseline] = ([sys.executable, "-c", BASELINE_RUNNER, str(pkg)], base_env)
        cases = [(p, c) for p in args.profiles.split(",") for c in args.cost_profiles.split(",")]
        config_args = [] if args.config is None else ["--config", str(Path(args.config).resolve())]
        print(f"{len(cases)} case(s) x {len(variants)} variant(s) x {args.reps} rep(s) + one --json run each; "
              f"`octoserve simulate --profile P --duration {args.duration} --cost-profile C {' '.join(config_args)}`",
              file=sys.stderr)
        rows = []
        ok = True
        for profile, cost in cases:
            sim = ["simulate", "--profile", profile, "--duration", args.duration, "--cost-profile", cost, *config_args]
            times: dict[str, list[tuple[float, float]]] = {v: [] for v in variants}
            reports: dict[str, set[str]] = {v: set() for v in variants}
            results = {}
            for rep in range(args.reps):
                for name, (prefix, env) in variants.items():
                    wall, cpu, report = run_once(prefix + sim, env, None)
                    times[name].append((wall, cpu))
                    reports[name].add(report)
                    print(f"  {profile} {cost} {name} rep {rep + 1}: wall {wall:.2f} s, cpu {cpu:.2f} s",
                          file=sys.stderr)
            for name, (prefix, env) in variants.items():
                json_path = tmp / f"{name}.json"
                reports[name].add(run_once(prefix + sim, env, json_path)[2])
                results[name] = results_of(json_path)
                json_path.unlink()
            same_runs = all(len(reports[v]) == 1 for v in variants)
            first = next(iter(variants))
            same_variants = all(results[v] == results[first] for v in variants)
            same_text = all(reports[v] == reports[first] for v in variants)
            ok = ok and same_runs and same_variants and same_text
            med = {v: (statistics.median(w for w, _ in t), statistics.median(c for _, c in t)) for v, t in times.items()}
            # Each rep runs every variant back to back, so a rep's CPU ratio sees one moment's load on both sides:
            # the median of those ratios is steadier than the ratio of medians on a shared machine.
            paired = {v: statistics.median(c / f for (_, c), (_, f) in zip(times[v], times[first])) for v in variants}
            rows.append((profile, cost, med, paired, same_runs, same_variants and same_text))
        print_table(rows, list(variants))
        return 0 if ok else 1


def print_table(rows, variants: list[str]) -> None:
    cols = " | ".join(f"{v} wall s | {v} cpu s" for v in variants)
    ratios = " | ".join(f"wall {v}/fast | cpu {v}/fast | cpu {v}/fast paired" for v in variants[1:])
    print(f"| profile | cost | {cols} | {ratios} | repeat-identical | variants identical |")
    print("|" + "---|" * (4 + 5 * len(variants) - 3))
    for profile, cost, med, paired, same_runs, same_variants in rows:
        cells = " | ".join(f"{med[v][0]:.2f} | {med[v][1]:.2f}" for v in variants)
        ratio_cells = " | ".join(f"{med[v][0] / med['fast'][0]:.2f}x | {med[v][1] / med['fast'][1]:.2f}x | "
                                 f"{paired[v]:.2f}x" for v in variants[1:])
        print(f"| {profile} | {cost} | {cells} | {ratio_cells} | {'yes' if same_runs else 'NO'} | "
              f"{'yes' if same_variants else 'NO'} |")


if __name__ == "__main__":
    sys.exit(main())
