"""The `nccl` KV transport: block bytes over NCCL point-to-point, control over gRPC.

Pull (default): decode's `pull` connects once per (prefill endpoint, TP rank) with
`NcclConnect`, then, per transfer, posts its receives straight into the paged KV cache while
prefill's `SendBlocksNccl` handler (`serve_send_blocks_nccl`) sends the held blocks. Push:
`push_session` (prefill, during the forward) and `serve_nccl_push_begin` / `take_pushed`
(decode). The engine pieces live in `pdplane.connector.nccl`; this class adapts them to
`KvTransport` and maps their errors to `TransferError` / gRPC statuses.

Options (from `kv_connector_extra_config`): `nccl_strategy` ("gather" | "grouped"),
`nccl_chunk_bytes`, `nccl_connect_timeout_s`, `push_buffer_bytes`, `push_spill_bytes`,
`push_ttl_s`, `tls_ca` (PEM CA of peers' KvTransfer TLS).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import grpc

from pdplane.connector.kv_cache import KvCacheView
from pdplane.connector.nccl.blocks import layer_byte_view
from pdplane.connector.nccl.engine import NcclEngine, NcclTransferError, PullTiming
from pdplane.connector.nccl.plan import DEFAULT_CHUNK_BYTES, Strategy
from pdplane.connector.nccl.push import PushReceiver, PushSession
from pdplane.connector.nccl.rpc import ACCEPTED_METADATA, ChannelCache, SendBlocksCall
from pdplane.connector.transports.base import KvTransport, Peer, PullRequest, TransferError
from pdplane.v1 import instance_pb2, kv_transfer_pb2

__all__ = ["NcclTransport"]

_DEFAULT_PUSH_BUFFER_BYTES = 1 << 30
_DEFAULT_PUSH_SPILL_BYTES = 4 << 30


class NcclTransport(KvTransport):
    """NCCL data path of one worker (TP rank). See the module docstring for the options.

    Raises ValueError for an unknown strategy or a non-positive size.
    """

    name: ClassVar[str] = "nccl"

    def __init__(
        self,
        nccl_strategy: str = Strategy.GATHER.value,
        nccl_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        nccl_connect_timeout_s: float = 30.0,
        push_buffer_bytes: int = _DEFAULT_PUSH_BUFFER_BYTES,
        push_spill_bytes: int = _DEFAULT_PUSH_SPILL_BYTES,
        push_ttl_s: float = 60.0,
        tls_ca: str | None = None,
    ) -> None:
        super().__init__()
        self.strategy = Strategy.parse(nccl_strategy)
        if nccl_chunk_bytes <= 0 or nccl_connect_timeout_s <= 0:
            raise ValueError("nccl_chunk_bytes and nccl_connect_timeout_s must be > 0")
        if push_buffer_bytes < 0 or push_spill_bytes < 0 or push_ttl_s <= 0:
            raise ValueError("push buffer/spill sizes must be >= 0 and push_ttl_s > 0")
        self.chunk_bytes = nccl_chunk_bytes
        self.connect_timeout_s = nccl_connect_timeout_s
        self._push_sizes = (push_buffer_bytes, push_spill_bytes, push_ttl_s)
        self._engine: NcclEngine | None = None
        self._receiver: PushReceiver | None = None
        # SendBlocksNccl needs its own call object (see rpc.py), hence own channels.
        self._channels = ChannelCache(tls_ca)
        self.last_timing = PullTiming()

    # -- setup ---------------------------------------------------------------------------------

    def bind(self, cache: KvCacheView) -> None:
        """Builds the engine over `cache` (CUDA tensors). Raises ValueError on a CPU cache or
        a layout that is not dense in memory; NcclUnavailableError without libnccl."""
        if cache.device.type != "cuda":
            raise ValueError(f"the nccl transport needs a CUDA KV cache, got {cache.device}")
        super().bind(cache)
        views = [layer_byte_view(lc.tensor, lc.block_dim) for lc in cache.layers]
        device = cache.device.index or 0
        self._engine = NcclEngine(
            device, views, self.strategy, self.chunk_bytes, self.connect_timeout_s
        )
        gpu, host, ttl = self._push_sizes
        self._receiver = PushReceiver(self._engine, gpu, host, ttl)

    @property
    def engine(self) -> NcclEngine:
        """The bound engine; raises RuntimeError before `bind`."""
        if self._engine is None:
            raise RuntimeError("nccl transport used before bind()")
        return self._engine

    @property
    def receiver(self) -> PushReceiver:
        """The push receive buffer; raises RuntimeError before `bind`."""
        if self._receiver is None:
            raise RuntimeError("nccl transport used before bind()")
        return self._receiver

    # -- pull side (decode) --------------------------------------------------------------------

    def pull(
        self,
        peer: Peer,
        request: PullRequest,
        remote_block_ids: Sequence[int] | None = None,
        strategy: Strategy | None = None,
        chunk_bytes: int | None = None,
        on_posted: Callable[[], None] | None = None,
    ) -> int:
        """Pulls `request`'s blocks over NCCL into `request.local_block_ids`; returns bytes.

        `remote_block_ids` (prefill ids at the requested positions, optional) lets the grouped
        strategy find the runs consecutive on both sides; `strategy` / `chunk_bytes` override
        the configured ones for this pull; `on_posted()` runs once the receives are posted.
        Raises TransferError."""
        request.remaining()
        stub = peer.stub
        md = peer.metadata

        def connect(req: kv_transfer_pb2.NcclConnectRequest, timeout: float) -> Any:
            return stub.NcclConnect.future(req, timeout=timeout, metadata=md)

        channel = self._channels.get(peer.endpoint)

        def send(req: kv_transfer_pb2.PullBlocksRequest, timeout: float) -> SendBlocksCall:
            return SendBlocksCall(channel, req, timeout, md)

        try:
            self.last_timing = self.engine.pull(
                peer.endpoint,
                request.to_proto(),
                list(request.local_block_ids),
                connect,
                send,
                request.deadline,
                remote_block_ids,
                strategy,
                chunk_bytes,
                on_posted,
            )
        except NcclTransferError as exc:
            raise TransferError(f"transfer {request.transfer_id}: {exc}", exc.code) from None
        return self.last_timing.nbytes

    # -- serve side (prefill) ------------------------------------------------------------------

    @staticmethod
    def _deadline(context: grpc.ServicerContext) -> float:
        left = context.time_remaining()
        return time.monotonic() + (left if left is not None else 60.0)

    def serve_send_blocks_nccl(
        self,
        block_ids: Sequence[int],
        request: kv_transfer_pb2.PullBlocksRequest,
        context: grpc.ServicerContext,
    ) -> kv_transfer_pb2.SendBlocksNcclResponse:
        try:
            sent = self.engine.serve_send(
                block_ids,
                request,
                self._deadline(context),
                lambda: context.send_initial_metadata((ACCEPTED_METADATA,)),
            )
        except NcclTransferError as exc:
            context.abort(exc.code, str(exc))
        return kv_transfer_pb2.SendBlocksNcclResponse(bytes_sent=sent)

    def serve_nccl_connect(
        self, request: kv_transfer_pb2.NcclConnectRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.NcclConnectResponse:
        try:
            self.engine.accept(request, self._deadline(context))
        except NcclTransferError as exc:
            context.abort(exc.code, str(exc))
        return kv_transfer_pb2.NcclConnectResponse(ok=True)

    # -- push ----------------------------------------------------------------------------------

    def serve_nccl_push_begin(
        self, request: kv_transfer_pb2.NcclPushBeginRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.NcclPushBeginResponse:
        """Serves `NcclPushBegin` (decode): reserve room, post the receives."""
        try:
            spilled = self.receiver.begin(request, self._deadline(context))
        except NcclTransferError as exc:
            context.abort(exc.code, str(exc))
        return kv_transfer_pb2.NcclPushBeginResponse(spilled=spilled)

    def push_session(
        self,
        peer: Peer,
        requester_id: str,
        items: Sequence[tuple[str, Sequence[int]]],
        layout: instance_pb2.KvLayout,
        deadline: float,
        tp_rank: int = 0,
    ) -> PushSession:
        """Starts pushing `items` ((transfer id, prefill block ids), send order) to `peer`;
        call `send_layer(l)` after each layer's forward, then `finish()`. Raises TransferError
        (RESOURCE_EXHAUSTED when decode has no room: the request is then served by pull)."""
        stub, md = peer.stub, peer.metadata

        def connect(req: kv_transfer_pb2.NcclConnectRequest, timeout: float) -> Any:
            return stub.NcclConnect.future(req, timeout=timeout, metadata=md)

        def begin(req: kv_transfer_pb2.NcclPushBeginRequest, timeout: float) -> Any:
            return stub.NcclPushBegin(req, timeout=timeout, metadata=md)

        try:
            return PushSession(
                self.engine,
                peer.endpoint,
                tp_rank,
                requester_id,
                items,
                connect,
                begin,
                layout,
                deadline,
            )
        except NcclTransferError as exc:
            raise TransferError(str(exc), exc.code) from None

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
        """Copies a pushed transfer into `local_block_ids` (decode); returns bytes. Only a
        whole transfer can be taken (a decode with local prefix hits pulls the rest instead);
        the sender is implied by the communicator the push came over, and a push still in
        flight is waited for until `deadline`. Raises TransferError (NOT_FOUND when nothing
        was pushed for it, INVALID_ARGUMENT for a part of a transfer)."""
        if self._receiver is None:
            raise TransferError("nccl transport used before bind()", grpc.StatusCode.NOT_FOUND)
        if remote_block_indices is not None and list(remote_block_indices) != list(
            range(len(local_block_ids))
        ):
            raise TransferError(
                f"transfer {transfer_id}: only whole pushed transfers are taken",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        try:
            return self._receiver.take(transfer_id, local_block_ids, deadline)
        except NcclTransferError as exc:
            raise TransferError(str(exc), exc.code) from None

    def discard_pushed(self, transfer_id: str, reason: str) -> None:
        if self._receiver is not None:
            self._receiver.discard(transfer_id)

    # -- lifecycle -----------------------------------------------------------------------------

    def peer_gone(self, peer_id: str) -> None:
        """Aborts the communicators with `peer_id` (an instance id or a KvTransfer endpoint)."""
        if self._engine is not None:
            self._engine.drop_peer(peer_id)
        self._channels.drop(peer_id)

    def close(self) -> None:
        self._channels.close()
        if self._receiver is not None:
            self._receiver.close()
        if self._engine is not None:
            self._engine.close()
