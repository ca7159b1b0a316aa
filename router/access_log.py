"""The router's access log: one structured line per request, written when the request ends.

A line (JSON, logger `octoserve.router.access`, msg "request") carries: request_id, model, tier, outcome
("ok", "refused", "cancelled", "failed"), code (the gRPC status name), reason (the error's sentence, when not ok),
retry_after_ms (refusals with a hint), ttft_ms (wall clock, when a token went out), tokens_out, cached_tokens,
instances (every instance that served the request, in order: a re-routed request lists the dead one first),
rerouted (how many times it was moved off a lost worker before its first token), continued (how many times it was
continued on another instance after streaming tokens) with continued_causes (crash, hang, kv_transfer or drain, one
per continuation, in order), resumed_tokens (a client resuming a cut stream: the tokens it had received, which
tokens_out does not count), and e2e_ms.

Cost: the hook runs once per request, never per token. Mode `all` writes every request; `errors` (the default)
writes every request that did not end ok and one in `sample_every` of the ok ones (a counter, not a random draw,
so the rate is exact); `off` writes nothing. A disabled line costs one comparison: the fields are only built for
lines that are written. scripts/bench_router.py measures the difference (see BENCHMARKS.md, "Faults").
"""

from __future__ import annotations

import logging

import grpc

from octoserve.services.core.errors import Overloaded
from octoserve.services.rpc import status as rpc_status

log = logging.getLogger("octoserve.router.access")

MODES = ("off", "errors", "all")
DEFAULT_MODE = "errors"
DEFAULT_SAMPLE_EVERY = 100


class AccessLog:
    def __init__(self, mode: str = DEFAULT_MODE, sample_every: int = DEFAULT_SAMPLE_EVERY) -> None:
        if mode not in MODES:
            raise ValueError(f"access log mode must be one of {', '.join(MODES)}, got {mode!r}")
        if sample_every < 1:
            raise ValueError(f"access log sample_every must be >= 1 (1 = every ok request), got {sample_every}")
        self.mode = mode
        self.sample_every = sample_every
        self._ok_seen = 0

    def _wants(self, ok: bool) -> bool:
        if self.mode == "all":
            return True
        if self.mode == "off":
            return False
        if not ok:
            return True
        self._ok_seen += 1
        return (self._ok_seen - 1) % self.sample_every == 0  # the first ok request, then one in sample_every

    def refused(self, request, request_id: str, error: Exception) -> None:
        """A request that never reached a worker (validation, admission, draining)."""
        if not self._wants(False):
            return
        st = rpc_status.status_for(error)
        fields = {
            "request_id": request_id or request.request_id, "model": request.model,
            "tier": _tier_name(request.priority), "outcome": "refused", "code": st.code.name,
            "reason": st.message, "tokens_out": 0, "instances": [],
        }
        if isinstance(error, Overloaded):
            fields["retry_after_ms"] = error.retry_after_ms
        log.info("request", extra={"fields": fields})

    def finished(self, st, now_s: float) -> None:
        """A dispatched request at its end: `st` is the router's RequestState."""
        ok = st.error is None and st.finish_reason != 0
        if not self._wants(ok):
            return
        if ok:
            outcome, code, reason = "ok", grpc.StatusCode.OK.name, ""
        elif st.error is not None:
            outcome, code, reason = "failed", st.error.code.name, st.error.message
            if st.error.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
                outcome = "refused"
        else:
            outcome, code, reason = "cancelled", grpc.StatusCode.CANCELLED.name, "the client cancelled or its deadline passed"
        fields = {
            "request_id": st.spec.request_id, "model": st.spec.model, "tier": st.spec.priority.name,
            "outcome": outcome, "code": code, "tokens_out": st.num_sent, "cached_tokens": st.num_cached_tokens,
            "instances": list(st.served_by), "e2e_ms": round((now_s - st.wall_start_s) * 1000.0, 3),
        }
        if st.rerouted:
            fields["rerouted"] = st.rerouted
        if st.continued:
            fields["continued"] = len(st.continued)
            fields["continued_causes"] = list(st.continued)
        if st.resumed:
            fields["resumed_tokens"] = st.resumed
        if reason:
            fields["reason"] = reason
        if st.error is not None:
            hint = _retry_after_ms(st.error)
            if hint is not None:
                fields["retry_after_ms"] = hint
        if st.first_token_s is not None:
            fields["ttft_ms"] = round((st.first_token_s - st.wall_start_s) * 1000.0, 3)
        log.info("request", extra={"fields": fields})


def _retry_after_ms(status: rpc_status.RpcStatus) -> int | None:
    for key, value in status.trailing_metadata:
        if key == rpc_status.RETRY_AFTER_MS_KEY:
            return int(value)
    return None


def _tier_name(priority: int) -> str:
    from octoserve.services.rpc.convert import PRIORITY_FROM_PB
    from octoserve.services.core.types import Priority

    return PRIORITY_FROM_PB.get(priority, Priority.STANDARD).name

