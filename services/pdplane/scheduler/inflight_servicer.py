"""`pdplane.v1.InflightExchange` over grpc.aio: one subscription's updates from a replica's
in-flight exchange (`pdplane.scheduler.inflight_exchange`), its own id refused."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from pdplane.v1 import inflight_pb2, inflight_pb2_grpc

__all__ = ["SERVICE_NAME", "InflightExchangeServicer"]

SERVICE_NAME = inflight_pb2.DESCRIPTOR.services_by_name["InflightExchange"].full_name


class InflightExchangeServicer(inflight_pb2_grpc.InflightExchangeServicer):
    """Subscribe streams `subscribe(replica_id)`'s updates; FAILED_PRECONDITION when it raises
    ValueError (a replica subscribing to itself)."""

    def __init__(
        self, subscribe: Callable[[str], AsyncIterator[inflight_pb2.InflightUpdate]]
    ) -> None:
        self._subscribe = subscribe

    async def Subscribe(
        self,
        request: inflight_pb2.SubscribeInflightRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> AsyncIterator[inflight_pb2.InflightUpdate]:
        try:
            updates = self._subscribe(request.replica_id)
            async for update in updates:
                yield update
        except ValueError as exc:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
