"""Push mode: decode's bounded receive buffer for pushed KV, and prefill's pusher.

Like the connector (`connector/pdplane/connector/transports/tcp/buffer.py`): a push reserves
room for the whole transfer when its header arrives, all or nothing (`RESOURCE_EXHAUSTED` when
it does not fit), and stays until the decode request that names it takes it, or until its TTL.
A refused transfer is remembered, so its decode request knows at once that nothing was pushed.
What that request then does is the decode sim's `push_overflow`: pull it (pdplane) or recompute
the prompt (the seed's P2pNcclConnector: "Failed to receive all KVs"), both counted.

No bytes: a sim push is the `PushBlocks` header alone, sized from the header's block count and
the receiver's layout; data chunks from a real pushing connector are accepted and dropped.
"""

from __future__ import annotations

import asyncio
import enum
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import grpc

from pdplane.v1 import instance_pb2, kv_transfer_tcp_pb2, kv_transfer_tcp_pb2_grpc

__all__ = ["Pusher", "ReceiveBuffer", "Taken"]

_TOMBSTONES = 10_000


class Taken(enum.Enum):
    """What a decode request found in the buffer for its transfer."""

    PUSHED = "pushed"  # its KV is here (taken out of the buffer)
    REFUSED = "refused"  # the push did not fit: nothing here
    ABSENT = "absent"  # never pushed, expired, or taken already


@dataclass(slots=True)
class _Entry:
    nbytes: int
    sender_id: str
    timer: asyncio.TimerHandle | None


class ReceiveBuffer:
    """Pushed transfers waiting for their decode request, at most `capacity_bytes` in all."""

    def __init__(self, capacity_bytes: int, ttl_s: float = 60.0) -> None:
        self.capacity_bytes = capacity_bytes
        self.ttl_s = ttl_s
        self.used_bytes = 0
        self._entries: dict[str, _Entry] = {}
        self._refused: OrderedDict[str, None] = OrderedDict()
        self.accepted = 0
        self.refused = 0
        self.expired = 0

    @property
    def headroom_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.used_bytes)

    def offer(self, transfer_id: str, sender_id: str, nbytes: int) -> bool:
        """Reserves `nbytes` for a push; False (and remembered) when it does not fit."""
        if transfer_id in self._entries:
            return True
        if nbytes > self.headroom_bytes:
            self.refused += 1
            self._refused[transfer_id] = None
            while len(self._refused) > _TOMBSTONES:
                self._refused.popitem(last=False)
            return False
        loop = asyncio.get_running_loop()
        timer = loop.call_later(self.ttl_s, self._expire, transfer_id)
        self._entries[transfer_id] = _Entry(nbytes, sender_id, timer)
        self.used_bytes += nbytes
        self.accepted += 1
        return True

    def take(self, transfer_id: str, sender_id: str = "") -> tuple[Taken, int]:
        """Takes a transfer's pushed KV out of the buffer: (what was found, bytes)."""
        entry = self._entries.get(transfer_id)
        if entry is not None and (not sender_id or entry.sender_id == sender_id):
            self._drop(transfer_id)
            return Taken.PUSHED, entry.nbytes
        if transfer_id in self._refused:
            del self._refused[transfer_id]
            return Taken.REFUSED, 0
        return Taken.ABSENT, 0

    def _drop(self, transfer_id: str) -> None:
        entry = self._entries.pop(transfer_id)
        if entry.timer is not None:
            entry.timer.cancel()
        self.used_bytes -= entry.nbytes

    def _expire(self, transfer_id: str) -> None:
        if transfer_id in self._entries:
            self._drop(transfer_id)
            self.expired += 1

    def clear(self) -> None:
        for transfer_id in list(self._entries):
            self._drop(transfer_id)

    async def serve(
        self,
        request_iterator: Any,
        context: grpc.aio.ServicerContext,
        layout: instance_pb2.KvLayout,
        block_bytes: int,
    ) -> kv_transfer_tcp_pb2.PushBlocksResponse:
        """`TcpKvTransfer.PushBlocks`: header first, then (ignored) chunks.

        INVALID_ARGUMENT for a stream without a header or of another layout;
        RESOURCE_EXHAUSTED when the transfer does not fit.
        """
        header: kv_transfer_tcp_pb2.PushHeader | None = None
        received = 0
        async for message in request_iterator:
            if header is None:
                if not message.HasField("header"):
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "header expected first")
                header = message.header
                if header.layout != layout:
                    await context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT, "pushed KV has another layout"
                    )
                nbytes = header.num_blocks * block_bytes
                if not self.offer(header.transfer_id, header.sender_id, nbytes):
                    await context.abort(
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                        f"receive buffer full: {nbytes} bytes asked, "
                        f"{self.headroom_bytes} of {self.capacity_bytes} free",
                    )
            else:
                received += len(message.chunk.data)
        if header is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "empty push stream")
        return kv_transfer_tcp_pb2.PushBlocksResponse(bytes_received=received)


class Pusher:
    """Prefill side: pushes a finished prompt's KV (a header) to the decode named for it."""

    def __init__(self, stub_for: Any, timeout_s: float = 5.0) -> None:
        self._stub_for = stub_for
        self._timeout_s = timeout_s
        self.pushed = 0
        self.refused = 0
        self.failed = 0

    async def push(
        self,
        endpoint: str,
        transfer_id: str,
        sender_id: str,
        layout: instance_pb2.KvLayout,
        num_blocks: int,
        metadata: Any = None,
    ) -> bool:
        """True when decode's buffer took the push; False when it refused or failed."""
        stub: kv_transfer_tcp_pb2_grpc.TcpKvTransferStub = self._stub_for(endpoint)
        header = kv_transfer_tcp_pb2.PushHeader(
            transfer_id=transfer_id, sender_id=sender_id, layout=layout, num_blocks=num_blocks
        )
        try:
            await stub.PushBlocks(
                iter([kv_transfer_tcp_pb2.PushBlocksMessage(header=header)]),
                timeout=self._timeout_s,
                metadata=metadata,
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                self.refused += 1
            else:
                self.failed += 1
            return False
        self.pushed += 1
        return True
