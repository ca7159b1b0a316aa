"""The ITL tail budget (services/core/tail_budget.py): exact counts, and the invariant as a property test."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octoserve.services.core.tail_budget import TailBudget


def test_a_slow_step_is_affordable_while_the_share_stays_within_the_fraction():
    t = TailBudget(0.05, window_gaps=100)
    assert t.affordable(0)  # a step without decodes delays nobody
    assert not t.affordable(1)  # no gap seen yet: one slow gap would be 100 %
    t.observe(19, 0)
    assert t.affordable(1) and not t.affordable(2)  # 1/20 = 5 %; 2/21 > 5 %
    t.observe(1, 1)
    assert (t.num_gaps, t.num_slow, t.slow_share()) == (20, 1, 0.05)
    assert not t.affordable(1)  # 2/21
    t.observe(19, 0)
    assert t.affordable(1)  # 2/40


def test_the_window_keeps_the_fewest_whole_steps_that_cover_it():
    t = TailBudget(0.1, window_gaps=10)
    for gaps, slow in ((4, 0), (4, 4), (4, 0)):
        t.observe(gaps, slow)
    assert (t.num_gaps, t.num_slow) == (12, 4)  # 8 would not cover 10
    t.observe(4, 0)
    assert (t.num_gaps, t.num_slow) == (12, 4)  # the first step slid out
    t.observe(6, 0)
    assert (t.num_gaps, t.num_slow) == (10, 0)  # the slow step slid out too
    t.observe(0, 0)
    assert t.num_gaps == 10


def test_bad_settings_are_refused():
    for fraction, window in ((1.0, 10), (-0.1, 10), (0.05, 0)):
        with pytest.raises(ValueError, match="need 0 <= fraction < 1 and window_gaps >= 1"):
            TailBudget(fraction, window)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(fraction=st.sampled_from([0.01, 0.025, 0.03, 0.05]), window=st.integers(1, 300),
       steps=st.lists(st.tuples(st.integers(0, 40), st.booleans()), max_size=200))
def test_every_trailing_window_keeps_its_slow_share_within_the_fraction(fraction, window, steps):
    """Steps run slow only when `affordable` allowed it (the batcher's rule); then at every step boundary the last
    min(window, all) gaps hold at most fraction x that many slow gaps, counted gap by gap."""
    t = TailBudget(fraction, window)
    history: list[bool] = []  # every gap so far, True = slow
    for gaps, wants_slow in steps:
        slow = wants_slow and gaps > 0 and t.affordable(gaps)
        t.observe(gaps, gaps if slow else 0)
        history.extend([slow] * gaps)
        trailing = history[-window:]
        assert sum(trailing) <= fraction * len(trailing) + 1e-9
        assert t.num_slow >= sum(trailing)  # the counted window covers the trailing one
