"""The worker-side NCCL transfer engine: communicators per peer, pull on both sides.

One 2-rank communicator per (peer instance, TP rank) and per direction of the handshake: the
side that calls `NcclConnect` generates the NCCL unique id and becomes rank 0; the side that
serves it becomes rank 1. Communicators are created on first use, cached, and dropped (aborted)
when a transfer on them fails or the peer leaves (`drop_peer`).

A pull on the decode side (`pull`) runs the `SendBlocks` RPC as a gRPC future while it
posts its receives: with lazily connected NCCL channels neither side's group can complete
before the other side's group is posted, so the two must overlap. Every step is bounded by the
pull's deadline; on a timeout or error the communicator is aborted and dropped, and the RPC is
cancelled.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc

from pdplane.connector.transports.nccl.binding import NcclLibrary
from pdplane.connector.transports.nccl.blocks import BlockMover
from pdplane.connector.transports.nccl.communicator import NcclCommunicator, P2pOp
from pdplane.connector.transports.nccl.plan import (
    DEFAULT_CHUNK_BYTES,
    Strategy,
    contiguous_runs,
    split_runs,
)
from pdplane.v1 import kv_transfer_nccl_pb2, kv_transfer_pb2

if TYPE_CHECKING:
    import torch

__all__ = ["NcclEngine", "NcclTransferError", "PullTiming"]

logger = logging.getLogger(__name__)

_WARMUP_BYTES = 4


class NcclTransferError(RuntimeError):
    """A transfer or handshake failed; `code` is the gRPC status that fits it best."""

    def __init__(self, message: str, code: grpc.StatusCode = grpc.StatusCode.INTERNAL) -> None:
        super().__init__(message)
        self.code = code


@dataclass(slots=True)
class PullTiming:
    """What one `pull` cost (seconds): connect (0 when cached), post (receives enqueued),
    total (until the bytes are in the cache), and the bytes moved."""

    connect_s: float = 0.0
    post_s: float = 0.0
    total_s: float = 0.0
    nbytes: int = 0


def _key(peer: str, tp_rank: int) -> str:
    return f"{peer}#{tp_rank}"


class NcclEngine:
    """NCCL data path of one worker (one TP rank on one CUDA device).

    Args:
        device: CUDA device index of this worker's KV cache.
        views: the KV cache layers' byte views (`blocks.layer_byte_view`), model order.
        strategy: how blocks travel (`plan.Strategy`); receivers decide, senders follow.
        chunk_bytes: gather staging size (bytes).
        connect_timeout_s: bound on creating a communicator (s).
    """

    def __init__(
        self,
        device: int,
        views: Sequence[torch.Tensor],
        strategy: Strategy = Strategy.GATHER,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        connect_timeout_s: float = 30.0,
    ) -> None:
        self.device = device
        self.mover = BlockMover(views, device)
        self.strategy = strategy
        self.chunk_bytes = chunk_bytes
        self.connect_timeout_s = connect_timeout_s
        self._lib = NcclLibrary.get()
        self._comms: dict[str, NcclCommunicator] = {}
        self._connecting: dict[str, threading.Lock] = {}
        self._lock = threading.Lock()
        #: the last communicators taken out of service: (key, communicator), newest last
        self.retired: deque[tuple[str, NcclCommunicator]] = deque(maxlen=64)

    # -- communicator cache --------------------------------------------------------------------

    def communicator(self, peer: str, tp_rank: int) -> NcclCommunicator | None:
        """The usable cached communicator with `peer` for `tp_rank`, if any."""
        with self._lock:
            comm = self._comms.get(_key(peer, tp_rank))
        return comm if comm is not None and comm.usable else None

    def states(self) -> dict[str, dict[str, str]]:
        """{"active": {"peer#tp_rank": state}, "retired": {...}} (states: "ready", "aborted",
        "closed"); retired lists the communicators dropped most recently."""
        with self._lock:
            return {
                "active": {k: c.state.value for k, c in self._comms.items()},
                "retired": {k: c.state.value for k, c in self.retired},
            }

    def _put(self, key: str, comm: NcclCommunicator) -> None:
        with self._lock:
            old = self._comms.pop(key, None)
            self._comms[key] = comm
            if old is not None:
                self.retired.append((key, old))
        if old is not None:
            old.abort("replaced by a new communicator")

    def _drop(self, key: str, comm: NcclCommunicator, reason: str) -> None:
        with self._lock:
            if self._comms.get(key) is comm:
                del self._comms[key]
                self.retired.append((key, comm))
        comm.abort(reason)

    def drop_peer_comm(self, comm: NcclCommunicator, reason: str) -> None:
        """Aborts `comm` and forgets it (after a failed transfer on it)."""
        with self._lock:
            for key, cached in list(self._comms.items()):
                if cached is comm:
                    del self._comms[key]
                    self.retired.append((key, comm))
        comm.abort(reason)

    def drop_peer(self, peer: str) -> int:
        """Aborts and forgets every communicator with `peer` (it left the registry or
        restarted). Returns how many were dropped."""
        with self._lock:
            keys = [k for k in self._comms if k.rpartition("#")[0] == peer]
            comms = [self._comms.pop(k) for k in keys]
            self.retired.extend(zip(keys, comms, strict=True))
        for comm in comms:
            comm.abort(f"peer {peer} left")
        return len(comms)

    def close(self) -> None:
        """Releases every communicator."""
        with self._lock:
            comms = list(self._comms.values())
            self._comms.clear()
        for comm in comms:
            comm.close()

    # -- handshake ---------------------------------------------------------------------------

    def _warmup(self, comm: NcclCommunicator, deadline: float) -> None:
        # Connects both directions now, so the first transfer pays no connection setup.
        import torch

        buf = torch.zeros(2 * _WARMUP_BYTES, dtype=torch.uint8, device=f"cuda:{self.device}")
        ptr = buf.data_ptr()
        comm.enqueue(
            [P2pOp(True, ptr, _WARMUP_BYTES), P2pOp(False, ptr + _WARMUP_BYTES, _WARMUP_BYTES)],
            deadline,
        )
        comm.wait(deadline, "warm-up")

    def connect(
        self,
        peer: str,
        tp_rank: int,
        call: Callable[[kv_transfer_nccl_pb2.NcclConnectRequest, float], Any],
        requester_id: str,
        deadline: float,
    ) -> NcclCommunicator:
        """The communicator with `peer` for `tp_rank`, creating it (rank 0) if needed.

        `call(request, timeout_s)` starts the peer's `NcclConnect` RPC and returns a
        grpc future (e.g. `stub.NcclConnect.future`). Raises NcclTransferError."""
        key = _key(peer, tp_rank)
        with self._lock:
            gate = self._connecting.setdefault(key, threading.Lock())
        with gate:  # one handshake per peer at a time; later callers reuse its result
            comm = self.communicator(peer, tp_rank)
            if comm is not None:
                return comm
            deadline = min(deadline, time.monotonic() + self.connect_timeout_s)
            uid = self._lib.get_unique_id()
            comm = NcclCommunicator.start(uid, 0, self.device, f"{key}/r0", self._lib)
            request = kv_transfer_nccl_pb2.NcclConnectRequest(
                requester_id=requester_id, tp_rank=tp_rank, unique_id=uid
            )
            future = call(request, max(deadline - time.monotonic(), 0.001))
            try:
                comm.wait_ready(deadline)
                self._warmup(comm, deadline)
                future.result(timeout=max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as exc:
                comm.abort("NcclConnect failed")
                raise NcclTransferError(
                    f"NcclConnect to {peer}: {exc.code().name}: {exc.details()}", exc.code()
                ) from None
            except Exception as exc:
                future.cancel()
                comm.abort(f"handshake failed: {exc}")
                raise NcclTransferError(
                    f"NCCL handshake with {peer}: {exc}", grpc.StatusCode.UNAVAILABLE
                ) from exc
            self._put(key, comm)
            return comm

    def accept(self, request: kv_transfer_nccl_pb2.NcclConnectRequest, deadline: float) -> None:
        """Serves `NcclConnect`: joins the requester's communicator as rank 1 (replacing an
        older one with the same requester and rank). Raises NcclTransferError."""
        if not request.requester_id:
            raise NcclTransferError("requester_id is empty", grpc.StatusCode.INVALID_ARGUMENT)
        key = _key(request.requester_id, request.tp_rank)
        deadline = min(deadline, time.monotonic() + self.connect_timeout_s)
        try:
            comm = NcclCommunicator.start(
                bytes(request.unique_id), 1, self.device, f"{key}/r1", self._lib
            )
        except ValueError as exc:
            raise NcclTransferError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
        try:
            comm.wait_ready(deadline)
            self._warmup(comm, deadline)
        except Exception as exc:
            comm.abort(f"handshake failed: {exc}")
            raise NcclTransferError(
                f"NCCL handshake with {request.requester_id}: {exc}",
                grpc.StatusCode.DEADLINE_EXCEEDED,
            ) from exc
        self._put(key, comm)

    # -- pull: serve side (prefill) ----------------------------------------------------------

    def _plan_args(
        self, plan: kv_transfer_nccl_pb2.NcclPlan, ids: Sequence[int]
    ) -> tuple[Strategy, int, list[Any]]:
        if plan.strategy == kv_transfer_nccl_pb2.NcclPlan.STRATEGY_GROUPED:
            return Strategy.GROUPED, 0, split_runs(list(plan.run_lengths), ids)
        return Strategy.GATHER, int(plan.chunk_bytes) or self.chunk_bytes, []

    def serve_send(
        self,
        block_ids: Sequence[int],
        request: kv_transfer_nccl_pb2.NcclPullRequest,
        deadline: float,
        accepted: Callable[[], None] = lambda: None,
    ) -> int:
        """Serves `SendBlocks`: sends `block_ids` (this worker's ids, in the requested
        order) to the requester and waits until the sends completed. Returns bytes sent.
        `accepted()` is called once the request is valid, right before the first send (the
        gRPC layer sends the initial metadata the receiver waits for, see `pull`).

        Raises NcclTransferError: FAILED_PRECONDITION (no communicator), INVALID_ARGUMENT
        (plan or ids do not fit), DEADLINE_EXCEEDED / ABORTED (communicator aborted)."""
        blocks = request.blocks
        comm = self.communicator(blocks.requester_id, blocks.tp_rank)
        if comm is None:
            raise NcclTransferError(
                f"no NCCL communicator with {blocks.requester_id} rank {blocks.tp_rank}",
                grpc.StatusCode.FAILED_PRECONDITION,
            )
        try:
            strategy, chunk_bytes, runs = self._plan_args(request.plan, block_ids)
            self.mover.check_ids(block_ids)
        except ValueError as exc:
            raise NcclTransferError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
        accepted()
        return self._run(
            comm,
            _key(blocks.requester_id, blocks.tp_rank),
            True,
            block_ids,
            strategy,
            chunk_bytes,
            runs,
            deadline,
        )

    def _run(
        self,
        comm: NcclCommunicator,
        key: str,
        is_send: bool,
        ids: Sequence[int],
        strategy: Strategy,
        chunk_bytes: int,
        runs: Sequence[Any],
        deadline: float,
    ) -> int:
        with comm.lock:
            try:
                nbytes = self.mover.enqueue(
                    comm, is_send, ids, strategy, deadline, chunk_bytes, runs
                )
                comm.wait(deadline)
            except ValueError as exc:
                self._drop(key, comm, f"bad transfer: {exc}")
                raise NcclTransferError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
            except TimeoutError as exc:
                self._drop(key, comm, str(exc))
                raise NcclTransferError(str(exc), grpc.StatusCode.DEADLINE_EXCEEDED) from exc
            except Exception as exc:
                self._drop(key, comm, str(exc))
                raise NcclTransferError(str(exc), grpc.StatusCode.ABORTED) from exc
        return nbytes

    # -- pull: receive side (decode) ---------------------------------------------------------

    def make_plan(
        self,
        local_ids: Sequence[int],
        remote_ids: Sequence[int] | None = None,
        strategy: Strategy | None = None,
        chunk_bytes: int | None = None,
    ) -> kv_transfer_nccl_pb2.NcclPlan:
        """The plan this receiver asks for (engine defaults unless `strategy`/`chunk_bytes`
        are given): GROUPED needs the sender's ids (`remote_ids`) to find the runs consecutive
        on both sides; without them GATHER is used."""
        strategy = strategy or self.strategy
        if strategy is Strategy.GROUPED and remote_ids is not None:
            runs = contiguous_runs(remote_ids, local_ids)
            return kv_transfer_nccl_pb2.NcclPlan(
                strategy=kv_transfer_nccl_pb2.NcclPlan.STRATEGY_GROUPED,
                run_lengths=[r.length for r in runs],
            )
        return kv_transfer_nccl_pb2.NcclPlan(
            strategy=kv_transfer_nccl_pb2.NcclPlan.STRATEGY_GATHER,
            chunk_bytes=chunk_bytes or self.chunk_bytes,
        )

    def pull(
        self,
        peer: str,
        request: kv_transfer_pb2.PullBlocksRequest,
        local_ids: Sequence[int],
        connect: Callable[[kv_transfer_nccl_pb2.NcclConnectRequest, float], Any],
        send: Callable[[kv_transfer_nccl_pb2.NcclPullRequest, float], Any],
        deadline: float,
        remote_ids: Sequence[int] | None = None,
        strategy: Strategy | None = None,
        chunk_bytes: int | None = None,
        on_posted: Callable[[], None] | None = None,
    ) -> PullTiming:
        """Pulls the blocks `request` names from `peer` into `local_ids` of this cache.

        `connect` starts the peer's NcclConnect RPC as a grpc future (`stub.NcclConnect.future`
        with metadata bound); `send` starts its SendBlocks as an `rpc.SendBlocksCall`. The plan
        is made here (see `make_plan` for `remote_ids`, `strategy`, `chunk_bytes`);
        `on_posted()` runs once all receives are posted (observability).
        Returns the timing; raises NcclTransferError (the communicator is
        aborted and dropped on NCCL failures)."""
        t0 = time.monotonic()
        timing = PullTiming()
        if len(request.block_indices) != len(local_ids):
            raise NcclTransferError(
                f"{len(request.block_indices)} block indices but {len(local_ids)} local blocks",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        comm = self.communicator(peer, request.tp_rank)
        if comm is None:
            comm = self.connect(peer, request.tp_rank, connect, request.requester_id, deadline)
            timing.connect_s = time.monotonic() - t0
        key = _key(peer, request.tp_rank)
        plan = self.make_plan(local_ids, remote_ids, strategy, chunk_bytes)
        strategy, chunk_bytes, runs = self._plan_args(plan, local_ids)
        call = kv_transfer_nccl_pb2.NcclPullRequest(blocks=request, plan=plan)
        with comm.lock:
            future = send(call, max(deadline - time.monotonic(), 0.001))
            # Post receives only once the sender accepted the request (its initial metadata):
            # NCCL cannot cancel a posted receive, so a refused request (unknown transfer, bad
            # indices) must fail before, or it would cost the communicator.
            if not future.accepted():
                try:
                    future.result()
                except grpc.RpcError as exc:
                    raise NcclTransferError(
                        f"SendBlocks on {peer}: {exc.code().name}: {exc.details()}",
                        exc.code(),
                    ) from None
                raise NcclTransferError(
                    f"SendBlocks on {peer} did not accept the request",
                    grpc.StatusCode.UNAVAILABLE,
                )
            try:
                timing.nbytes = self.mover.enqueue(
                    comm, False, local_ids, strategy, deadline, chunk_bytes, runs
                )
                timing.post_s = time.monotonic() - t0
                if on_posted is not None:
                    on_posted()
                comm.wait(deadline)
                response = future.result(timeout=max(deadline - time.monotonic(), 0.001))
            except grpc.RpcError as exc:
                # The sender failed or refused: our receives can never complete.
                self._drop(key, comm, f"SendBlocks failed: {exc.code().name}")
                raise NcclTransferError(
                    f"SendBlocks on {peer}: {exc.code().name}: {exc.details()}", exc.code()
                ) from None
            except ValueError as exc:
                future.cancel()
                self._drop(key, comm, f"bad transfer: {exc}")
                raise NcclTransferError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
            except Exception as exc:
                future.cancel()
                self._drop(key, comm, str(exc))
                code = (
                    grpc.StatusCode.DEADLINE_EXCEEDED
                    if isinstance(exc, TimeoutError)
                    else grpc.StatusCode.ABORTED
                )
                raise NcclTransferError(f"pull from {peer}: {exc}", code) from exc
        if response.bytes_sent != timing.nbytes:
            raise NcclTransferError(
                f"peer sent {response.bytes_sent} bytes, expected {timing.nbytes}",
                grpc.StatusCode.DATA_LOSS,
            )
        timing.total_s = time.monotonic() - t0
        return timing
