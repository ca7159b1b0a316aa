"""BENCHMARKS.md, "Fault runs: continued vs failed": the four fault runs and their table, from one command.

    .venv/bin/python scripts/fault_continuation.py [--benchmarks BENCHMARKS.md]

Runs `octoserve simulate --duration 60s --fault sm-0@30+5` under the cost profiles default and pessimistic, each
with the config's `policies.max_continuations` and with `--set policies.max_continuations=0`, in process through
the same calls the CLI makes (services/sim/cli_simulate.py: the arguments parsed by its own parser, the node
loaded with the overrides, the workload, the simulation, the fault report). Per run:
- rerouted, continued, failed (bound / refused), dip (at) and recovery: the fault report (`octoserve simulate`
  prints the same);
- from the records of the lost instance's model (the 8B): admitted requests (not refused) and the share of them
  meeting the SLO; admitted requests that arrived in the 10 s before the fault and failed (ended with an error);
  the continued streams (`num_continuations > 0`) meeting the SLO, and the gap across the fault of each: from its
  last token at or before the fault to its first token after it (the continuation's first), P50 / P95 / max
  (numpy's linear percentiles).
Progress goes to stderr. Without --benchmarks the table is printed; with it, the table of that section and its
"Command: ..." sentence are rewritten in place (the rest of the file is left as it is).
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import numpy as np  # noqa: E402

from octoserve.services.metrics import RequestRecord, SloSpec, meets_slo  # noqa: E402

SECTION = "### Fault runs: continued vs failed"
FAULT = "sm-0@30+5"
DURATION = "60s"
BEFORE_S = 10.0  # "admitted 20-30 s": arrived in the 10 s before the fault
COST_PROFILES = ("default", "pessimistic")
COMMAND = "python scripts/fault_continuation.py --benchmarks BENCHMARKS.md"
HEADER = ("| cost profile | max_continuations | rerouted | continued | failed (bound / refused) | 8B admitted, met SLO "
          "| admitted 20-30 s, failed | continued met SLO | gap across the fault P50 / P95 / max | dip (at) "
          "| recovery |")
ALIGN = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
WRAP = 117  # the section's line length


@dataclass(frozen=True, slots=True)
class RecordFigures:
    """What the table says of one run's records of one model (`record_figures`)."""

    admitted: int
    met_slo: int
    admitted_before: int  # admitted, arrived in [fault - before_s, fault)
    failed_before: int  # of those, ended with an error
    continued: int  # num_continuations > 0
    continued_met_slo: int
    gaps_s: tuple[float, ...]  # per continued stream with tokens on both sides of the fault, in record order

    @property
    def met_fraction(self) -> float:
        return self.met_slo / self.admitted if self.admitted else 0.0

    def gap_stats_s(self) -> tuple[float, float, float] | None:
        """(P50, P95, max) of the gaps, numpy's linear percentiles; None without any."""
        if not self.gaps_s:
            return None
        p50, p95 = np.percentile(self.gaps_s, [50, 95])
        return float(p50), float(p95), max(self.gaps_s)


def gap_across_s(record: RequestRecord, fault_at_s: float) -> float | None:
    """From the last token at or before the fault to the first one after it; None without tokens on both sides."""
    before = [t for t in record.token_times_s if t <= fault_at_s]
    after = [t for t in record.token_times_s if t > fault_at_s]
    if not before or not after:
        return None
    return min(after) - max(before)


def record_figures(records: Sequence[RequestRecord], model: str, fault_at_s: float, slo: SloSpec,
                   before_s: float = BEFORE_S) -> RecordFigures:
    mine = [r for r in records if r.model == model and not r.refused]
    before = [r for r in mine if fault_at_s - before_s <= r.arrival_s < fault_at_s]
    continued = [r for r in mine if r.num_continuations > 0]
    gaps = tuple(g for r in continued if (g := gap_across_s(r, fault_at_s)) is not None)
    return RecordFigures(
        admitted=len(mine),
        met_slo=sum(meets_slo(r, slo) for r in mine),
        admitted_before=len(before),
        failed_before=sum(bool(r.error) for r in before),
        continued=len(continued),
        continued_met_slo=sum(meets_slo(r, slo) for r in continued),
        gaps_s=gaps,
    )


def table_row(cost_profile: str, max_continuations: int, report, figures: RecordFigures) -> str:
    """One Markdown row; `report`: the run's `faults.FaultReport` (any object with its fields)."""
    gaps = figures.gap_stats_s()
    recovery = "never" if report.recovery_s is None else f"{report.recovery_s:.0f} s"
    cells = [
        cost_profile,
        str(max_continuations),
        f"{report.rerouted:,}",
        f"{report.continued:,}",
        f"{report.failed_bound + report.failed_refused:,} ({report.failed_bound:,} / {report.failed_refused:,})",
        f"{figures.admitted:,}, {100 * figures.met_fraction:.1f} %",
        f"{figures.failed_before:,} of {figures.admitted_before:,}",
        f"{figures.continued_met_slo:,} of {figures.continued:,}" if figures.continued else "-",
        "-" if gaps is None else " / ".join(f"{g:.1f}" for g in gaps) + " s",
        f"{100 * report.dip:.1f} % ({report.dip_at_s:.0f} s)",
        recovery,
    ]
    return "| " + " | ".join(cells) + " |"


def format_table(rows: Sequence[str]) -> str:
    return "\n".join([HEADER, ALIGN, *rows])


# --- the runs ----------------------------------------------------------------------------------------------------

def simulate_args(cost_profile: str, no_continuations: bool) -> list[str]:
    """`octoserve simulate`'s arguments for one run (the table's command)."""
    argv = ["--duration", DURATION, "--fault", FAULT, "--cost-profile", cost_profile]
    return argv + (["--set", "policies.max_continuations=0"] if no_continuations else [])


def run_one(cost_profile: str, no_continuations: bool) -> str:
    """One simulation as `octoserve simulate` runs it; its table row."""
    from octoserve.services.metrics import slo_spec_of
    from octoserve.services import config
    from octoserve.services.sim import cli_simulate
    from octoserve.services.sim.driver import cycle_collector_paused
    from octoserve.services.sim.faults import fault_report, parse_fault
    from octoserve.services.workload import generate_trace
    from octoserve.services.workload_io import node_workload, with_workload_slos

    parser = argparse.ArgumentParser(prog="octoserve simulate")
    cli_simulate.add_arguments(parser)
    argv = simulate_args(cost_profile, no_continuations)
    args = parser.parse_args(argv)
    print(f"octoserve simulate {' '.join(argv)}", file=sys.stderr)
    with cycle_collector_paused():
        node = config.load_with_overrides(args.config, args.overrides, args.cost_profile)
        profile, trace = node_workload(args, node)
        node = with_workload_slos(node, profile)
        if trace is None:
            trace = generate_trace(profile, args.seed)
        faults = [parse_fault(f) for f in args.faults]
        print(f"  {len(trace)} requests of {profile.name} at {profile.rate_rps:g} req/s for {profile.duration_s:g} s",
              file=sys.stderr)
        keep: list = []
        result = cli_simulate.simulate_with_progress(node, trace, profile.duration_s, seed=args.seed,
                                                     warmup_s=args.warmup, faults=faults, keep=keep)
        (fault,) = faults
        model = node.instance(fault.instance_id).model
        slo = slo_spec_of(node.slo)
        # As `cli_simulate.format_fault_reports` makes it
        report = fault_report(result.records, slo, fault, model, counts=result.fault_counts_by_fault[0],
                              faults=faults)
        figures = record_figures(result.records, model, fault.at_s, slo)
        del keep
    if figures.continued != report.continued:
        print(f"  note: {figures.continued} records continued, the fault report says {report.continued}",
              file=sys.stderr)
    row = table_row(cost_profile, node.policies.max_continuations, report, figures)
    print(f"  {row}", file=sys.stderr)
    return row


def head_commit() -> str:
    try:
        return subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


# --- BENCHMARKS.md -----------------------------------------------------------------------------------------------

def command_sentence(commit: str) -> str:
    return (f"Command: `{COMMAND}` (it runs `octoserve simulate --duration {DURATION} --fault {FAULT} "
            f"[--cost-profile P] [--set policies.max_continuations=0]` in process, four runs, and reads the table "
            f"off their fault reports and records; default placement, seed-000 at its profile rate, one of the four "
            f"8B replicas lost at 30 s for 5 s; the simulator as of {commit}).")


_SENTENCE = re.compile(r"Command: `[^`]*`(?: \([^()]*\))?\.", re.S)


def _reflow(paragraph: str) -> str:
    return textwrap.fill(" ".join(paragraph.split()), width=WRAP, break_long_words=False, break_on_hyphens=False)


def rewrite_section(text: str, table: str, sentence: str) -> str:
    """`text` (BENCHMARKS.md) with the section's table and its "Command: ..." sentence replaced (that sentence's
    paragraph reflowed); the rest as it was."""
    start = text.find("\n" + SECTION + "\n")
    if start < 0:
        raise SystemExit(f"no section {SECTION!r}")
    start += 1
    nxt = re.search(r"\n#{1,3} ", text[start + len(SECTION):])
    end = len(text) if nxt is None else start + len(SECTION) + nxt.start() + 1
    section = text[start:end]
    paragraphs = section.split("\n\n")
    tables = [i for i, p in enumerate(paragraphs) if p.lstrip().startswith("| cost profile |")]
    commands = [i for i, p in enumerate(paragraphs) if _SENTENCE.search(p)]
    if len(tables) != 1 or len(commands) != 1:
        raise SystemExit(f"section {SECTION!r}: expected one table and one 'Command: `...`' sentence, found "
                         f"{len(tables)} and {len(commands)}")
    (t,), (c,) = tables, commands
    trailing = paragraphs[t][len(paragraphs[t].rstrip("\n")):]
    paragraphs[t] = table + trailing
    paragraphs[c] = _reflow(_SENTENCE.sub(lambda _: sentence, paragraphs[c], count=1))
    return text[:start] + "\n\n".join(paragraphs) + text[end:]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--benchmarks", metavar="BENCHMARKS.md",
                        help="rewrite the section's table and command sentence in this file (default: print the table)")
    args = parser.parse_args(argv)
    rows = [run_one(profile, no_cont) for profile in COST_PROFILES for no_cont in (False, True)]
    table = format_table(rows)
    if args.benchmarks:
        path = Path(args.benchmarks)
        text = path.read_text(encoding="utf-8")
        new = rewrite_section(text, table, command_sentence(head_commit()))
        path.write_text(new, encoding="utf-8")
        print(f"{path}: section {SECTION!r} {'rewritten' if new != text else 'unchanged'}", file=sys.stderr)
    else:
        print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
