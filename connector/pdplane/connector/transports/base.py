"""The KV transport interface: how the bytes of KV cache blocks move between two instances.

The connector owns everything around a transfer (which blocks prefill holds, the transfer ids
that grant access, the `pdplane.v1.KvTransfer` gRPC server, auth, timeouts, reporting to vLLM);
a transport only moves block bytes. It is used on both sides of a pull:

* **Serve side (prefill).** The connector's `KvTransfer` servicer validates a call (the
  transfer id is one this instance issued and still holds, the block indices are in range, the
  requester's layout equals ours), pins the held blocks so they cannot be freed mid-read, and
  then calls `serve_pull_blocks` (TCP: the RPC's response stream carries the bytes) or
  `serve_send_blocks_nccl` (NCCL: the RPC returns once the sends completed) with the prefill
  block ids to send, in the order the requester asked for them. `serve_nccl_connect` answers
  the NCCL communicator handshake. A transport that does not support a call keeps the default,
  which answers UNIMPLEMENTED.

* **Pull side (decode).** The connector's background puller calls `pull(peer, request)` from a
  worker thread (never the engine thread) once vLLM has allocated the decode blocks. `pull`
  fills `request.local_block_ids[i]` with prefill's block at position
  `request.remote_block_indices[i]`, for every layer, straight into the paged KV cache, and
  returns the number of bytes received. It must return or raise by `request.deadline`
  (`time.monotonic()` seconds); every gRPC call it makes passes `timeout=request.remaining()`
  and `metadata=peer.metadata`. On any failure it raises `TransferError` (the connector then
  reports the blocks to vLLM as load errors and tells prefill to free them); partial writes are
  fine, because failed blocks are recomputed or the request fails.

* **Push mode** (optional; `kv_connector_extra_config.mode: "push"`). Prefill's worker opens a
  `push_session` per decode peer when a step computes a prompt whose decode is known, calls
  `send_layer(l)` on it right after attention layer l wrote its KV (vLLM's `save_kv_layer`)
  and `finish()` at the step's `wait_for_save`. Decode's transport keeps what arrives in a
  bounded receive buffer (`serve_push_blocks` for TCP, `serve_nccl_push_begin` for NCCL); the
  decode request then `take_pushed`s it into its blocks, or, when nothing usable was pushed
  (buffer full, push failed or late), pulls as above and `discard_pushed`s any leftover. Push
  only ever saves a pull: prefill holds the blocks exactly as in pull mode until decode
  completes the transfer.

Both sides get the worker's KV cache through `bind(cache)` before the first call. Tensor
parallel: rank i of decode pulls from rank i of prefill (`request.tp_rank`); each rank has its
own transport object and `KvTransfer` server.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import grpc

from pdplane.connector.kv_cache import KvCacheView
from pdplane.v1 import instance_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc

__all__ = ["KvTransport", "Peer", "PullRequest", "PushSender", "TransferError"]


class TransferError(RuntimeError):
    """A pull failed (peer unreachable, transfer unknown/expired, layout mismatch, timeout,
    short or malformed data). The message says which; `code` is the gRPC status when one
    caused it."""

    def __init__(self, message: str, code: grpc.StatusCode | None = None) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True, slots=True)
class Peer:
    """A prefill instance's `KvTransfer` endpoint as seen from decode: a ready stub plus the
    call metadata (bearer token) every call must carry."""

    endpoint: str  # host:port
    stub: kv_transfer_pb2_grpc.KvTransferStub
    metadata: tuple[tuple[str, str], ...] = ()


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
        requester_id: this instance's registry id (selects the NCCL communicator).
        deadline: `time.monotonic()` time by which `pull` must have returned or raised.
    """

    transfer_id: str
    remote_block_indices: Sequence[int]
    local_block_ids: Sequence[int]
    expected_layout: instance_pb2.KvLayout
    tp_rank: int = 0
    requester_id: str = ""
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
        """The `PullBlocksRequest` naming this pull (for PullBlocks / SendBlocksNccl)."""
        return kv_transfer_pb2.PullBlocksRequest(
            transfer_id=self.transfer_id,
            block_indices=list(self.remote_block_indices),
            expected_layout=self.expected_layout,
            tp_rank=self.tp_rank,
            requester_id=self.requester_id,
        )


class PushSender(Protocol):
    """Prefill side of one step's push to one decode worker (see the module docstring)."""

    def send_layer(self, layer: int) -> None:
        """Sends layer `layer`'s blocks of every pushed transfer (its KV is written).
        Raises TransferError; the session is then aborted."""

    def finish(self) -> int:
        """Ends the session (bounded); returns bytes sent or queued. Raises TransferError."""

    def abort(self, reason: str) -> None:
        """Ends the session now; decode frees what arrived and pulls instead."""


class KvTransport(ABC):
    """Moves KV cache block bytes; one object per worker (TP rank), on both roles."""

    #: "tcp" or "nccl", as in `kv_connector_extra_config.transport` and the registry's
    #: `Transport` enum.
    name: ClassVar[str]

    def __init__(self) -> None:
        self._cache: KvCacheView | None = None

    @property
    def cache(self) -> KvCacheView:
        """The bound KV cache; raises RuntimeError before `bind`."""
        if self._cache is None:
            raise RuntimeError(f"{self.name} transport used before bind()")
        return self._cache

    def bind(self, cache: KvCacheView) -> None:
        """Gives the transport this worker's KV cache (called once, from register_kv_caches)."""
        self._cache = cache

    # -- pull side (decode) -------------------------------------------------------------------

    @abstractmethod
    def pull(self, peer: Peer, request: PullRequest) -> int:
        """Fills `request.local_block_ids` with prefill's blocks; returns bytes received.

        Runs on a worker thread; bounded by `request.deadline`. Raises TransferError.
        """

    # -- serve side (prefill) -----------------------------------------------------------------

    def serve_pull_blocks(
        self,
        block_ids: Sequence[int],
        request: kv_transfer_pb2.PullBlocksRequest,
        context: grpc.ServicerContext,
    ) -> Iterator[kv_transfer_pb2.KvChunk]:
        """Yields the chunks of a `PullBlocks` stream for `block_ids` (prefill ids, validated,
        pinned, in the requested order). Default: UNIMPLEMENTED."""
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{self.name} transport has no PullBlocks")
        yield from ()

    def serve_send_blocks_nccl(
        self,
        block_ids: Sequence[int],
        request: kv_transfer_pb2.PullBlocksRequest,
        context: grpc.ServicerContext,
    ) -> kv_transfer_pb2.SendBlocksNcclResponse:
        """Sends `block_ids` (validated, pinned, in order) to the requester over NCCL and returns
        once the sends completed. Default: UNIMPLEMENTED."""
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{self.name} transport has no NCCL send")
        raise AssertionError("unreachable")

    def serve_nccl_connect(
        self, request: kv_transfer_pb2.NcclConnectRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.NcclConnectResponse:
        """Joins the requester's 2-rank NCCL communicator. Default: UNIMPLEMENTED."""
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{self.name} transport has no NCCL")
        raise AssertionError("unreachable")

    def serve_nccl_push_begin(
        self, request: kv_transfer_pb2.NcclPushBeginRequest, context: grpc.ServicerContext
    ) -> kv_transfer_pb2.NcclPushBeginResponse:
        """NCCL push mode: reserves room for the announced transfers and posts the receives.
        Default: UNIMPLEMENTED."""
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{self.name} transport has no NCCL push")
        raise AssertionError("unreachable")

    # -- push mode ----------------------------------------------------------------------------

    def push_session(
        self,
        peer: Peer,
        requester_id: str,
        items: Sequence[tuple[str, Sequence[int]]],
        layout: instance_pb2.KvLayout,
        deadline: float,
        tp_rank: int = 0,
    ) -> PushSender:
        """Prefill: starts pushing `items` ((transfer id, this worker's block ids in token
        order), send order) to `peer`, the decode worker of rank `tp_rank`; `requester_id` is
        this instance's id; every wait ends by `deadline` (monotonic s). Raises TransferError
        (UNIMPLEMENTED by default; RESOURCE_EXHAUSTED when decode has no room)."""
        raise TransferError(f"{self.name} transport has no push", grpc.StatusCode.UNIMPLEMENTED)

    def serve_push_blocks(
        self,
        header: kv_transfer_pb2.PushHeader,
        messages: Iterator[kv_transfer_pb2.PushBlocksMessage],
        context: grpc.ServicerContext,
    ) -> kv_transfer_pb2.PushBlocksResponse:
        """Decode: receives the pushed transfer `header` announces (layout already checked)
        from the rest of the stream into the receive buffer. Default: UNIMPLEMENTED."""
        context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{self.name} transport has no PushBlocks")
        raise AssertionError("unreachable")

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
        """Decode: copies the pushed blocks at `remote_block_indices` (default: all, in order)
        of `transfer_id`, pushed by instance `sender_id`, into `local_block_ids`; waits up to
        `wait_s` (and never past `deadline`) for a push still arriving. Returns bytes copied.
        Raises TransferError (NOT_FOUND: nothing usable was pushed — pull instead)."""
        raise TransferError(f"{self.name} transport has no push", grpc.StatusCode.NOT_FOUND)

    def discard_pushed(self, transfer_id: str, reason: str) -> None:  # noqa: B027 - optional
        """Decode: a push of `transfer_id` will not be used (pulled instead): free it now and
        refuse it if it arrives later."""

    def expire_pushed(self) -> None:  # noqa: B027 - optional hook
        """Decode: frees pushed transfers past their TTL. Called on every engine step, so it
        must be cheap when nothing is due."""

    def peer_gone(self, peer_id: str) -> None:  # noqa: B027 - optional hook
        """A peer instance left the registry: drop what is cached for it (e.g. communicators)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Releases everything the transport holds; called once at connector shutdown."""
