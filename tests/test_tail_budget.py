"""The ITL tail budget (services/core/tail_budget.py): exact counts, and the invariant as a property test."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octoserve.services.core.tail_budget import TailBudget


def test_a_slow_step_is_affordable_while_the_window_keeps_its_share():
    t = TailBudget(0.05, window_gaps=100)  # 5 slow gaps in any 100
    assert t.affordable(0)  # a step without decodes delays nobody
    assert t.affordable(5) and not t.affordable(6)  # a fresh instance: the gaps before its first count as fast
    t.observe(4, 4)
    assert (t.num_gaps, t.num_slow, t.slow_share()) == (4, 4, 1.0)
    assert t.affordable(1) and not t.affordable(2)
    t.observe(96, 0)
    t.observe(1, 1)
    assert (t.num_gaps, t.num_slow) == (101, 5)
    assert not t.affordable(1)
    t.observe(3, 0)  # the first step (4 slow gaps) slides out once the rest cover the window
    assert (t.num_gaps, t.num_slow) == (100, 1)
    assert t.affordable(4) and not t.affordable(5)


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
    `window` gaps (the gaps before the first counted as fast) hold at most fraction x window slow gaps, counted gap
    by gap."""
    t = TailBudget(fraction, window)
    history: list[bool] = [False] * window  # every gap so far, True = slow, after the fresh instance's fast ones
    for gaps, wants_slow in steps:
        slow = wants_slow and gaps > 0 and t.affordable(gaps)
        t.observe(gaps, gaps if slow else 0)
        history.extend([slow] * gaps)
        trailing = history[-window:]
        assert sum(trailing) <= fraction * window + 1e-9
        assert t.num_slow >= sum(trailing)  # the counted window covers the trailing one


def test_gaps_until_affordable_counts_the_fast_gaps_that_slide_the_slow_ones_out():
    t = TailBudget(0.05, window_gaps=100)  # 5 slow gaps in any 100
    assert t.gaps_until_affordable(5) == 0 and t.gaps_until_affordable(0) == 0
    assert t.gaps_until_affordable(6) == -1  # over the budget alone: never
    t.observe(4, 4)
    t.observe(96, 0)
    assert t.gaps_until_affordable(1) == 0 and t.gaps_until_affordable(2) == 4
    t.observe(3, 0)
    assert t.gaps_until_affordable(2) == 1  # 99 held after the slow step: one more gap covers the window
    t.observe(1, 0)
    assert t.gaps_until_affordable(2) == 0 and t.affordable(5)


@settings(max_examples=300, deadline=None, derandomize=True)
@given(fraction=st.sampled_from([0.01, 0.025, 0.05, 0.1]), window=st.integers(1, 300),
       steps=st.lists(st.tuples(st.integers(1, 40), st.booleans()), max_size=120), want=st.integers(1, 30))
def test_gaps_until_affordable_is_exactly_when_a_step_becomes_affordable(fraction, window, steps, want):
    """After the answer's number of fast gaps (in one-gap steps) a step of `want` slow gaps is affordable, and
    after one fewer it is not."""
    t = TailBudget(fraction, window)
    for gaps, wants_slow in steps:
        slow = wants_slow and t.affordable(gaps)
        t.observe(gaps, gaps if slow else 0)
    g = t.gaps_until_affordable(want)
    if want > fraction * window + 1e-9:
        assert g == -1
        return
    assert g >= 0

    def after(n: int) -> bool:
        probe = TailBudget(fraction, window)
        for gaps, slow in t._steps:
            probe.observe(gaps, slow)
        for _ in range(n):
            probe.observe(1, 0)
        return probe.affordable(want)

    assert after(g)
    if g > 0:
        assert not after(g - 1)


@pytest.mark.parametrize(("cost_profile", "window_8b"), [("default", 4000), ("pessimistic", 32000)])
def test_a_wide_batch_and_a_gang_member_keep_the_short_window(cost_profile, window_8b):
    """The default node: the 70B's narrow batch spends its tail over the configured 32,000 gaps; the 8B's batch is
    wide under the default profile (215 sequences), so it keeps a window of 4,000 gaps, and a long step over more
    than 160 decodes never fits it. Under the pessimistic profile the 8B's batch (112) is narrow and keeps the
    configured window, whose full 4 % it may spend once it has seen it."""
    from octoserve.services.config import load_with_overrides
    from octoserve.services.core.instance import instance_parts
    from octoserve.services.core.step_budget import StepBudget

    node = load_with_overrides(None, [], cost_profile)
    configs = {i.model: instance_parts(node, i).batcher_config for i in node.instances}
    assert configs["llama-3-70b"].tail_window_gaps == 32000
    assert configs["llama-3-8b"].tail_window_gaps == window_8b
    assert (configs["llama-3-8b"].max_num_seqs >= 128) == (cost_profile == "default")
    tail = StepBudget(configs["llama-3-8b"]).tail
    assert tail.affordable(160) and not tail.affordable(161)  # fresh: SHORT_WINDOW_GAPS counted as fast either way
    tail.observe(32000, 0)
    assert tail.affordable(160) and (tail.affordable(161) == (cost_profile == "pessimistic"))
    # seed 003's node is a gang: its LM and SMs keep the short window whatever their batch
    gang = load_with_overrides(str(Path(__file__).parent.parent / "services" / "configs" / "node-seed003.yaml"), [],
                               cost_profile)
    assert gang.gang is not None
    assert {instance_parts(gang, i).batcher_config.tail_window_gaps for i in gang.instances} == {4000}
    # a configured window shorter than the short one is every instance's
    short = load_with_overrides(None, ["policies.tail_window_gaps=1000"], cost_profile)
    assert {instance_parts(short, i).batcher_config.tail_window_gaps for i in short.instances} == {1000}


def test_a_fresh_instance_counts_no_more_than_the_fresh_gaps_as_fast():
    """A long window is not credited whole to a fresh instance: until it has seen the window's worth of gaps, its
    limit is the fraction of the gaps it has seen (its own step's included), or of SHORT_WINDOW_GAPS (4,000) if
    more."""
    from octoserve.services.core.tail_budget import SHORT_WINDOW_GAPS

    assert SHORT_WINDOW_GAPS == 4000
    t = TailBudget(0.04, window_gaps=32000)
    assert t.affordable(160) and not t.affordable(161)  # 4 % of 4,000, not of 32,000
    assert t.slow_room() == pytest.approx(160)
    t.observe(4000, 0)
    assert t.affordable(166) and not t.affordable(167)  # 166 + 4,000 gaps: 4 % of 4,166 = 166.6
    assert t.gaps_until_affordable(200) == 800  # 200 slow of 5,000 gaps
    t.observe(799, 0)
    assert not t.affordable(200)
    t.observe(1, 0)
    assert t.affordable(200) and t.slow_room() == pytest.approx(192)
    t.observe(27200, 0)  # the window is full: 4 % of 32,000
    assert t.affordable(1280) and not t.affordable(1281) and t.gaps_until_affordable(1281) == -1
    # a window no longer than the fresh gaps is credited whole, as before
    short = TailBudget(0.04, window_gaps=4000)
    assert short.fresh_gaps == 4000 and short.affordable(160) and not short.affordable(161)
