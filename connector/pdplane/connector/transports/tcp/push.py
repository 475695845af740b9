"""TCP push mode, sender side: prefill streams a transfer's blocks layer by layer
(`TcpKvTransfer.PushBlocks`) into decode's bounded `PushBuffer` (buffer.py; the receiving
handler is in servicer.py); decode's request later copies them into its own blocks.

Sender (`TcpPushSession`, prefill's engine thread): one client stream per pushed transfer. The
header goes out at once; `send_layer(l)` copies layer l's blocks (a snapshot: the bytes are
read while the engine is between layers) and queues their chunks; gRPC's own thread sends
them, so the forward never waits on the network. `finish()` only closes the streams. The
outcome (received, refused for want of room, failed) arrives asynchronously and is only logged:
prefill holds the blocks as in pull mode, so a push that did not land costs decode one pull.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import torch

from pdplane.connector.kv_cache import KvCacheView
from pdplane.connector.transports.base import Peer, TransferError
from pdplane.v1 import instance_pb2, kv_transfer_tcp_pb2, kv_transfer_tcp_pb2_grpc

__all__ = ["PushResult", "TcpPushSession", "tensor_bytes"]

log = logging.getLogger(__name__)

_END = None  # queue sentinel: the stream is complete


def tensor_bytes(t: torch.Tensor) -> bytes:
    """Raw bytes of `t` in C order (a uint8 view works for every dtype, bfloat16 included)."""
    return t.contiguous().view(torch.uint8).numpy().tobytes()


@dataclass(frozen=True, slots=True)
class PushResult:
    """How one push ended, seen from prefill (for logs and tests)."""

    transfer_id: str
    ok: bool
    nbytes: int
    seconds: float
    code: grpc.StatusCode | None = None
    error: str = ""


class _Stream:
    def __init__(self, transfer_id: str, block_ids: list[int]) -> None:
        self.transfer_id = transfer_id
        self.block_ids = block_ids
        self.queue: queue.SimpleQueue[kv_transfer_tcp_pb2.PushBlocksMessage | None] = (
            queue.SimpleQueue()
        )
        self.call: Any = None  # grpc.Future of the PushBlocks call
        self.started = time.monotonic()


def _messages(
    q: queue.SimpleQueue[kv_transfer_tcp_pb2.PushBlocksMessage | None], deadline: float
) -> Iterator[kv_transfer_tcp_pb2.PushBlocksMessage]:
    # Runs on gRPC's request-consumer thread; ends at the sentinel or the deadline, so the
    # thread never outlives the call even if the engine stopped feeding it.
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            msg = q.get(timeout=left)
        except queue.Empty:
            return
        if msg is _END:
            return
        yield msg


class TcpPushSession:
    """One engine step's pushes to one decode worker (one client stream per transfer).

    Args:
        cache: this worker's KV cache.
        peer: decode's KvTransfer endpoint (same TP rank).
        sender_id: this (prefill) instance's registry id.
        items: (transfer id, this worker's block ids in token order), send order.
        layout: this worker's KV layout (decode refuses another).
        deadline: monotonic seconds by which every stream must have ended.
        tp_rank: this worker's TP rank.
        chunk_bytes: target bytes per message.
        results: where each push's `PushResult` is appended when it ends (any thread).

    Raises TransferError (INVALID_ARGUMENT) for block ids outside the cache.
    """

    def __init__(
        self,
        cache: KvCacheView,
        peer: Peer,
        sender_id: str,
        items: Sequence[tuple[str, Sequence[int]]],
        layout: instance_pb2.KvLayout,
        deadline: float,
        tp_rank: int,
        chunk_bytes: int,
        results: list[PushResult],
    ) -> None:
        self._cache = cache
        self._chunk_bytes = chunk_bytes
        self._results = results
        self._lock = threading.Lock()
        self.bytes_queued = 0
        self._streams: list[_Stream] = []
        for transfer_id, ids in items:
            try:
                cache.check_block_ids(ids)
            except ValueError as exc:
                raise TransferError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
            self._streams.append(_Stream(transfer_id, list(ids)))
        timeout = max(deadline - time.monotonic(), 0.001)
        stub = peer.stub(kv_transfer_tcp_pb2_grpc.TcpKvTransferStub)
        for s in self._streams:
            header = kv_transfer_tcp_pb2.PushHeader(
                transfer_id=s.transfer_id,
                sender_id=sender_id,
                tp_rank=tp_rank,
                layout=layout,
                num_blocks=len(s.block_ids),
            )
            s.queue.put(kv_transfer_tcp_pb2.PushBlocksMessage(header=header))
            s.call = stub.PushBlocks.future(
                _messages(s.queue, deadline), timeout=timeout, metadata=peer.metadata
            )
            s.call.add_done_callback(lambda call, s=s: self._ended(s, call))

    def send_layer(self, layer: int) -> None:
        """Queues layer `layer`'s blocks of every live stream (copied now, sent by gRPC)."""
        lc = self._cache.layers[layer]
        per_chunk = max(1, self._chunk_bytes // lc.block_nbytes)
        for s in self._streams:
            if s.call.done():  # refused or failed already: stop copying for it
                continue
            data = self._cache.read_blocks(layer, s.block_ids)
            if data.device.type != "cpu":
                data = data.cpu()
            for first in range(0, len(s.block_ids), per_chunk):
                part = data[first : first + per_chunk]
                chunk = kv_transfer_tcp_pb2.KvChunk(
                    layer=layer, first=first, num_blocks=int(part.shape[0]), data=tensor_bytes(part)
                )
                s.queue.put(kv_transfer_tcp_pb2.PushBlocksMessage(chunk=chunk))
                self.bytes_queued += len(chunk.data)

    def finish(self) -> int:
        """Closes every stream (does not wait for delivery); returns bytes queued."""
        for s in self._streams:
            s.queue.put(_END)
        return self.bytes_queued

    def abort(self, reason: str) -> None:
        """Cancels every stream: decode frees what arrived and will pull."""
        log.info("push aborted: %s", reason)
        for s in self._streams:
            s.queue.put(_END)
            s.call.cancel()

    def _ended(self, s: _Stream, call: Any) -> None:
        seconds = time.monotonic() - s.started
        if call.cancelled():
            result = PushResult(s.transfer_id, False, 0, seconds, grpc.StatusCode.CANCELLED)
        else:
            exc = call.exception()
            if exc is None:
                result = PushResult(s.transfer_id, True, call.result().bytes_received, seconds)
            else:
                code = exc.code() if isinstance(exc, grpc.Call) else None
                detail = exc.details() if isinstance(exc, grpc.Call) else str(exc)
                result = PushResult(s.transfer_id, False, 0, seconds, code, str(detail))
        if result.ok:
            log.info(
                "transfer %s: pushed %d bytes in %.1f ms",
                s.transfer_id,
                result.nbytes,
                seconds * 1000,
            )
        else:
            name = result.code.name if result.code else "ERROR"
            log.info(
                "transfer %s: push not delivered (%s: %s); decode will pull",
                s.transfer_id,
                name,
                result.error,
            )
        with self._lock:
            self._results.append(result)
            del self._results[:-1000]
