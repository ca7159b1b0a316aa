"""What the router's access log costs: scripts/bench_router.py run with `--access-log off`, `errors` (the default:
every failed request and 1 in 100 ok ones, i.e. sampled) and `all` (every request), in rotation, the same settings
otherwise, and the modes side by side.

    .venv/bin/python scripts/bench_access_log.py [--rounds 3] [--modes off,errors,all] [--levels 32,128] [--requests 100]

Each round runs every mode once, the order rotated round by round (so no mode always runs first or last on a
machine whose load drifts). Reported per mode (median over rounds): the router's added TTFT P50 on idle probes (each
probe is a request, so `all` writes a line per probe), streamed tokens per router CPU-second at each level, and
each mode's ratio to `off`. Nothing is asserted; on a shared machine only ratios from one run are comparable.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


def run_once(mode: str, args: argparse.Namespace, out: Path) -> dict:
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "bench_router.py"), "--levels", args.levels,
           "--requests", str(args.requests), "--level-s", str(args.level_s), "--profile", "none", "--out", "",
           "--json", str(out), "--router-args", f"--access-log {mode}"]
    print(f"[{mode}] {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, check=True, cwd=REPO_ROOT, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--modes", default="off,errors,all", help="access-log modes; the first is the baseline")
    p.add_argument("--levels", default="32,128")
    p.add_argument("--requests", type=int, default=100)
    p.add_argument("--level-s", type=float, default=6.0)
    args = p.parse_args()
    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for mode in modes[r % len(modes):] + modes[:r % len(modes)]:
                results[mode].append(run_once(mode, args, Path(tmp) / f"{mode}-{r}.json"))
                print(f"  round {r + 1}/{args.rounds} {mode} done", flush=True)

    def med(mode: str, f) -> float:
        return statistics.median(f(res) for res in results[mode])

    rows = [("added TTFT P50, idle (ms)", lambda res: res["ttft"]["added_p50_ms"])]
    for i, level in enumerate(args.levels.split(",")):
        rows.append((f"tokens per router CPU-s, {level} streams",
                     lambda res, i=i: res["levels"][i]["tokens_per_s"] / max(res["levels"][i]["router_cpu"], 1e-9)))
    base = modes[0]
    print(f"\n| metric (median of {args.rounds} rounds) | " + " | ".join(f"access log {m}" for m in modes) + " | "
          + " | ".join(f"{m} / {base}" for m in modes[1:]) + " |")
    print("|---|" + "---:|" * (2 * len(modes) - 1))
    for name, f in rows:
        values = [med(m, f) for m in modes]
        ratios = [v / values[0] if values[0] else float("nan") for v in values[1:]]
        print(f"| {name} | " + " | ".join(f"{v:,.3f}" for v in values) + " | "
              + " | ".join(f"{r:.3f}" for r in ratios) + " |")


if __name__ == "__main__":
    main()
