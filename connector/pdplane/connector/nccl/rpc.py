"""The decode side's `SendBlocksNccl` call, with the server's acceptance visible early.

Decode must post its NCCL receives only once prefill accepted the request (a refused request
would leave receives nobody matches; NCCL cannot cancel them), and prefill's sends complete
only once decode posted them. Prefill therefore sends its initial metadata (`ACCEPTED`) right
before sending. grpc-python delivers a *unary* call's initial metadata only together with its
response, so the call is made through a server-streaming call object on the same method path:
the wire format of a unary and a server-streaming call is the same (one request; responses;
trailers), and a streaming call object hands out initial metadata as soon as it arrives.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import grpc

from pdplane.core import grpc_util
from pdplane.v1 import kv_transfer_pb2

__all__ = ["ACCEPTED_METADATA", "ChannelCache", "SendBlocksCall"]

#: initial metadata of SendBlocksNccl: the sender accepted the request and is about to send
ACCEPTED_METADATA = ("pdplane-nccl", "sending")

_SEND_BLOCKS_NCCL = "/pdplane.v1.KvTransfer/SendBlocksNccl"


class SendBlocksCall:
    """One `SendBlocksNccl` call in flight: `accepted()`, then `result()`; `cancel()`."""

    def __init__(
        self,
        channel: grpc.Channel,
        request: kv_transfer_pb2.PullBlocksRequest,
        timeout_s: float,
        metadata: tuple[tuple[str, str], ...] = (),
    ) -> None:
        method = channel.unary_stream(
            _SEND_BLOCKS_NCCL,
            request_serializer=kv_transfer_pb2.PullBlocksRequest.SerializeToString,
            response_deserializer=kv_transfer_pb2.SendBlocksNcclResponse.FromString,
        )
        self._call: Any = method(request, timeout=timeout_s, metadata=metadata)

    def accepted(self) -> bool:
        """Waits for the server's initial metadata (bounded by the call's deadline); True when
        it accepted the request, False when the call ended without accepting."""
        return ACCEPTED_METADATA in tuple(self._call.initial_metadata() or ())

    def result(self, timeout: float | None = None) -> kv_transfer_pb2.SendBlocksNcclResponse:
        """The response (bounded by the call's deadline; `timeout` is accepted for the
        future-like interface). Raises grpc.RpcError with the call's status."""
        for response in self._call:
            return response  # type: ignore[no-any-return]
        raise self._call  # ended with OK but no message: the RpcError carries the status

    def cancel(self) -> None:
        self._call.cancel()


class ChannelCache:
    """gRPC channels to peers' KvTransfer servers, one per endpoint (TLS when `tls_ca`)."""

    def __init__(self, tls_ca: str | Path | None = None) -> None:
        self._tls_ca = tls_ca
        self._channels: dict[str, grpc.Channel] = {}
        self._lock = threading.Lock()

    def get(self, endpoint: str) -> grpc.Channel:
        with self._lock:
            if endpoint not in self._channels:
                self._channels[endpoint] = grpc_util.channel(endpoint, self._tls_ca)
            return self._channels[endpoint]

    def drop(self, endpoint: str) -> None:
        with self._lock:
            channel = self._channels.pop(endpoint, None)
        if channel is not None:
            channel.close()

    def close(self) -> None:
        with self._lock:
            channels = list(self._channels.values())
            self._channels.clear()
        for channel in channels:
            channel.close()
