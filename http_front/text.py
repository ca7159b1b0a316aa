"""Text in and out of the front: prompt encoding, chat templates and incremental detokenization.

The router and workers speak token ids. With a model directory (`--model DIR`, the vllm engine) the front uses
the checkpoint's own tokenizer (tokenizer.json) and chat template (`chat_template` in tokenizer_config.json, or
chat_template.jinja), so a chat request becomes the same token ids vLLM's own server would feed the engine.
Without one (the sim engine), a text prompt goes to the router as text (one token per UTF-8 byte, the router's own
rule), chats are rendered with `DEFAULT_CHAT_TEMPLATE`, and each output token id reads `<id>` in the text: the
simulated model has no vocabulary, so its text is a placeholder that keeps one visible unit per token.

Invariant of `Detokenizer`: the concatenation of what `push` returns equals decode(all ids) once `flush` is
called, and no piece ends inside a multi-byte character (a piece whose decode ends in U+FFFD is held back until
the next token completes it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Roles in plain markers; used when the model has no template of its own (and by the sim engine).
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _compile(template: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

    def raise_exception(message: str):
        raise ValueError(message)

    env.globals["raise_exception"] = raise_exception
    return env.from_string(template)


@dataclass
class TextCodec:
    """One model's tokenizer and chat template (`tokenizer` None: the byte/placeholder rules above)."""

    tokenizer: Any = None  # a `tokenizers.Tokenizer`
    chat_template: str = DEFAULT_CHAT_TEMPLATE
    bos_token: str = ""
    eos_token: str = ""

    def __post_init__(self) -> None:
        self._template = _compile(self.chat_template)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path) -> TextCodec:
        from tokenizers import Tokenizer

        d = Path(model_dir)
        config = json.loads((d / "tokenizer_config.json").read_text()) if (d / "tokenizer_config.json").exists() else {}
        template = config.get("chat_template")
        if template is None and (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text()
        return cls(Tokenizer.from_file(str(d / "tokenizer.json")), template or DEFAULT_CHAT_TEMPLATE,
                   _token_text(config.get("bos_token")), _token_text(config.get("eos_token")))

    def render_chat(self, messages) -> str:
        return self._template.render(messages=list(messages), add_generation_prompt=True,
                                     bos_token=self.bos_token, eos_token=self.eos_token)

    def encode_prompt(self, text: str, *, chat: bool) -> str | tuple[int, ...]:
        """Token ids for the router, or the text itself when the node tokenizes by bytes. A chat rendering already
        holds its special tokens; a completion prompt gets the tokenizer's (BOS), as vLLM's server does."""
        if self.tokenizer is None:
            return text
        return tuple(self.tokenizer.encode(text, add_special_tokens=not chat).ids)

    def detokenizer(self) -> Detokenizer:
        return Detokenizer(self.tokenizer)


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # the AddedToken form
        return value.get("content", "")
    return value or ""


class Detokenizer:
    """Incremental decoding: decode a short window ending at the new ids and emit what it adds."""

    __slots__ = ("tokenizer", "ids", "prefix_offset", "read_offset")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, new_ids) -> str:
        if self.tokenizer is None:
            return "".join(f"<{i}>" for i in new_ids)
        self.ids.extend(new_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return full[len(prefix):]
        return ""

    def flush(self) -> str:
        """What is still held back (an incomplete character at the very end), when the stream ends."""
        if self.tokenizer is None or self.read_offset == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset:self.read_offset], skip_special_tokens=True)
        full = decode(self.ids[self.prefix_offset:], skip_special_tokens=True)
        self.read_offset = len(self.ids)
        return full[len(prefix):]


class StopTrimmer:
    """OpenAI's `stop` semantics on streamed text: the returned text ends before the first stop string.

    The engine stops generating at a stop string, but its last token carries the stop string's text (and maybe
    more); the front never sends text that could be the start of a stop string until the next piece decides it.
    Invariant: the concatenation of what `push` and `finish` return is the whole text cut before the first
    occurrence of any stop string (the whole text when none occurs)."""

    __slots__ = ("stops", "held", "stopped", "_keep")

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = stops
        self.held = ""
        self.stopped = False
        self._keep = max((len(s) for s in stops), default=1) - 1

    def push(self, text: str) -> str:
        if not self.stops:
            return text
        if self.stopped:
            return ""
        self.held += text
        cut = min((i for i in (self.held.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            out, self.held = self.held[:cut], ""
            return out
        safe = len(self.held) - self._keep
        if safe <= 0:
            return ""
        out, self.held = self.held[:safe], self.held[safe:]
        return out

    def finish(self) -> str:
        if self.stopped:
            return ""
        out, self.held = self.held, ""
        return out
