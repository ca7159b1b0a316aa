"""Request validation at the router: reject what no engine could ever serve, with a message saying what to change.

Invariants:
- Pure: looks only at the request and the model's shape; never at load (that is admission's job).
- Raises the first problem found as `InvalidArgument(field, message)`, checked in a fixed order
  (prompt, max_tokens, sampling, deadline) so the same bad request always gets the same answer.
- The context window is `max_context_len` when given (a per-deployment override), else the model's own.
"""

from __future__ import annotations

import math
from typing import Any

from octoserve.services.core.errors import InvalidArgument
from octoserve.services.core.types import RequestSpec


def validate_request(spec: RequestSpec, model: Any, max_context_len: int | None = None) -> None:
    """Raise `InvalidArgument` for the first out-of-range field of `spec` served by `model` (a ModelSpec)."""
    window = max_context_len if max_context_len is not None else model.max_context_len
    _check_prompt(spec, model, window)
    _check_max_tokens(spec, model, window)
    _check_sampling(spec)
    _check_deadline(spec)


def _check_prompt(spec: RequestSpec, model: Any, window: int) -> None:
    n = spec.num_prompt_tokens
    if n == 0:
        raise InvalidArgument("prompt", "the prompt is empty; send at least one prompt token")
    if n >= window:
        # At least one token must be left to generate.
        raise InvalidArgument(
            "prompt",
            f"the prompt of {n} tokens does not fit the {window}-token context window of {model.name}; "
            f"shorten it to at most {window - 1} tokens",
        )
    vocab = getattr(model, "vocab_size", None)
    if vocab is not None:
        for position, token_id in enumerate(spec.prompt_token_ids):
            if not 0 <= token_id < vocab:
                raise InvalidArgument(
                    "prompt",
                    f"prompt token id {token_id} at position {position} is outside the vocabulary of "
                    f"{model.name} (ids 0..{vocab - 1}); re-tokenize with {model.name}'s tokenizer",
                )


def _check_max_tokens(spec: RequestSpec, model: Any, window: int) -> None:
    max_tokens, n = spec.max_tokens, spec.num_prompt_tokens
    if max_tokens < 1:
        raise InvalidArgument("max_tokens", f"max_tokens is {max_tokens}; set it to at least 1")
    if n + max_tokens > window:
        raise InvalidArgument(
            "max_tokens",
            f"max_tokens {max_tokens} + prompt {n} tokens exceeds the {window}-token context window of "
            f"{model.name}; lower max_tokens to at most {window - n}",
        )


def _check_sampling(spec: RequestSpec) -> None:
    temperature, top_p = spec.sampling.temperature, spec.sampling.top_p
    if math.isnan(temperature) or temperature < 0:
        raise InvalidArgument(
            "temperature", f"temperature is {temperature}; set it to 0 (greedy) or a positive number"
        )
    if math.isnan(top_p) or not 0 < top_p <= 1:
        raise InvalidArgument("top_p", f"top_p is {top_p}; set it in (0, 1] (1 disables nucleus sampling)")
    if any(s == "" for s in spec.sampling.stop):
        raise InvalidArgument("stop", "a stop string is empty; remove it or give it at least one character")


def _check_deadline(spec: RequestSpec) -> None:
    slo = spec.ttft_slo_ms
    if slo is not None and (math.isnan(slo) or slo <= 0):
        raise InvalidArgument("ttft_slo_ms", f"ttft_slo_ms is {slo}; set a positive deadline or leave it unset")
