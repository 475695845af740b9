"""The `nccl` KV transport: block bytes over NCCL point-to-point, control over gRPC.

Pull (default): decode's `pull` connects once per (prefill endpoint, TP rank) with
`NcclKvTransfer.NcclConnect`, then, per transfer, posts its receives straight into the paged KV
cache while prefill's `SendBlocks` handler (service.py) sends the held blocks. Push:
`push_session` (prefill, during the forward) and `NcclPushBegin` / the receive buffer
(decode, push.py). The engine pieces live in this folder; this class adapts them to
`KvTransport` and maps their errors to `TransferError`.

Options (from `kv_connector_extra_config`): `nccl_strategy` ("gather" | "grouped"),
`nccl_chunk_bytes`, `nccl_connect_timeout_s`, `push_buffer_bytes`, `push_spill_bytes`,
`push_ttl_s`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from pdplane.connector.kv_cache import KvCacheView
from pdplane.connector.transports.base import (
    BlockAccess,
    KvTransport,
    Peer,
    PeerDirectory,
    PeerInstance,
    PullRequest,
    PullResult,
    ServiceBinding,
    TransferError,
)
from pdplane.connector.transports.nccl.blocks import layer_byte_view
from pdplane.connector.transports.nccl.engine import NcclEngine, NcclTransferError
from pdplane.connector.transports.nccl.plan import DEFAULT_CHUNK_BYTES, Strategy
from pdplane.connector.transports.nccl.push import PushReceiver, PushSession
from pdplane.connector.transports.nccl.rpc import SendBlocksCall
from pdplane.connector.transports.nccl.service import SERVICE_NAME, NcclKvTransferServicer
from pdplane.connector.transports.receive_buffer import ReceiveBuffer
from pdplane.v1 import instance_pb2, kv_transfer_nccl_pb2, kv_transfer_nccl_pb2_grpc

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

    # -- setup ---------------------------------------------------------------------------------

    def bind(self, cache: KvCacheView, peers: PeerDirectory | None = None) -> None:
        """Builds the engine over `cache` (CUDA tensors). Raises ValueError on a CPU cache or
        a layout that is not dense in memory; NcclUnavailableError without libnccl."""
        if cache.device.type != "cuda":
            raise ValueError(f"the nccl transport needs a CUDA KV cache, got {cache.device}")
        super().bind(cache, peers)
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

    @property
    def receive_buffer(self) -> ReceiveBuffer | None:
        return self._receiver

    def services(self, access: BlockAccess) -> list[ServiceBinding]:
        servicer = NcclKvTransferServicer(access, self.engine, self.receiver)
        return [
            ServiceBinding(
                SERVICE_NAME,
                lambda server: kv_transfer_nccl_pb2_grpc.add_NcclKvTransferServicer_to_server(
                    servicer, server
                ),
            )
        ]

    # -- pull side (decode) --------------------------------------------------------------------

    def pull(
        self,
        peer: Peer,
        request: PullRequest,
        remote_block_ids: Sequence[int] | None = None,
        strategy: Strategy | None = None,
        chunk_bytes: int | None = None,
        on_posted: Callable[[], None] | None = None,
    ) -> PullResult:
        """Pulls `request`'s blocks over NCCL into `request.local_block_ids`.

        `remote_block_ids` (prefill ids at the requested positions, optional) lets the grouped
        strategy find the runs consecutive on both sides; `strategy` / `chunk_bytes` override
        the configured ones for this pull; `on_posted()` runs once the receives are posted.
        Returns this transfer's bytes and timing. Raises TransferError."""
        request.remaining()
        stub = peer.stub(kv_transfer_nccl_pb2_grpc.NcclKvTransferStub)
        md = peer.metadata

        def connect(req: kv_transfer_nccl_pb2.NcclConnectRequest, timeout: float) -> Any:
            return stub.NcclConnect.future(req, timeout=timeout, metadata=md)

        def send(req: kv_transfer_nccl_pb2.NcclPullRequest, timeout: float) -> SendBlocksCall:
            return SendBlocksCall(peer.channel, req, timeout, md)

        try:
            timing = self.engine.pull(
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
        return PullResult(timing.nbytes, timing.connect_s, timing.post_s, timing.total_s)

    # -- push ----------------------------------------------------------------------------------

    def push_session(
        self,
        peer: Peer,
        requester_id: str,
        items: Sequence[tuple[str, Sequence[int]]],
        layout: instance_pb2.KvLayout,
        deadline: float,
        tp_rank: int = 0,
        peer_id: str = "",
    ) -> PushSession:
        """Starts pushing `items` ((transfer id, prefill block ids), send order) to `peer`;
        call `send_layer(l)` after each layer's forward, then `finish()`. Raises TransferError
        (RESOURCE_EXHAUSTED when decode has no room: the request is then served by pull)."""
        stub, md = peer.stub(kv_transfer_nccl_pb2_grpc.NcclKvTransferStub), peer.metadata

        def connect(req: kv_transfer_nccl_pb2.NcclConnectRequest, timeout: float) -> Any:
            return stub.NcclConnect.future(req, timeout=timeout, metadata=md)

        def begin(req: kv_transfer_nccl_pb2.NcclPushBeginRequest, timeout: float) -> Any:
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

    # -- lifecycle -----------------------------------------------------------------------------

    def peer_gone(self, peer: PeerInstance) -> None:
        """Aborts the communicators with `peer` and frees what it pushed here."""
        if self._engine is not None:
            self._engine.drop_peer(peer.instance_id)
        if self._receiver is not None:
            self._receiver.drop_sender(peer.instance_id)

    def stats(self) -> dict[str, int]:
        if self._engine is None:
            return {}
        return {"communicators": len(self._engine.states()["active"])}

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        if self._engine is not None:
            self._engine.close()
