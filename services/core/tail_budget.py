"""The ITL tail budget of one instance: how many slow inter-token gaps it may still spend.

An ITL SLO is a percentile (P95 < 30 ms), not a wall on every step: up to 5 % of a model's inter-token gaps may be
slower. A step that runs longer than the SLO (a whole prompt prefilled at once) makes one slow gap for every decode
in it, and gives the prompts in it their first token several steps sooner. `TailBudget` counts the gaps of the
last `window_gaps` decode tokens and how many of them were slow, and allows a slow step only while the slow share
stays at or under `fraction` (about half the quantile's tail: room for the cost model's error and for the gaps of
the other instances of the model, which share the model's P95).

Invariant (given that only steps `affordable` allowed turned out slow): the last `window_gaps` gaps hold at most
`fraction` x `window_gaps` slow ones at every step boundary, where a fresh instance counts up to SHORT_WINDOW_GAPS of
the gaps before its first as fast (it has delayed nobody yet: a prompt on an idle node may run in one step). Until it
has seen a window's worth, its limit is `fraction` x the gaps it has seen, or x SHORT_WINDOW_GAPS if more: a long window
(32,000 gaps, ~30 s of a 70B's decodes) credited whole to a fresh instance let it spend up to 1,280 slow gaps in its
first seconds (`make run`'s simulated 70B read an ITL P95 of 59.7 ms over its 4-s window). Between long steps the
trailing window only gains fast gaps, so its slow count never rises; at a long step `affordable` checked it,
counting every slow gap of the oldest step still in the window even where part of that step has slid out (so the
check is strict).

Clock-free and exact: the window is a count of gaps, not a span of time.
"""

from __future__ import annotations

from collections import deque

# A step planned by the linear step model to end within this share of the ITL SLO makes no slow gap: the share
# left is for the model's error (the attention of a chunk over its own earlier chunks, which it leaves out).
FREE_STEP_SHARE = 0.95
# The window every instance had before long windows: the most gaps a fresh instance counts as fast before it has
# seen them (the module docstring), so it spends no more than it did then, and the window of the instances that
# keep a short one (services/core/instance.py, short_tail_window_gaps).
SHORT_WINDOW_GAPS = 4000


class TailBudget:
    """The slow share of an instance's recent inter-token gaps; see the module docstring."""

    __slots__ = ("fraction", "window_gaps", "fresh_gaps", "_steps", "_num_gaps", "_num_slow")

    def __init__(self, fraction: float, window_gaps: int) -> None:
        if not 0.0 <= fraction < 1.0 or window_gaps < 1:
            raise ValueError("need 0 <= fraction < 1 and window_gaps >= 1")
        self.fraction = fraction
        self.window_gaps = window_gaps
        self.fresh_gaps = min(window_gaps, SHORT_WINDOW_GAPS)
        self._steps: deque[tuple[int, int]] = deque()  # (gaps, slow gaps) of each step with decodes, oldest first
        self._num_gaps = 0
        self._num_slow = 0

    def observe(self, num_gaps: int, num_slow: int) -> None:
        """One step's decode tokens (`num_gaps`), of which `num_slow` came later than the SLO after the previous."""
        if num_gaps <= 0:
            return
        self._steps.append((num_gaps, num_slow))
        self._num_gaps += num_gaps
        self._num_slow += num_slow
        steps = self._steps
        # Keep the fewest whole steps that still cover the window: the oldest goes once the rest cover it alone.
        while self._num_gaps - steps[0][0] >= self.window_gaps:
            gaps, slow = steps.popleft()
            self._num_gaps -= gaps
            self._num_slow -= slow

    def affordable(self, num_gaps: int) -> bool:
        """Whether a step whose `num_gaps` decode tokens all come late keeps the slow share within the fraction
        (a step without decodes delays no gap: always)."""
        if num_gaps <= 0:
            return True
        return self._num_slow + num_gaps <= self._limit(self._num_gaps + num_gaps)

    def _limit(self, num_gaps: int) -> float:
        """The most slow gaps a window holding `num_gaps` gaps (its own, before it is full) may hold."""
        return self.fraction * max(self.fresh_gaps, min(self.window_gaps, num_gaps)) + 1e-9

    def gaps_until_affordable(self, num_gaps: int) -> int:
        """How many more fast gaps must come before a step of `num_gaps` slow ones is `affordable` (0: now; -1:
        never, the step alone is over the budget). Each new gap pushes the window on; a step leaves it once the
        steps after it cover the window alone, taking its slow gaps with it."""
        if num_gaps <= 0 or self.affordable(num_gaps):
            return 0
        limit = self.fraction * self.window_gaps + 1e-9
        if num_gaps > limit:
            return -1
        if self._num_slow + num_gaps <= limit:
            # Not full yet: no step leaves before it is, and each new gap raises the limit by `fraction`.
            need = -(-(self._num_slow + num_gaps - 1e-9) // self.fraction)  # the gaps the window must hold
            return max(0, int(need) - self._num_gaps - num_gaps)
        slow = self._num_slow
        dropped = 0
        for gaps, step_slow in self._steps:
            dropped += gaps
            slow -= step_slow
            if slow + num_gaps <= limit:
                # This step leaves once the gaps after it (held and new) reach the window.
                return max(0, self.window_gaps - (self._num_gaps - dropped))
        return self.window_gaps  # unreachable: with every step gone the slow count is 0

    def slow_room(self) -> float:
        """The slow gaps the window may still take at its present size (as `affordable` counts them, less the
        growth of the limit that the step's own gaps bring while the window is not yet full)."""
        return self._limit(self._num_gaps) - self._num_slow

    def slow_share(self) -> float:
        """The slow share of the gaps in the window (0 before any)."""
        return self._num_slow / self._num_gaps if self._num_gaps else 0.0

    @property
    def num_gaps(self) -> int:
        return self._num_gaps

    @property
    def num_slow(self) -> int:
        return self._num_slow
