"""services/core/continuation.py: the request that continues a stream lost with its instance, and the bound."""

from __future__ import annotations

import pytest

from octoserve.services.core.continuation import continuation_spec, may_continue
from octoserve.services.core.types import Priority, RequestSpec, SamplingParams


def original(max_tokens=100, sim_output_len=60) -> RequestSpec:
    return RequestSpec("r7", "llama-3-8b", (11, 12, 13), SamplingParams(max_tokens, 0.7, 0.9, 42, ("\n",), True),
                       arrival_s=3.0, priority=Priority.INTERACTIVE, ttft_slo_ms=180.0, sim_output_len=sim_output_len)


def test_the_continuation_is_the_prompt_plus_the_streamed_tokens_with_the_rest_of_max_tokens():
    spec = continuation_spec(original(), [21, 22, 23, 24], now=9.5)
    assert spec == RequestSpec("r7", "llama-3-8b", (11, 12, 13, 21, 22, 23, 24),
                               SamplingParams(96, 0.7, 0.9, 42, ("\n",), True), arrival_s=9.5,
                               priority=Priority.INTERACTIVE, ttft_slo_ms=180.0, sim_output_len=56)


def test_a_second_continuation_builds_on_the_original_with_every_token_streamed():
    first = continuation_spec(original(), [21, 22], now=5.0)
    second = continuation_spec(original(), [21, 22, 31, 32, 33], now=8.0)
    assert second.prompt_token_ids == first.prompt_token_ids + (31, 32, 33)
    assert (second.max_tokens, second.sim_output_len) == (95, 55)


@pytest.mark.parametrize("sim_output_len, expected", [(None, None), (3, 1), (10, 7)])
def test_the_simulated_output_length_shrinks_by_the_streamed_tokens_never_below_one(sim_output_len, expected):
    assert continuation_spec(original(sim_output_len=sim_output_len), [1, 2, 3], 0.0).sim_output_len == expected


@pytest.mark.parametrize("done, bound, expected", [(0, 0, False), (0, 2, True), (1, 2, True), (2, 2, False)])
def test_may_continue_up_to_the_bound(done, bound, expected):
    assert may_continue(done, bound) is expected
