"""Report figures a reader can place: the simulator's fault report dates a dip from the fault on (a request lost
with its instance is dated by the fault, not by its last token a step earlier); `elastic-day` names what each goodput
is and what each ratio divides; `plan`'s placement list keeps its ranking order and its header says what it is.
CLI runs are subprocesses from a temporary directory outside the checkout."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from octoserve.services.sim.cli_plan import RANKING_ORDER
from octoserve.services.sim.elastic_day import summary_lines

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OCTOSERVE_PURE_PYTHON": "1"}  # stderr stays free of the stale-extension warning


def octoserve(*argv: str, cwd) -> subprocess.CompletedProcess:
    done = subprocess.run([sys.executable, "-m", "octoserve.services.cli", *argv], capture_output=True, text=True,
                          timeout=300, cwd=cwd, env=ENV)
    assert done.returncode == 0, done.stderr
    return done


FAULT_HEADER = ("fault                 model          before    dip (at)         recovery   rerouted  continued  failed  "
                "bound  refused")
FAULT_NOTE = ("(attainment: requests meeting the SLO / requests ended, by second of outcome: finish, refusal, or the "
              "fault for a request lost with its instance; dip (at): the worst second from the fault on; recovery: "
              "from the fault to the end of the first 10 s window, after the instance is back, within 5 points of "
              "before; rerouted: moved before their first token; continued: streams that went on from their last "
              "token on another instance; failed: requests the fault ended, because their continuations were spent "
              "(bound, policies.max_continuations) or no instance had room to take them again (refused))")
FAULT_ROW = re.compile(r"sm-0@20\+5 +llama-3-8b +(\d+\.\d)% +(\d+\.\d)% \( *(\d+) s\) +(\d+ s|never) +(\d+) +(\d+) "
                       r"+(\d+) +(\d+) +(\d+)")


@pytest.mark.parametrize("bound", [None, 0])
def test_simulate_dates_the_fault_dip_from_the_fault_on(tmp_path, bound):
    sets = [] if bound is None else ["--set", f"policies.max_continuations={bound}"]
    out = octoserve("simulate", "--rate", "60", "--duration", "40s", "--fault", "sm-0@20+5", *sets,
                    cwd=tmp_path).stdout
    lines = out.splitlines()
    i = lines.index(FAULT_HEADER)
    assert lines[i + 2] == FAULT_NOTE and i + 3 == len(lines)
    row = FAULT_ROW.fullmatch(lines[i + 1])
    assert row, lines[i + 1]
    before, dip, dip_at, _, _, continued, failed, bound_failed, refused = row.groups()
    assert int(failed) == int(bound_failed) + int(refused)
    if bound == 0:  # the streams on sm-0 fail with it, and make the dip
        assert int(continued) == 0 and int(failed) > 0 and int(failed) == int(bound_failed)
        assert float(dip) < float(before)
    else:  # they go on elsewhere
        assert int(continued) > 0 and int(failed) == 0
    # Before: the dip (its requests lost with sm-0, by their last token) was dated 19 s, before the fault at 20 s.
    assert int(dip_at) >= 20


def test_elastic_day_names_each_goodput_and_what_each_ratio_divides():
    h = {"static": 80.45, "oracle": 90.0, "elastic": 80.45, "vs_static": 1.0, "vs_oracle": 80.45 / 90.0,
         "load_vs_static": 1.02, "load_vs_oracle": 0.95, "lost": {"static": 0, "oracle": 0, "elastic": 0, "pd": 0},
         "adapt_s": math.nan, "first_adapt_s": math.nan, "placement_adapt_s": math.nan, "step_best": "",
         "reconfigs": 4, "migrated": 12, "pd_fixed": 50.0, "pd_balanced": 55.0, "pd_factor": 1.1, "pd_reconfigs": 2}
    assert summary_lines(SimpleNamespace(static_by_mean=55.45), h).splitlines()[:4] == [
        "goodput: best static 80.45 req/s, static for the average mix 55.45 req/s, hourly oracle 90.00 req/s, "
        "elastic 80.45 req/s",
        "  (best static: the best of the static placements simulated for the day; static for the average mix: the "
        "best of those picked for the day's mean demand alone)",
        "elastic / best static 1.00x, elastic / static for the average mix 1.45x, elastic / hourly oracle 0.89x",
        "load-weighted goodput: elastic / best static 1.02x, elastic / hourly oracle 0.95x",
    ]
    assert summary_lines(SimpleNamespace(static_by_mean=55.45), h).splitlines()[-1] == (
        "P/D phase, disaggregated: fixed ratio 50.00 req/s, balanced 55.00 req/s (balanced / fixed 1.10x, "
        "2 role changes)")


def test_elastic_day_prints_the_labelled_lines(tmp_path):
    out = octoserve("elastic-day", "--hour-s", "5", "--cost-profile", "default", cwd=tmp_path).stdout.splitlines()
    g = next(i for i, line in enumerate(out) if line.startswith("goodput: "))
    num = r"(\d+\.\d\d)"
    goodput = re.fullmatch(rf"goodput: best static {num} req/s, static for the average mix {num} req/s, hourly "
                           rf"oracle {num} req/s, elastic {num} req/s", out[g])
    assert goodput, out[g]
    static, by_mean, oracle, elastic = map(float, goodput.groups())
    assert by_mean <= static  # the best static is the best of all the static placements tried
    ratios = re.fullmatch(rf"elastic / best static {num}x, elastic / static for the average mix {num}x, elastic / "
                          rf"hourly oracle {num}x", out[g + 2])
    assert ratios, out[g + 2]
    for ratio, denominator in zip(map(float, ratios.groups()), (static, by_mean, oracle)):
        assert abs(ratio - elastic / denominator) <= 0.006 + 0.01 * ratio  # the printed figures are rounded
    assert re.fullmatch(rf"load-weighted goodput: elastic / best static {num}x, elastic / hourly oracle {num}x",
                        out[g + 3]), out[g + 3]
    assert re.fullmatch(rf"P/D phase, disaggregated: fixed ratio {num} req/s, balanced {num} req/s \(balanced / "
                        rf"fixed {num}x, \d+ role changes\)", out[g + 5]), out[g + 5]


PLAN_HEADER = ("SLO-aware estimate per placement (decode steps <= ITL SLO, a mean prompt's prefill <= TTFT SLO, KV "
               "fits), ranked: placements that serve every model first, then by estimated goodput, then by mix rate "
               "(the order --top N simulates)")
PLAN_ROW = re.compile(r"  goodput ~ +(\d+\.\d) req/s  mix rate ~ +(\d+\.\d)  \[(.*?)\]  (.*?)(  \(serves no [^)]*\))?"
                      r"(  \(rank \d+ of \d+: best time-shared\))?")


def test_plan_lists_placements_in_their_ranking_order_and_says_which(tmp_path):
    assert PLAN_HEADER.endswith(f"ranked: {RANKING_ORDER}")
    out = octoserve("plan", "--workload", str(REPO / "examples" / "workload-chat.yaml"), "--top", "0",
                    cwd=tmp_path).stdout.splitlines()
    i = out.index(PLAN_HEADER)
    rows = []
    for line in out[i + 1:]:
        if not line:
            break
        m = PLAN_ROW.fullmatch(line)
        assert m, line
        caps = dict(part.rsplit(" ", 1) for part in m.group(3).split(", "))
        serves_all = all(float(v) > 0 for v in caps.values())
        assert (m.group(5) is None) == serves_all, line  # a placement that drops a model says which
        if m.group(6) is None:  # the best time-shared one, listed below the others with its rank
            rows.append((not serves_all, -float(m.group(1)), -float(m.group(2))))
    assert len(rows) >= 2 and rows == sorted(rows)
    # This workload has both kinds: placements serving both models come first even at a lower goodput estimate.
    assert rows[0][0] is False and rows[-1][0] is True and -rows[-1][1] > -rows[2][1]
