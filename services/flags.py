"""Command-line values every `octoserve` command reads and checks the same way, before any work.

A duration flag takes plain seconds or a number with a unit: `90`, `90s`, `500ms`, `2m` (`parse_duration_s`, the
one parser of every duration flag). A value that cannot work (a rate of 0, a warm-up as long as the run, a fault on an instance the node lacks) is a
`UsageError` naming the flag and what to change, raised before a trace is generated or a process started, so the
user does not wait for a run that fails at its end.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable


# unit suffix -> seconds; "ms" before "s" and "m": the longest suffix that matches is the unit
DURATION_UNITS_S = {"ms": 1e-3, "s": 1.0, "m": 60.0}


def parse_duration_s(text: str) -> float:
    """'90', '90s', '500ms', '2m' -> seconds (an argparse `type`: a bad value is argparse's exit 2)."""
    value = text.strip().lower()
    factor = 1.0
    for unit in sorted(DURATION_UNITS_S, key=len, reverse=True):
        if value.endswith(unit):
            value, factor = value.removesuffix(unit), DURATION_UNITS_S[unit]
            break
    try:
        seconds = float(value) * factor
    except ValueError:
        seconds = math.nan
    if not math.isfinite(seconds):
        raise argparse.ArgumentTypeError(f"duration {text!r}: use seconds like 90, 90s, 500ms or 2m")
    return seconds


def _bad_input(message: str) -> Exception:
    # imported here: `octoserve health` (an exec probe, kept light) uses the parser alone, and services.usage
    # imports the placement module
    from octoserve.services.usage import UsageError

    return UsageError(message)


def check_positive(flag: str, value: float | None, what: str, example: str) -> None:
    """`--flag` must be a finite number > 0 when given; `what` names the quantity, `example` a valid use."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise _bad_input(f"{flag} {value:g}: {what} must be > 0, e.g. {example}")


# workload flag -> (what it is, a valid use); where a command has the flag, a value <= 0 is refused
WORKLOAD_FLAGS = {
    "rate": ("the arrival rate (req/s)", "--rate 50"),
    "duration": ("the arrival window", "--duration 30s"),
    "burstiness": ("the gamma shape of the inter-arrivals (1 is Poisson, < 1 burstier)", "--burstiness 0.5"),
}


def check_workload_flags(args: argparse.Namespace) -> None:
    """--rate, --duration and --burstiness of the commands that have them."""
    for name, (what, example) in WORKLOAD_FLAGS.items():
        check_positive(f"--{name}", getattr(args, name, None), what, example)


def check_warmup(warmup_s: float | None, window_s: float, longer: str = "a longer --duration") -> None:
    """--warmup must leave part of the `window_s` arrival window to measure; `longer` says how to lengthen it."""
    if warmup_s is None:
        return
    if not (math.isfinite(warmup_s) and warmup_s >= 0):
        raise _bad_input(f"--warmup {warmup_s:g}: the warm-up must be >= 0 s, e.g. --warmup 10s")
    if warmup_s >= window_s:
        raise _bad_input(f"--warmup {warmup_s:g} s leaves nothing to measure in the {window_s:g} s arrival window: "
                         f"give a shorter --warmup or {longer}")


def check_faults(texts: Iterable[str], instance_ids: Iterable[str]) -> None:
    """Each --fault INSTANCE@T[+DOWN] parses and names an instance of the node."""
    from octoserve.services.sim.faults import parse_fault

    ids = list(instance_ids)
    for text in texts:
        try:
            fault = parse_fault(text)
        except ValueError as e:  # its message is "fault 'TEXT': what to write"
            raise _bad_input(f"--fault {text!r}: {str(e).partition(': ')[2]}") from None
        if fault.instance_id not in ids:
            raise _bad_input(f"--fault {text!r}: the node has no instance {fault.instance_id!r}; name one of "
                             f"{', '.join(ids)}")
