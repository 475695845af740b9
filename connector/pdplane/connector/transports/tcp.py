"""TCP transport: block bytes streamed over the `KvTransfer.PullBlocks` gRPC response stream
(pull), or over the `KvTransfer.PushBlocks` client stream into decode's bounded receive buffer
(push mode, `tcp_push.py`).

Each `KvChunk` carries a run of consecutive requested blocks of one layer as raw bytes in the
holder's layout (block index first, C order) — no pickle, no intermediate receive buffer: the
puller writes each chunk straight into its paged KV cache blocks and checks at the end that
every (layer, block) arrived exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence

import grpc
import torch

from pdplane.connector.push_buffer import PushBuffer, PushRefused
from pdplane.connector.transports.base import KvTransport, Peer, PullRequest, TransferError
from pdplane.connector.transports.tcp_push import (
    PushResult,
    TcpPushSession,
    copy_pushed,
    receive_push,
    tensor_bytes,
)
from pdplane.v1 import instance_pb2, kv_transfer_pb2

__all__ = ["DEFAULT_CHUNK_BYTES", "TcpTransport"]

#: Target size of one KvChunk (bytes); well under the 64 MiB gRPC message limit.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


class TcpTransport(KvTransport):
    """KV block bytes over gRPC (CPU instances and tests).

    Args:
        chunk_bytes: target bytes per KvChunk.
        push_buffer_bytes: push mode, decode: capacity of the receive buffer (bytes);
            0 = refuse pushes (pull mode).
        push_ttl_s: push mode, decode: a push not taken this long is freed (s).
    """

    name = "tcp"

    def __init__(
        self,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        push_buffer_bytes: int = 0,
        push_ttl_s: float = 60.0,
    ) -> None:
        super().__init__()
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.chunk_bytes = chunk_bytes
        self.push_buffer = PushBuffer(push_buffer_bytes, push_ttl_s) if push_buffer_bytes else None
        self.push_results: list[PushResult] = []  # prefill: how the last 1000 pushes ended

    def serve_pull_blocks(
        self,
        block_ids: Sequence[int],
        request: kv_transfer_pb2.PullBlocksRequest,
        context: grpc.ServicerContext,
    ) -> Iterator[kv_transfer_pb2.KvChunk]:
        cache = self.cache
        for layer, lc in enumerate(cache.layers):
            per_chunk = max(1, self.chunk_bytes // lc.block_nbytes)
            for first in range(0, len(block_ids), per_chunk):
                if not context.is_active():
                    return
                ids = block_ids[first : first + per_chunk]
                data = cache.read_blocks(layer, ids)
                if data.device.type != "cpu":
                    data = data.cpu()
                yield kv_transfer_pb2.KvChunk(
                    layer=layer, first=first, num_blocks=len(ids), data=tensor_bytes(data)
                )

    def pull(self, peer: Peer, request: PullRequest) -> int:
        cache = self.cache
        n = len(request.local_block_ids)
        if n != len(request.remote_block_indices):
            raise TransferError("local and remote block lists differ in length")
        cache.check_block_ids(request.local_block_ids)
        received = [bytearray(n) for _ in cache.layers]  # 1 per (layer, position) written
        total = 0
        call = peer.stub.PullBlocks(
            request.to_proto(), timeout=request.remaining(), metadata=peer.metadata
        )
        try:
            for chunk in call:
                total += self._write_chunk(chunk, request, received)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
            raise TransferError(
                f"PullBlocks {request.transfer_id} from {peer.endpoint}: {code}: {details}", code
            ) from exc
        finally:
            call.cancel()
        missing = sum(r.count(0) for r in received)
        if missing:
            raise TransferError(f"transfer {request.transfer_id}: {missing} layer-blocks missing")
        return total

    def _write_chunk(
        self, chunk: kv_transfer_pb2.KvChunk, request: PullRequest, received: list[bytearray]
    ) -> int:
        cache = self.cache
        if chunk.layer >= cache.num_layers:
            raise TransferError(f"chunk for layer {chunk.layer} of {cache.num_layers}")
        lc = cache.layers[chunk.layer]
        first, count = chunk.first, chunk.num_blocks
        if count == 0 or first + count > len(request.local_block_ids):
            raise TransferError(f"chunk blocks [{first}, {first + count}) out of range")
        if len(chunk.data) != count * lc.block_nbytes:
            raise TransferError(
                f"chunk of {len(chunk.data)} bytes, expected {count * lc.block_nbytes}"
            )
        seen = received[chunk.layer]
        if any(seen[first : first + count]):
            raise TransferError(f"layer {chunk.layer}: blocks sent twice")
        data = (
            torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)
            .view(lc.tensor.dtype)
            .reshape(count, *lc.block_shape)
        )
        cache.write_blocks(chunk.layer, request.local_block_ids[first : first + count], data)
        seen[first : first + count] = b"\x01" * count
        return len(chunk.data)

    # -- push mode -----------------------------------------------------------------------------

    def push_session(
        self,
        peer: Peer,
        requester_id: str,
        items: Sequence[tuple[str, Sequence[int]]],
        layout: instance_pb2.KvLayout,
        deadline: float,
        tp_rank: int = 0,
    ) -> TcpPushSession:
        return TcpPushSession(
            self.cache,
            peer,
            requester_id,
            items,
            layout,
            deadline,
            tp_rank,
            self.chunk_bytes,
            self.push_results,
        )

    def serve_push_blocks(
        self,
        header: kv_transfer_pb2.PushHeader,
        messages: Iterator[kv_transfer_pb2.PushBlocksMessage],
        context: grpc.ServicerContext,
    ) -> kv_transfer_pb2.PushBlocksResponse:
        buffer = self.push_buffer
        if buffer is None:
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, "push mode is off here: no receive buffer"
            )
            raise AssertionError("unreachable")  # abort raises
        try:
            received = receive_push(buffer, self.cache, header, messages)
        except PushRefused as exc:
            context.abort(exc.code, str(exc))
        return kv_transfer_pb2.PushBlocksResponse(bytes_received=received)

    def take_pushed(
        self,
        transfer_id: str,
        local_block_ids: Sequence[int],
        deadline: float,
        *,
        sender_id: str = "",
        remote_block_indices: Sequence[int] | None = None,
        wait_s: float = 0.0,
    ) -> int:
        buffer = self.push_buffer
        wait = min(wait_s, deadline - time.monotonic())
        entry = buffer.take(transfer_id, sender_id, wait) if buffer is not None else None
        if entry is None:
            raise TransferError(
                f"transfer {transfer_id}: no usable push", grpc.StatusCode.NOT_FOUND
            )
        return copy_pushed(entry, self.cache, remote_block_indices, local_block_ids)

    def discard_pushed(self, transfer_id: str, reason: str) -> None:
        if self.push_buffer is not None:
            self.push_buffer.discard(transfer_id, reason)

    def expire_pushed(self) -> None:
        if self.push_buffer is not None:
            self.push_buffer.expire()

    def close(self) -> None:
        if self.push_buffer is not None:
            self.push_buffer.close()
