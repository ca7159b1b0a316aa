"""The one mapping from octoserve's typed errors to gRPC statuses (and back, for the SDK).

- InvalidArgument -> INVALID_ARGUMENT with a `google.rpc.BadRequest` detail whose one field violation names the
  field at fault (the HTTP front reports it as `error.param`), UnknownModel -> NOT_FOUND, SloInfeasible and ItlInfeasible -> FAILED_PRECONDITION,
  DeadlineExceeded -> DEADLINE_EXCEEDED,
  Draining -> UNAVAILABLE, Overloaded -> RESOURCE_EXHAUSTED with a `google.rpc.RetryInfo` detail
  (`grpc-status-details-bin`) and a plain `retry-after-ms` trailer for clients that do not parse rich status.
- Engine errors reaching the edge: CapacityError -> RESOURCE_EXHAUSTED, HandoffError -> UNAVAILABLE.
The message is always the error's own sentence saying what to change; nothing else rewrites it.
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import grpc.aio
from google.protobuf import duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from octoserve.services.core.errors import (
    DeadlineExceeded,
    Draining,
    InvalidArgument,
    ItlInfeasible,
    OctoserveError,
    Overloaded,
    SloInfeasible,
    Unauthenticated,
    UnknownModel,
)
from octoserve.services.engine.base import CapacityError, EngineError, HandoffError

RETRY_AFTER_MS_KEY = "retry-after-ms"
# Trailer of a decode worker's UNAVAILABLE when a KV transfer into it failed (value: timeout, corrupt or error): the
# worker lives and stays routable; only the request's hand-off failed.
KV_TRANSFER_FAILED_KEY = "x-octoserve-kv-transfer-failed"

_CODES: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownModel, grpc.StatusCode.NOT_FOUND),
    (Overloaded, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (SloInfeasible, grpc.StatusCode.FAILED_PRECONDITION),
    (ItlInfeasible, grpc.StatusCode.FAILED_PRECONDITION),
    (DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
    (Draining, grpc.StatusCode.UNAVAILABLE),
    (Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (CapacityError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (HandoffError, grpc.StatusCode.UNAVAILABLE),
)


@dataclass(frozen=True, slots=True)
class RpcStatus:
    code: grpc.StatusCode
    message: str
    trailing_metadata: tuple[tuple[str, str | bytes], ...] = ()


CODE_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}  # a status code's wire value -> grpc.StatusCode


def rpc_error(code: grpc.StatusCode, details: str, trailing=()) -> grpc.aio.AioRpcError:
    """The error a grpc.aio call raises, for a status answered some other way (a stream's message, in-process)."""
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


def status_for(error: Exception) -> RpcStatus:
    """The status an error becomes at the edge; unknown exceptions are INTERNAL (a bug, not the user's doing)."""
    code = next((c for t, c in _CODES if isinstance(error, t)), grpc.StatusCode.INTERNAL)
    message = error.message if isinstance(error, OctoserveError) else (str(error) or type(error).__name__)
    if isinstance(error, Overloaded):
        return RpcStatus(code, message, retry_trailers(code, message, error.retry_after_ms))
    if isinstance(error, InvalidArgument) and error.field:
        return RpcStatus(code, message, field_trailers(code, message, error.field))
    return RpcStatus(code, message)


def field_trailers(code: grpc.StatusCode, message: str, field: str) -> tuple[tuple[str, str | bytes], ...]:
    """Rich status naming the field at fault (google.rpc.BadRequest, one field violation)."""
    detail = error_details_pb2.BadRequest(field_violations=[
        error_details_pb2.BadRequest.FieldViolation(field=field, description=message)])
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(detail)
    return tuple(rpc_status.to_status(status).trailing_metadata)


def retry_trailers(code: grpc.StatusCode, message: str, retry_after_ms: int) -> tuple[tuple[str, str | bytes], ...]:
    """Rich status (RetryInfo) plus the plain `retry-after-ms` trailer."""
    delay = duration_pb2.Duration()
    delay.FromMilliseconds(int(retry_after_ms))
    detail = error_details_pb2.RetryInfo(retry_delay=delay)
    status = status_pb2.Status(code=code.value[0], message=message)
    status.details.add().Pack(detail)
    rich = rpc_status.to_status(status)
    return (*rich.trailing_metadata, (RETRY_AFTER_MS_KEY, str(int(retry_after_ms))))


async def abort(context: grpc.aio.ServicerContext, error: Exception):
    """Ends the RPC with the error's status; never returns (grpc raises AbortError)."""
    st = status_for(error)
    await context.abort(st.code, st.message, trailing_metadata=st.trailing_metadata)


def retry_after_ms_from(error: grpc.aio.AioRpcError) -> int | None:
    """The retry hint of a RESOURCE_EXHAUSTED status: RetryInfo first, the plain trailer as fallback."""
    status = rpc_status.from_call(error)
    if status is not None:
        for detail in status.details:
            if detail.Is(error_details_pb2.RetryInfo.DESCRIPTOR):
                info = error_details_pb2.RetryInfo()
                detail.Unpack(info)
                return info.retry_delay.ToMilliseconds()
    for key, value in error.trailing_metadata() or ():
        if key == RETRY_AFTER_MS_KEY:
            return int(value)
    return None


