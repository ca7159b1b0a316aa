"""The front inside the router process: the same `Front`, calling the router's servicer in the same event loop
instead of through a gRPC channel (no serialization, no loopback hop, no grpc.aio poller thread on the token path).

`LocalGeneration` has the two methods of the generated `GenerationStub` the front uses, with the same behaviour:
`Generate(...)` returns a call whose `read()` gives the next response, `grpc.aio.EOF` at the end, or raises
`grpc.aio.AioRpcError` with the status the servicer aborted with (trailers included, so 429s keep their retry
delay); `cancel()` ends the servicer's generator, which aborts the request on its workers as a gRPC cancel would.
A deadline (`timeout=`) is enforced on every read, as grpc enforces it on the call.

Used by `python -m octoserve.router --http-port P` (see `serve_inside`); the measurements that decide between
this and the separate process are in docs/bench/openai_front.md.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import grpc
import grpc.aio
from aiohttp import web

from octoserve.services.rpc.status import rpc_error


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, details: str, trailing_metadata) -> None:
        super().__init__(details)
        self.code, self.details, self.trailing_metadata = code, details, tuple(trailing_metadata or ())


class _Context:
    """The part of grpc.aio.ServicerContext the router's servicer uses."""

    def __init__(self, metadata, deadline_s: float | None) -> None:
        self._metadata = tuple(metadata or ())
        self._deadline_s = deadline_s

    def invocation_metadata(self):
        return self._metadata

    def time_remaining(self) -> float | None:
        return None if self._deadline_s is None else max(0.0, self._deadline_s - time.monotonic())

    async def send_initial_metadata(self, metadata) -> None:
        pass  # no headers in-process

    async def abort(self, code, details="", trailing_metadata=()):
        raise _Abort(code, details, trailing_metadata)


class LocalCall:
    def __init__(self, servicer, request, timeout: float | None, metadata) -> None:
        self._deadline_s = None if timeout is None else time.monotonic() + timeout
        self._stream = servicer.Generate(request, _Context(metadata, self._deadline_s))
        self._done = False

    async def read(self):
        try:
            if self._deadline_s is None:
                return await self._stream.__anext__()
            return await asyncio.wait_for(self._stream.__anext__(), max(0.0, self._deadline_s - time.monotonic()))
        except StopAsyncIteration:
            self._done = True
            return grpc.aio.EOF
        except _Abort as e:
            self._done = True
            raise rpc_error(e.code, e.details, e.trailing_metadata) from None
        except TimeoutError:
            self._done = True
            raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None

    def cancel(self) -> None:
        if not self._done:
            self._done = True
            asyncio.ensure_future(self._stream.aclose())


class LocalGeneration:
    def __init__(self, servicer) -> None:
        self.servicer = servicer

    def Generate(self, request, timeout: float | None = None, metadata=()) -> LocalCall:
        return LocalCall(self.servicer, request, timeout, metadata)

    async def ListModels(self, request, timeout: float | None = None, wait_for_ready: bool = False, metadata=None):
        """metadata None: the front's own question (no tenant check); a client's headers: checked as over gRPC."""
        if metadata is None:
            return await self.servicer.ListModels(request, None)
        try:
            return await self.servicer.ListModels(request, _Context(metadata, None))
        except _Abort as e:
            raise rpc_error(e.code, e.details, e.trailing_metadata) from None


async def serve_inside(servicer, port: int, model: str | None, models_root: str | None, grace_s: float,
                       ready_file: str | None, host: str = "127.0.0.1"):
    """Starts the front on host:port in this process (the router's own --host); returns (front, runner)."""
    from octoserve.http_front.app import Front, load_codecs

    front = Front("in-process", grace_s=grace_s, stub=LocalGeneration(servicer),
                  chat_default_max_tokens=servicer.settings.limits.chat_default_max_tokens)
    await front.refresh_models(timeout_s=5.0)
    load_codecs(front, model, models_root)
    runner = web.AppRunner(front.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = site._server.sockets[0].getsockname()[1]
    if ready_file:
        tmp = f"{ready_file}.tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "port": bound, "metrics_port": bound}, f)
        os.replace(tmp, ready_file)
    return front, runner


def add_router_arguments(parser) -> None:
    """The router's flags for a front inside it (`python -m octoserve.router --http-port P ...`)."""
    parser.add_argument("--http-port", type=int, default=None,
                        help="also serve the OpenAI-compatible front in this process on 127.0.0.1:P (0: any)")
    parser.add_argument("--http-model", default=None, help="model folder for the front's tokenizer and template")
    parser.add_argument("--http-models-root", default=None, help="a folder per served model name, for the front")
    parser.add_argument("--http-ready-file", default=None, help="where the front writes its pid and port")


def with_front_inside(spec, servicer, args):
    """`spec` (a router ServiceSpec) that also starts the front once SERVING, and drains it before the router."""
    import dataclasses

    if args.http_port is None:
        return spec
    state = {}

    async def on_serving(running) -> None:
        if spec.on_serving is not None:
            await spec.on_serving(running)
        state["front"], state["runner"] = await serve_inside(
            servicer, args.http_port, args.http_model, args.http_models_root, spec.grace_s, args.http_ready_file,
            getattr(args, "host", None) or "127.0.0.1")

    async def drain(grace_s: float) -> None:
        """Both fronts stop taking requests at the same moment (HTTP 503 `draining`, gRPC UNAVAILABLE), then each
        finishes what it holds: draining the front first left gRPC admitting while HTTP refused."""
        front = state.get("front")
        if front is not None:
            front.draining = True
        servicer.draining = True
        waits = ([front.drain()] if front is not None else []) + ([spec.drain(grace_s)] if spec.drain else [])
        await asyncio.gather(*waits)
        if front is not None:
            await state["runner"].cleanup()

    return dataclasses.replace(spec, on_serving=on_serving, drain=drain)
