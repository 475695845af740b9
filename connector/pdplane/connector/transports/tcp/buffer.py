"""Decode side of TCP push mode: the bounded receive buffer pushed KV lands in
(`receive_buffer.ReceiveBuffer`).

A push (`TcpKvTransfer.PushBlocks`) reserves room for all of a transfer's blocks of every layer
when its header arrives (all or nothing: `PushRefused` with RESOURCE_EXHAUSTED when it does not
fit, and the decode request then pulls as usual), fills it chunk by chunk while prefill's
forward runs, and is then READY until the decode request that names the transfer takes it
(`take`; `claim` hands out the raw entry) — or until its TTL, when it is freed unclaimed. A
push that ends incomplete, or that a pull overtook (`discard`), is freed at once. Every wait
here is bounded by the caller.

On CPU the buffer is plain host memory, so "spill to host memory" has nothing left to do: one
bounded buffer. Thread safety: gRPC handler threads write, decode's pull threads take, the
engine thread calls `expire`; one condition variable guards the table and the byte count.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc
import torch

from pdplane.connector.kv_cache import KvCacheView
from pdplane.connector.transports.base import TransferError
from pdplane.connector.transports.receive_buffer import ReceiveBuffer

__all__ = ["PushBuffer", "PushEntry", "PushRefused", "PushState", "copy_pushed"]

_TOMBSTONE_LIMIT = 10_000
_INVALID = grpc.StatusCode.INVALID_ARGUMENT
_ABORTED = grpc.StatusCode.ABORTED


class PushRefused(Exception):
    """The buffer will not take (or keep) a push; `code` is the gRPC status to answer with."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


class PushState(enum.Enum):
    RECEIVING = "receiving"
    READY = "ready"
    GONE = "gone"  # taken, discarded, failed or expired: its bytes are no longer counted


@dataclass(slots=True)
class PushEntry:
    """One pushed transfer. `layers[l]` holds `num_blocks` blocks of layer l back to back
    (`block_nbytes[l]` bytes each, the sender's layout); `seen[l][i]` = block i arrived."""

    transfer_id: str
    sender_id: str
    num_blocks: int
    block_nbytes: tuple[int, ...]
    nbytes: int
    layers: list[bytearray]
    seen: list[bytearray]
    expires_at: float
    state: PushState = PushState.RECEIVING
    received: int = 0  # bytes written so far
    error: str = ""
    started: float = field(default_factory=time.monotonic)

    def write(self, layer: int, first: int, count: int, data: bytes) -> None:
        """Copies `count` blocks of `layer` starting at position `first`. Raises PushRefused
        (INVALID_ARGUMENT) for a chunk out of range, of the wrong size or sent twice, and
        (ABORTED) once the push is no longer wanted."""
        if self.state is not PushState.RECEIVING:
            raise PushRefused(f"transfer {self.transfer_id}: {self.error}", _ABORTED)
        if layer >= len(self.layers):
            raise PushRefused(f"chunk for layer {layer} of {len(self.layers)}", _INVALID)
        size = self.block_nbytes[layer]
        if count == 0 or first + count > self.num_blocks:
            raise PushRefused(f"chunk blocks [{first}, {first + count}) out of range", _INVALID)
        if len(data) != count * size:
            raise PushRefused(f"chunk of {len(data)} bytes, expected {count * size}", _INVALID)
        seen = self.seen[layer]
        if any(seen[first : first + count]):
            raise PushRefused(f"layer {layer}: blocks sent twice", _INVALID)
        self.layers[layer][first * size : (first + count) * size] = data
        seen[first : first + count] = b"\x01" * count
        self.received += len(data)

    def missing(self) -> int:
        """(layer, block) pairs not received yet."""
        return sum(s.count(0) for s in self.seen)


class PushBuffer(ReceiveBuffer):
    """Pushed transfers awaiting their decode request, at most `capacity_bytes` in all.

    Args:
        capacity_bytes: bytes of KV the buffer may hold (reserved per push); 0 = refuse all.
        ttl_s: a push not taken this long after it started is freed (s).
        clock: monotonic seconds (tests pass a fake).
    """

    def __init__(
        self, capacity_bytes: int, ttl_s: float = 60.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if capacity_bytes < 0 or ttl_s <= 0:
            raise ValueError("capacity_bytes must be >= 0 and ttl_s > 0")
        self._capacity = capacity_bytes
        self._cache: KvCacheView | None = None
        self.ttl_s = ttl_s
        self._clock = clock
        self._cond = threading.Condition()
        self._entries: dict[str, PushEntry] = {}
        self._used = 0
        # transfer id -> why it may not be pushed (pulled already, refused, failed): a late
        # push is refused, and a decode request finds out at once that it must pull.
        self._closed: OrderedDict[str, str] = OrderedDict()
        self._next_expiry = float("inf")
        self.refused = 0  # pushes refused for want of room (a counter, for logs and tests)

    def bind(self, cache: KvCacheView) -> None:
        """The KV cache that `take` copies into."""
        self._cache = cache

    @property
    def capacity_bytes(self) -> int:
        return self._capacity

    @property
    def used_bytes(self) -> int:
        """Bytes reserved by pushes not yet taken or freed."""
        return self._used

    @property
    def headroom_bytes(self) -> int:
        """Bytes still free (the registry load report's receive-buffer headroom)."""
        return self._capacity - self._used

    def __len__(self) -> int:
        return len(self._entries)

    def reserve(
        self, transfer_id: str, sender_id: str, num_blocks: int, block_nbytes: Sequence[int]
    ) -> PushEntry:
        """Reserves room for `num_blocks` blocks of every layer (`block_nbytes[l]` bytes each).

        Raises PushRefused: RESOURCE_EXHAUSTED (does not fit), ALREADY_EXISTS (pushed, pulled
        or refused before), INVALID_ARGUMENT (empty id or no blocks)."""
        if not transfer_id or num_blocks <= 0 or not block_nbytes:
            raise PushRefused("a push needs a transfer id, blocks and layers", _INVALID)
        nbytes = num_blocks * sum(block_nbytes)
        self.expire()
        with self._cond:
            if transfer_id in self._entries or transfer_id in self._closed:
                why = self._closed.get(transfer_id, "pushed already")
                raise PushRefused(
                    f"transfer {transfer_id} cannot be pushed: {why}",
                    grpc.StatusCode.ALREADY_EXISTS,
                )
            if self._used + nbytes > self._capacity:
                self.refused += 1
                self._close(transfer_id, "refused: receive buffer full")
                raise PushRefused(
                    f"receive buffer full: transfer {transfer_id} needs {nbytes} bytes, "
                    f"{self._capacity - self._used} of {self._capacity} free",
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                )
            entry = PushEntry(
                transfer_id,
                sender_id,
                num_blocks,
                tuple(int(b) for b in block_nbytes),
                nbytes,
                [bytearray(num_blocks * b) for b in block_nbytes],
                [bytearray(num_blocks) for _ in block_nbytes],
                self._clock() + self.ttl_s,
            )
            self._entries[transfer_id] = entry
            self._used += nbytes
            self._next_expiry = min(self._next_expiry, entry.expires_at)
            self._cond.notify_all()
            return entry

    def commit(self, entry: PushEntry) -> None:
        """The push stream ended: READY if every block of every layer arrived, else freed.
        Raises PushRefused (INVALID_ARGUMENT when incomplete, ABORTED when already gone)."""
        with self._cond:
            if entry.state is not PushState.RECEIVING:
                raise PushRefused(
                    f"transfer {entry.transfer_id}: {entry.error or 'no longer wanted'}",
                    grpc.StatusCode.ABORTED,
                )
            missing = entry.missing()
            if missing:
                self._drop(entry, f"push ended with {missing} layer-blocks missing")
                raise PushRefused(entry.error, _INVALID)
            entry.state = PushState.READY
            self._cond.notify_all()

    def fail(self, entry: PushEntry, reason: str) -> None:
        """Frees a push that could not finish (stream broken, cancelled, malformed)."""
        with self._cond:
            if entry.state is not PushState.GONE:
                self._drop(entry, reason)

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
        if self._cache is None:
            raise RuntimeError("PushBuffer.take before bind()")
        wait = min(wait_s, deadline - self._clock())
        entry = self.claim(transfer_id, sender_id, wait)
        if entry is None:
            raise TransferError(
                f"transfer {transfer_id}: no usable push", grpc.StatusCode.NOT_FOUND
            )
        return copy_pushed(entry, self._cache, remote_block_indices, local_block_ids)

    def claim(self, transfer_id: str, sender_id: str, wait_s: float) -> PushEntry | None:
        """Removes and returns the READY push of `transfer_id` (its bytes are no longer
        counted: the caller copies them out and drops the entry). Waits up to `wait_s` for a
        push that has not arrived or not finished yet. None = no usable push (never pushed,
        refused, failed, too late or from another sender): the caller pulls, then `discard`s."""
        deadline = self._clock() + max(wait_s, 0.0)
        with self._cond:
            while True:
                entry = self._entries.get(transfer_id)
                if entry is not None and entry.state is PushState.READY:
                    if entry.sender_id != sender_id:
                        self._drop(entry, f"pushed by {entry.sender_id}, not {sender_id}")
                        return None
                    self._entries.pop(transfer_id)
                    self._used -= entry.nbytes
                    entry.state = PushState.GONE
                    self._close(transfer_id, "taken")
                    return entry
                left = deadline - self._clock()
                if transfer_id in self._closed or left <= 0:
                    return None
                self._cond.wait(left)

    def discard(self, transfer_id: str, reason: str) -> None:
        """Decode will not use a push of `transfer_id` (it pulled instead, or gave up): frees
        one in progress or ready, and refuses one arriving later."""
        with self._cond:
            entry = self._entries.get(transfer_id)
            if entry is not None:
                self._drop(entry, reason)
            else:
                self._close(transfer_id, reason)

    def expire(self) -> int:
        """Frees pushes past their TTL; returns how many. Cheap when none is due."""
        now = self._clock()
        if now < self._next_expiry:
            return 0
        with self._cond:
            old = [e for e in self._entries.values() if e.expires_at <= now]
            for entry in old:
                self._drop(entry, "not taken within the TTL")
            self._next_expiry = min((e.expires_at for e in self._entries.values()), default=now)
            if not self._entries:
                self._next_expiry = float("inf")
        return len(old)

    def drop_sender(self, sender_id: str) -> int:
        with self._cond:
            gone = [e for e in self._entries.values() if e.sender_id == sender_id]
            for entry in gone:
                self._drop(entry, f"sender {sender_id} left")
        return len(gone)

    def close(self) -> None:
        """Frees everything (connector shutdown)."""
        with self._cond:
            for entry in list(self._entries.values()):
                self._drop(entry, "shutting down")

    def _drop(self, entry: PushEntry, reason: str) -> None:
        # Caller holds the condition.
        if self._entries.get(entry.transfer_id) is entry:
            del self._entries[entry.transfer_id]
            self._used -= entry.nbytes
        entry.state = PushState.GONE
        entry.error = entry.error or reason
        self._close(entry.transfer_id, reason)
        self._cond.notify_all()

    def _close(self, transfer_id: str, reason: str) -> None:
        self._closed[transfer_id] = reason
        self._closed.move_to_end(transfer_id)
        while len(self._closed) > _TOMBSTONE_LIMIT:
            self._closed.popitem(last=False)
        self._cond.notify_all()


def copy_pushed(
    entry: PushEntry,
    cache: KvCacheView,
    remote_block_indices: Sequence[int] | None,
    local_block_ids: Sequence[int],
) -> int:
    """Writes the pushed blocks at `remote_block_indices` (None = all, in order) into
    `local_block_ids` of every layer. Returns bytes copied. Raises TransferError on a length
    mismatch or bad block ids."""
    everything = range(entry.num_blocks)
    indices = list(everything if remote_block_indices is None else remote_block_indices)
    if len(indices) != len(local_block_ids) or any(not 0 <= i < entry.num_blocks for i in indices):
        raise TransferError(
            f"transfer {entry.transfer_id}: {len(local_block_ids)} local blocks for positions "
            f"{indices[:8]} of a {entry.num_blocks}-block push",
            grpc.StatusCode.INVALID_ARGUMENT,
        )
    try:
        cache.check_block_ids(local_block_ids)
        total = 0
        whole = indices == list(everything)
        for layer, lc in enumerate(cache.layers):
            data = (
                torch.frombuffer(entry.layers[layer], dtype=torch.uint8)
                .view(lc.tensor.dtype)
                .reshape(entry.num_blocks, *lc.block_shape)
            )
            if not whole:
                data = data[indices]
            cache.write_blocks(layer, local_block_ids, data)
            total += len(indices) * lc.block_nbytes
    except ValueError as exc:
        raise TransferError(str(exc), grpc.StatusCode.INVALID_ARGUMENT) from None
    return total
