"""`pdplane.v1.RegistryWorkers`' servicer, in the process that holds the store.

`pdplane registry --workers N` (docs/registry.md, "Worker processes") serves the public port
from N worker processes; each hands the heartbeats it takes to this servicer in batches. A
heartbeat here costs the store's own work (validation, lease, load, watch event: ~10 us) and a
share of one read and one write per batch, where the public port pays gRPC Python's per-message
cost (~100 us of a core) for each heartbeat.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from pdplane.registry.servicer import ERRORS, beat, status_of
from pdplane.registry.store import InstanceStore
from pdplane.v1 import registry_pb2
from pdplane.v1 import registry_workers_pb2 as workers_pb2
from pdplane.v1 import registry_workers_pb2_grpc as workers_pb2_grpc

__all__ = ["SERVICE_NAME", "WorkersServicer"]

SERVICE_NAME = "pdplane.v1.RegistryWorkers"


class WorkersServicer(workers_pb2_grpc.RegistryWorkersServicer):
    """Answers each batch of heartbeats with one result per heartbeat, in order."""

    def __init__(self, store: InstanceStore) -> None:
        self._store = store

    async def _result(self, request: registry_pb2.HeartbeatRequest) -> workers_pb2.HeartbeatResult:
        try:
            return workers_pb2.HeartbeatResult(response=await beat(self._store, request))
        except ERRORS as exc:
            code, details = status_of(exc)
            return workers_pb2.HeartbeatResult(code=code.value[0], details=details)

    async def Heartbeats(  # type: ignore[override]
        self,
        request_iterator: AsyncIterator[workers_pb2.HeartbeatBatch],
        context: grpc.aio.ServicerContext,
    ) -> None:
        """One HeartbeatBatchResult per HeartbeatBatch, results in the batch's order; a
        refused heartbeat is a result with its status code, never the stream's end."""
        while (batch := await context.read()) is not grpc.aio.EOF:
            results = [await self._result(request) for request in batch.heartbeats]
            await context.write(workers_pb2.HeartbeatBatchResult(results=results))
