"""Stop strings across a seam: output tokens that sit at the end of a worker's prompt (a continued or resumed stream,
router/failover.py) or that another engine sampled (a disaggregated request's first token) are output the engine's
own stop-string check never sees, since an engine matches stop strings in the text of the tokens it generated
itself. A stop string that begins in those tokens and ends in the new ones would be missed, and the stream would run
on past where an uninterrupted run stops.

`SeamStop` finds exactly those matches: the text of the last output tokens before the seam (enough for the longest
stop string) followed by the new tokens, one token at a time, until the new text is long enough that no stop string
can still span the seam. Matches that lie wholly in the new text are the engine's own, as in an uninterrupted run.
`stop_at_seam` ends a worker's output stream at such a match: the outputs up to and including the token that
completes it, the last one finished STOP (an uninterrupted run's stream holds that token too), then the engine's
stream is closed (which aborts the request there).

Engines with a tokenizer offer `detokenize(token_ids) -> str` (vLLM); the sim engine has none and no stop strings.
The router says how many output tokens end the prompt in the `SEAM_TOKENS_KEY` metadata of the worker RPC.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from octoserve.services.core.types import FinishReason, RequestOutput

SEAM_TOKENS_KEY = "x-octoserve-seam-tokens"  # output tokens at the end of the request's prompt (0: none)


def seam_tokens(metadata) -> int:
    """The SEAM_TOKENS_KEY value of a worker RPC's invocation metadata (0 when absent or malformed)."""
    for key, value in metadata or ():
        if key == SEAM_TOKENS_KEY:
            try:
                return max(0, int(value))
            except ValueError:
                return 0
    return 0


class SeamStop:
    """`before_ids`: the output tokens just before the seam (the caller passes at most the longest stop string's
    length of them: a token is at least one character). `feed(new_ids)` -> the index in `new_ids` of the token that
    completes a stop string beginning before the seam, or None."""

    def __init__(self, detokenize: Callable[[Sequence[int]], str], before_ids: Sequence[int],
                 stop: Sequence[str]) -> None:
        self.detokenize = detokenize
        self.ids = list(before_ids)
        self.base_len = len(detokenize(self.ids))
        self.stop = tuple(s for s in stop if s)
        self.longest = max((len(s) for s in self.stop), default=0)
        self.done = not self.stop or not self.ids

    def feed(self, new_ids: Sequence[int]) -> int | None:
        for i, token_id in enumerate(new_ids):
            if self.done:
                return None
            self.ids.append(token_id)
            text = self.detokenize(self.ids)
            for s in self.stop:
                # A match starting at or after `start` ends past the seam; one starting before base_len spans it.
                at = text.find(s, max(0, self.base_len - len(s) + 1))
                if at != -1 and at < self.base_len:
                    return i
            if len(text) - self.base_len >= self.longest - 1:
                self.done = True  # from here a match lies wholly in the new text: the engine's own check
        return None


def checker(engine, stop: Sequence[str], before_ids: Sequence[int]) -> SeamStop | None:
    """A SeamStop for a request whose output tokens `before_ids` precede what `engine` generates, or None when
    there is nothing to check (no stop strings, no such tokens, or an engine without a tokenizer)."""
    detokenize = getattr(engine, "detokenize", None)
    stop = tuple(s for s in stop if s)
    if detokenize is None or not stop or not before_ids:
        return None
    longest = max(len(s) for s in stop)
    return SeamStop(detokenize, tuple(before_ids)[-longest:], stop)


async def stop_at_seam(outputs: AsyncIterator[RequestOutput], check: SeamStop) -> AsyncIterator[RequestOutput]:
    """`outputs`, ended at the first stop string spanning the seam (see the module doc)."""
    try:
        async for out in outputs:
            at = check.feed(out.new_token_ids) if out.new_token_ids else None
            if at is None:
                yield out
                if out.finish_reason is not None:
                    return
                continue
            yield RequestOutput(out.request_id, tuple(out.new_token_ids[:at + 1]), FinishReason.STOP,
                                out.num_prompt_tokens, out.num_cached_prompt_tokens,
                                out.num_output_tokens - (len(out.new_token_ids) - (at + 1)))
            return
    finally:
        aclose = getattr(outputs, "aclose", None)
        if aclose is not None:
            await aclose()
