"""The OpenAI-compatible HTTP front: speaks HTTP/JSON to clients and `octoserve.v1.Generation` to the router.

It runs inside the router process (`python -m octoserve.router --http-port 8000`, what `octoserve up` and
docker-compose do: the servicer is called in the same event loop, see `local.py`), or as a process of its own:

    python -m octoserve.http_front --router 127.0.0.1:50051 [--port 8000] [--model DIR | --models-root DIR]

The choice was measured (docs/bench/openai_front.md): inside, the front adds 0.5 ms to TTFT, saves the gRPC hop
that stalls for tens of ms when a busy engine shares the CPUs, and costs the router less CPU per token than the
gRPC write to a separate front would.

Endpoints: POST /v1/completions, POST /v1/chat/completions (SSE when `stream` is true), GET /v1/models,
GET /health, GET /metrics. Request and response shapes: `protocol.py`; text and chat templates: `text.py`.

Per request: parse (400 on bad input) -> template and tokenize -> one Generate stream to the router. The HTTP
status is chosen after the router's first message or error, so an admission refusal is a real 429/404/400/503
with its Retry-After, never a 200 stream that fails. Once tokens flowed, a router stream that ends UNAVAILABLE (the
router restarted, or could not continue the request on another worker) is resumed where it stopped
(`RouterStream`), within bounds; any other failure, or one past the bounds, is an SSE `error` event.
A client that disconnects cancels its gRPC stream, which aborts the request on every worker (the router's rule).

Headers that travel to the router as gRPC metadata: `authorization` and `x-api-key` (the tenant key, checked by the
router, not here) and
`x-octoserve-sim-output-len` (the sim engine's output length for trace replay).

Lifecycle: starts once the router answers ListModels, then writes the ready file (pid, port). SIGTERM: new
requests get 503 `draining`, in-flight streams finish within `--grace-s`, then the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import signal
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

import grpc
import grpc.aio
import prometheus_client as prom
from aiohttp import web

from octoserve.client import RetryPolicy, message_too_large, retry_after_ms_from_trailers
from octoserve.http_front import protocol
from octoserve.http_front.protocol import ApiError, ParsedRequest
from octoserve.http_front.text import StopTrimmer, TextCodec
from octoserve.services.rpc.limits import Limits, limits_from_dict
from octoserve.services.rpc.server import GRPC_OPTIONS, HOST, log_fields, setup_logging, stop_with_launcher
from octoserve.v1 import generate_pb2 as pb
from octoserve.v1 import generate_pb2_grpc as pb_grpc

log = logging.getLogger("octoserve.http_front")

DEFAULT_PORT = 8000
PASSED_HEADERS = ("authorization", "x-api-key", "x-octoserve-sim-output-len")
PRIORITY_PB = {"INTERACTIVE": pb.INTERACTIVE, "STANDARD": pb.STANDARD, "BATCH": pb.BATCH}
OTHER_MODEL = "unserved"  # the one metric label for model names the node does not serve (as the router)
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
DONE = b"data: [DONE]\n\n"
_dumps = json.JSONEncoder(separators=(",", ":"), ensure_ascii=False).encode


def sse(obj) -> bytes:
    return b"data: " + _dumps(obj).encode() + b"\n\n"


class FrontMetrics:
    """Prometheus metrics of the front. Times are wall-clock seconds; model labels are the served models or
    `other`, so a client cannot create series."""

    def __init__(self, served: set[str]) -> None:
        self.registry = prom.CollectorRegistry()
        self.served = served
        self.requests = prom.Counter("octoserve_http_requests", "HTTP requests by endpoint and status code",
                                     ["endpoint", "code"], registry=self.registry)
        self.ttft = prom.Histogram("octoserve_http_ttft_seconds",
                                   "seconds from the request arriving to its first token leaving the front",
                                   ["model"], registry=self.registry,
                                   buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
        self.tokens = prom.Counter("octoserve_http_streamed_tokens", "output tokens sent to clients (tokens)",
                                   ["model"], registry=self.registry)
        self.in_flight = prom.Gauge("octoserve_http_in_flight", "requests being served (requests)",
                                    registry=self.registry)
        self.resumes = prom.Counter("octoserve_http_resumed_streams",
                                    "router streams cut after tokens and resumed where they stopped (resumes)",
                                    ["model"], registry=self.registry)

    def model_label(self, model: str) -> str:
        return model if model in self.served else OTHER_MODEL


class Front:
    def __init__(self, router_address: str, codecs: Mapping[str, TextCodec] | None = None, grace_s: float = 10.0,
                 default_codec: TextCodec | None = None, stub=None, chat_default_max_tokens: int | None = None,
                 resume_policy: RetryPolicy = RetryPolicy(), rng: random.Random | None = None) -> None:
        """`stub`: the router's Generation API; by default a gRPC channel to `router_address`, inside the router
        process the servicer itself (`local.LocalGeneration`). `chat_default_max_tokens`: the cap on a chat that
        sends no max_tokens (`limits.chat_default_max_tokens`; None: the rest of the context window).
        `resume_policy`: the bounds and delays of resuming a cut stream (`RouterStream`; max_resumes 0: never)."""
        self.resume_policy = resume_policy
        self.rng = rng if rng is not None else random.Random()
        self.chat_default_max_tokens = chat_default_max_tokens
        self.router_address = router_address
        self.codecs = dict(codecs or {})  # model -> its tokenizer and chat template
        self.default_codec = default_codec or TextCodec()  # models without their own (the sim engine)
        self.grace_s = grace_s
        self.channel = None if stub is not None else grpc.aio.insecure_channel(router_address, options=GRPC_OPTIONS)
        self.stub = stub if stub is not None else pb_grpc.GenerationStub(self.channel)
        self.models: dict[str, int] = {}  # served model -> context window
        self.metrics = FrontMetrics(set())
        self.created = int(time.time())
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def refresh_models(self, timeout_s: float, wait_for_ready: bool = False, metadata=None) -> None:
        """The served models from the router's ListModels, asked with a client's tenant key (`metadata`) or, for
        the front's own refreshes (startup, /health), with none: a router that requires keys then answers
        UNAUTHENTICATED, which says it is up; the models stay those of the node config (`set_models`)."""
        try:
            reply = await self.stub.ListModels(pb.ListModelsRequest(), timeout=timeout_s,
                                               wait_for_ready=wait_for_ready, metadata=metadata)
        except grpc.aio.AioRpcError as e:
            if metadata is None and e.code() == grpc.StatusCode.UNAUTHENTICATED and self.models:
                return
            raise
        self.set_models({m.name: m.context_window for m in reply.models})

    def set_models(self, models: dict[str, int]) -> None:
        self.models = dict(models)
        self.metrics.served.clear()
        self.metrics.served.update(self.models)

    def codec(self, model: str) -> TextCodec:
        return self.codecs.get(model, self.default_codec)

    def app(self) -> web.Application:
        app = web.Application(client_max_size=64 * 1024 * 1024, middlewares=[self._json_errors])
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_get("/v1/models", self.list_models)
        app.router.add_get("/health", self.health)
        app.router.add_get("/metrics", self.metrics_handler)
        return app

    @web.middleware
    async def _json_errors(self, request: web.Request, handler):
        """aiohttp's own errors (unknown path, wrong method, body too large) in OpenAI's JSON shape, not text/plain."""
        try:
            return await handler(request)
        except web.HTTPException as e:
            if e.status < 400:
                raise
            allowed = getattr(e, "allowed_methods", ())
            return self._error_response(None, protocol.http_error(e.status, e.reason, request.method, request.path,
                                                                  tuple(allowed)))

    # ---- endpoints ----------------------------------------------------------------------------------------------

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def list_models(self, request: web.Request) -> web.Response:
        try:  # with the client's tenant key: a node that requires keys answers 401 without one, as for completions
            await self.refresh_models(timeout_s=5.0, metadata=_metadata(request.headers))
        except grpc.aio.AioRpcError as e:
            return self._error_response("/v1/models", protocol.error_for_status(e.code(), e.details() or ""))
        self.metrics.requests.labels("/v1/models", "200").inc()
        return web.json_response(protocol.models_response(sorted(self.models.items()), self.created))

    async def health(self, request: web.Request) -> web.Response:
        if self.draining:
            return self._error_response("/health", protocol.draining_error())
        try:
            await self.refresh_models(timeout_s=2.0)
        except grpc.aio.AioRpcError as e:
            return self._error_response("/health", ApiError(
                503, f"the router at {self.router_address} does not answer ({e.code().name}: {e.details()})",
                type="unavailable_error", code="router_unavailable"))
        return web.json_response({"status": "ok", "models": sorted(self.models)})

    async def metrics_handler(self, request: web.Request) -> web.Response:
        return web.Response(body=prom.generate_latest(self.metrics.registry),
                            headers={"Content-Type": prom.CONTENT_TYPE_LATEST})

    # ---- generation ---------------------------------------------------------------------------------------------

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        endpoint = request.path
        t0 = time.monotonic()
        if self.draining:
            return self._error_response(endpoint, protocol.draining_error())
        self._enter()
        try:
            try:
                body = protocol.parse_body(await request.read())
                parsed = (protocol.parse_chat if chat else protocol.parse_completion)(body, request.headers)
                call = RouterStream(self, self._grpc_request(parsed, chat), parsed.timeout_s,
                                    _metadata(request.headers), chat)
            except ApiError as e:
                return self._error_response(endpoint, e)
            try:
                first = await call.read()
            except ApiError as e:
                return self._error_response(endpoint, e)
            model_label = self.metrics.model_label(parsed.model)
            self.metrics.ttft.labels(model_label).observe(time.monotonic() - t0)
            self.metrics.requests.labels(endpoint, "200").inc()
            if parsed.stream:
                return await self._stream(request, call, first, parsed, chat, model_label)
            return await self._collect(call, first, parsed, chat, model_label)
        finally:
            self._exit()

    def _grpc_request(self, parsed: ParsedRequest, chat: bool) -> pb.GenerateRequest:
        if chat:
            try:
                text = self.codec(parsed.model).render_chat(parsed.messages)
            except Exception as e:  # a template that rejects these messages (e.g. roles out of order)
                raise protocol.invalid("messages", f"the chat template of {parsed.model} rejects these "
                                                   f"messages: {e}") from None
            prompt = self.codec(parsed.model).encode_prompt(text, chat=True)
        elif isinstance(parsed.prompt, str):
            prompt = self.codec(parsed.model).encode_prompt(parsed.prompt, chat=False)
        else:
            prompt = parsed.prompt
        max_tokens = parsed.max_tokens
        if max_tokens is None:  # chat without a limit: the rest of the context window, capped by the config
            window = self.models.get(parsed.model, 0)
            num_prompt = len(prompt.encode()) if isinstance(prompt, str) else len(prompt)
            max_tokens = max(1, window - num_prompt)
            if self.chat_default_max_tokens is not None:
                max_tokens = min(max_tokens, self.chat_default_max_tokens)
        req = pb.GenerateRequest(
            model=parsed.model, max_tokens=max_tokens, temperature=parsed.temperature, top_p=parsed.top_p,
            stop=parsed.stop, ignore_eos=parsed.ignore_eos,
            priority=PRIORITY_PB.get(parsed.priority, pb.PRIORITY_UNSPECIFIED), ttft_slo_ms=parsed.ttft_slo_ms or 0,
        )
        if isinstance(prompt, str):
            req.text = prompt
        else:
            req.token_ids.SetInParent()
            req.token_ids.ids.extend(prompt)
        if parsed.seed is not None:
            req.seed = parsed.seed
        return req

    async def _stream(self, request: web.Request, call: RouterStream, first: pb.GenerateResponse, parsed: ParsedRequest,
                      chat: bool, model_label: str) -> web.StreamResponse:
        rid = ("chatcmpl-" if chat else "cmpl-") + (first.request_id or uuid.uuid4().hex)
        created = int(time.time())
        detok, trim = self.codec(parsed.model).detokenizer(), StopTrimmer(parsed.stop)
        tokens = self.metrics.tokens.labels(model_label)
        response = web.StreamResponse(headers=SSE_HEADERS)
        await response.prepare(request)
        message, is_first = first, True
        try:
            while True:
                text = trim.push(detok.push(message.token_ids))
                finish = protocol.FINISH_REASONS.get(message.finish_reason)
                if finish is not None:
                    text += trim.push(detok.flush()) + trim.finish()
                if message.token_ids:
                    tokens.inc(len(message.token_ids))
                if message.token_ids or finish is not None or is_first:  # one event per message, as vLLM does
                    # (text may be empty: a token that completes no character, or one held back by `stop`)
                    chunk = (protocol.chat_chunk(rid, created, parsed.model, text, finish, is_first) if chat else
                             protocol.completion_chunk(rid, created, parsed.model, text, finish))
                    await response.write(sse(chunk))
                    is_first = False
                if finish is not None:
                    if parsed.include_usage:
                        await response.write(sse(protocol.usage_chunk(rid, created, parsed.model, chat,
                                                                      _usage(message))))
                    break
                try:
                    message = await call.read()
                except ApiError as e:  # headers are sent: the error travels as an SSE event
                    await response.write(sse(e.body()))
                    break
            await response.write(DONE)
        except ConnectionResetError:  # the client went away: the finally below aborts its request
            log.info("client disconnected mid-stream", extra=log_fields(request_id=rid))
        finally:
            call.cancel()
        return response

    async def _collect(self, call: RouterStream, first: pb.GenerateResponse, parsed: ParsedRequest, chat: bool,
                       model_label: str) -> web.Response:
        rid = ("chatcmpl-" if chat else "cmpl-") + (first.request_id or uuid.uuid4().hex)
        detok, trim = self.codec(parsed.model).detokenizer(), StopTrimmer(parsed.stop)
        pieces, message = [], first
        try:
            while True:
                pieces.append(trim.push(detok.push(message.token_ids)))
                if message.finish_reason:
                    pieces.append(trim.push(detok.flush()) + trim.finish())
                    break
                message = await call.read()
        except ApiError as e:
            return self._error_response(None, e)
        finally:
            call.cancel()
        self.metrics.tokens.labels(model_label).inc(message.usage.completion_tokens)
        build = protocol.chat_response if chat else protocol.completion_response
        return web.json_response(build(rid, int(time.time()), parsed.model, "".join(pieces),
                                       protocol.FINISH_REASONS.get(message.finish_reason), _usage(message)),
                                 dumps=lambda o: _dumps(o))

    def _error_response(self, endpoint: str | None, e: ApiError) -> web.Response:
        if endpoint is not None:
            self.metrics.requests.labels(endpoint, str(e.status)).inc()
        return web.Response(status=e.status, body=_dumps(e.body()).encode(),
                            headers={"Content-Type": "application/json", **e.headers})

    # ---- drain --------------------------------------------------------------------------------------------------

    def _enter(self) -> None:
        self.in_flight += 1
        self.metrics.in_flight.inc()
        self._idle.clear()

    def _exit(self) -> None:
        self.in_flight -= 1
        self.metrics.in_flight.dec()
        if self.in_flight == 0:
            self._idle.set()

    async def drain(self) -> None:
        self.draining = True
        log.info("draining", extra=log_fields(in_flight=self.in_flight))
        try:
            await asyncio.wait_for(self._idle.wait(), self.grace_s)
        except TimeoutError:
            log.warning("grace period over with requests in flight; closing them", extra=log_fields(
                in_flight=self.in_flight))

    async def close(self) -> None:
        if self.channel is not None:
            await self.channel.close()


class RouterStream:
    """One request's Generate stream to the router, resumed where it stopped when it ends UNAVAILABLE after tokens
    (the router restarted, or refused to continue the request on another worker), as the SDK resumes
    (octoserve.client): the same request under the router's id for it, with `resume_from` = every token received,
    so the router generates only the rest and reports usage for the whole request; the client's SSE stream or JSON
    body goes on as one, only with a longer gap. Every stream is resumed, sampled ones too: an OpenAI client cannot
    resume one itself, and the text the front sends stays cut at a stop string across the gap (`StopTrimmer`).

    Bounds: at most `front.resume_policy.max_resumes` resumes per request; each waits the router's retry hint
    (none above `max_backoff_s`) or the backoff, then up to `resume_wait_s` for a separate-process front's channel
    to reconnect, and none outlives the request's deadline. A resumed call refused before its own first token
    (RESOURCE_EXHAUSTED or UNAVAILABLE: a router still coming back) is sent again as the SDK sends a new call's
    retries, at most `max_attempts` sends per resume. A failure not resumed is the router's status as an ApiError,
    as before."""

    def __init__(self, front: Front, request: pb.GenerateRequest, timeout_s: float | None, metadata,
                 chat: bool) -> None:
        self.front, self.request, self.metadata, self.chat = front, request, metadata, chat
        self.deadline_s = None if timeout_s is None else time.monotonic() + timeout_s
        self.call = front.stub.Generate(request, timeout=timeout_s, metadata=metadata)
        self.request_id = ""
        self.received: list[int] = []
        self.resumes = 0
        self.sends = 1  # sends of the current request (the original, or its latest resume)
        self.received_at_send = 0  # tokens received when the current request was sent

    async def read(self) -> pb.GenerateResponse:
        """The next message of the router's stream, or the router's status as an ApiError (`param`: the field the
        router named, if any)."""
        while True:
            try:
                message = await self.call.read()
            except grpc.aio.AioRpcError as e:
                delay_s = self._resend_delay_s(e)
                if delay_s is not None:
                    await self._send_again(delay_s, e, resume=False)
                    continue
                delay_s = self._resume_delay_s(e)
                if delay_s is None:
                    raise _api_error(e, self.chat) from None
                await self._send_again(delay_s, e, resume=True)
                continue
            if message is grpc.aio.EOF:  # the router always ends a stream with a finish reason or a status
                raise ApiError(502, "the router ended the stream without a finish reason", type="internal_error",
                               code="incomplete_stream")
            self.request_id = self.request_id or message.request_id
            self.received.extend(message.token_ids)
            return message

    def cancel(self) -> None:
        self.call.cancel()  # no-op once the stream ended; aborts the request when the client went away

    def _resend_delay_s(self, e: grpc.aio.AioRpcError) -> float | None:
        """Seconds before sending a resumed request again that was refused before its own first token, or None."""
        policy = self.front.resume_policy
        if (self.resumes == 0 or len(self.received) != self.received_at_send
                or e.code() not in policy.retryable_codes or self.sends >= policy.max_attempts):
            return None
        return self._delay_s(e, self.sends - 1)

    def _resume_delay_s(self, e: grpc.aio.AioRpcError) -> float | None:
        policy = self.front.resume_policy
        if (e.code() != grpc.StatusCode.UNAVAILABLE or self.resumes >= policy.max_resumes
                or not 0 < len(self.received) < self.request.max_tokens):
            return None
        return self._delay_s(e, self.resumes)

    def _delay_s(self, e: grpc.aio.AioRpcError, retry_index: int) -> float | None:
        """The router's retry hint (None when above `max_backoff_s`) or the backoff; None past the deadline."""
        policy = self.front.resume_policy
        hint_ms = retry_after_ms_from_trailers(tuple(e.trailing_metadata() or ()))
        hint_s = None if hint_ms is None else hint_ms / 1000.0
        if hint_s is not None and hint_s > policy.max_backoff_s:
            return None
        delay_s = policy.delay_s(retry_index, hint_s, self.front.rng)
        if self.deadline_s is not None and time.monotonic() + delay_s >= self.deadline_s:
            return None
        return delay_s

    async def _send_again(self, delay_s: float, cause: grpc.aio.AioRpcError, resume: bool) -> None:
        """The request again, resumed from every token received: a resume (`resume`), or a resumed request's
        next send."""
        self.call.cancel()
        if resume:
            self.resumes += 1
            self.sends = 0
            self.front.metrics.resumes.labels(self.front.metrics.model_label(self.request.model)).inc()
        self.sends += 1
        self.received_at_send = len(self.received)
        log.info("resuming a cut stream" if resume else "sending a resumed stream again",
                 extra=log_fields(request_id=self.request_id, tokens=len(self.received), resume=self.resumes,
                                  send=self.sends, cause=cause.details()))
        await asyncio.sleep(delay_s)
        if self.front.channel is not None:  # a front of its own: its router may be restarting
            wait_s = self.front.resume_policy.resume_wait_s
            if self.deadline_s is not None:
                wait_s = max(0.0, min(wait_s, self.deadline_s - time.monotonic()))
            try:
                await asyncio.wait_for(self.front.channel.channel_ready(), wait_s)
            except TimeoutError:
                pass  # the resumed call fails UNAVAILABLE and the bound decides
        resumed = pb.GenerateRequest()
        resumed.CopyFrom(self.request)
        resumed.request_id = self.request_id
        resumed.resume_from.ids[:] = self.received
        timeout_s = None if self.deadline_s is None else max(0.0, self.deadline_s - time.monotonic())
        self.call = self.front.stub.Generate(resumed, timeout=timeout_s, metadata=self.metadata)


def _api_error(e: grpc.aio.AioRpcError, chat: bool) -> ApiError:
    """The router's status as the front's error."""
    trailers = tuple(e.trailing_metadata() or ())
    too_large = message_too_large(e.code(), e.details(), trailers)
    if too_large is not None:  # the transport's size limit: invalid input, not an overload
        return protocol.invalid("messages" if chat else "prompt", too_large)
    return protocol.error_for_status(e.code(), e.details() or e.code().name, _retry_after_ms(trailers),
                                     param=protocol.field_from_trailers(trailers, chat))


def _retry_after_ms(trailing_metadata) -> int | None:
    ms = retry_after_ms_from_trailers(tuple(trailing_metadata or ()))
    return None if ms is None else int(round(ms))


def _usage(message: pb.GenerateResponse) -> dict:
    u = message.usage
    return protocol.usage_json(u.prompt_tokens, u.completion_tokens, u.cached_prompt_tokens)


def _metadata(headers: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple((h, headers[h]) for h in PASSED_HEADERS if h in headers)


# ---- process ------------------------------------------------------------------------------------------------------


def config_limits(config_path: str | None) -> Limits:
    """The `limits:` section of the node config the front was started with (defaults without one)."""
    if not config_path:
        return Limits()
    from octoserve.services.config import load_service_sections

    return limits_from_dict(load_service_sections(config_path).get("limits"))


def config_models(config_path: str | None) -> dict[str, int]:
    """The served models of the node config the front was started with (the embedded one without), with their
    context windows: what the router's ListModels answers."""
    from octoserve.services.config import load_node_config

    return {name: spec.max_context_len for name, spec in load_node_config(config_path).models.items()}


async def serve(args: argparse.Namespace) -> int:
    stop_with_launcher()
    front = Front(args.router, grace_s=args.grace_s,
                  chat_default_max_tokens=config_limits(args.config).chat_default_max_tokens)
    front.set_models(config_models(args.config))  # what a router requiring tenant keys serves (see refresh_models)
    await front.refresh_models(timeout_s=args.startup_timeout_s, wait_for_ready=True)
    load_codecs(front, args.model, args.models_root)
    runner = web.AppRunner(front.app(), access_log=None, handle_signals=False)
    await runner.setup()
    site = web.TCPSite(runner, args.host, args.port)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # the bound port when --port 0
    if args.ready_file:
        tmp = f"{args.ready_file}.tmp"
        with open(tmp, "w") as f:
            json.dump({"pid": os.getpid(), "port": port, "metrics_port": port}, f)
        os.replace(tmp, args.ready_file)
    log.info("serving", extra=log_fields(address=f"{args.host}:{port}", router=args.router,
                                         models=sorted(front.models)))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await front.drain()
    await runner.cleanup()
    await front.close()
    log.info("stopped")
    return 0


def load_codecs(front: Front, model: str | None, models_root: str | None) -> None:
    """`model`: one folder for every served model; `models_root`: a folder per served model name, where present."""
    if model:
        front.default_codec = TextCodec.from_model_dir(model)
    if models_root:
        for name in front.models:
            folder = Path(models_root) / name
            if (folder / "tokenizer.json").exists():
                front.codecs[name] = TextCodec.from_model_dir(folder)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--router", required=True, help="the router's host:port (octoserve.v1.Generation)")
    parser.add_argument("--host", default=HOST, help="address to bind (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help="HTTP port (0: any free port)")
    parser.add_argument("--model", default=None,
                        help="model directory whose tokenizer and chat template serve every model (as `up --model`)")
    parser.add_argument("--models-root", default=None,
                        help="folder with one subfolder per served model name (its tokenizer and chat template)")
    parser.add_argument("--ready-file", default=None)
    parser.add_argument("--grace-s", type=float, default=10.0)
    parser.add_argument("--startup-timeout-s", type=float, default=60.0)
    parser.add_argument("--config", default=None,
                        help="node config YAML: its limits.chat_default_max_tokens caps chats without max_tokens")
    parser.add_argument("--log-level", default="INFO")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="http_front", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging("http_front", args.log_level)
    import uvloop

    return uvloop.run(serve(args))
