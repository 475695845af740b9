"""TCP transport: block bytes streamed over the `KvTransfer.PullBlocks` gRPC response stream.

Each `KvChunk` carries a run of consecutive requested blocks of one layer as raw bytes in the
holder's layout (block index first, C order) — no pickle, no intermediate receive buffer: the
puller writes each chunk straight into its paged KV cache blocks and checks at the end that
every (layer, block) arrived exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import grpc
import torch

from pdplane.connector.transports.base import KvTransport, Peer, PullRequest, TransferError
from pdplane.v1 import kv_transfer_pb2

__all__ = ["DEFAULT_CHUNK_BYTES", "TcpTransport"]

#: Target size of one KvChunk (bytes); well under the 64 MiB gRPC message limit.
DEFAULT_CHUNK_BYTES = 4 * 1024 * 1024


def _tensor_bytes(t: torch.Tensor) -> bytes:
    # A uint8 view works for every dtype, bfloat16 included (numpy has no bfloat16).
    return t.contiguous().view(torch.uint8).numpy().tobytes()


class TcpTransport(KvTransport):
    """KV block bytes over gRPC (CPU instances and tests)."""

    name = "tcp"

    def __init__(self, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> None:
        super().__init__()
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.chunk_bytes = chunk_bytes

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
                    layer=layer, first=first, num_blocks=len(ids), data=_tensor_bytes(data)
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
