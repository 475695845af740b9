"""The `pdplane.v1.NcclKvTransfer` service of one worker: the NCCL handshake, prefill's side of
a pull (validate, pin, send over the pair's communicator) and decode's side of a push (reserve
room, post receives).

Handlers only translate: access to held blocks goes through the connector's `BlockAccess`,
the bytes through the worker's `NcclEngine` / `PushReceiver`; their errors become statuses.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import grpc

from pdplane.connector.transports.base import AccessDenied, BlockAccess
from pdplane.connector.transports.nccl.engine import NcclTransferError
from pdplane.connector.transports.nccl.rpc import ACCEPTED_METADATA
from pdplane.v1 import kv_transfer_nccl_pb2, kv_transfer_nccl_pb2_grpc

if TYPE_CHECKING:
    from pdplane.connector.transports.nccl.engine import NcclEngine
    from pdplane.connector.transports.nccl.push import PushReceiver

__all__ = ["SERVICE_NAME", "NcclKvTransferServicer"]

SERVICE_NAME = "pdplane.v1.NcclKvTransfer"


def _deadline(context: grpc.ServicerContext) -> float:
    left = context.time_remaining()
    return time.monotonic() + (left if left is not None else 60.0)


class NcclKvTransferServicer(kv_transfer_nccl_pb2_grpc.NcclKvTransferServicer):
    """Serves the NCCL control RPCs of one worker.

    Args:
        access: the connector's held blocks and layout.
        engine: the worker's communicators and block mover.
        receiver: decode's push receive buffer.
    """

    def __init__(self, access: BlockAccess, engine: NcclEngine, receiver: PushReceiver) -> None:
        self._access = access
        self._engine = engine
        self._receiver = receiver

    def NcclConnect(
        self, request: kv_transfer_nccl_pb2.NcclConnectRequest, context: grpc.ServicerContext
    ) -> kv_transfer_nccl_pb2.NcclConnectResponse:
        try:
            self._engine.accept(request, _deadline(context))
        except NcclTransferError as exc:
            context.abort(exc.code, str(exc))
        return kv_transfer_nccl_pb2.NcclConnectResponse(ok=True)

    def SendBlocks(
        self, request: kv_transfer_nccl_pb2.NcclPullRequest, context: grpc.ServicerContext
    ) -> kv_transfer_nccl_pb2.NcclSendBlocksResponse:
        try:
            pinned = self._access.pin(request.blocks, context.time_remaining(), context)
        except AccessDenied as exc:
            context.abort(exc.code, str(exc))
            raise AssertionError("unreachable") from None  # abort raises
        with pinned:
            try:
                sent = self._engine.serve_send(
                    pinned.block_ids,
                    request,
                    _deadline(context),
                    lambda: context.send_initial_metadata((ACCEPTED_METADATA,)),
                )
            except NcclTransferError as exc:
                context.abort(exc.code, str(exc))
        return kv_transfer_nccl_pb2.NcclSendBlocksResponse(bytes_sent=sent)

    def NcclPushBegin(
        self, request: kv_transfer_nccl_pb2.NcclPushBeginRequest, context: grpc.ServicerContext
    ) -> kv_transfer_nccl_pb2.NcclPushBeginResponse:
        """Decode: reserve room for the announced transfers, post the receives."""
        try:
            self._access.check_layout(request.layout, who="sender")
            spilled = self._receiver.begin(request, _deadline(context))
        except AccessDenied as exc:
            context.abort(exc.code, str(exc))
        except NcclTransferError as exc:
            context.abort(exc.code, str(exc))
        return kv_transfer_nccl_pb2.NcclPushBeginResponse(spilled=spilled)
