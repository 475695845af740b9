"""INVALID_ARGUMENT for requests that are not the protobuf message the RPC takes.

grpcio answers a request its deserializer cannot parse with INTERNAL "Exception deserializing
request!" (sync server) or UNKNOWN "Unexpected DecodeError" (asyncio server): both read as a
server bug. These interceptors wrap each handler's request deserializer so that a parse failure
becomes a marker, and the handler then ends the call with INVALID_ARGUMENT naming the message
type, before any servicer code sees it. Every pdplane server installs one (after token auth).
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import grpc

from pdplane.core.grpc.echo import echo

__all__ = ["AioDecodeErrorInterceptor", "DecodeErrorInterceptor"]


class _Undecodable:
    """What a guarded deserializer returns for bytes that are not a valid message."""

    __slots__ = ("message",)

    def __init__(self, error: Exception) -> None:
        self.message = f"undecodable request: {echo(str(error), 200)}"


def _guarded(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserialize is None:
        return None

    def guarded(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # a DecodeError, or whatever a custom deserializer raises
            return _Undecodable(exc)

    return guarded


def _rebuilt(handler: grpc.RpcMethodHandler, **behaviours: Any) -> grpc.RpcMethodHandler:
    deserializer = _guarded(handler.request_deserializer)
    serializer = handler.response_serializer
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(
            behaviours["stream_stream"], deserializer, serializer
        )
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(
            behaviours["stream_unary"], deserializer, serializer
        )
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(
            behaviours["unary_stream"], deserializer, serializer
        )
    return grpc.unary_unary_rpc_method_handler(behaviours["unary_unary"], deserializer, serializer)


def _behaviour(handler: grpc.RpcMethodHandler) -> Callable[..., Any]:
    for name in ("unary_unary", "unary_stream", "stream_unary", "stream_stream"):
        behaviour = getattr(handler, name)
        if behaviour is not None:
            return behaviour  # type: ignore[no-any-return]
    raise ValueError("handler without a behaviour")


# --- sync servers ------------------------------------------------------------------------


def _checked(requests: Iterator[Any], context: grpc.ServicerContext) -> Iterator[Any]:
    for request in requests:
        if isinstance(request, _Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        yield request


def _sync_guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    behaviour = _behaviour(handler)

    def unary(request: Any, context: grpc.ServicerContext) -> Any:
        if isinstance(request, _Undecodable):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return behaviour(request, context)

    def streaming(requests: Iterator[Any], context: grpc.ServicerContext) -> Any:
        return behaviour(_checked(requests, context), context)

    return _rebuilt(
        handler,
        unary_unary=unary,
        unary_stream=unary,
        stream_unary=streaming,
        stream_stream=streaming,
    )


class DecodeErrorInterceptor(grpc.ServerInterceptor):
    """Sync server interceptor: an undecodable request ends with INVALID_ARGUMENT."""

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], grpc.RpcMethodHandler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        return _sync_guard(handler)


# --- asyncio servers ---------------------------------------------------------------------


async def _aio_checked(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
) -> AsyncIterator[Any]:
    async for request in requests:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        yield request


async def _answer(result: Any) -> Any:
    return await result if inspect.isawaitable(result) else result


class _CheckedReads:
    """A servicer context whose `read()` ends the call with INVALID_ARGUMENT on an undecodable
    request: what `_aio_checked` does for handlers that iterate their requests, for handlers
    that read them with `context.read()` (gRPC's reader/writer API). Everything else is the
    wrapped context's."""

    __slots__ = ("_context",)

    def __init__(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        self._context = context

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def read(self) -> Any:
        request = await self._context.read()
        if isinstance(request, _Undecodable):
            await self._context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return request


def _aio_guard(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    behaviour = _behaviour(handler)

    async def unary_unary(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        return await _answer(behaviour(request, context))

    async def unary_stream(
        request: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        if isinstance(request, _Undecodable):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message)
        async for response in _responses(behaviour(request, context)):
            yield response

    async def stream_unary(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> Any:
        return await _answer(behaviour(_aio_checked(requests, context), context))

    async def stream_stream(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> AsyncIterator[Any]:
        async for response in _responses(behaviour(_aio_checked(requests, context), context)):
            yield response

    async def stream_stream_rw(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        # A reader/writer handler stays a coroutine: gRPC then lets it read and write the
        # stream itself, with no async generator per message between gRPC and the handler.
        await behaviour(_aio_checked(requests, context), _CheckedReads(context))

    reader_writer = inspect.iscoroutinefunction(behaviour)
    return _rebuilt(
        handler,
        unary_unary=unary_unary,
        unary_stream=unary_stream,
        stream_unary=stream_unary,
        stream_stream=stream_stream_rw if reader_writer else stream_stream,
    )


async def _responses(result: Any) -> AsyncIterator[Any]:
    # A streaming behaviour is an async generator, or a coroutine writing with context.write.
    if inspect.isasyncgen(result):
        async for response in result:
            yield response
    else:
        await result


def _is_async(handler: grpc.RpcMethodHandler) -> bool:
    behaviour = _behaviour(handler)
    return inspect.iscoroutinefunction(behaviour) or inspect.isasyncgenfunction(behaviour)


class AioDecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """Asyncio server interceptor: an undecodable request ends with INVALID_ARGUMENT.

    Handlers that are plain functions (run by grpc.aio in its thread pool) are left as they
    are: wrapping them in coroutines would move them onto the event loop."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None or not _is_async(handler):
            return handler
        return _aio_guard(handler)
