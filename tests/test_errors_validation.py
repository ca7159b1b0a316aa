"""Typed errors and request validation: each problem gets its exact message saying what to change."""

import dataclasses

import pytest

from octoserve.services.core.errors import DeadlineExceeded, Draining, InvalidArgument, OctoserveError, Overloaded, UnknownModel
from octoserve.services.core.specs import MODEL_PRESETS
from octoserve.services.core.types import Priority, RequestSpec, SamplingParams
from octoserve.services.core.validation import validate_request

LM = MODEL_PRESETS["llama-3-70b"]  # 8192-token window, vocab 128256


def spec(prompt_len=1200, max_tokens=100, **sampling) -> RequestSpec:
    return RequestSpec(
        request_id="r1",
        model="llama-3-70b",
        prompt_token_ids=tuple(range(1000, 1000 + prompt_len)),
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),
        arrival_s=0.0,
    )


def test_errors_carry_fields_and_messages():
    e = Overloaded("llama-3-8b", Priority.INTERACTIVE, 320, "queue full")
    assert isinstance(e, OctoserveError)
    assert (e.model, e.tier, e.retry_after_ms, e.reason) == ("llama-3-8b", Priority.INTERACTIVE, 320, "queue full")
    assert e.message == "llama-3-8b is overloaded for INTERACTIVE requests (queue full); retry after 320 ms"
    u = UnknownModel("gpt-4", ["llama-3-8b", "llama-3-70b"])
    assert u.message == "unknown model 'gpt-4'; this node serves: llama-3-70b, llama-3-8b"
    assert u.known == ("llama-3-70b", "llama-3-8b")
    i = InvalidArgument("top_p", "bad")
    assert (i.field, i.message, str(i)) == ("top_p", "bad", "bad")
    assert "retry" in DeadlineExceeded().message and "draining" in Draining().message


def test_errors_compare_by_value():
    assert Overloaded("m", Priority.BATCH, 5, "x") == Overloaded("m", Priority.BATCH, 5, "x")
    assert Overloaded("m", Priority.BATCH, 5, "x") != Overloaded("m", Priority.BATCH, 6, "x")
    assert InvalidArgument("a", "x") != InvalidArgument("b", "x")


def test_a_valid_request_passes():
    assert validate_request(spec(), LM, None) is None
    assert validate_request(spec(1200, 6992), LM, None) is None  # exactly fills the window


@pytest.mark.parametrize(
    "request_, window, field, message",
    [
        (spec(0), None, "prompt", "the prompt is empty; send at least one prompt token"),
        (
            spec(8192),
            None,
            "prompt",
            "the prompt of 8192 tokens does not fit the 8192-token context window of llama-3-70b; "
            "shorten it to at most 8191 tokens",
        ),
        (
            spec(600),
            512,
            "prompt",
            "the prompt of 600 tokens does not fit the 512-token context window of llama-3-70b; "
            "shorten it to at most 511 tokens",
        ),
        (spec(10, 0), None, "max_tokens", "max_tokens is 0; set it to at least 1"),
        (
            spec(1200, 9000),
            None,
            "max_tokens",
            "max_tokens 9000 + prompt 1200 tokens exceeds the 8192-token context window of llama-3-70b; "
            "lower max_tokens to at most 6992",
        ),
        (spec(temperature=-0.5), None, "temperature", "temperature is -0.5; set it to 0 (greedy) or a positive number"),
        (spec(top_p=0.0), None, "top_p", "top_p is 0.0; set it in (0, 1] (1 disables nucleus sampling)"),
        (spec(top_p=1.5), None, "top_p", "top_p is 1.5; set it in (0, 1] (1 disables nucleus sampling)"),
        (spec(stop=("", "x")), None, "stop", "a stop string is empty; remove it or give it at least one character"),
    ],
)
def test_each_bad_field_has_its_message(request_, window, field, message):
    with pytest.raises(InvalidArgument) as info:
        validate_request(request_, LM, window)
    assert (info.value.field, info.value.message) == (field, message)


def test_token_outside_vocabulary():
    bad = dataclasses.replace(spec(3), prompt_token_ids=(5, 128256, 7))
    with pytest.raises(InvalidArgument) as info:
        validate_request(bad, LM, None)
    assert info.value.message == (
        "prompt token id 128256 at position 1 is outside the vocabulary of llama-3-70b (ids 0..128255); "
        "re-tokenize with llama-3-70b's tokenizer"
    )


def test_non_positive_deadline():
    bad = dataclasses.replace(spec(), ttft_slo_ms=0.0)
    with pytest.raises(InvalidArgument) as info:
        validate_request(bad, LM, None)
    assert info.value.field == "ttft_slo_ms"
    assert info.value.message == "ttft_slo_ms is 0.0; set a positive deadline or leave it unset"


def test_first_problem_wins_in_fixed_order():
    with pytest.raises(InvalidArgument) as info:
        validate_request(spec(0, 0, temperature=-1.0), LM, None)
    assert info.value.field == "prompt"
