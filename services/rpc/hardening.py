"""Servicer registration that turns undecodable requests into a typed INVALID_ARGUMENT instead of grpc's INTERNAL.

`add_servicer(servicer, service_descriptor, server, max_message_bytes=...)` registers every method of the service
like the generated `add_*Servicer_to_server` does, except that the request deserializer never raises: bytes that
are not a valid message (truncated, wrong wire types, a string field holding invalid UTF-8) or that are over
`max_message_bytes` become a `Malformed` value, and the method answers INVALID_ARGUMENT saying what was wrong
before the servicer sees anything. Unexpected exceptions in a servicer stay grpc's (INTERNAL), and are logged.
"""

from __future__ import annotations

import contextlib
import inspect
import logging

import grpc
from google.protobuf import message as pb_message
from google.protobuf import message_factory

log = logging.getLogger("octoserve.rpc")


class Malformed:
    __slots__ = ("reason",)

    def __init__(self, reason: str) -> None:
        self.reason = reason


def safe_deserializer(cls, method: str, max_bytes: int | None):
    def deserialize(data: bytes):
        if max_bytes is not None and len(data) > max_bytes:
            return Malformed(f"the {method} request is {len(data)} bytes, over this server's limit of {max_bytes}; "
                             "send a shorter prompt (or fewer stop strings)")
        try:
            return cls.FromString(data)
        except pb_message.DecodeError as e:
            return Malformed(f"the {method} request is not a valid {cls.DESCRIPTOR.full_name} message ({e}); "
                             "send a well-formed message (string fields must be valid UTF-8)")

    return deserialize


def _unary(behavior):
    async def handler(request, context):
        if type(request) is Malformed:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        return await behavior(request, context)

    return handler


def _stream(behavior):
    async def handler(request, context):
        if type(request) is Malformed:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
        responses = behavior(request, context)
        if inspect.iscoroutine(responses):  # a role that does not stream this method answers with an abort
            await responses
            return
        async with contextlib.aclosing(responses):
            async for response in responses:
                yield response

    return handler


def _bidi(behavior):
    # Client streams (the scheduler's GangSteps): each request is checked as it arrives; a malformed one ends the
    # call with INVALID_ARGUMENT.
    async def handler(request_iterator, context):
        async def checked():
            async for request in request_iterator:
                if type(request) is Malformed:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.reason)
                yield request

        async with contextlib.aclosing(behavior(checked(), context)) as responses:
            async for response in responses:
                yield response

    return handler


def add_servicer(servicer, service_descriptor, server: grpc.aio.Server, *, max_message_bytes: int | None = None) -> None:
    handlers = {}
    for method in service_descriptor.methods:
        if method.client_streaming and not method.server_streaming:
            raise NotImplementedError(f"{method.full_name}: client-only streaming is not used by octoserve")
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        behavior = getattr(servicer, method.name)
        if method.client_streaming:
            handlers[method.name] = grpc.stream_stream_rpc_method_handler(
                _bidi(behavior), request_deserializer=safe_deserializer(request_cls, method.name, max_message_bytes),
                response_serializer=response_cls.SerializeToString)
            continue
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        wrap = _stream if method.server_streaming else _unary
        handlers[method.name] = make(
            wrap(behavior),
            request_deserializer=safe_deserializer(request_cls, method.name, max_message_bytes),
            response_serializer=response_cls.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service_descriptor.full_name, handlers),))
