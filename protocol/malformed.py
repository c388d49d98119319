"""A request that does not parse is refused in one line, on every gRPC service and method.

gRPC parses a request with the method's ``request_deserializer`` before the servicer sees it, and a
``DecodeError`` there is answered ``UNKNOWN: Unexpected <class '...DecodeError'>``. So every servicer
is registered through ``register`` (the coordinator's server, and ``start_mtls_server`` for the peer
and pipeline servers): it hands the generated ``add_*Servicer_to_server`` a stand-in server that
rewrites each method handler before the real server gets it (the generated stubs stay as protoc
wrote them: ``python -m murmur.protocol.generate --check``):

- a method that takes one request gets the raw bytes (no deserializer) and parses them itself,
  aborting with INVALID_ARGUMENT ``malformed JoinRequest: <why>`` when they do not parse;
- a method that takes a stream parses each message as it is read (``context.read()`` or the
  request iterator) and raises ``MalformedMessage``, a ``DecodeError``: a handler that refuses a
  bad frame itself (the exchange refuses a corrupt chunk as its sender's input) still does; one
  that escapes the handler is answered INVALID_ARGUMENT the same way.

A parse failure is the caller's fault (another version's message, a fuzzer, a broken client): the
server keeps serving, and other calls never notice.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf.message import DecodeError

MAX_DETAIL = 200  # characters of the parser's own words kept in the one-line refusal


class MalformedMessage(DecodeError):
    """A request message that does not parse; ``str()`` is the one-line refusal."""


def register(add_to_server: Callable[[Any, Any], None], servicer: object, server: grpc.aio.Server) -> None:
    """``add_to_server(servicer, server)`` (a generated ``add_*Servicer_to_server``), with every
    method's request parsing guarded as above."""
    add_to_server(servicer, _GuardedRegistry(server))


class _GuardedRegistry:
    """What the generated ``add_*Servicer_to_server`` calls on a server, guarding each handler."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(tuple(_GuardedGeneric(h) for h in handlers))

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self._server.add_registered_method_handlers(service, {m: guard(h) for m, h in handlers.items()})


class _GuardedGeneric(grpc.GenericRpcHandler):
    def __init__(self, inner: grpc.GenericRpcHandler) -> None:
        self._inner = inner

    def service(self, handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler | None:
        handler = self._inner.service(handler_call_details)
        return guard(handler) if handler is not None else None


def _type_name(parse: Callable[[bytes], object]) -> str:
    owner = getattr(parse, "__self__", None)  # ``SomeMessage.FromString``: the message class
    return getattr(owner, "__name__", "") or "request"


def _parser(parse: Callable[[bytes], object]) -> Callable[[bytes], object]:
    what = _type_name(parse)

    def parsed(data: bytes) -> object:
        try:
            return parse(data)
        except Exception as err:  # noqa: BLE001 - whatever the parser raises, the bytes are not a message
            detail = " ".join(str(err).split())[:MAX_DETAIL] or type(err).__name__
            raise MalformedMessage(f"malformed {what}: {detail}") from None

    return parsed


async def _refuse(context: grpc.aio.ServicerContext, err: MalformedMessage) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))


def guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """The handler with its request parsing guarded (aio handlers; others pass through)."""
    parse = handler.request_deserializer
    if parse is None:
        return handler
    parsed = _parser(parse)
    if handler.request_streaming:
        # Parsed as each message is read (in the handler's task), so the deserializer may raise.
        kind = "stream_stream" if handler.response_streaming else "stream_unary"
        behaviour = getattr(handler, kind)
        return handler._replace(request_deserializer=parsed, **{kind: _catching(behaviour)})  # type: ignore[attr-defined]
    kind = "unary_stream" if handler.response_streaming else "unary_unary"
    behaviour = getattr(handler, kind)
    return handler._replace(request_deserializer=None, **{kind: _parsing(behaviour, parsed)})  # type: ignore[attr-defined]


def _parsing(behaviour: Callable[..., Any], parsed: Callable[[bytes], object]) -> Callable[..., Any]:
    """A one-request behaviour that takes the raw bytes and parses them first."""
    if inspect.isasyncgenfunction(behaviour):

        async def agen(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                request = parsed(raw)
            except MalformedMessage as err:
                await _refuse(context, err)
            async for reply in behaviour(request, context):
                yield reply

        return agen

    if inspect.iscoroutinefunction(behaviour):

        async def coro(raw: bytes, context: grpc.aio.ServicerContext) -> Any:
            try:
                request = parsed(raw)
            except MalformedMessage as err:
                await _refuse(context, err)
            return await behaviour(request, context)

        return coro

    raise TypeError(f"{behaviour!r}: murmur's servers are grpc.aio servers with async handlers")


def _catching(behaviour: Callable[..., Any]) -> Callable[..., Any]:
    """A stream-request behaviour whose unhandled parse failure is answered INVALID_ARGUMENT."""
    if inspect.isasyncgenfunction(behaviour):

        async def agen(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                async for reply in behaviour(requests, context):
                    yield reply
            except MalformedMessage as err:
                await _refuse(context, err)

        return agen

    if inspect.iscoroutinefunction(behaviour):

        async def coro(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await behaviour(requests, context)
            except MalformedMessage as err:
                await _refuse(context, err)

        return coro

    raise TypeError(f"{behaviour!r}: murmur's servers are grpc.aio servers with async handlers")
