"""The KV transport interface: how the bytes of KV cache blocks move between two instances.

The connector owns everything around a transfer (which blocks prefill holds, the transfer ids
that grant access, auth, timeouts, reporting to vLLM, the worker's gRPC server); a transport
only moves block bytes, and everything it needs for that lives in its own folder
(`transports/<name>/`): its RPCs (a gRPC service of its own, e.g. `pdplane.v1.TcpKvTransfer`),
their handlers, its receive buffer. The shared `pdplane.v1.KvTransfer` service (complete,
abort) knows nothing of any transport.

* **Serve side (prefill).** `services(access)` returns the transport's gRPC services; the
  connector adds them to the worker's server. A handler asks `access` (`BlockAccess`) for the
  blocks a request names: `access.pin` checks that the transfer id is one this instance issued
  and still holds, the block indices and the requester's layout, and pins the hold so that it
  cannot be freed while the bytes are read; `AccessDenied` carries the gRPC status to answer.

* **Pull side (decode).** The connector's background puller calls `pull(peer, request)` from a
  worker thread (never the engine thread) once vLLM has allocated the decode blocks. `pull`
  fills `request.local_block_ids[i]` with prefill's block at position
  `request.remote_block_indices[i]`, for every layer, straight into the paged KV cache, and
  returns a `PullResult` (bytes and timing of this transfer). It must return or raise by
  `request.deadline` (`time.monotonic()` seconds); every gRPC call it makes passes
  `metadata=peer.metadata`. On any failure it raises `TransferError` (the connector then
  reports the blocks to vLLM as load errors and tells prefill to free them); partial writes are
  fine, because failed blocks are recomputed or the request fails.

* **Push mode** (optional; `kv_connector_extra_config.mode: "push"`). Prefill's worker opens a
  `push_session` per decode peer when a step computes a prompt whose decode is known, calls
  `send_layer(l)` on it right after attention layer l wrote its KV (vLLM's `save_kv_layer`)
  and `finish()` at the step's `wait_for_save`. Decode's transport keeps what arrives in its
  `receive_buffer` (`receive_buffer.ReceiveBuffer`); the decode request then takes it into its
  blocks, or, when nothing usable was pushed, pulls as above and discards any leftover. Push
  only ever saves a pull: prefill holds the blocks exactly as in pull mode until decode
  completes the transfer.

* **Peers.** `preconnect(peers)` may set up, in the background, what the first transfer with
  each peer would otherwise pay for (NCCL: communicators); `peer_gone(peer)` drops everything
  kept for a peer that left the registry. `stats()` feeds logs and metrics.

Both sides get the worker's KV cache (and the connector's channels to peers) through `bind`
before the first call. Tensor parallel: rank i of decode talks to rank i of prefill
(`request.tp_rank`); each rank has its own transport object and gRPC server.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

import grpc

from pdplane.connector.kv_cache import KvCacheView
from pdplane.v1 import instance_pb2, kv_transfer_pb2

if TYPE_CHECKING:
    from pdplane.connector.transports.receive_buffer import ReceiveBuffer

__all__ = [
    "AccessDenied",
    "BlockAccess",
    "KvTransport",
    "LocalWorker",
    "Peer",
    "PeerDirectory",
    "PeerInstance",
    "PinnedBlocks",
    "PullRequest",
    "PullResult",
    "PushSender",
    "ServiceBinding",
    "TransferError",
]

_Stub = TypeVar("_Stub")


class TransferError(RuntimeError):
    """A pull failed (peer unreachable, transfer unknown/expired, layout mismatch, timeout,
    short or malformed data). The message says which; `code` is the gRPC status when one
    caused it."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Peer:
    """One peer worker's gRPC server as seen from this worker: a channel (shared by every
    service on that server) plus the call metadata (bearer token) every call must carry.
    Stubs are built once per stub class (`stub`), never per transfer."""

    endpoint: str  # host:port of the peer's rank server
    channel: grpc.Channel
    metadata: tuple[tuple[str, str], ...] = ()
    _stubs: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    def stub(self, stub_type: Callable[[grpc.Channel], _Stub]) -> _Stub:
        """The cached `stub_type(channel)` (a generated `...Stub` class)."""
        stub = self._stubs.get(stub_type)
        if stub is None:
            stub = self._stubs.setdefault(stub_type, stub_type(self.channel))
        return stub  # type: ignore[no-any-return]


class PeerDirectory(Protocol):
    """The connector's channels to peers (`peers.PeerPool`), as a transport sees them."""

    def get(self, endpoint: str, tp_rank: int = 0) -> Peer:
        """The peer for rank `tp_rank` of the instance whose rank 0 is at `endpoint`."""
        ...


@dataclass(frozen=True, slots=True)
class PeerInstance:
    """A registered instance this worker exchanges KV with, as the connector's registry watch
    sees it. `kv_endpoint` is its rank 0's host:port (rank i listens on port + i). What the
    two do: this worker pulls from it (`pulls_from`: it prefills, we decode), it pulls from
    this worker (`serves_to`), this worker pushes to it (`pushes_to`, push mode)."""

    instance_id: str
    kv_endpoint: str
    pulls_from: bool = False
    serves_to: bool = False
    pushes_to: bool = False


@dataclass(frozen=True, slots=True)
class LocalWorker:
    """This worker as peers know it: its instance's registry id, its own server's advertised
    host:port (this rank's) and its TP rank."""

    instance_id: str = ""
    endpoint: str = ""
    tp_rank: int = 0


@dataclass(frozen=True, slots=True)
class PullRequest:
    """One pull of a transfer's blocks into this worker's KV cache.

    Attributes:
        transfer_id: issued by prefill (from `kv_transfer_params`); names the held blocks.
        remote_block_indices: positions in prefill's block list (0 = first prompt block).
        local_block_ids: decode block ids, same length: block `remote_block_indices[i]` goes
            into `local_block_ids[i]`.
        expected_layout: this worker's KV layout; prefill refuses a different one.
        tp_rank: this worker's tensor-parallel rank (pulls from the same rank of prefill).
        requester_id: this instance's registry id.
        peer_id: prefill's registry id (`engine_id` of the params; "" = unknown): what the
            NCCL transport keys its communicators by.
        deadline: `time.monotonic()` time by which `pull` must have returned or raised.
    """

    transfer_id: str
    remote_block_indices: Sequence[int]
    local_block_ids: Sequence[int]
    expected_layout: instance_pb2.KvLayout
    tp_rank: int = 0
    requester_id: str = ""
    peer_id: str = ""
    deadline: float = field(default_factory=lambda: time.monotonic() + 30.0)

    def remaining(self) -> float:
        """Seconds left until the deadline; raises TransferError(DEADLINE_EXCEEDED) if none."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TransferError(
                f"transfer {self.transfer_id}: deadline exceeded", grpc.StatusCode.DEADLINE_EXCEEDED
            )
        return left

    def to_proto(self) -> kv_transfer_pb2.PullBlocksRequest:
        """The `PullBlocksRequest` naming this pull."""
        return kv_transfer_pb2.PullBlocksRequest(
            transfer_id=self.transfer_id,
            block_indices=list(self.remote_block_indices),
            expected_layout=self.expected_layout,
            tp_rank=self.tp_rank,
            requester_id=self.requester_id,
        )


@dataclass(frozen=True, slots=True)
class PullResult:
    """What one pull moved and cost (seconds): `connect_s` setting up a connection first (0
    when one was ready), `post_s` until the receives were posted (NCCL), `total_s` until the
    bytes were in the cache."""

    nbytes: int
    connect_s: float = 0.0
    post_s: float = 0.0
    total_s: float = 0.0


class PushSender(Protocol):
    """Prefill side of one step's push to one decode worker (see the module docstring)."""

    def send_layer(self, layer: int) -> None:
        """Sends layer `layer`'s blocks of every pushed transfer (its KV is written).
        Raises TransferError; the session is then aborted."""

    def finish(self) -> int:
        """Ends the session (bounded); returns bytes sent or queued. Raises TransferError."""

    def abort(self, reason: str) -> None:
        """Ends the session now; decode frees what arrived and pulls instead."""


class AccessDenied(Exception):
    """A request for held blocks is refused; `code` is the gRPC status to answer with."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


class PinnedBlocks(Protocol):
    """Held blocks pinned for one read (`BlockAccess.pin`); `release()` (or leaving the
    `with` block) ends the read, after which the hold may be freed."""

    block_ids: list[int]  # prefill block ids, in the requested order

    def release(self) -> None: ...

    def __enter__(self) -> PinnedBlocks: ...

    def __exit__(self, *exc: object) -> None: ...


class BlockAccess(Protocol):
    """What a transport's handlers may ask of the connector: its layout, and held blocks."""

    layout: instance_pb2.KvLayout

    def check_layout(self, layout: instance_pb2.KvLayout, who: str = "requester") -> None:
        """Raises AccessDenied(INVALID_ARGUMENT) unless `layout` equals this worker's."""
        ...

    def pin(
        self,
        request: kv_transfer_pb2.PullBlocksRequest,
        time_remaining: float | None = None,
        context: Any = None,
    ) -> PinnedBlocks:
        """Pins the blocks `request` names (transfer held, indices in range, layout equal),
        waiting a little (never past `time_remaining` seconds) for a hold the engine has not
        registered yet. `context`: the gRPC call serving it, if any (the read's tracing span
        is then a child of the caller's). Raises AccessDenied (NOT_FOUND, INVALID_ARGUMENT)."""
        ...


@dataclass(frozen=True, slots=True)
class ServiceBinding:
    """One gRPC service a transport (or the connector) hosts on the worker's server.

    `name` is its full name (health and reflection); `register(server)` adds its handlers
    (e.g. a generated `add_...Servicer_to_server`); `threads` is how many server threads it may
    hold at once for long-lived streams, on top of the server's base pool."""

    name: str
    register: Callable[[grpc.Server], object]
    threads: int = 0


class KvTransport(ABC):
    """Moves KV cache block bytes; one object per worker (TP rank), on both roles."""

    #: "tcp" or "nccl", as in `kv_connector_extra_config.transport` and the registry's
    #: `Transport` enum.
    name: ClassVar[str]

    def __init__(self) -> None:
        self._cache: KvCacheView | None = None
        self._peers: PeerDirectory | None = None
        self.local = LocalWorker()

    @property
    def cache(self) -> KvCacheView:
        """The bound KV cache; raises RuntimeError before `bind`."""
        if self._cache is None:
            raise RuntimeError(f"{self.name} transport used before bind()")
        return self._cache

    @property
    def peers(self) -> PeerDirectory | None:
        """The connector's channels to peers (None when bound without them, e.g. in tests)."""
        return self._peers

    def bind(
        self,
        cache: KvCacheView,
        peers: PeerDirectory | None = None,
        local: LocalWorker | None = None,
    ) -> None:
        """Gives the transport this worker's KV cache, the connector's channels to peers and
        who this worker is (called once, from register_kv_caches)."""
        self._cache = cache
        self._peers = peers
        self.local = local or LocalWorker()

    # -- pull side (decode) -------------------------------------------------------------------

    @abstractmethod
    def pull(self, peer: Peer, request: PullRequest) -> PullResult:
        """Fills `request.local_block_ids` with prefill's blocks.

        Runs on a worker thread; bounded by `request.deadline`. Raises TransferError.
        """

    # -- serve side ---------------------------------------------------------------------------

    @abstractmethod
    def services(self, access: BlockAccess) -> list[ServiceBinding]:
        """The transport's gRPC services for this worker's server, serving through `access`."""

    # -- push mode ----------------------------------------------------------------------------

    def push_session(
        self,
        peer: Peer,
        requester_id: str,
        items: Sequence[tuple[str, Sequence[int]]],
        layout: instance_pb2.KvLayout,
        deadline: float,
        tp_rank: int = 0,
        peer_id: str = "",
    ) -> PushSender:
        """Prefill: starts pushing `items` ((transfer id, this worker's block ids in token
        order), send order) to `peer`, the decode worker of rank `tp_rank` of instance
        `peer_id`; `requester_id` is this instance's id; every wait ends by `deadline`
        (monotonic s). Raises TransferError (UNIMPLEMENTED by default; RESOURCE_EXHAUSTED when
        decode has no room)."""
        raise TransferError(f"{self.name} transport has no push", grpc.StatusCode.UNIMPLEMENTED)

    @property
    def receive_buffer(self) -> ReceiveBuffer | None:
        """Decode, push mode: where pushed transfers wait for their request (None = this
        transport takes no pushes)."""
        return None

    # -- peers and lifecycle ------------------------------------------------------------------

    def preconnect(self, peers: Sequence[PeerInstance], deadline: float) -> int:
        """Sets up what the first transfer with each of `peers` would otherwise pay for, by
        `deadline` (monotonic s); returns how many are ready. Default: nothing to set up."""
        return 0

    def peer_gone(self, peer: PeerInstance) -> dict[str, int]:
        """`peer` left the registry: drops what is kept for it (connections, pushed KV);
        returns how many of each, e.g. {"communicators": 2}. Default: nothing kept."""
        return {}

    def stats(self) -> dict[str, int]:
        """Counters and gauges for logs and metrics, e.g. {"communicators": 3}."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases everything the transport holds; called once at connector shutdown."""
