"""`pdplane.v1.Registry` served by a worker process: heartbeats go to the store process in
batches (`HeartbeatBatcher`); every other RPC is forwarded as it came (the caller's bearer
token with it, so the store process decides what the caller may do, as on a one-process
registry) and answered with the store process's answer or status.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import grpc

from pdplane.core.grpc.auth import AUTH_KEY
from pdplane.registry.worker.batcher import HeartbeatBatcher
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from pdplane.v1 import registry_workers_pb2 as workers_pb2

__all__ = ["ForwardingServicer"]

_R = TypeVar("_R")
_CODES = {code.value[0]: code for code in grpc.StatusCode}
#: A deadline longer than this (s) is no deadline (gRPC reports "none" as a huge number).
_NO_DEADLINE_S = 1e8


def _forwarded(context: grpc.aio.ServicerContext) -> tuple[tuple[str, str], ...]:
    return tuple(
        (key, value)
        for key, value in context.invocation_metadata() or ()
        if key == AUTH_KEY and isinstance(value, str)
    )


def _timeout(context: grpc.aio.ServicerContext) -> float | None:
    left = context.time_remaining()
    return left if left is not None and left < _NO_DEADLINE_S else None


def _refuse(context: grpc.aio.ServicerContext, result: workers_pb2.HeartbeatResult) -> None:
    context.set_code(_CODES.get(result.code, grpc.StatusCode.UNKNOWN))
    context.set_details(result.details)


def _relay_status(context: grpc.aio.ServicerContext, exc: grpc.aio.AioRpcError) -> None:
    context.set_code(exc.code())
    context.set_details(exc.details() or "")


class ForwardingServicer(registry_pb2_grpc.RegistryServicer):
    """The public Registry of a worker process, over a channel to the store process."""

    def __init__(self, stub: registry_pb2_grpc.RegistryStub, batcher: HeartbeatBatcher) -> None:
        self._stub = stub
        self._batcher = batcher

    async def _unary(
        self,
        call: Callable[..., Awaitable[_R]],
        request: Any,
        context: grpc.aio.ServicerContext,
        empty: _R,
    ) -> _R:
        try:
            return await call(request, metadata=_forwarded(context), timeout=_timeout(context))
        except grpc.aio.AioRpcError as exc:
            _relay_status(context, exc)
            return empty

    async def _stream(
        self, call: Callable[..., Any], request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        forwarded = call(request, metadata=_forwarded(context), timeout=_timeout(context))
        try:
            async for message in forwarded:
                yield message
        except grpc.aio.AioRpcError as exc:
            _relay_status(context, exc)
        finally:
            forwarded.cancel()

    async def Register(  # type: ignore[override]
        self, request: registry_pb2.RegisterRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.RegisterResponse:
        """Forwarded to the store process."""
        return await self._unary(
            self._stub.Register, request, context, registry_pb2.RegisterResponse()
        )

    async def Heartbeat(  # type: ignore[override]
        self, request: registry_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.HeartbeatResponse:
        """Answered from the next batch's result (the status a one-process registry gives)."""
        result = await self._batcher.beat(request)
        if result.code:
            _refuse(context, result)
        return result.response

    async def HeartbeatStream(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[registry_pb2.HeartbeatRequest],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """One response per heartbeat from its batch's result; the first refusal ends the
        stream with its status."""
        while (request := await context.read()) is not grpc.aio.EOF:
            result = await self._batcher.beat(request)
            if result.code:
                _refuse(context, result)
                return
            await context.write(result.response)

    async def Deregister(  # type: ignore[override]
        self, request: registry_pb2.DeregisterRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.DeregisterResponse:
        """Forwarded to the store process."""
        return await self._unary(
            self._stub.Deregister, request, context, registry_pb2.DeregisterResponse()
        )

    async def ListInstances(  # type: ignore[override]
        self, request: registry_pb2.ListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> registry_pb2.ListInstancesResponse:
        """Forwarded to the store process."""
        return await self._unary(
            self._stub.ListInstances, request, context, registry_pb2.ListInstancesResponse()
        )

    async def ListInstancesStream(  # type: ignore[override]
        self, request: registry_pb2.ListInstancesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry_pb2.ListInstancesResponse]:
        """Forwarded to the store process, message by message."""
        async for message in self._stream(self._stub.ListInstancesStream, request, context):
            yield message

    async def GetInstance(  # type: ignore[override]
        self, request: registry_pb2.GetInstanceRequest, context: grpc.aio.ServicerContext
    ) -> instance_pb2.Instance:
        """Forwarded to the store process."""
        return await self._unary(self._stub.GetInstance, request, context, instance_pb2.Instance())

    async def WatchInstances(  # type: ignore[override]
        self, request: registry_pb2.WatchInstancesRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[registry_pb2.WatchEvent]:
        """Forwarded to the store process, event by event (the worker holds no state: a
        watcher's revisions are the store process's)."""
        async for event in self._stream(self._stub.WatchInstances, request, context):
            yield event
