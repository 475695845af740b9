"""Forwards gRPC calls unchanged to another server: a heartbeat relay's calls to the registry.

A host's heartbeat relay (`pdplane.registry.relay`) answers HeartbeatStream itself and hands
every other Registry call to the registry, as bytes: nothing is decoded or re-encoded on the
way, the caller's metadata (its bearer token) and deadline go with the call, and the registry's
status and details come back as they were. So the registry authenticates, validates and
answers exactly as if it had been called directly.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import Any

import grpc
from google.protobuf.descriptor import ServiceDescriptor

__all__ = ["HOP_KEY", "ForwardingHandler", "shapes"]

#: Metadata a forwarding relay adds to every call it sends on: (HOP_KEY, its id).
HOP_KEY = "pdplane-relay-hop"

#: Metadata gRPC itself sets on a call (pseudo-headers, transport details): never copied.
_TRANSPORT_KEYS = ("grpc-", ":", "user-agent", "content-type", "te")


def shapes(services: Iterable[ServiceDescriptor]) -> dict[str, tuple[bool, bool]]:
    """`"/package.Service/Method"` -> (request streaming, response streaming) of each method."""
    return {
        f"/{service.full_name}/{method.name}": (method.client_streaming, method.server_streaming)
        for service in services
        for method in service.methods
    }


async def _onward(
    context: grpc.aio.ServicerContext[Any, Any], hop: tuple[str, str]
) -> tuple[tuple[str, Any], ...]:
    """The caller's metadata and this relay's `hop` mark, for the call sent on; aborts with
    FAILED_PRECONDITION when the call already carries the mark (it came round a loop)."""
    kept = tuple(
        (m.key, m.value)
        for m in context.invocation_metadata() or ()
        if not m.key.startswith(_TRANSPORT_KEYS)
    )
    if hop in kept:
        await context.abort(
            grpc.StatusCode.FAILED_PRECONDITION,
            "this call came back to the heartbeat relay that sent it on: its --registry leads "
            "back to itself",
        )
    return (*kept, hop)


async def _relay_error(context: grpc.aio.ServicerContext[Any, Any], exc: grpc.RpcError) -> None:
    # The registry's status, as it sent it; UNKNOWN when the call broke without one.
    code = exc.code() if isinstance(exc, grpc.aio.AioRpcError) else grpc.StatusCode.UNKNOWN
    await context.abort(code, exc.details() if isinstance(exc, grpc.aio.AioRpcError) else "")


async def _replies(call: Any, context: Any) -> AsyncIterator[bytes]:
    """The replies of the registry's streaming `call`, then its status."""
    try:
        async for reply in call:
            yield reply
    except grpc.RpcError as exc:
        await _relay_error(context, exc)
    finally:
        call.cancel()  # the caller left: end the registry's side too


class ForwardingHandler(grpc.GenericRpcHandler):
    """Serves each method of `shapes` by calling the same method on `channel()` (the channel
    to use now: a relay moves to another registry replica when one fails), as bytes, marked
    with `hop` (metadata key and this relay's id: a call already marked is refused).

    `local` maps methods to handlers served here instead (the relay's HeartbeatStream). A
    method in neither is UNIMPLEMENTED, as on the registry.
    """

    def __init__(
        self,
        channel: Callable[[], grpc.aio.Channel],
        shapes: Mapping[str, tuple[bool, bool]],
        hop: tuple[str, str],
        local: Mapping[str, grpc.RpcMethodHandler],
    ) -> None:
        self._handlers: dict[str, grpc.RpcMethodHandler] = {
            method: self._forwarder(channel, method, hop, *shape)
            for method, shape in shapes.items()
        }
        self._handlers.update(local)

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        return self._handlers.get(handler_call_details.method)

    @staticmethod
    def _forwarder(
        channel: Callable[[], grpc.aio.Channel],
        method: str,
        hop: tuple[str, str],
        request_streaming: bool,
        response_streaming: bool,
    ) -> grpc.RpcMethodHandler:
        # serializer/deserializer None on both sides: the messages stay bytes.
        if not request_streaming and not response_streaming:

            async def unary_unary(request: bytes, context: Any) -> bytes:
                try:
                    metadata = await _onward(context, hop)
                    reply: bytes = await channel().unary_unary(method)(
                        request, metadata=metadata, timeout=context.time_remaining()
                    )
                except grpc.RpcError as exc:
                    await _relay_error(context, exc)
                return reply

            return grpc.unary_unary_rpc_method_handler(unary_unary)
        if not request_streaming:
            # Async generator functions: gRPC runs any other callable on its thread pool.
            async def unary_stream(request: bytes, context: Any) -> AsyncIterator[bytes]:
                metadata = await _onward(context, hop)
                call = channel().unary_stream(method)(
                    request, metadata=metadata, timeout=context.time_remaining()
                )
                async for reply in _replies(call, context):
                    yield reply

            return grpc.unary_stream_rpc_method_handler(unary_stream)

        async def stream_stream(
            requests: AsyncIterator[bytes], context: Any
        ) -> AsyncIterator[bytes]:
            metadata = await _onward(context, hop)
            call = channel().stream_stream(method)(
                requests, metadata=metadata, timeout=context.time_remaining()
            )
            async for reply in _replies(call, context):
                yield reply

        # The registry's port has no request-streaming unary-response method; one would be
        # forwarded as a stream (its single reply relayed), which gRPC accepts on the wire.
        return grpc.stream_stream_rpc_method_handler(stream_stream)
