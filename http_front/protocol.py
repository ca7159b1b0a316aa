"""The OpenAI-compatible wire format, translated to and from octoserve's public gRPC API. Pure: no sockets, no clock.

Job:
- `parse_completion(body)` / `parse_chat(body)`: an OpenAI request body (already JSON-decoded) and the request's
  headers -> a frozen `ParsedRequest`, or `ApiError` 400 naming the field and what to change. Types are checked
  here; value ranges the router checks (max_tokens >= 1, temperature >= 0, top_p in (0, 1], ...) are left to the
  router so that HTTP and gRPC clients get the same message, except where the value cannot even be put on the
  wire (a negative integer in a uint32 field): then this module raises the router's own sentence.
- `error_for_status(code, message, retry_after_ms, param)`: a gRPC status from the router -> the HTTP status, headers
  and OpenAI error JSON (`{"error": {"message", "type", "param", "code"}}`); `param` is the field the router named
  in its `google.rpc.BadRequest` detail (`field_from_trailers`), null where no one field is at fault.
- Chunk and response builders for both endpoints.

Octoserve's own fields (all optional), as extra body fields or as headers (the header wins when both are given):
- `priority` / `X-Octoserve-Priority`: INTERACTIVE, STANDARD (default) or BATCH.
- `ttft_slo_ms` / `X-Octoserve-Ttft-Slo-Ms`: the request's own time-to-first-token deadline in ms.
- `timeout_ms` / `X-Octoserve-Timeout-Ms`: the whole call's deadline in ms (504 when it passes).
- `ignore_eos`: generate max_tokens tokens whatever the model samples (load harnesses use it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
from google.rpc import error_details_pb2, status_pb2

PRIORITIES = ("INTERACTIVE", "STANDARD", "BATCH")
PRIORITY_HEADER = "x-octoserve-priority"
TTFT_SLO_HEADER = "x-octoserve-ttft-slo-ms"
TIMEOUT_HEADER = "x-octoserve-timeout-ms"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the window
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1


class ApiError(Exception):
    """An HTTP error in OpenAI's shape. `headers` go on the response (Retry-After for 429)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: Mapping[str, str] | None = None,
                 extra: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = dict(headers or {})
        self.extra = dict(extra or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code,
                          **self.extra}}

    def __repr__(self) -> str:
        return f"ApiError({self.status}, {self.message!r})"


def invalid(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param, code="invalid_argument")


@dataclass(frozen=True, slots=True)
class ParsedRequest:
    """What one OpenAI request asks of the node. `prompt` is text or token ids; `messages` is set for chat."""

    model: str
    prompt: str | tuple[int, ...] | None  # None for chat: the chat template makes it from `messages`
    messages: tuple[Mapping[str, Any], ...] | None
    max_tokens: int | None  # None: the endpoint's default
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    ignore_eos: bool
    stream: bool
    include_usage: bool
    priority: str | None  # one of PRIORITIES, None: the node's default (STANDARD)
    ttft_slo_ms: int | None
    timeout_s: float | None
    echo: bool = False


# ---- parsing --------------------------------------------------------------------------------------------------


def parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON ({e}); send a JSON object",
                       code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body is a JSON {type(body).__name__}, not an object; send a JSON object",
                       code="invalid_json")
    return body


def parse_completion(body: Mapping[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        parsed_prompt: str | tuple[int, ...] = prompt
    elif isinstance(prompt, list) and all(_is_int(t) for t in prompt):
        for position, token_id in enumerate(prompt):
            if token_id < 0:
                raise invalid("prompt", f"prompt token id {token_id} at position {position} is negative; "
                                        "token ids are >= 0")
        parsed_prompt = tuple(prompt)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise invalid("prompt", f"prompt is a batch of {len(prompt)} prompts; send one prompt per request")
    else:
        raise invalid("prompt", "prompt is missing or not a string or a list of token ids; send one of those")
    if body.get("logprobs") not in (None, 0, False):
        raise _no_logprobs("logprobs")
    _check_n(body)
    if _get_bool(body, "echo", False):
        raise invalid("echo", "echo is not supported; send the prompt without echo and join it yourself")
    return _common(body, headers, prompt=parsed_prompt, messages=None, max_tokens_keys=("max_tokens",),
                   default_max_tokens=COMPLETIONS_DEFAULT_MAX_TOKENS)


def parse_chat(body: Mapping[str, Any], headers: Mapping[str, str]) -> ParsedRequest:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages is missing or empty; send a list of {role, content} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise invalid(f"messages[{i}]", f"messages[{i}] is not an object with a string role; "
                                            "send {\"role\": ..., \"content\": ...}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text parts can be served by a text model
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise invalid(f"messages[{i}].content", f"messages[{i}].content has a part that is not text; "
                                                            "this node serves text models only")
                texts.append(part["text"])
            content = "".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise invalid(f"messages[{i}].content", f"messages[{i}].content is not a string or a list of text parts")
        out.append({"role": m["role"], "content": content})
    if _get_bool(body, "logprobs", False) or body.get("top_logprobs") not in (None, 0):
        raise _no_logprobs("logprobs")
    if body.get("tools") or body.get("functions"):
        raise invalid("tools", "tools and functions are not supported by this node; send plain messages")
    _check_n(body)
    return _common(body, headers, prompt=None, messages=tuple(out),
                   max_tokens_keys=("max_completion_tokens", "max_tokens"), default_max_tokens=None)


def _common(body: Mapping[str, Any], headers: Mapping[str, str], *, prompt, messages, max_tokens_keys,
            default_max_tokens: int | None) -> ParsedRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("model", "model is missing; name one of the models GET /v1/models lists")
    max_tokens = default_max_tokens
    for key in max_tokens_keys:
        if body.get(key) is not None:
            max_tokens = _get_int(body, key, lo_message=lambda v, k=key: f"{k} is {v}; set it to at least 1")
            break
    stream = _get_bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options", "stream_options is not an object; send {\"include_usage\": true}")
    include_usage = bool(options and options.get("include_usage"))
    if include_usage and not stream:
        raise invalid("stream_options", "stream_options is only allowed with stream: true")
    seed = body.get("seed")
    if seed is not None:
        seed = _get_int(body, "seed", hi=UINT64_MAX,
                        lo_message=lambda v: f"seed is {v}; set it in 0..{UINT64_MAX} or leave it unset")
    return ParsedRequest(
        model=model,
        prompt=prompt,
        messages=messages,
        max_tokens=max_tokens,
        temperature=_get_float(body, "temperature", 1.0),
        top_p=_get_top_p(body),
        seed=seed,
        stop=_get_stop(body),
        ignore_eos=_get_bool(body, "ignore_eos", False),
        stream=stream,
        include_usage=include_usage,
        priority=_get_priority(body, headers),
        ttft_slo_ms=_get_ms(body, headers, "ttft_slo_ms", TTFT_SLO_HEADER,
                            lambda v: f"ttft_slo_ms is {v}; set a positive deadline or leave it unset"),
        timeout_s=_timeout_s(body, headers),
    )


def _no_logprobs(param: str) -> ApiError:
    return invalid(param, "logprobs are not available from this node (its public API streams token ids and "
                          "text only); leave logprobs unset")


def _check_n(body: Mapping[str, Any]) -> None:
    n = body.get("n")
    if n is not None and n != 1:
        raise invalid("n", f"n is {n!r}; this node returns one choice per request: set n to 1 or leave it unset")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _get_int(body: Mapping[str, Any], key: str, *, hi: int = UINT32_MAX, lo_message) -> int:
    v = body.get(key)
    if not _is_int(v):
        raise invalid(key, f"{key} is {v!r}, not an integer; send a whole number")
    if v < 0:  # cannot be put in the uint field: the router's own sentence
        raise invalid(key, lo_message(v))
    if v > hi:
        raise invalid(key, f"{key} is {v}; set it to at most {hi}")
    return v


def _get_float(body: Mapping[str, Any], key: str, default: float) -> float:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise invalid(key, f"{key} is {v!r}, not a number; send a number")
    return float(v)


def _get_top_p(body: Mapping[str, Any]) -> float:
    """top_p; an explicit 0 is refused here with a hint for greedy decoding (the router refuses it too: `top_p` is
    an optional field on the wire). Other out-of-range values are the router's to refuse."""
    top_p = _get_float(body, "top_p", 1.0)
    if top_p == 0:
        raise invalid("top_p", "top_p is 0; set it in (0, 1] (1 disables nucleus sampling; for greedy decoding set "
                               "temperature to 0)")
    return top_p


def _get_bool(body: Mapping[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(key, f"{key} is {v!r}, not a boolean; send true or false")
    return v


def _get_stop(body: Mapping[str, Any]) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid("stop", "stop is not a string or a list of strings")
    return tuple(stop)  # how many and how long: the router's limits (limits.max_stop_strings, max_stop_chars)


def _get_priority(body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    v = headers.get(PRIORITY_HEADER, body.get("priority"))
    if v is None:
        return None
    if not isinstance(v, str) or v.upper() not in PRIORITIES:
        raise invalid("priority", f"priority is {v!r}; use one of {', '.join(PRIORITIES)}")
    return v.upper()


def _get_ms(body: Mapping[str, Any], headers: Mapping[str, str], key: str, header: str, lo_message) -> int | None:
    if header in headers:
        raw = headers[header]
        try:
            v: Any = int(raw)
        except ValueError:
            raise invalid(key, f"the {header} header is {raw!r}, not an integer number of milliseconds") from None
    else:
        v = body.get(key)
        if v is None:
            return None
    if not _is_int(v):
        raise invalid(key, f"{key} is {v!r}, not an integer number of milliseconds")
    if v <= 0:
        raise invalid(key, lo_message(v))
    if v > UINT32_MAX:
        raise invalid(key, f"{key} is {v}; set it to at most {UINT32_MAX}")
    return v


def _timeout_s(body: Mapping[str, Any], headers: Mapping[str, str]) -> float | None:
    ms = _get_ms(body, headers, "timeout_ms", TIMEOUT_HEADER,
                 lambda v: f"timeout_ms is {v}; set a positive deadline or leave it unset")
    return None if ms is None else ms / 1000.0


# ---- errors ---------------------------------------------------------------------------------------------------

# gRPC status -> (HTTP status, OpenAI error type, code)
_STATUS_MAP: dict[grpc.StatusCode, tuple[int, str, str]] = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error", "invalid_argument"),
    grpc.StatusCode.FAILED_PRECONDITION: (400, "invalid_request_error", "slo_infeasible"),
    grpc.StatusCode.NOT_FOUND: (404, "invalid_request_error", "model_not_found"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error", "invalid_api_key"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error", "permission_denied"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "overloaded_error", "overloaded"),
    grpc.StatusCode.UNAVAILABLE: (503, "unavailable_error", "unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error", "deadline_exceeded"),
    grpc.StatusCode.CANCELLED: (499, "cancelled_error", "cancelled"),
}


STATUS_DETAILS_KEY = "grpc-status-details-bin"


def field_from_trailers(trailing_metadata, chat: bool = False) -> str | None:
    """The request field a router INVALID_ARGUMENT names (its google.rpc.BadRequest detail), as the HTTP param:
    the router's `prompt` is `messages` for a chat. None when the status names no field."""
    for key, value in trailing_metadata or ():
        if key != STATUS_DETAILS_KEY:
            continue
        try:
            status = status_pb2.Status.FromString(value)
        except Exception:  # a malformed detail names nothing
            return None
        for detail in status.details:
            if detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
                info = error_details_pb2.BadRequest()
                detail.Unpack(info)
                for violation in info.field_violations:
                    field = violation.field
                    return "messages" if chat and field == "prompt" else field
    return None


def error_for_status(code: grpc.StatusCode, message: str, retry_after_ms: int | None = None,
                     param: str | None = None) -> ApiError:
    """The HTTP error for a router status. An overload carries `Retry-After` (whole seconds, rounded up, since
    the header cannot say less) and the exact delay as `retry-after-ms` and in the body; `param` names the field at
    fault (see `field_from_trailers`)."""
    if code == grpc.StatusCode.UNAVAILABLE and message == ROUTER_DRAINING:
        return draining_error()  # the router drains: the front's own answer while it drains, the same either way
    status, type_, err_code = _STATUS_MAP.get(code, (500, "internal_error", code.name.lower()))
    headers: dict[str, str] = {}
    extra: dict[str, Any] = {}
    if retry_after_ms is not None and status in (429, 503):
        headers["Retry-After"] = str(max(1, math.ceil(retry_after_ms / 1000)))
        headers["retry-after-ms"] = str(int(retry_after_ms))
        extra["retry_after_ms"] = int(retry_after_ms)
    return ApiError(status, message, type=type_, code=err_code, param=param, headers=headers, extra=extra)


def http_error(status: int, reason: str, method: str, path: str, allowed: Sequence[str] = ()) -> ApiError:
    """An error aiohttp raises before a handler runs (no such path, wrong method, body too large), in OpenAI's
    shape."""
    if status == 404:
        return ApiError(404, f"no endpoint {method} {path}; this node serves POST /v1/completions, "
                             "POST /v1/chat/completions, GET /v1/models, GET /health and GET /metrics",
                        code="unknown_url")
    if status == 405:
        return ApiError(405, f"{path} does not accept {method}; use {' or '.join(sorted(allowed)) or 'another method'}",
                        code="method_not_allowed", headers={"Allow": ", ".join(sorted(allowed))})
    if status == 413:
        return ApiError(413, f"the request body is too large ({reason}); send a smaller body", code="body_too_large")
    return ApiError(status, f"{method} {path}: {reason}", code=f"http_{status}")


# The router's UNAVAILABLE message while it drains (`services.core.errors.Draining`, checked equal in the tests).
ROUTER_DRAINING = "the server is draining and takes no new requests; retry on another replica"


def draining_error() -> ApiError:
    return ApiError(503, "the node is draining (shutting down) and accepts no new requests; retry on another node",
                    type="unavailable_error", code="draining")


def unknown_model(model: str, served: Sequence[str]) -> ApiError:
    """The router's NOT_FOUND sentence, for requests the front answers before calling it."""
    return ApiError(404, f"unknown model {model!r}; this node serves: {', '.join(sorted(served)) or '(none)'}",
                    code="model_not_found")


# ---- responses ------------------------------------------------------------------------------------------------

FINISH_REASONS = {1: "stop", 2: "length", 3: "abort"}  # octoserve.v1.FinishReason -> OpenAI finish_reason


def usage_json(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


def completion_chunk(rid: str, created: int, model: str, text: str, finish_reason: str | None) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]}


def chat_chunk(rid: str, created: int, model: str, text: str | None, finish_reason: str | None,
               first: bool) -> dict[str, Any]:
    delta: dict[str, Any] = {"role": "assistant", "content": text or ""} if first else (
        {"content": text} if text or finish_reason is None else {})
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]}


def usage_chunk(rid: str, created: int, model: str, chat: bool, usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion", "created": created,
            "model": model, "choices": [], "usage": usage}


def completion_response(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                        usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage}


def chat_response(rid: str, created: int, model: str, text: str, finish_reason: str | None,
                  usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage}


def models_response(models: Sequence[tuple[str, int]], created: int) -> dict[str, Any]:
    """`models`: (name, context window) pairs."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "octoserve",
                                        "max_model_len": window} for name, window in models]}
