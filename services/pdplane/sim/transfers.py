"""KV held for remote decodes (prefill side) and the `pdplane.v1.KvTransfer` peer control.

A prefill sim holds a transfer's blocks until the decode side calls CompleteTransfer, the
gateway calls AbortTransfer, or `kv_hold_timeout_s` passes, exactly the lifecycle of the pdplane
connector: a CompleteTransfer or AbortTransfer for an id not held (yet) is remembered for
`kv_hold_timeout_s`, and a hold arriving under it then ends at once (the gateway frees the KV of
a prefill whose answer it gave up on by the transfer id it chose). No bytes move: the decode
sim only waits for the simulated pull time. The servicers over this table, and push mode's
`PushBlocks` into the decode sim's receive buffer, are in `pdplane.sim.servicer`.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from pdplane.core import tracing
from pdplane.v1 import (
    kv_transfer_pb2,
    kv_transfer_pb2_grpc,
    kv_transfer_tcp_pb2_grpc,
)

__all__ = ["HeldTransfer", "KvPeers", "TransferTable"]


@dataclass(slots=True)
class HeldTransfer:
    """Blocks a prefill sim keeps for one remote decode."""

    transfer_id: str
    request_id: str
    block_ids: list[int]
    num_tokens: int
    created: float = field(default_factory=time.time)
    timer: asyncio.TimerHandle | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "transfer_id": self.transfer_id,
            "request_id": self.request_id,
            "block_ids": self.block_ids,
            "num_tokens": self.num_tokens,
            "created": self.created,
        }


class TransferTable:
    """Held transfers of one prefill sim, with a bounded history of how each ended."""

    def __init__(
        self, free: Callable[[list[int]], None], timeout_s: float, history: int = 1000
    ) -> None:
        self._free = free
        self._timeout_s = timeout_s
        self.held: dict[str, HeldTransfer] = {}
        #: finished transfers: dicts with transfer_id, request_id, reason, freed_at.
        self.freed: deque[dict[str, Any]] = deque(maxlen=max(history, 1))
        #: ids ended before they were held: id -> (reason, loop time it is forgotten at);
        #: oldest first, at most `history` of them
        self._tombstones: OrderedDict[str, tuple[str, float]] = OrderedDict()
        self._history = max(history, 1)

    def hold(self, transfer: HeldTransfer) -> None:
        """Starts holding; frees by itself after the timeout, at once if the transfer was
        ended before (`end`)."""
        loop = asyncio.get_running_loop()
        self.held[transfer.transfer_id] = transfer
        tombstone = self._tombstones.pop(transfer.transfer_id, None)
        if tombstone is not None and tombstone[1] > loop.time():
            self.release(transfer.transfer_id, f"{tombstone[0]} (before the hold started)")
            return
        transfer.timer = loop.call_later(
            self._timeout_s, self.release, transfer.transfer_id, "timeout"
        )

    def end(self, transfer_id: str, reason: str) -> bool:
        """CompleteTransfer or AbortTransfer: frees the transfer's blocks now. Returns False
        when it is not held; then, unless it ended already, a hold arriving under
        `transfer_id` within the hold timeout ends at once (as the connector's tombstones)."""
        if self.release(transfer_id, reason):
            return True
        if not any(f["transfer_id"] == transfer_id for f in self.freed):
            now = asyncio.get_running_loop().time()
            while self._tombstones and (
                len(self._tombstones) >= self._history
                or next(iter(self._tombstones.values()))[1] <= now
            ):
                self._tombstones.popitem(last=False)
            self._tombstones[transfer_id] = (reason, now + self._timeout_s)
        return False

    def release(self, transfer_id: str, reason: str) -> bool:
        """Frees a transfer's blocks; False when it is unknown (already freed)."""
        transfer = self.held.pop(transfer_id, None)
        if transfer is None:
            return False
        if transfer.timer is not None:
            transfer.timer.cancel()
        self._free(transfer.block_ids)
        self.freed.append(
            {
                "transfer_id": transfer_id,
                "request_id": transfer.request_id,
                "reason": reason,
                "freed_at": time.time(),
            }
        )
        return True

    def release_all(self, reason: str) -> None:
        for transfer_id in list(self.held):
            self.release(transfer_id, reason)


class KvPeers:
    """Decode side: one cached KvTransfer stub per prefill endpoint."""

    def __init__(self, token: str | None = None, timeout_s: float = 5.0) -> None:
        from pdplane.core.grpc.util import aio_channel, token_metadata

        self._channel = aio_channel
        self._metadata = token_metadata(token)
        self._timeout_s = timeout_s
        self._stubs: dict[str, tuple[grpc.aio.Channel, kv_transfer_pb2_grpc.KvTransferStub]] = {}
        self._tcp_stubs: dict[str, kv_transfer_tcp_pb2_grpc.TcpKvTransferStub] = {}

    def stub(self, endpoint: str) -> kv_transfer_pb2_grpc.KvTransferStub:
        """The cached stub of a peer's KvTransfer server."""
        return self._stub(endpoint)

    def tcp_stub(self, endpoint: str) -> kv_transfer_tcp_pb2_grpc.TcpKvTransferStub:
        """The cached stub of the TCP transport's service on the same server (pushes)."""
        stub = self._tcp_stubs.get(endpoint)
        if stub is None:
            self._stub(endpoint)  # the channel
            stub = kv_transfer_tcp_pb2_grpc.TcpKvTransferStub(self._stubs[endpoint][0])
            self._tcp_stubs[endpoint] = stub
        return stub

    @property
    def metadata(self) -> Any:
        """Call metadata (the bearer token, if any)."""
        return self._metadata

    def _stub(self, endpoint: str) -> kv_transfer_pb2_grpc.KvTransferStub:
        entry = self._stubs.get(endpoint)
        if entry is None:
            channel = self._channel(endpoint)
            entry = (channel, kv_transfer_pb2_grpc.KvTransferStub(channel))
            self._stubs[endpoint] = entry
        return entry[1]

    async def complete(self, endpoint: str, transfer_id: str, success: bool = True) -> str | None:
        """Tells prefill the pull is done (or gave up, success=False): it frees the blocks.

        Returns None when prefill freed a transfer it held, else why not (gRPC status name and
        details, or "unknown transfer").
        """
        try:
            response = await self._stub(endpoint).CompleteTransfer(
                kv_transfer_pb2.CompleteTransferRequest(transfer_id=transfer_id, success=success),
                timeout=self._timeout_s,
                metadata=tracing.grpc_metadata(self._metadata),
            )
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {exc.details()}"
        return None if response.freed else "transfer unknown to prefill (freed or aborted)"

    async def close(self) -> None:
        for channel, _ in self._stubs.values():
            await channel.close()
        self._stubs.clear()
        self._tcp_stubs.clear()
