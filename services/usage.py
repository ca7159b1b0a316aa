"""Bad input to the `octoserve` command, and how the command reports it.

A user who mistypes a flag, names a missing file or writes an invalid config or workload gets one message that
says what to change, on stderr, and exit status 2 (the status argparse uses for bad arguments); the Python
traceback is shown only with `--debug`. Anything else is a bug and keeps its traceback.

Invariants:
- `UsageError` is raised only for input the user can fix; its message stands alone (no traceback needed).
- `BAD_INPUT` lists every exception type the command treats as bad input: `UsageError`, the node config's
  `PlacementError` (every problem listed) and the file errors of a path the user gave.
"""

from __future__ import annotations

import os
import sys
import traceback

from octoserve.services.core.placement import PlacementError

EXIT_BAD_INPUT = 2


class UsageError(Exception):
    """Input the user can fix (a flag, a file, a value in it); the message says what to change."""


BAD_INPUT: tuple[type[BaseException], ...] = (
    UsageError, PlacementError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError,
)


def describe(error: BaseException) -> str:
    """The one message printed for a bad-input error."""
    if isinstance(error, FileNotFoundError) and error.filename is not None:
        return f"{error.filename}: no such file"
    if isinstance(error, IsADirectoryError) and error.filename is not None:
        return f"{error.filename}: is a directory, not a file"
    if isinstance(error, PermissionError) and error.filename is not None:
        return f"{error.filename}: permission denied"
    return str(error)


def report(command: str, error: BaseException, debug: bool) -> int:
    """Print `error` for the user (with its traceback only when `debug`) and return the exit status."""
    if debug:
        traceback.print_exception(error, file=sys.stderr)
    print(f"octoserve {command}: error: {describe(error)}", file=sys.stderr)
    return EXIT_BAD_INPUT


def exit_process(code: int) -> None:
    """End the process now with `code`, its output flushed and logging shut down as at a normal exit, without
    freeing its objects one by one: after a simulation that is a large graph (the trace's token tuples, the
    records, the simulator), ~0.1 s of a ~3 s command. Only for a command run as the whole process (`main`)."""
    import logging

    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken pipe: nothing more can reach it
            pass
    os._exit(code)
