"""NCCL push mode (the seed's PUT_ASYNC): prefill sends a transfer layer by layer during its
forward; decode receives into a bounded GPU receive buffer, spilling to pinned host memory
when the buffer is full, and refusing (RESOURCE_EXHAUSTED) when both are full, so nothing
waits for room and nothing overflows.

Sender (`PushSession`): `push_begin` on the PUSH pair's stream (the receiver reserves room and
posts all receives, then answers `push_ready`), then `send_layer(l)` after each attention layer
wrote its KV, then `finish()`. Message order on the
communicator: for each layer, for each item in the begin request's order, one message holding
the item's blocks of that layer in the `[outer, n, inner_bytes]` byte layout.

Receiver (`PushReceiver`): `begin` (serves the `push_begin`), then `take` copies a received transfer
into the blocks vLLM allocated for it and frees its room; unclaimed transfers expire.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import grpc

from pdplane.connector.transports.base import TransferError
from pdplane.connector.transports.nccl.communicator import NcclCommunicator, P2pOp
from pdplane.connector.transports.nccl.errors import NcclTransferError, status_of
from pdplane.connector.transports.nccl.pairs import Pair
from pdplane.connector.transports.receive_buffer import ReceiveBuffer
from pdplane.v1 import kv_transfer_nccl_pb2

if TYPE_CHECKING:
    import torch

    from pdplane.connector.transports.nccl.engine import NcclEngine

__all__ = ["PushReceiver", "PushSession"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Slot:
    transfer_id: str
    sender_id: str
    num_blocks: int
    nbytes: int
    spilled: bool
    layers: list[torch.Tensor]  # per layer: [outer, n, inner_bytes] uint8, GPU or pinned host
    expires_at: float
    done: threading.Event = field(default_factory=threading.Event)
    error: str = ""


class PushReceiver(ReceiveBuffer):
    """Decode side of push mode: a bounded receive buffer with pinned-host spill.

    Args:
        engine: the worker's NCCL engine (communicators, KV cache byte views).
        gpu_bytes: receive buffer capacity on the GPU (bytes).
        host_bytes: pinned host spill capacity (bytes); 0 = no spill.
        ttl_s: a received transfer nobody takes within this time is freed (s).
    """

    def __init__(
        self, engine: NcclEngine, gpu_bytes: int, host_bytes: int, ttl_s: float = 60.0
    ) -> None:
        self.engine = engine
        self.gpu_bytes = gpu_bytes
        self.host_bytes = host_bytes
        self.ttl_s = ttl_s
        self._slots: dict[str, _Slot] = {}
        self._gpu_used = 0
        self._host_used = 0
        self._lock = threading.Lock()
        self._waiters = ThreadPoolExecutor(max_workers=4, thread_name_prefix="pdplane-push-wait")

    @property
    def capacity_bytes(self) -> int:
        """The larger of the GPU buffer and the host spill (a push lands in either)."""
        return max(self.gpu_bytes, self.host_bytes)

    @property
    def headroom_bytes(self) -> int:
        """The largest push that fits now: in the GPU buffer or else in the host spill."""
        with self._lock:
            return max(self.gpu_bytes - self._gpu_used, self.host_bytes - self._host_used)

    @property
    def gpu_headroom_bytes(self) -> int:
        """Bytes still free in the GPU receive buffer."""
        with self._lock:
            return self.gpu_bytes - self._gpu_used

    def _release(self, slot: _Slot) -> None:
        # Caller holds self._lock.
        if self._slots.get(slot.transfer_id) is slot:
            del self._slots[slot.transfer_id]
            if slot.spilled:
                self._host_used -= slot.nbytes
            else:
                self._gpu_used -= slot.nbytes

    def expire(self, now: float | None = None) -> int:
        """Frees received transfers past their TTL. Returns how many. Cheap when empty."""
        if not self._slots:
            return 0
        now = time.monotonic() if now is None else now
        with self._lock:
            old = [s for s in self._slots.values() if s.expires_at <= now and s.done.is_set()]
            for slot in old:
                self._release(slot)
        return len(old)

    def _reserve(
        self, items: Sequence[kv_transfer_nccl_pb2.NcclPushItem]
    ) -> list[tuple[str, int, bool]]:
        mover = self.engine.mover
        self.expire()
        with self._lock:
            gpu, host = self._gpu_used, self._host_used
            plan = []
            for item in items:
                if item.transfer_id in self._slots or not item.transfer_id:
                    raise NcclTransferError(
                        f"transfer id {item.transfer_id!r} empty or already pushed",
                        grpc.StatusCode.ALREADY_EXISTS,
                    )
                nbytes = mover.transfer_bytes(item.num_blocks)
                if gpu + nbytes <= self.gpu_bytes:
                    gpu += nbytes
                    plan.append((item.transfer_id, nbytes, False))
                elif host + nbytes <= self.host_bytes:
                    host += nbytes
                    plan.append((item.transfer_id, nbytes, True))
                else:
                    raise NcclTransferError(
                        f"receive buffer full: {nbytes} bytes for {item.transfer_id} fit neither "
                        f"the GPU buffer ({self.gpu_bytes - gpu} of {self.gpu_bytes} free) nor "
                        f"the host spill ({self.host_bytes - host} of {self.host_bytes} free)",
                        grpc.StatusCode.RESOURCE_EXHAUSTED,
                    )
            self._gpu_used, self._host_used = gpu, host
        return plan

    def begin(
        self,
        request: kv_transfer_nccl_pb2.NcclPushBeginRequest,
        deadline: float,
        comm: NcclCommunicator,
        sender_id: str,
        done: Callable[[str | None], None],
    ) -> list[bool]:
        """Serves a push pair's `push_begin` from instance `sender_id`: reserves room for
        every item (all or nothing), posts the receives on `comm`, and returns at once with,
        per item, whether it spilled to host memory. `done(error)` runs once the receives
        completed (error None) or failed; not when this raises.

        Raises NcclTransferError (RESOURCE_EXHAUSTED, ALREADY_EXISTS; ABORTED: posting
        failed, the communicator is of no use)."""
        import torch

        plan = self._reserve(request.items)
        views = self.engine.mover.views
        dev = f"cuda:{self.engine.device}"
        slots: list[_Slot] = []
        for (tid, nbytes, spilled), item in zip(plan, request.items, strict=True):
            n = item.num_blocks
            layers = [
                torch.empty(
                    (int(v.shape[0]), n, int(v.shape[2])),
                    dtype=torch.uint8,
                    device="cpu" if spilled else dev,
                    pin_memory=spilled,
                )
                for v in views
            ]
            slots.append(
                _Slot(
                    tid,
                    sender_id,
                    n,
                    nbytes,
                    spilled,
                    layers,
                    time.monotonic() + self.ttl_s,
                )
            )
        with self._lock:
            for slot in slots:
                self._slots[slot.transfer_id] = slot
        try:
            with comm.lock, torch.cuda.device(self.engine.device), torch.cuda.stream(comm.stream):
                bounce = None
                if any(s.spilled for s in slots):
                    biggest = max(t.numel() for s in slots if s.spilled for t in s.layers)
                    bounce = torch.empty(biggest, dtype=torch.uint8, device=dev)
                for layer in range(len(views)):
                    for slot in slots:
                        dst = slot.layers[layer]
                        if not slot.spilled:
                            comm.enqueue([P2pOp(False, dst.data_ptr(), dst.numel())], deadline)
                            continue
                        assert bounce is not None
                        comm.enqueue([P2pOp(False, bounce.data_ptr(), dst.numel())], deadline)
                        dst.view(-1).copy_(bounce[: dst.numel()], non_blocking=True)
                if bounce is not None:
                    bounce.record_stream(comm.stream)
        except Exception as exc:
            self._fail(slots, f"posting receives failed: {exc}")
            raise NcclTransferError(str(exc), grpc.StatusCode.ABORTED) from exc
        self._waiters.submit(self._await, comm, slots, deadline, done)
        return [s.spilled for s in slots]

    def _fail(self, slots: Sequence[_Slot], error: str) -> None:
        with self._lock:
            for slot in slots:
                slot.error = error
                self._release(slot)
                slot.done.set()

    def _await(
        self,
        comm: NcclCommunicator,
        slots: Sequence[_Slot],
        deadline: float,
        done: Callable[[str | None], None],
    ) -> None:
        try:
            comm.wait(deadline, "push receive")
        except Exception as exc:
            logger.warning("push receive failed: %s", exc)
            self._fail(slots, str(exc))
            done(str(exc))
            return
        for slot in slots:
            slot.done.set()
        done(None)

    def take(
        self,
        transfer_id: str,
        local_block_ids: Sequence[int],
        deadline: float,
        *,
        sender_id: str = "",
        remote_block_indices: Sequence[int] | None = None,
        wait_s: float = 0.0,
    ) -> int:
        """Copies a pushed transfer into `local_block_ids` and frees its room. Only a whole
        transfer can be taken (a decode with local prefix hits pulls the rest instead); the
        sender is implied by the communicator the push came over, and a push still in flight
        is waited for until `deadline`. Raises TransferError (NOT_FOUND when nothing was pushed
        for it, INVALID_ARGUMENT for a part of a transfer, DEADLINE_EXCEEDED, ABORTED)."""
        if remote_block_indices is not None and list(remote_block_indices) != list(
            range(len(local_block_ids))
        ):
            raise TransferError(
                f"transfer {transfer_id}: only whole pushed transfers are taken",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        try:
            return self._take(transfer_id, local_block_ids, deadline)
        except NcclTransferError as exc:
            raise TransferError(str(exc), exc.code) from None

    def _take(self, transfer_id: str, local_ids: Sequence[int], deadline: float) -> int:
        import torch

        with self._lock:
            slot = self._slots.get(transfer_id)
        if slot is None:
            raise NcclTransferError(f"no pushed transfer {transfer_id}", grpc.StatusCode.NOT_FOUND)
        if not slot.done.wait(timeout=max(deadline - time.monotonic(), 0)):
            raise NcclTransferError(
                f"pushed transfer {transfer_id} not complete", grpc.StatusCode.DEADLINE_EXCEEDED
            )
        if slot.error:
            raise NcclTransferError(slot.error, grpc.StatusCode.ABORTED)
        if len(local_ids) != slot.num_blocks:
            raise NcclTransferError(
                f"{len(local_ids)} local blocks for a {slot.num_blocks}-block transfer",
                grpc.StatusCode.INVALID_ARGUMENT,
            )
        mover = self.engine.mover
        mover.check_ids(local_ids)
        with torch.cuda.device(self.engine.device):
            index = torch.tensor(list(local_ids), dtype=torch.long, device=f"cuda:{mover.device}")
            for view, data in zip(mover.views, slot.layers, strict=True):
                src = data.to(index.device, non_blocking=True) if slot.spilled else data
                view.index_copy_(1, index, src)
            torch.cuda.current_stream(self.engine.device).synchronize()
        with self._lock:
            self._release(slot)
        return slot.nbytes

    def discard(self, transfer_id: str, reason: str = "") -> None:
        """Frees a received transfer decode will not take (it pulled instead). A transfer
        still being received is left to its bounded wait and then to the TTL, because its
        buffer is the target of receives NCCL has already posted."""
        with self._lock:
            slot = self._slots.get(transfer_id)
            if slot is not None and slot.done.is_set():
                self._release(slot)

    def drop_sender(self, sender_id: str) -> int:
        """Frees the received transfers of `sender_id` (those still being received end with
        their communicator, which is dropped with the peer)."""
        with self._lock:
            gone = [s for s in self._slots.values() if s.sender_id == sender_id and s.done.is_set()]
            for slot in gone:
                self._release(slot)
        return len(gone)

    def close(self) -> None:
        """Stops the waiter threads (their waits are bounded) and frees everything."""
        self._waiters.shutdown(wait=True)
        with self._lock:
            self._slots.clear()
            self._gpu_used = self._host_used = 0


class PushSession:
    """Prefill side of one forward step's push to one decode worker, over the pair's stream.

    Holds the pair's lock from `push_begin` to `finish`, so no other transfer interleaves
    messages. Use as a context manager or call `finish()`/`abort()`.
    """

    def __init__(
        self,
        engine: NcclEngine,
        pair: Pair,
        requester_id: str,
        items: Sequence[tuple[str, Sequence[int]]],
        layout: Any,
        deadline: float,
    ) -> None:
        """Announces `items` ((transfer id, this worker's block ids) in send order) on `pair`
        (acquired from `engine`; released when the session ends) and waits for decode's
        `push_ready`. Raises NcclTransferError (RESOURCE_EXHAUSTED when the receiver is
        full); the pair is released then."""
        import torch

        self.engine = engine
        self.pair = pair
        self.comm = pair.comm
        self.deadline = deadline
        self.items = [(tid, list(ids)) for tid, ids in items]
        self._open = True
        self.comm.lock.acquire()
        try:
            for _, ids in self.items:
                engine.mover.check_ids(ids)
            seq, waiter = pair.expect()
            begin = kv_transfer_nccl_pb2.NcclPushBeginRequest(
                requester_id=requester_id,
                tp_rank=pair.key.tp_rank,
                layout=layout,
                items=[
                    kv_transfer_nccl_pb2.NcclPushItem(transfer_id=tid, num_blocks=len(ids))
                    for tid, ids in self.items
                ],
                seq=seq,
                timeout_ms=max(int((deadline - time.monotonic()) * 1000), 1),
            )
            assert pair.link is not None
            pair.link.send(kv_transfer_nccl_pb2.NcclControl(push_begin=begin))
            ready = waiter.wait(deadline, "push_ready")
        except ValueError as exc:
            self._close()
            raise NcclTransferError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
        except NcclTransferError as exc:
            self.abort(str(exc))  # no answer: the stream is of no use any more
            raise
        if ready.code:
            self._close()
            raise NcclTransferError(
                f"push to {pair.key.peer_id}: {ready.message}", status_of(ready.code)
            )
        self.spilled = list(ready.spilled)
        dev = f"cuda:{engine.device}"
        self._index = [torch.tensor(ids, dtype=torch.long, device=dev) for _, ids in self.items]
        self.bytes_sent = 0

    def _close(self) -> None:
        if self._open:
            self._open = False
            self.comm.lock.release()
            self.engine.release(self.pair)

    def send_layer(self, layer: int) -> None:
        """Enqueues layer `layer`'s messages, ordered after the work already on the current
        CUDA stream (the forward that wrote that layer's KV). Raises NcclTransferError."""
        import torch

        if not self._open:
            raise NcclTransferError("push session closed", grpc.StatusCode.FAILED_PRECONDITION)
        view = self.engine.mover.views[layer]
        try:
            with torch.cuda.device(self.engine.device):
                compute = torch.cuda.current_stream(self.engine.device)
                with torch.cuda.stream(self.comm.stream):
                    self.comm.stream.wait_stream(compute)
                    parts = [view.index_select(1, index) for index in self._index]
                    self.comm.enqueue(
                        [P2pOp(True, p.data_ptr(), p.numel()) for p in parts], self.deadline
                    )
                    for part in parts:
                        part.record_stream(self.comm.stream)
                        self.bytes_sent += part.numel()
        except Exception as exc:
            self.abort(str(exc))
            raise NcclTransferError(f"push layer {layer}: {exc}", grpc.StatusCode.ABORTED) from exc

    def finish(self) -> int:
        """Waits (bounded by the session deadline) until every message left; returns bytes.
        Raises NcclTransferError after aborting the pair."""
        try:
            self.comm.wait(self.deadline, "push send")
        except Exception as exc:
            self.abort(str(exc))
            code = (
                grpc.StatusCode.DEADLINE_EXCEEDED
                if isinstance(exc, TimeoutError)
                else grpc.StatusCode.ABORTED
            )
            raise NcclTransferError(f"push: {exc}", code) from exc
        finally:
            self._close()
        return self.bytes_sent

    def abort(self, reason: str) -> None:
        """Aborts the pair (the receiver's waits then fail) and ends the session."""
        self.engine.fail(self.pair, reason)
        self._close()

    def __enter__(self) -> PushSession:
        return self

    def __exit__(self, exc_type: Any, *_: Any) -> None:
        if exc_type is not None:
            self.abort(f"push session ended by {exc_type.__name__}")
        self._close()
