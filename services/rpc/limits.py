"""Input limits of the node's gRPC APIs and the checks that enforce them before any work starts.

The `limits:` section of the node config (every key optional; defaults shown):
    limits:
      max_message_bytes: 4194304      # largest public request accepted (4 MiB: a 128k-token prompt is ~0.6 MiB)
      max_concurrent_streams: 4096    # HTTP/2 streams per client connection at the router; more wait at the client
      max_stop_strings: 64            # entries in GenerateRequest.stop
      max_stop_chars: 1024            # characters per stop string
      max_request_id_chars: 256
      # chat_default_max_tokens: 1024   # an HTTP chat without max_tokens generates at most this many tokens;
                                        # unset (the default, as vLLM): the rest of the model's context window
The longest prompt is the model's context window minus one token (per model, `models.<name>.max_context_len`).

Invariants: every check raises `InvalidArgument(field, message)` whose message says what to change; checks are
cheap (lengths and enum lookups, no per-token work) and run before the request is converted or validated in full.
A worker re-checks what it receives (`check_worker_spec`): the internal APIs do not trust their callers either.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields

from octoserve.services.core.errors import InvalidArgument
from octoserve.services.core.types import RequestSpec
from octoserve.services.core.validation import validate_request
from octoserve.v1 import generate_pb2 as gen_pb

TRANSPORT_SLACK = 2  # the transport accepts this x max_message_bytes, so an oversized request still gets our message


@dataclass(frozen=True, slots=True)
class Limits:
    max_message_bytes: int = 4 * 1024 * 1024
    max_concurrent_streams: int = 4096
    max_stop_strings: int = 64
    max_stop_chars: int = 1024
    max_request_id_chars: int = 256
    # The HTTP front's max_tokens for a chat that sends none: min(this, the rest of the context window); None (the
    # default, as vLLM): the rest of the context window. The gRPC API has no default (max_tokens is required).
    chat_default_max_tokens: int | None = None

    def router_grpc_options(self) -> tuple[tuple[str, int], ...]:
        return (("grpc.max_receive_message_length", TRANSPORT_SLACK * self.max_message_bytes),
                ("grpc.max_concurrent_streams", self.max_concurrent_streams))


OPTIONAL_LIMITS = frozenset({"chat_default_max_tokens"})  # null/None: unset


def limits_from_dict(d: Mapping | None) -> Limits:
    if not d:
        return Limits()
    known = {f.name for f in fields(Limits)}
    if unknown := sorted(set(d) - known):
        raise ValueError(f"unknown key(s) {unknown} in limits; known: {sorted(known)}")
    for k, v in d.items():
        if v is None and k in OPTIONAL_LIMITS:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"limits.{k} must be a positive integer, not {v!r}")
    return Limits(**d)


_PRIORITIES = {v.number for v in gen_pb.Priority.DESCRIPTOR.values}


def check_public_request(req: gen_pb.GenerateRequest, limits: Limits, max_context_len: int | None) -> None:
    """Shape checks of a client request; `max_context_len` is the named model's window (None: unknown model)."""
    if len(req.request_id) > limits.max_request_id_chars:
        raise InvalidArgument("request_id", f"request_id has {len(req.request_id)} characters; use at most "
                                            f"{limits.max_request_id_chars} (or leave it empty)")
    if req.priority not in _PRIORITIES:
        raise InvalidArgument("priority", f"priority {req.priority} is not a known tier; use INTERACTIVE, STANDARD "
                                          "or BATCH (or leave it unset for STANDARD)")
    which = req.WhichOneof("prompt")
    if which is None:
        raise InvalidArgument("prompt", "the request has no prompt; set text or token_ids")
    n = len(req.token_ids.ids) if which == "token_ids" else len(req.text)  # characters <= UTF-8 bytes
    if max_context_len is not None and n >= max_context_len and which == "token_ids":
        raise InvalidArgument("prompt", f"the prompt of {n} tokens does not fit the {max_context_len}-token context "
                                        f"window of {req.model}; shorten it to at most {max_context_len - 1} tokens")
    if len(req.stop) > limits.max_stop_strings:
        raise InvalidArgument("stop", f"{len(req.stop)} stop strings; send at most {limits.max_stop_strings}")
    for s in req.stop:
        if len(s) > limits.max_stop_chars:
            raise InvalidArgument("stop", f"a stop string has {len(s)} characters; shorten each to at most "
                                          f"{limits.max_stop_chars}")
    if not math.isfinite(req.temperature):
        raise InvalidArgument("temperature", f"temperature is {req.temperature}; set it to 0 (greedy) or a "
                                             "positive finite number")


def check_worker_spec(spec: RequestSpec, model_name: str, model_spec) -> None:
    """What a worker checks on every RequestSpec it is sent (the router validated it, but a caller may not be it)."""
    if not spec.request_id:
        raise InvalidArgument("request_id", "the RequestSpec has no request_id; set a unique one")
    if spec.model != model_name:
        raise InvalidArgument("model", f"this worker serves {model_name}, not {spec.model!r}; send it to an "
                                       f"instance of {spec.model!r}")
    if not math.isfinite(spec.sampling.temperature):
        raise InvalidArgument("temperature", f"temperature is {spec.sampling.temperature}; set a finite value")
    if spec.ttft_slo_ms is not None and not math.isfinite(spec.ttft_slo_ms):
        raise InvalidArgument("ttft_slo_ms", f"ttft_slo_ms is {spec.ttft_slo_ms}; set a finite value or leave it unset")
    if not math.isfinite(spec.arrival_s):
        raise InvalidArgument("arrival_s", f"arrival_s is {spec.arrival_s}; send the monotonic clock reading")
    if model_spec is not None:
        validate_request(spec, model_spec)
