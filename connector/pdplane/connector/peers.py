"""Decode side: cached gRPC channels to prefill instances' KvTransfer servers."""

from __future__ import annotations

import threading

import grpc

from pdplane.connector.transports.base import Peer
from pdplane.core import grpc_util
from pdplane.v1 import kv_transfer_pb2_grpc

__all__ = ["PeerPool", "rank_endpoint"]


def rank_endpoint(endpoint: str, tp_rank: int) -> str:
    """The KvTransfer endpoint of `tp_rank` given rank 0's "host:port" (rank i listens on
    port + i). Raises ValueError on a malformed endpoint."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad KV endpoint {endpoint!r}; expected host:port")
    return f"{host}:{int(port) + tp_rank}"


class PeerPool:
    """One channel per peer endpoint, created on first use and kept until `close`.

    Args:
        token: bearer token sent on every call (None = none).
        tls_ca: PEM CA to verify peers' TLS (None = plaintext).
    """

    def __init__(self, token: str | None = None, tls_ca: str | None = None) -> None:
        self._metadata = grpc_util.token_metadata(token)
        self._tls_ca = tls_ca
        self._lock = threading.Lock()
        self._channels: dict[str, tuple[grpc.Channel, Peer]] = {}

    def get(self, endpoint: str, tp_rank: int = 0) -> Peer:
        """The peer for rank `tp_rank` of the instance whose rank 0 is at `endpoint`."""
        target = rank_endpoint(endpoint, tp_rank)
        with self._lock:
            entry = self._channels.get(target)
            if entry is None:
                ch = grpc_util.channel(target, self._tls_ca)
                entry = (ch, Peer(target, kv_transfer_pb2_grpc.KvTransferStub(ch), self._metadata))
                self._channels[target] = entry
            return entry[1]

    def drop(self, endpoint: str) -> None:
        """Closes the channel to `endpoint` (a peer left)."""
        with self._lock:
            entry = self._channels.pop(endpoint, None)
        if entry is not None:
            entry[0].close()

    def close(self) -> None:
        with self._lock:
            entries, self._channels = list(self._channels.values()), {}
        for ch, _ in entries:
            ch.close()
