"""The primary's end of `pdplane.v1.RegistryLink` (registry_link.proto): the heartbeats that
registry workers read from their clients, applied in batches."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from pdplane.registry.servicer import RegistryServicer
from pdplane.v1 import registry_link_pb2, registry_link_pb2_grpc

__all__ = ["RegistryLinkServicer"]


class RegistryLinkServicer(registry_link_pb2_grpc.RegistryLinkServicer):
    """Applies each batch through `registry` (exactly as its HeartbeatStream would) and answers
    it with the outcomes in order. A batch's heartbeats are applied concurrently: they belong to
    different streams (a stream waits for its answer before it sends again), and one that waits
    on the store (the etcd store taking an instance over) must not hold up the others."""

    def __init__(self, registry: RegistryServicer) -> None:
        self._registry = registry

    async def ApplyHeartbeats(  # type: ignore[override]
        self, request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]
    ) -> None:
        """One HeartbeatBatchResult per HeartbeatBatch, in order."""
        while (batch := await context.read()) is not grpc.aio.EOF:
            outcomes = await asyncio.gather(
                *(self._registry.heartbeat_outcome(request) for request in batch.heartbeats)
            )
            await context.write(registry_link_pb2.HeartbeatBatchResult(outcomes=outcomes))
