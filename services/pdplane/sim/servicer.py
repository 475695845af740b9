"""The simulator's gRPC servicers of the KV transfer services, over its transfer table
(`pdplane.sim.transfers`) and push mode's receive buffer (`pdplane.sim.push`).

`pdplane.v1.KvTransfer`: CompleteTransfer and AbortTransfer free a prefill sim's held blocks.
`pdplane.v1.TcpKvTransfer`: PushBlocks reserves room in a decode sim's receive buffer; pulls
answer UNIMPLEMENTED, since no bytes move.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from pdplane.core import tracing
from pdplane.sim.push import ReceiveBuffer
from pdplane.sim.transfers import TransferTable
from pdplane.v1 import (
    instance_pb2,
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    kv_transfer_tcp_pb2,
    kv_transfer_tcp_pb2_grpc,
)

__all__ = ["TcpDataServicer", "TransferServicer"]

_NO_BYTES = "the simulator holds no KV bytes: only CompleteTransfer and AbortTransfer are served"


class TcpDataServicer(kv_transfer_tcp_pb2_grpc.TcpKvTransferServicer):
    """The TCP transport's data RPCs: PushBlocks into the receive buffer (push mode); pulls
    answer UNIMPLEMENTED (there are no bytes)."""

    def __init__(
        self,
        buffer: ReceiveBuffer | None = None,
        layout: instance_pb2.KvLayout | None = None,
        block_bytes: int = 0,
    ) -> None:
        self._buffer = buffer
        self._layout = layout or instance_pb2.KvLayout()
        self._block_bytes = block_bytes

    async def PullBlocks(
        self, request: Any, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kv_transfer_tcp_pb2.KvChunk]:
        """UNIMPLEMENTED: there are no bytes to stream."""
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, _NO_BYTES)
        yield kv_transfer_tcp_pb2.KvChunk()  # never reached: abort raises

    async def PushBlocks(self, request_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        """Reserves the push in the receive buffer (push mode); UNIMPLEMENTED in pull mode
        (a pushing prefill then falls back to pull)."""
        if self._buffer is None:
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in push mode: pull instead")
            return None
        return await self._buffer.serve(request_iterator, context, self._layout, self._block_bytes)


class TransferServicer(kv_transfer_pb2_grpc.KvTransferServicer):
    """CompleteTransfer and AbortTransfer over the table."""

    def __init__(self, table: TransferTable) -> None:
        self._table = table

    async def CompleteTransfer(
        self, request: kv_transfer_pb2.CompleteTransferRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.CompleteTransferResponse:
        """Frees the transfer's blocks (decode pulled them or gave up); freed=False if unknown.

        Traced as `pdplane.kv_serve`, the span the connector's prefill records for serving the
        pull: the sim moves no bytes, so its one prefill-side call of a pull stands for it."""
        reason = "completed" if request.success else "failed"
        attrs = {"pdplane.transfer_id": request.transfer_id} if tracing.enabled() else None
        parent = tracing.grpc_parent(context)
        with tracing.span("pdplane.kv_serve", parent=parent, attributes=attrs, server=True):
            freed = self._table.end(request.transfer_id, reason)
        return kv_transfer_pb2.CompleteTransferResponse(freed=freed)

    async def AbortTransfer(
        self, request: kv_transfer_pb2.AbortTransferRequest, context: grpc.aio.ServicerContext
    ) -> kv_transfer_pb2.AbortTransferResponse:
        """Frees the transfer's blocks now; freed=False if unknown (then remembered)."""
        reason = f"aborted: {request.reason}" if request.reason else "aborted"
        return kv_transfer_pb2.AbortTransferResponse(
            freed=self._table.end(request.transfer_id, reason)
        )
