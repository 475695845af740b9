"""Frees KV that a prefill instance holds for a cancelled request (`KvTransfer.AbortTransfer`).

Called when a client goes away (or decode refuses the request) after prefill answered but before
decode finished, so prefill frees the blocks now instead of at its hold timeout. Best effort:
bounded by a timeout, failures are logged, never raised.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import grpc

from pdplane.core.grpc_util import aio_channel, token_metadata
from pdplane.v1 import kv_transfer_pb2, kv_transfer_pb2_grpc

__all__ = ["KvAborter"]

log = logging.getLogger(__name__)

#: Channels kept open to this many prefill KvTransfer endpoints (least recently used closed first).
_MAX_CHANNELS = 256


class KvAborter:
    """Sends `AbortTransfer` to prefill instances' KvTransfer servers over cached channels.

    Args:
        token: bearer token for the KvTransfer servers, if they require one.
        tls_ca: PEM file of the CA when they serve TLS.
        timeout_s: deadline of one AbortTransfer call (s).
    """

    def __init__(
        self, *, token: str | None = None, tls_ca: str | Path | None = None, timeout_s: float = 2.0
    ) -> None:
        self._metadata = token_metadata(token)
        self._tls_ca = tls_ca
        self._timeout_s = timeout_s
        self._stubs: OrderedDict[str, tuple[grpc.aio.Channel, kv_transfer_pb2_grpc.KvTransferStub]]
        self._stubs = OrderedDict()

    async def _stub(self, endpoint: str) -> kv_transfer_pb2_grpc.KvTransferStub:
        entry = self._stubs.get(endpoint)
        if entry is None:
            if len(self._stubs) >= _MAX_CHANNELS:
                _, (old, _) = self._stubs.popitem(last=False)
                await old.close(grace=self._timeout_s)
            channel = aio_channel(endpoint, self._tls_ca)
            entry = (channel, kv_transfer_pb2_grpc.KvTransferStub(channel))
            self._stubs[endpoint] = entry
        else:
            self._stubs.move_to_end(endpoint)
        return entry[1]

    async def abort(self, kv_endpoint: str, transfer_id: str, reason: str) -> bool:
        """Asks the prefill instance at `kv_endpoint` (host:port) to free `transfer_id` now.

        Returns whether prefill freed blocks; False on any error (logged).
        """
        request = kv_transfer_pb2.AbortTransferRequest(transfer_id=transfer_id, reason=reason)
        try:
            stub = await self._stub(kv_endpoint)
            reply = await stub.AbortTransfer(
                request, timeout=self._timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "AbortTransfer(%s) at %s failed: %s %s",
                transfer_id,
                kv_endpoint,
                exc.code().name,
                exc.details(),
            )
            return False
        return bool(reply.freed)

    async def close(self) -> None:
        """Closes every cached channel."""
        stubs, self._stubs = self._stubs, OrderedDict()
        for channel, _ in stubs.values():
            await channel.close()
