"""Command-line values every `octoserve` command checks the same way, before any work.

A value that cannot work (a rate of 0, a warm-up as long as the run, a fault on an instance the node lacks) is a
`UsageError` naming the flag and what to change, raised before a trace is generated or a process started, so the
user does not wait for a run that fails at its end.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Iterable

from octoserve.services.usage import UsageError


def check_positive(flag: str, value: float | None, what: str, example: str) -> None:
    """`--flag` must be a finite number > 0 when given; `what` names the quantity, `example` a valid use."""
    if value is not None and not (math.isfinite(value) and value > 0):
        raise UsageError(f"{flag} {value:g}: {what} must be > 0, e.g. {example}")


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
        raise UsageError(f"--warmup {warmup_s:g}: the warm-up must be >= 0 s, e.g. --warmup 10s")
    if warmup_s >= window_s:
        raise UsageError(f"--warmup {warmup_s:g} s leaves nothing to measure in the {window_s:g} s arrival window: "
                         f"give a shorter --warmup or {longer}")


def check_faults(texts: Iterable[str], instance_ids: Iterable[str]) -> None:
    """Each --fault INSTANCE@T[+DOWN] parses and names an instance of the node."""
    from octoserve.services.sim.faults import parse_fault

    ids = list(instance_ids)
    for text in texts:
        try:
            fault = parse_fault(text)
        except ValueError as e:  # its message is "fault 'TEXT': what to write"
            raise UsageError(f"--fault {text!r}: {str(e).partition(': ')[2]}") from None
        if fault.instance_id not in ids:
            raise UsageError(f"--fault {text!r}: the node has no instance {fault.instance_id!r}; name one of "
                             f"{', '.join(ids)}")
