"""Heartbeats of many streams handed to the store process as batches.

Self-clocked batching: one batch in flight on one `RegistryWorkers.Heartbeats` stream; the
heartbeats that arrive meanwhile go together in the next batch as soon as its answer is in.
No timer: alone, a heartbeat goes at once; under load, batches grow with the rate, so the
store process pays one gRPC read and write per batch instead of per heartbeat.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from pdplane.v1 import registry_pb2
from pdplane.v1 import registry_workers_pb2 as workers_pb2
from pdplane.v1 import registry_workers_pb2_grpc as workers_pb2_grpc

__all__ = ["HeartbeatBatcher"]

log = logging.getLogger(__name__)

_Pending = tuple[registry_pb2.HeartbeatRequest, "asyncio.Future[workers_pb2.HeartbeatResult]"]
#: Most heartbeats in one batch (~100 bytes each: far below the 4 MiB message limit).
MAX_BATCH = 4096
#: Wait before opening the stream again after it failed (s).
_RETRY_S = 0.1


def _unavailable(why: str) -> workers_pb2.HeartbeatResult:
    return workers_pb2.HeartbeatResult(
        code=grpc.StatusCode.UNAVAILABLE.value[0],
        details=f"registry store process unreachable: {why}"[:1000],
    )


class HeartbeatBatcher:
    """`beat()` answers one heartbeat as the store process did; `run()` carries the batches.

    A heartbeat whose batch was lost with the stream (the store process stopped) is answered
    UNAVAILABLE, never retried here: the instance's client heartbeats again.
    """

    def __init__(
        self, stub: workers_pb2_grpc.RegistryWorkersStub, metadata: tuple[tuple[str, str], ...]
    ) -> None:
        self._stub = stub
        self._metadata = metadata
        self._pending: list[_Pending] = []
        self._wake = asyncio.Event()

    @property
    def queued(self) -> int:
        """Heartbeats waiting for the next batch."""
        return len(self._pending)

    async def beat(self, request: registry_pb2.HeartbeatRequest) -> workers_pb2.HeartbeatResult:
        """The store process's result for `request` (`code` 0 and `response`, or the status a
        unary Heartbeat would have had; UNAVAILABLE when the store process is unreachable)."""
        future: asyncio.Future[workers_pb2.HeartbeatResult] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending.append((request, future))
        self._wake.set()
        return await future

    async def run(self) -> None:
        """Carries batches until cancelled, opening the stream again after a failure."""
        while True:
            call = self._stub.Heartbeats(metadata=self._metadata)
            try:
                await self._carry(call)
            except grpc.aio.AioRpcError as exc:
                log.warning("heartbeat batches to the store process failed: %s", exc.code().name)
            finally:
                call.cancel()
            await asyncio.sleep(_RETRY_S)

    async def _carry(self, call: grpc.aio.StreamStreamCall) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending[:MAX_BATCH], self._pending[MAX_BATCH:]
            if self._pending:
                self._wake.set()
            live = [(request, future) for request, future in batch if not future.done()]
            if not live:
                continue
            try:
                await call.write(workers_pb2.HeartbeatBatch(heartbeats=[r for r, _ in live]))
                answer = await call.read()
            except BaseException as exc:
                self._answer_all(live, _unavailable(type(exc).__name__))
                raise
            if answer is grpc.aio.EOF or len(answer.results) != len(live):
                self._answer_all(live, _unavailable("the stream ended"))
                return
            for (_, future), result in zip(live, answer.results, strict=True):
                if not future.done():
                    future.set_result(result)

    @staticmethod
    def _answer_all(batch: list[_Pending], result: workers_pb2.HeartbeatResult) -> None:
        for _, future in batch:
            with contextlib.suppress(asyncio.InvalidStateError):
                future.set_result(result)
