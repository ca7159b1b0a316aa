"""A tiny dependency-free progress bar for long commands (simulate, bench, bench-suite).

Invariants: writes only to its stream (stderr by default), never to stdout, so `--json` output stays clean;
redraws at most once per `min_interval_s` (default 0.2 s, ~5/s) so it costs nothing in tight loops; stays silent
when the stream is not a TTY unless `force=True`; `close()` always writes one final line ending in a newline,
and only once.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO


class Progress:
    def __init__(
        self,
        total: int | None,
        label: str = "",
        *,
        stream: TextIO | None = None,
        force: bool = False,
        min_interval_s: float = 0.2,
        width: int = 30,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.label = label
        self.count = 0
        self._stream = stream if stream is not None else sys.stderr
        self._live = force or bool(getattr(self._stream, "isatty", lambda: False)())
        self._min_interval_s = min_interval_s
        self._width = width
        self._clock = clock
        self._start_s = clock()
        self._last_draw_s = -float("inf")
        self._closed = False

    def update(self, n: int = 1) -> None:
        self.count += n
        if not self._live or self._closed:
            return
        now = self._clock()
        if now - self._last_draw_s >= self._min_interval_s:
            self._last_draw_s = now
            self._stream.write("\r" + self.line(now))
            self._stream.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        prefix = "\r" if self._live else ""
        self._stream.write(prefix + self.line(self._clock()) + "\n")
        self._stream.flush()

    def line(self, now: float) -> str:
        elapsed_s = now - self._start_s
        head = f"{self.label} " if self.label else ""
        if not self.total:
            return f"{head}{self.count} in {elapsed_s:.1f} s"
        frac = min(1.0, self.count / self.total)
        filled = int(frac * self._width)
        bar = "#" * filled + "." * (self._width - filled)
        return f"{head}[{bar}] {100 * frac:3.0f}% {self.count}/{self.total} {elapsed_s:.1f} s"

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
