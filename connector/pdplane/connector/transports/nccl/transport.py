"""The `nccl` KV transport: block bytes over NCCL point-to-point, control over gRPC.

Pull (default): decode opens one pair per (prefill instance, TP rank) — a communicator and its
control stream, `NcclKvTransfer.Pair` — then, per transfer, one request and one verdict on that
stream while the bytes go straight into the paged KV cache (engine.py). Push: `push_session`
(prefill, during the forward) announces the step's transfers on a push pair; decode's receive
buffer (push.py) takes them. Pairs are set up in the background where they will be needed
(`preconnect`), capped per worker (`max_peer_communicators`), and dropped when their peer
leaves (`peer_gone`). This class adapts the engine to `KvTransport` and maps its errors to
`TransferError`.

Options (from `kv_connector_extra_config`): `nccl_chunk_bytes`, `nccl_connect_timeout_s`,
`max_peer_communicators`, `push_buffer_bytes`, `push_spill_bytes`, `push_ttl_s`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import ClassVar

import grpc

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
from pdplane.connector.transports.nccl.blocks import layer_byte_view
from pdplane.connector.transports.nccl.chunk_plan import DEFAULT_CHUNK_BYTES
from pdplane.connector.transports.nccl.engine import (
    DEFAULT_MAX_PEER_COMMUNICATORS,
    NcclEngine,
    NcclTransferError,
    PullTiming,
)
from pdplane.connector.transports.nccl.pairs import PairKey, Purpose
from pdplane.connector.transports.nccl.push import PushReceiver, PushSession
from pdplane.connector.transports.nccl.servicer import SERVICE_NAME, NcclKvTransferServicer
from pdplane.connector.transports.receive_buffer import ReceiveBuffer
from pdplane.v1 import instance_pb2, kv_transfer_nccl_pb2, kv_transfer_nccl_pb2_grpc

__all__ = ["NcclTransport"]

log = logging.getLogger(__name__)

_DEFAULT_PUSH_BUFFER_BYTES = 1 << 30
_DEFAULT_PUSH_SPILL_BYTES = 4 << 30
#: server threads beyond the pairs' streams (Preconnect calls, a pair replacing another)
_SPARE_THREADS = 8


class NcclTransport(KvTransport):
    """NCCL data path of one worker (TP rank). See the module docstring for the options.

    Raises ValueError for a non-positive size.
    """

    name: ClassVar[str] = "nccl"

    def __init__(
        self,
        nccl_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        nccl_connect_timeout_s: float = 30.0,
        max_peer_communicators: int = DEFAULT_MAX_PEER_COMMUNICATORS,
        push_buffer_bytes: int = _DEFAULT_PUSH_BUFFER_BYTES,
        push_spill_bytes: int = _DEFAULT_PUSH_SPILL_BYTES,
        push_ttl_s: float = 60.0,
    ) -> None:
        super().__init__()
        if nccl_chunk_bytes <= 0 or nccl_connect_timeout_s <= 0 or max_peer_communicators < 1:
            raise ValueError(
                "nccl_chunk_bytes and nccl_connect_timeout_s must be > 0, "
                "max_peer_communicators >= 1"
            )
        if push_buffer_bytes < 0 or push_spill_bytes < 0 or push_ttl_s <= 0:
            raise ValueError("push buffer/spill sizes must be >= 0 and push_ttl_s > 0")
        self.chunk_bytes = nccl_chunk_bytes
        self.connect_timeout_s = nccl_connect_timeout_s
        self.max_peer_communicators = max_peer_communicators
        self._push_sizes = (push_buffer_bytes, push_spill_bytes, push_ttl_s)
        self._engine: NcclEngine | None = None
        self._receiver: PushReceiver | None = None

    # -- setup ---------------------------------------------------------------------------------

    def bind(
        self,
        cache: KvCacheView,
        peers: PeerDirectory | None = None,
        local: LocalWorker | None = None,
    ) -> None:
        """Builds the engine over `cache` (CUDA tensors). Raises ValueError on a CPU cache or
        a layout that is not dense in memory; NcclUnavailableError without libnccl."""
        if cache.device.type != "cuda":
            raise ValueError(f"the nccl transport needs a CUDA KV cache, got {cache.device}")
        super().bind(cache, peers, local)
        views = [layer_byte_view(lc.tensor, lc.block_dim) for lc in cache.layers]
        device = cache.device.index or 0
        engine = NcclEngine(
            device,
            views,
            self.chunk_bytes,
            self.connect_timeout_s,
            self.max_peer_communicators,
        )
        engine.instance_id = self.local.instance_id
        engine.mover.warm_up(self.chunk_bytes)
        gpu, host, ttl = self._push_sizes
        self._receiver = engine.receiver = PushReceiver(engine, gpu, host, ttl)
        self._engine = engine

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
        engine = self.engine
        engine.access = access
        servicer = NcclKvTransferServicer(engine, self.peers)
        return [
            ServiceBinding(
                SERVICE_NAME,
                lambda server: kv_transfer_nccl_pb2_grpc.add_NcclKvTransferServicer_to_server(
                    servicer, server
                ),
                # one handler per pair this worker serves (each holds its stream)
                threads=self.max_peer_communicators + _SPARE_THREADS,
            )
        ]

    # -- pull side (decode) --------------------------------------------------------------------

    def pull(self, peer: Peer, request: PullRequest) -> PullResult:
        timing = self.pull_timed(peer, request)
        return PullResult(timing.nbytes, timing.connect_s, timing.post_s, timing.total_s)

    def pull_timed(
        self,
        peer: Peer,
        request: PullRequest,
        chunk_bytes: int | None = None,
        on_posted: Callable[[], None] | None = None,
    ) -> PullTiming:
        """`pull` with the engine's full timing of this transfer. `chunk_bytes` overrides the
        configured message size; `on_posted()` runs once all receives are posted. Raises
        TransferError."""
        request.remaining()
        try:
            return self.engine.pull(
                request.peer_id,
                peer,
                request.to_proto(),
                list(request.local_block_ids),
                request.deadline,
                chunk_bytes,
                on_posted,
            )
        except NcclTransferError as exc:
            raise TransferError(f"transfer {request.transfer_id}: {exc}", exc.code) from None

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
        engine = self.engine
        key = PairKey(peer_id or peer.endpoint, tp_rank, Purpose.PUSH)
        try:
            pair, _ = engine.acquire(key, peer, deadline)
            return PushSession(engine, pair, requester_id, items, layout, deadline)
        except NcclTransferError as exc:
            raise TransferError(str(exc), exc.code) from None

    # -- peers and lifecycle -------------------------------------------------------------------

    def preconnect(self, peers: Sequence[PeerInstance], deadline: float) -> int:
        """Opens, in the background of the first request, the pairs this worker will need with
        `peers`: a PULL pair to each prefill it pulls from; for each decode that pulls from
        it, asks that decode to open its PULL pair now (`NcclKvTransfer.Preconnect`); a PUSH
        pair to each decode it pushes to. Never evicts: stops at `max_peer_communicators`.
        Returns how many pairs were opened."""
        directory, engine, rank = self.peers, self.engine, self.local.tp_rank
        if directory is None:
            return 0
        jobs: list[Callable[[], bool]] = []
        for p in peers:
            peer = directory.get(p.kv_endpoint, rank)
            if p.pulls_from:
                jobs.append(
                    partial(
                        engine.open,
                        PairKey(p.instance_id, rank, Purpose.PULL),
                        peer,
                        deadline,
                        False,
                    )
                )
            if p.serves_to:
                jobs.append(partial(self._ask_to_connect, peer, deadline))
            if p.pushes_to:
                jobs.append(
                    partial(
                        engine.open,
                        PairKey(p.instance_id, rank, Purpose.PUSH),
                        peer,
                        deadline,
                        False,
                    )
                )
        opened, errors = engine.preconnect(jobs, deadline)
        if errors:
            log.info("pre-connect: %d pairs opened, %d not: %s", opened, len(errors), errors[:3])
        return opened

    def _ask_to_connect(self, peer: Peer, deadline: float) -> bool:
        local = self.local
        request = kv_transfer_nccl_pb2.NcclPreconnectRequest(
            requester_id=local.instance_id, tp_rank=local.tp_rank, endpoint=local.endpoint
        )
        try:
            answer = peer.stub(kv_transfer_nccl_pb2_grpc.NcclKvTransferStub).Preconnect(
                request, timeout=max(deadline - time.monotonic(), 0.001), metadata=peer.metadata
            )
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else grpc.StatusCode.UNKNOWN
            raise NcclTransferError(f"Preconnect at {peer.endpoint}: {exc}", code) from None
        return bool(answer.connected)

    def peer_gone(self, peer: PeerInstance) -> dict[str, int]:
        """Aborts the pairs with `peer` (transfers on them fail at once) and frees what it
        pushed here."""
        out = {}
        if self._engine is not None:
            out["communicators"] = self._engine.drop_peer(peer.instance_id, "peer left")
        if self._receiver is not None:
            out["pushed"] = self._receiver.drop_sender(peer.instance_id)
        return out

    def stats(self) -> dict[str, int]:
        return self._engine.stats() if self._engine is not None else {}

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.close()
        if self._engine is not None:
            self._engine.close()
