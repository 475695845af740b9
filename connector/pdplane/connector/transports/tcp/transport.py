"""TCP transport: block bytes streamed over the `TcpKvTransfer.PullBlocks` gRPC response stream
(pull), or over the `TcpKvTransfer.PushBlocks` client stream into decode's bounded receive
buffer (push mode, `push.py`, `buffer.py`).

Each `KvChunk` carries a run of consecutive requested blocks of one layer as raw bytes in the
holder's layout (block index first, C order) — no pickle, no intermediate receive buffer: the
puller writes each chunk straight into its paged KV cache blocks and checks at the end that
every (layer, block) arrived exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import grpc
import torch

from pdplane.connector.kv_cache import KvCacheView
from pdplane.connector.transports.base import (
    BlockAccess,
    KvTransport,
    LocalWorker,
    Peer,
    PeerDirectory,
    PeerInstance,
    PullRequest,
    PullResult,
    ServiceBinding,
    TransferError,
)
from pdplane.connector.transports.receive_buffer import ReceiveBuffer
from pdplane.connector.transports.tcp.buffer import PushBuffer
from pdplane.connector.transports.tcp.push import PushResult, TcpPushSession
from pdplane.connector.transports.tcp.servicer import SERVICE_NAME, TcpKvTransferServicer
from pdplane.v1 import instance_pb2, kv_transfer_tcp_pb2, kv_transfer_tcp_pb2_grpc

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

    def bind(
        self,
        cache: KvCacheView,
        peers: PeerDirectory | None = None,
        local: LocalWorker | None = None,
    ) -> None:
        super().bind(cache, peers, local)
        if self.push_buffer is not None:
            self.push_buffer.bind(cache)

    @property
    def receive_buffer(self) -> ReceiveBuffer | None:
        return self.push_buffer

    def services(self, access: BlockAccess) -> list[ServiceBinding]:
        servicer = TcpKvTransferServicer(access, self.cache, self.chunk_bytes, self.push_buffer)
        return [
            ServiceBinding(
                SERVICE_NAME,
                lambda server: kv_transfer_tcp_pb2_grpc.add_TcpKvTransferServicer_to_server(
                    servicer, server
                ),
            )
        ]

    # -- pull (decode) -------------------------------------------------------------------------

    def pull(self, peer: Peer, request: PullRequest) -> PullResult:
        t0 = time.monotonic()
        cache = self.cache
        n = len(request.local_block_ids)
        if n != len(request.remote_block_indices):
            raise TransferError("local and remote block lists differ in length")
        cache.check_block_ids(request.local_block_ids)
        received = [bytearray(n) for _ in cache.layers]  # 1 per (layer, position) written
        total = 0
        stub = peer.stub(kv_transfer_tcp_pb2_grpc.TcpKvTransferStub)
        call = stub.PullBlocks(
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
        return PullResult(total, total_s=time.monotonic() - t0)

    def _write_chunk(
        self, chunk: kv_transfer_tcp_pb2.KvChunk, request: PullRequest, received: list[bytearray]
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
        peer_id: str = "",
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

    # -- lifecycle -----------------------------------------------------------------------------

    def preconnect(self, peers: Sequence[PeerInstance], deadline: float) -> int:
        """Opens the channels to `peers` this worker will call (pull from, push to) and waits
        (until `deadline`) for them to connect; returns how many did."""
        directory = self.peers
        if directory is None:
            return 0
        calls = [p for p in peers if p.pulls_from or p.pushes_to]
        ready = 0
        for p in calls:
            channel = directory.get(p.kv_endpoint, self.local.tp_rank).channel
            try:
                grpc.channel_ready_future(channel).result(max(deadline - time.monotonic(), 0))
                ready += 1
            except grpc.FutureTimeoutError:
                continue
        return ready

    def peer_gone(self, peer: PeerInstance) -> dict[str, int]:
        """Frees what `peer` pushed here (its channel is the connector's to drop)."""
        if self.push_buffer is None:
            return {}
        return {"pushed": self.push_buffer.drop_sender(peer.instance_id)}

    def stats(self) -> dict[str, int]:
        buffer = self.push_buffer
        if buffer is None:
            return {}
        return {"push_buffer_used_bytes": buffer.used_bytes, "pushes_refused": buffer.refused}

    def close(self) -> None:
        if self.push_buffer is not None:
            self.push_buffer.close()
