"""The `pdplane.v1.TcpKvTransfer` service of one worker: prefill's side of a pull (the bytes of
the requested blocks streamed as `KvChunk`s) and decode's side of a push (a `PushBlocks`
stream filling the receive buffer).

Handlers only translate: access to held blocks goes through the connector's `BlockAccess`
(transfer id, layout, indices, pin), the bytes through the `KvCacheView`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc

from pdplane.connector.kv_cache import KvCacheView
from pdplane.connector.transports.base import AccessDenied, BlockAccess
from pdplane.connector.transports.tcp.buffer import PushBuffer, PushRefused, PushState
from pdplane.connector.transports.tcp.push import tensor_bytes
from pdplane.v1 import kv_transfer_pb2, kv_transfer_tcp_pb2, kv_transfer_tcp_pb2_grpc

__all__ = ["SERVICE_NAME", "TcpKvTransferServicer", "read_chunks", "receive_push"]

SERVICE_NAME = "pdplane.v1.TcpKvTransfer"

_INVALID = grpc.StatusCode.INVALID_ARGUMENT


def read_chunks(
    cache: KvCacheView,
    block_ids: Sequence[int],
    chunk_bytes: int,
    context: grpc.ServicerContext | None = None,
) -> Iterator[kv_transfer_tcp_pb2.KvChunk]:
    """The `KvChunk`s of a pull of `block_ids` (prefill ids, in the requested order): layer by
    layer, runs of at most `chunk_bytes` (at least one block). Stops early when `context`
    is no longer active (the caller went away)."""
    for layer, lc in enumerate(cache.layers):
        per_chunk = max(1, chunk_bytes // lc.block_nbytes)
        for first in range(0, len(block_ids), per_chunk):
            if context is not None and not context.is_active():
                return
            ids = block_ids[first : first + per_chunk]
            data = cache.read_blocks(layer, ids)
            if data.device.type != "cpu":
                data = data.cpu()
            yield kv_transfer_tcp_pb2.KvChunk(
                layer=layer, first=first, num_blocks=len(ids), data=tensor_bytes(data)
            )


def receive_push(
    buffer: PushBuffer,
    cache: KvCacheView,
    header: kv_transfer_tcp_pb2.PushHeader,
    messages: Iterator[kv_transfer_tcp_pb2.PushBlocksMessage],
) -> int:
    """Decode: reserves room for the transfer `header` announces and fills it from
    `messages`. Returns bytes received. Raises PushRefused (with the gRPC status to answer);
    whatever goes wrong, the entry's room is freed before this returns or raises."""
    if header.num_blocks > cache.num_blocks:
        raise PushRefused(
            f"{header.num_blocks} blocks pushed, the cache has {cache.num_blocks}", _INVALID
        )
    entry = buffer.reserve(
        header.transfer_id,
        header.sender_id,
        header.num_blocks,
        [lc.block_nbytes for lc in cache.layers],
    )
    try:
        for msg in messages:
            if not msg.HasField("chunk"):
                raise PushRefused("a PushBlocks message after the first needs a chunk", _INVALID)
            c = msg.chunk
            entry.write(c.layer, c.first, c.num_blocks, c.data)
        buffer.commit(entry)
    finally:
        if entry.state is PushState.RECEIVING:  # stream broke (cancelled, deadline, error)
            buffer.fail(entry, "push stream ended before all blocks arrived")
    return entry.received


class TcpKvTransferServicer(kv_transfer_tcp_pb2_grpc.TcpKvTransferServicer):
    """Serves pulls of held blocks and receives pushes.

    Args:
        access: the connector's held blocks and layout.
        cache: this worker's KV cache.
        chunk_bytes: target bytes per `KvChunk`.
        buffer: push mode, decode: the receive buffer (None = pushes are refused).
    """

    def __init__(
        self,
        access: BlockAccess,
        cache: KvCacheView,
        chunk_bytes: int,
        buffer: PushBuffer | None = None,
    ) -> None:
        self._access = access
        self._cache = cache
        self._chunk_bytes = chunk_bytes
        self._buffer = buffer

    def PullBlocks(
        self, request: kv_transfer_pb2.PullBlocksRequest, context: grpc.ServicerContext
    ) -> Iterator[kv_transfer_tcp_pb2.KvChunk]:
        try:
            pinned = self._access.pin(request, context.time_remaining(), context)
        except AccessDenied as exc:
            context.abort(exc.code, str(exc))
            raise AssertionError("unreachable") from None  # abort raises
        with pinned:
            yield from read_chunks(self._cache, pinned.block_ids, self._chunk_bytes, context)

    def PushBlocks(
        self,
        request_iterator: Iterator[kv_transfer_tcp_pb2.PushBlocksMessage],
        context: grpc.ServicerContext,
    ) -> kv_transfer_tcp_pb2.PushBlocksResponse:
        """Push mode (decode): the first message's header names the transfer and the sender's
        layout (refused unless equal to ours); the chunks that follow fill the buffer."""
        first = next(request_iterator, None)
        if first is None or not first.HasField("header") or not first.header.transfer_id:
            context.abort(_INVALID, "PushBlocks starts with a header")
            raise AssertionError("unreachable")  # abort raises
        try:
            self._access.check_layout(first.header.layout, who="sender")
        except AccessDenied as exc:
            context.abort(exc.code, str(exc))
        if self._buffer is None:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "push mode is off here: no receive buffer"
            )
            raise AssertionError("unreachable")
        try:
            received = receive_push(self._buffer, self._cache, first.header, request_iterator)
        except PushRefused as exc:
            context.abort(exc.code, str(exc))
        return kv_transfer_tcp_pb2.PushBlocksResponse(bytes_received=received)
