"""`pdplane.v1.KvTransfer` of a worker's server: CompleteTransfer and AbortTransfer end a hold,
whatever the transport (the server and the holds it serves: `pdplane.connector.server`)."""

from __future__ import annotations

from collections.abc import Callable

import grpc

from pdplane.connector.transports.base import ServiceBinding
from pdplane.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

__all__ = ["REASON_CHARS", "SERVICE_NAME", "KvTransferServicer"]

SERVICE_NAME = "pdplane.v1.KvTransfer"
#: Longest AbortTransfer reason kept, and transfer id quoted in a NOT_FOUND message (both come
#: from peers; every other end reason is this package's, registry-bounded ids).
REASON_CHARS = 200


class KvTransferServicer(kv_transfer_pb2_grpc.KvTransferServicer):
    """`pdplane.v1.KvTransfer`: the end of a hold, whatever the transport. `release(transfer_id,
    reason)` ends the hold and says whether it was held (`HoldAccess.release`)."""

    def __init__(self, release: Callable[[str, str], bool]) -> None:
        self._release_hold = release

    def binding(self) -> ServiceBinding:
        """This service as one of the worker server's services."""
        return ServiceBinding(
            SERVICE_NAME,
            lambda server: kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(self, server),
        )

    def _release(self, transfer_id: str, reason: str, context: grpc.ServicerContext) -> bool:
        if not transfer_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "transfer_id is required")
        return self._release_hold(transfer_id, reason)

    def CompleteTransfer(
        self, request: kv_transfer_pb2.CompleteTransferRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.CompleteTransferResponse:
        reason = "completed" if request.success else "completed (decode failed)"
        freed = self._release(request.transfer_id, reason, context)
        return kv_transfer_pb2.CompleteTransferResponse(freed=freed)

    def AbortTransfer(
        self, request: kv_transfer_pb2.AbortTransferRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.AbortTransferResponse:
        # Bounded where it arrives: it is kept with the ended hold and logged.
        reason = f"aborted: {(request.reason or 'no reason given')[:REASON_CHARS]}"
        freed = self._release(request.transfer_id, reason, context)
        return kv_transfer_pb2.AbortTransferResponse(freed=freed)
