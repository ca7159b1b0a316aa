"""Stream continuation: a request whose instance was lost after it streamed tokens goes on as a new request.

The rule (the simulator's driver applies it at a fault, services/sim/driver.py; the live router's failover follows
the same rule):
- the continuation's prompt is the original prompt followed by every token already streamed; its `max_tokens` is the
  original's less those tokens; every other sampling parameter is the original's. The client's stream goes on under
  the same request id, so its TTFT stays its original first token, and the wait for the continuation's first token
  is one (longer) inter-token gap;
- a request is continued at most `policies.max_continuations` times; lost once more, it fails (`may_continue`);
- admission applies to the continuation, as to a request the node admitted before (`RouterPolicy.route(...,
  admitted=True)`: an instance must have KV for it; the arrival gates that guard first tokens are not run again):
  refused, the request fails (UNAVAILABLE with the refusal's retry hint).
A request with no token streamed is not continued: it is placed again as it was (the re-route rule).

Pure: no clock (`now` is passed in), no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence

from octoserve.services.core.types import RequestSpec, SamplingParams


def may_continue(num_continuations: int, max_continuations: int) -> bool:
    """Whether a request continued `num_continuations` times so far may be continued once more."""
    return num_continuations < max_continuations


def continuation_spec(original: RequestSpec, streamed_token_ids: Sequence[int], now: float) -> RequestSpec:
    """The request that continues `original` (the request as it arrived, never an earlier continuation, so every
    seam builds on the same base) after `streamed_token_ids` (every token its client has seen, over all its earlier
    continuations) reached the client; it arrives at `now`. `max_tokens` (and a simulated request's output length)
    less the streamed tokens, at least 1."""
    num_streamed = len(streamed_token_ids)
    sampling = original.sampling
    true_len = original.sim_output_len
    return RequestSpec(
        request_id=original.request_id,
        model=original.model,
        prompt_token_ids=tuple(original.prompt_token_ids) + tuple(streamed_token_ids),
        sampling=SamplingParams(max(1, sampling.max_tokens - num_streamed), sampling.temperature, sampling.top_p,
                                sampling.seed, sampling.stop, sampling.ignore_eos),
        arrival_s=now,
        priority=original.priority,
        ttft_slo_ms=original.ttft_slo_ms,
        sim_output_len=None if true_len is None else max(1, true_len - num_streamed),
    )
