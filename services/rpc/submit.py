"""The Submit stream: a router's Generate requests as messages on one open stream per worker (worker.proto).

Job: both ends of it. A unary call costs the first token's path its set-up on both sides (call object, a handler
task, two completion-queue round trips: ~0.9 ms one way on a loaded 2-core host, against ~0.4 ms for a message on an
open stream); the answer (started, or the status Generate would have aborted with) is not on that path.
- Worker: `serve_submit(generate, requests, context)` runs every request through the servicer's own `Generate`
  (role checks, the role switch's gate, validation: one code path), each in a task of its own, and answers each with
  a `SubmitResult` as it completes. `Generate` sees a `MessageContext`: the message's metadata, and an `abort` that
  becomes the result's status.
- Router: `SubmitStream` opens the stream on first use, writes each request, and resolves the request's wait with
  the result, raising the `grpc.aio.AioRpcError` the unary call would have raised. A stream that breaks (the worker
  died) fails every request still waiting with UNAVAILABLE, as their calls would have failed; the next request
  opens a new stream. A worker without the method (UNIMPLEMENTED: an older build) gets unary Generate calls from
  then on.

Invariant: one result per submitted request, unless the stream breaks first (then the router's side fails it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence

import grpc
import grpc.aio

from octoserve.services.rpc.gen import worker_pb2 as w_pb
from octoserve.services.rpc.status import CODE_BY_VALUE, rpc_error

log = logging.getLogger("octoserve.rpc.submit")

def metadata_entries(metadata: Sequence[tuple[str, str | bytes]] | None) -> list[w_pb.MetadataEntry]:
    return [w_pb.MetadataEntry(key=k, value=v if isinstance(v, bytes) else v.encode()) for k, v in metadata or ()]


def metadata_pairs(entries) -> tuple[tuple[str, str | bytes], ...]:
    """Entries back as gRPC metadata: text values decoded, `-bin` keys' values kept as bytes."""
    return tuple((e.key, e.value if e.key.endswith("-bin") else e.value.decode()) for e in entries)


# ---- worker side ---------------------------------------------------------------------------------------------------


class _Aborted(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing_metadata = code, details, tuple(trailing_metadata or ())


class MessageContext:
    """The part of grpc.aio.ServicerContext a worker's Generate uses, for one message of the stream."""

    __slots__ = ("_metadata",)

    def __init__(self, metadata: tuple[tuple[str, str | bytes], ...]) -> None:
        self._metadata = metadata

    def invocation_metadata(self):
        return self._metadata

    async def abort(self, code, details="", trailing_metadata=()):
        raise _Aborted(code, details, trailing_metadata)


async def serve_submit(generate: Callable[..., Awaitable], requests: AsyncIterator[w_pb.SubmitRequest],
                       context) -> AsyncIterator[w_pb.SubmitResult]:
    results: asyncio.Queue[w_pb.SubmitResult | None] = asyncio.Queue()
    tasks: set[asyncio.Task] = set()

    async def one(message: w_pb.SubmitRequest) -> None:
        request = message.request
        try:
            await generate(request, MessageContext(metadata_pairs(message.metadata)))
            result = w_pb.SubmitResult(request_id=request.spec.request_id)
        except _Aborted as e:
            result = w_pb.SubmitResult(request_id=request.spec.request_id, code=e.code.value[0], message=e.details,
                                       trailing_metadata=metadata_entries(e.trailing_metadata))
        except Exception as e:  # a bug must answer its request, not leave the router waiting for its deadline
            log.exception("Submit: Generate failed", extra={"fields": {"request_id": request.spec.request_id}})
            result = w_pb.SubmitResult(request_id=request.spec.request_id, code=grpc.StatusCode.INTERNAL.value[0],
                                       message=f"{type(e).__name__}: {e}")
        results.put_nowait(result)

    async def read() -> None:
        try:
            async for message in requests:
                task = asyncio.create_task(one(message))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        finally:
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
            results.put_nowait(None)

    reader = asyncio.create_task(read())
    try:
        while (result := await results.get()) is not None:
            yield result
        await reader  # the request side's own error (a malformed message), if any
    finally:
        reader.cancel()
        for task in tasks:
            task.cancel()


# ---- router side ---------------------------------------------------------------------------------------------------


class SubmitStream:
    """One worker's Submit stream, as the router uses it: `await submit(request, metadata, timeout_s)`."""

    def __init__(self, stub, instance_id: str) -> None:
        self._stub = stub
        self._instance_id = instance_id
        self._call = None
        self._reader: asyncio.Task | None = None
        self._waiting: dict[str, tuple[asyncio.Future, object]] = {}  # request id -> (its wait, the call it went on)
        self._write_lock = asyncio.Lock()
        self.unary = False  # the worker has no Submit method: unary Generate calls instead

    async def submit(self, request: w_pb.WorkerGenerateRequest, metadata, timeout_s: float | None) -> None:
        """Starts `request` on the worker; raises grpc.aio.AioRpcError as a unary Generate call would."""
        if self.unary:
            await self._stub.Generate(request, timeout=timeout_s, metadata=metadata)
            return
        request_id = request.spec.request_id
        waiter = asyncio.get_running_loop().create_future()
        try:
            try:
                async with self._write_lock:
                    if self._call is None:
                        self._open()
                    call = self._call
                    self._waiting[request_id] = (waiter, call)
                    await call.write(w_pb.SubmitRequest(request=request, metadata=metadata_entries(metadata)))
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError, grpc.aio.UsageError):
                pass  # the stream is breaking: its reader fails this request's wait with the stream's status
            if timeout_s is None:
                await waiter
                return
            try:
                await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
            except TimeoutError:
                raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
        except grpc.aio.AioRpcError as e:
            if e.code() is grpc.StatusCode.UNIMPLEMENTED and not self.unary:
                self.unary = True  # an older worker: the unary call, from now on
                await self._stub.Generate(request, timeout=timeout_s, metadata=metadata)
                return
            raise
        finally:
            entry = self._waiting.get(request_id)
            if entry is not None and entry[0] is waiter:
                del self._waiting[request_id]

    def _open(self) -> None:
        self._call = self._stub.Submit()
        self._reader = asyncio.create_task(self._read(self._call), name=f"submit-{self._instance_id}")

    async def _read(self, call) -> None:
        error = None
        try:
            async for result in call:
                waiter, _ = self._waiting.get(result.request_id, (None, None))
                if waiter is None or waiter.done():
                    continue  # its submitter gave up (deadline, cancel)
                if result.code == 0:
                    waiter.set_result(None)
                else:
                    code = CODE_BY_VALUE.get(result.code, grpc.StatusCode.UNKNOWN)
                    waiter.set_exception(rpc_error(code, result.message, metadata_pairs(result.trailing_metadata)))
        except grpc.aio.AioRpcError as e:
            error = e
        except asyncio.CancelledError:
            error = rpc_error(grpc.StatusCode.CANCELLED, "the router closed the submit stream")
        finally:
            if self._call is call:
                self._call = None
            if error is None:
                error = rpc_error(grpc.StatusCode.UNAVAILABLE, f"{self._instance_id} ended the submit stream")
            elif error.code() not in (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.CANCELLED):
                error = rpc_error(grpc.StatusCode.UNAVAILABLE, error.details() or "connection lost",
                                   tuple(error.trailing_metadata() or ()))
            for waiter, on_call in list(self._waiting.values()):
                if on_call is call and not waiter.done():
                    waiter.set_exception(error)

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._reader is not None:
            self._reader.cancel()
