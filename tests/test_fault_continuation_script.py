"""scripts/fault_continuation.py: the table's figures from hand-made records and a fault at 30 s (no simulation),
and the rewrite of its BENCHMARKS.md section."""

import importlib.util
import sys
from pathlib import Path

import pytest

from octoserve.services.metrics import RequestRecord, SloSpec
from octoserve.services.core.types import Priority
from octoserve.services.sim.faults import FaultReport, InstanceFault

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("fault_continuation", ROOT / "scripts" / "fault_continuation.py")
fault_continuation = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = fault_continuation  # its dataclass looks itself up there
_spec.loader.exec_module(fault_continuation)

SM, LM = "llama-3-8b", "llama-3-70b"
FAULT_AT_S = 30.0
SLO = SloSpec()  # TTFT 250 ms, TPOT 30 ms
TICK = 1 / 64  # exact in binary: every time below is


def rec(rid, arrival_s, tokens=(), *, model=SM, finished=True, error="", refused=False, continued=0):
    tokens = tuple(tokens)
    return RequestRecord(rid, model, Priority.STANDARD, arrival_s, num_output_tokens=len(tokens),
                         first_token_s=tokens[0] if tokens else None, token_times_s=tokens,
                         finish_s=tokens[-1] if finished and tokens and not error else None, error=error,
                         refused=refused, num_continuations=continued)


def records():
    # Continued, within the SLO: a token every TICK from 0.125 s to exactly 30 s (the fault: still before it),
    # then 2 s of re-prefill, then 8 more: TTFT 125 ms, TPOT 31.98 s / 1920 = 16.7 ms.
    long_stream = [0.125 + k * TICK for k in range(1913)] + [32.0 + j * TICK for j in range(8)]
    assert long_stream[1912] == FAULT_AT_S
    return [
        rec("long", 0.0, long_stream, continued=1),  # gap 2.0
        rec("slow", 25.0, [25.125, 29.5, 32.5, 33.0], continued=1),  # gap 3.0, TPOT 2.6 s: misses
        rec("lost-again", 26.0, [26.125, 29.75, 30.75], error="instance sm-1 was lost", continued=1),  # gap 1.0
        rec("ok", 21.0, [21.125, 21.125 + TICK]),
        rec("failed", 22.0, [22.125, 22.25], error="instance sm-0 was lost"),
        rec("refused", 23.0, refused=True),
        rec("at-fault", 30.0, [30.125]),  # one token: TTFT only; not in the 10 s before the fault
        rec("failed-earlier", 19.5, [19.625], error="instance sm-0 was lost"),  # before the window
        rec("other-model", 25.0, [25.125], model=LM),
    ]


def test_record_figures_from_hand_made_records():
    f = fault_continuation.record_figures(records(), SM, FAULT_AT_S, SLO)
    assert (f.admitted, f.met_slo) == (7, 3)  # long, ok, at-fault
    assert (f.admitted_before, f.failed_before) == (4, 2)  # slow, lost-again, ok, failed; lost-again and failed
    assert (f.continued, f.continued_met_slo) == (3, 1)
    assert f.gaps_s == (2.0, 3.0, 1.0)
    assert f.gap_stats_s() == pytest.approx((2.0, 2.9, 3.0))


def test_gap_is_last_token_at_or_before_the_fault_to_the_first_after():
    assert fault_continuation.gap_across_s(rec("a", 0.0, [29.0, 30.0, 33.5]), FAULT_AT_S) == 3.5
    assert fault_continuation.gap_across_s(rec("b", 0.0, [29.0, 29.5]), FAULT_AT_S) is None
    assert fault_continuation.gap_across_s(rec("c", 31.0, [31.5]), FAULT_AT_S) is None


def _report(continued, bound, refused, recovery_s):
    return FaultReport(InstanceFault("sm-0", FAULT_AT_S, 5.0), SM, 0.5, 0.25, 32.0, recovery_s, 4, continued, bound,
                       refused)


def test_table_rows():
    f = fault_continuation.record_figures(records(), SM, FAULT_AT_S, SLO)
    assert fault_continuation.table_row("default", 2, _report(3, 0, 0, 19.0), f) == (
        "| default | 2 | 4 | 3 | 0 (0 / 0) | 7, 42.9 % | 2 of 4 | 1 of 3 | 2.0 / 2.9 / 3.0 s | 25.0 % (32 s) | 19 s |")
    none = fault_continuation.record_figures([r for r in records() if not r.num_continuations], SM, FAULT_AT_S, SLO)
    assert fault_continuation.table_row("pessimistic", 0, _report(0, 2, 1, None), none) == (
        "| pessimistic | 0 | 4 | 0 | 3 (2 / 1) | 4, 50.0 % | 1 of 2 | - | - | 25.0 % (32 s) | never |")


def test_rewrite_section_replaces_its_table_and_command_only():
    doc = ("## Before\n\n| cost profile | x |\n|---|---|\n| keep | 1 |\n\n"
           f"{fault_continuation.SECTION}\n\nIntro. Command: `octoserve simulate --fault sm-0@30+5\n--json F` (as of "
           "abc; the rest). After it.\n\n| cost profile | old |\n|---|---|\n| default | 9 |\n\nProse after.\n\n"
           "## Next\n\n| cost profile | y |\n")
    table = "| cost profile | new |\n|---|---|\n| default | 1 |"
    once = fault_continuation.rewrite_section(doc, table, fault_continuation.command_sentence("1234567"))
    assert once.startswith("## Before\n\n| cost profile | x |\n|---|---|\n| keep | 1 |\n\n")
    assert once.endswith("\n\nProse after.\n\n## Next\n\n| cost profile | y |\n")
    assert f"\n\n{table}\n\nProse after." in once and "| default | 9 |" not in once
    body = " ".join(once.split(fault_continuation.SECTION)[1].split())
    assert f"Intro. Command: `{fault_continuation.COMMAND}` (it runs `octoserve simulate" in body
    assert "the simulator as of 1234567). After it." in body
    assert all(len(line) <= fault_continuation.WRAP for line in once.splitlines())
    assert fault_continuation.rewrite_section(once, table, fault_continuation.command_sentence("1234567")) == once
