"""Cached gRPC channels to peer instances' worker servers (one per rank endpoint)."""

from __future__ import annotations

import threading

from pdplane.connector.transports.base import Peer
from pdplane.core.grpc import util as grpc_util

__all__ = ["PeerPool", "rank_endpoint"]


def rank_endpoint(endpoint: str, tp_rank: int) -> str:
    """The KvTransfer endpoint of `tp_rank` given rank 0's "host:port" (rank i listens on
    port + i). Raises ValueError on a malformed endpoint."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"bad KV endpoint {endpoint!r}; expected host:port")
    return f"{host}:{int(port) + tp_rank}"


class PeerPool:
    """One channel per peer rank endpoint, created on first use, kept until `drop` (the peer
    left) or `close`. Every transport's stubs share it (`Peer.stub`).

    Args:
        token: bearer token sent on every call (None = none).
        tls_ca: PEM CA to verify peers' TLS (None = plaintext).
    """

    def __init__(self, token: str | None = None, tls_ca: str | None = None) -> None:
        self._metadata = grpc_util.token_metadata(token)
        self._tls_ca = tls_ca
        self._lock = threading.Lock()
        self._peers: dict[str, Peer] = {}

    def get(self, endpoint: str, tp_rank: int = 0) -> Peer:
        """The peer for rank `tp_rank` of the instance whose rank 0 is at `endpoint`."""
        target = rank_endpoint(endpoint, tp_rank)
        with self._lock:
            peer = self._peers.get(target)
            if peer is None:
                peer = Peer(target, grpc_util.channel(target, self._tls_ca), self._metadata)
                self._peers[target] = peer
            return peer

    def __len__(self) -> int:
        return len(self._peers)

    def drop(self, endpoint: str, tp_rank: int = 0) -> bool:
        """Closes the channel to rank `tp_rank` of the instance whose rank 0 is at `endpoint`
        (it left); True when there was one."""
        try:
            target = rank_endpoint(endpoint, tp_rank)
        except ValueError:
            return False
        with self._lock:
            peer = self._peers.pop(target, None)
        if peer is not None:
            peer.channel.close()
        return peer is not None

    def close(self) -> None:
        with self._lock:
            peers, self._peers = list(self._peers.values()), {}
        for peer in peers:
            peer.channel.close()
