"""The decode side's `NcclKvTransfer.SendBlocks` call, with the server's acceptance visible
early.

Decode must post its NCCL receives only once prefill accepted the request (a refused request
would leave receives nobody matches; NCCL cannot cancel them), and prefill's sends complete
only once decode posted them. Prefill therefore sends its initial metadata (`ACCEPTED`) right
before sending. grpc-python delivers a *unary* call's initial metadata only together with its
response, so the call is made through a server-streaming call object on the same method path:
the wire format of a unary and a server-streaming call is the same (one request; responses;
trailers), and a streaming call object hands out initial metadata as soon as it arrives.
"""

from __future__ import annotations

from typing import Any

import grpc

from pdplane.v1 import kv_transfer_nccl_pb2

__all__ = ["ACCEPTED_METADATA", "SendBlocksCall"]

#: initial metadata of SendBlocks: the sender accepted the request and is about to send
ACCEPTED_METADATA = ("pdplane-nccl", "sending")

_SEND_BLOCKS = "/pdplane.v1.NcclKvTransfer/SendBlocks"


class SendBlocksCall:
    """One `SendBlocks` call in flight: `accepted()`, then `result()`; `cancel()`."""

    def __init__(
        self,
        channel: grpc.Channel,
        request: kv_transfer_nccl_pb2.NcclPullRequest,
        timeout_s: float,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        method = channel.unary_stream(
            _SEND_BLOCKS,
            request_serializer=kv_transfer_nccl_pb2.NcclPullRequest.SerializeToString,
            response_deserializer=kv_transfer_nccl_pb2.NcclSendBlocksResponse.FromString,
        )
        self._call: Any = method(request, timeout=timeout_s, metadata=metadata)

    def accepted(self) -> bool:
        """Waits for the server's initial metadata (bounded by the call's deadline); True when
        it accepted the request, False when the call ended without accepting."""
        return ACCEPTED_METADATA in tuple(self._call.initial_metadata() or ())

    def result(self, timeout: float | None = None) -> kv_transfer_nccl_pb2.NcclSendBlocksResponse:
        """The response (bounded by the call's deadline; `timeout` is accepted for the
        future-like interface). Raises grpc.RpcError with the call's status."""
        for response in self._call:
            return response  # type: ignore[no-any-return]
        raise self._call  # ended with OK but no message: the RpcError carries the status

    def cancel(self) -> None:
        self._call.cancel()
