"""The `pdplane.v1.NcclKvTransfer` service of one worker: the server's end of pairs (the
stream that creates a communicator and carries its transfers' control) and `Preconnect`.

Handlers only translate: the engine serves the pairs (pulls through the connector's
`BlockAccess`, pushes into the receive buffer); its errors become statuses.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import grpc

from pdplane.connector.transports.base import PeerDirectory
from pdplane.connector.transports.nccl.errors import NcclTransferError
from pdplane.connector.transports.nccl.pairs import PairKey, Purpose
from pdplane.v1 import kv_transfer_nccl_pb2, kv_transfer_nccl_pb2_grpc

if TYPE_CHECKING:
    from pdplane.connector.transports.nccl.engine import NcclEngine

__all__ = ["SERVICE_NAME", "NcclKvTransferServicer"]

SERVICE_NAME = "pdplane.v1.NcclKvTransfer"


class NcclKvTransferServicer(kv_transfer_nccl_pb2_grpc.NcclKvTransferServicer):
    """Serves the NCCL control of one worker.

    Args:
        engine: the worker's pairs, block mover and push receiver.
        peers: channels to peers (`Preconnect` opens a pair to the caller through them).
    """

    def __init__(self, engine: NcclEngine, peers: PeerDirectory | None) -> None:
        self._engine = engine
        self._peers = peers

    def Pair(
        self,
        request_iterator: Iterator[kv_transfer_nccl_pb2.NcclControl],
        context: grpc.ServicerContext,
    ) -> Iterator[kv_transfer_nccl_pb2.NcclControl]:
        return self._engine.serve_pair(request_iterator, context)

    def Preconnect(
        self, request: kv_transfer_nccl_pb2.NcclPreconnectRequest, context: grpc.ServicerContext
    ) -> kv_transfer_nccl_pb2.NcclPreconnectResponse:
        """Opens this worker's PULL pair with the caller (a prefill that just started)."""
        if not request.requester_id or not request.endpoint:
            context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "requester_id and endpoint are required"
            )
        if self._peers is None:
            context.abort(grpc.StatusCode.UNIMPLEMENTED, "this worker opens no pairs")
            raise AssertionError("unreachable")  # abort raises
        left = context.time_remaining()
        deadline = time.monotonic() + (left if left is not None else 30.0)
        key = PairKey(request.requester_id, request.tp_rank, Purpose.PULL)
        try:
            peer = self._peers.get(request.endpoint, 0)
            opened = self._engine.open(key, peer, deadline, evict=False)
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NcclTransferError as exc:
            context.abort(exc.code, str(exc))
        return kv_transfer_nccl_pb2.NcclPreconnectResponse(connected=opened)
