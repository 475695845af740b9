"""`KvEventLog`: one engine's KV cache events, sequenced, with a snapshot of what is cached.

The connector (fed by vLLM's own events) and the simulator (fed by its prefix cache) call
exactly three methods as their cache changes: `stored`, `removed`, `cleared`. The log

* assigns every event the next number of a monotonic sequence (1, 2, ...; `epoch` names the
  log, so a restarted engine is never mistaken for the old one),
* keeps the engine's current cached block set (engine hash + medium -> parent, tokens, LoRA),
  from which a snapshot is built for a subscriber that cannot be replayed,
* keeps a bounded ring of recent events (by events and by blocks) for subscribers that resume,
* computes pdplane's own chained hashes of the stored blocks (`pdplane.core.prefix_hash`) and
  sends them with the events and snapshots (`BlockStored.own_hashes`), so that every
  subscriber only updates tables instead of hashing every instance's tokens itself: the
  hashing cost is spread over the engines (about 1 us per 16-token block on the engine's
  event thread) instead of concentrated in each scheduler.

`SubscriptionCursor` turns the log into the message sequence of `KvEvents.Subscribe`
(protos/pdplane/v1/kv_events.proto): snapshot chunks when needed, then batches of events, and
a new snapshot whenever the subscriber fell out of the ring. The gRPC servicers that serve it
are in `pdplane.core.kv_events.servicer`.

Light: imports only the standard library and the generated protobuf code (no grpc), so the
connector inside vLLM and the simulator can both use it. Thread-safe: writers and readers may
be on different threads.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
from array import array
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pdplane.core.kv_events.columns import ColumnStore, encode_batch
from pdplane.core.prefix_hash import HASH_VERSION, block_hashes
from pdplane.v1 import kv_events_pb2

__all__ = [
    "DEFAULT_MEDIUM",
    "KvEventLog",
    "SubscriptionCursor",
    "canonical_extra_keys",
    "engine_hash",
]

log = logging.getLogger(__name__)

#: vLLM's name for the engine's own device KV cache (what a `None` medium means).
DEFAULT_MEDIUM = "GPU"
_U64 = (1 << 64) - 1


def engine_hash(value: int | bytes) -> int:
    """An engine block hash as an unsigned 64-bit int: ints are taken modulo 2**64 (older vLLM
    published signed Python hashes), bytes (vLLM's sha256 form) by their last 8 bytes read
    big-endian, as vLLM's own `maybe_convert_block_hash` does."""
    if isinstance(value, bytes | bytearray):
        return int.from_bytes(bytes(value[-8:]), "big")
    return int(value) & _U64


def canonical_extra_keys(keys: Any) -> str:
    """Canonical JSON text of one block's extra keys (a vLLM tuple, possibly nested); "" for
    none. Bytes become hex strings; anything else unknown becomes its str()."""
    if not keys:
        return ""

    def plain(x: Any) -> Any:
        if isinstance(x, bytes | bytearray):
            return bytes(x).hex()
        if isinstance(x, list | tuple):
            return [plain(v) for v in x]
        if x is None or isinstance(x, bool | int | float | str):
            return x
        return str(x)

    return json.dumps(plain(keys), separators=(",", ":"), ensure_ascii=False)


@dataclass(frozen=True, slots=True)
class _Block:
    parent: int | None
    tokens: bytes  # uint32 native-endian (array "I")
    block_size: int
    lora_id: int | None
    lora_name: str
    extra_key: str
    own: int | None  # our own chained hash (None: the parent's was unknown)


class KvEventLog:
    """The sequenced KV cache event log of one engine.

    Args:
        replay_events: most events kept for resuming subscribers.
        replay_blocks: most blocks (summed over the kept events) kept for resuming subscribers;
            bounds the ring's memory (about 4 * block_size bytes of token ids per block).
        epoch: the log's identity; default a random 63-bit number.
        own_hashes: compute and send our own block hashes (`BlockStored.own_hashes`);
            False leaves them to the subscribers.
    """

    def __init__(
        self,
        *,
        replay_events: int = 16_384,
        replay_blocks: int = 65_536,
        epoch: int | None = None,
        own_hashes: bool = True,
    ) -> None:
        if replay_events <= 0 or replay_blocks <= 0:
            raise ValueError("replay_events and replay_blocks must be > 0")
        self.epoch = epoch if epoch is not None else (secrets.randbits(63) or 1)
        self._replay_events = replay_events
        self._replay_blocks = replay_blocks
        self._own_hashes = own_hashes
        self._lock = threading.Lock()
        self._head = 0  # last assigned sequence
        # (event, blocks, its columnar form if it has one: kv_columns.encode_batch)
        self._ring: deque[tuple[kv_events_pb2.KvEvent, int, ColumnStore | None]] = deque()
        self._ring_blocks = 0
        self._blocks: dict[tuple[str, int], _Block] = {}
        self._listeners: dict[int, Callable[[], None]] = {}
        self._next_listener = 0
        self.closed = False

    # -- writers -------------------------------------------------------------------------------

    def stored(
        self,
        block_hashes: Sequence[int | bytes],
        parent_hash: int | bytes | None,
        token_ids: Sequence[int],
        block_size: int,
        *,
        medium: str | None = None,
        lora_id: int | None = None,
        lora_name: str | None = None,
        extra_keys: Sequence[str | None] | None = None,
    ) -> int:
        """The engine cached these full blocks (vLLM `BlockStored`). Returns the sequence.

        Args:
            block_hashes: engine hashes of the blocks, in token order (ints or vLLM's bytes).
            parent_hash: engine hash of the block before the first one; None = sequence start.
            token_ids: `block_size * len(block_hashes)` token ids (each in [0, 2**32)).
            block_size: tokens per block (> 0).
            medium: where they are cached; None = `DEFAULT_MEDIUM`.
            lora_id / lora_name: the LoRA adapter the blocks were computed with, if any.
            extra_keys: none, or per block the canonical text (`canonical_extra_keys`) of the
                extra keys the engine mixed into that block's hash.

        Raises:
            ValueError: wrong token count, bad block size, extra keys not one per block, or
                token ids outside uint32.
        """
        n = len(block_hashes)
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        if len(token_ids) != n * block_size:
            raise ValueError(f"{len(token_ids)} token ids for {n} blocks of {block_size}")
        extras = [e or "" for e in extra_keys] if extra_keys else []
        if extras and len(extras) != n:
            raise ValueError(f"{len(extras)} extra keys for {n} blocks")
        try:
            tokens = array("I", token_ids)
        except (OverflowError, TypeError) as exc:
            raise ValueError(f"token ids must be integers in [0, 2**32): {exc}") from None
        hashes = [engine_hash(h) for h in block_hashes]
        parent = None if parent_hash is None else engine_hash(parent_hash)
        med = medium or DEFAULT_MEDIUM
        name = lora_name or ""
        own = self._own_of(tokens, block_size, parent, med, name, extras) if n else None
        msg = kv_events_pb2.BlockStored(
            block_hashes=hashes,
            token_ids=tokens,
            block_size=block_size,
            lora_name=name,
            extra_keys=extras,
            medium=med,
        )
        if parent is not None:
            msg.parent_block_hash = parent
        if lora_id is not None:
            msg.lora_id = lora_id
        if own is not None:
            msg.own_hashes.extend(own)
            msg.hash_version = HASH_VERSION
        raw = tokens.tobytes()
        step = block_size * tokens.itemsize
        col = None  # the common single-block store (kv_columns): one block, a parent, our
        # own hash, no LoRA, no extra keys
        common = parent is not None and own is not None and lora_id is None and not name
        if n == 1 and common and not extras:
            assert parent is not None and own is not None
            col = ColumnStore(hashes[0], parent, own[0], raw, block_size, med, HASH_VERSION)
        with self._lock:
            prev = parent
            for i, h in enumerate(hashes):
                self._blocks[(med, h)] = _Block(
                    prev,
                    raw[i * step : (i + 1) * step],
                    block_size,
                    lora_id,
                    name,
                    extras[i] if extras else "",
                    own[i] if own is not None else None,
                )
                prev = h
            seq = self._append_locked(kv_events_pb2.KvEvent(stored=msg), n, col)
        self._notify()
        return seq

    def _own_of(
        self,
        tokens: array[int],
        block_size: int,
        parent: int | None,
        medium: str,
        lora: str,
        extras: list[str],
    ) -> list[int] | None:
        """Our own hashes of a stored run, or None (off, or the parent is not cached here)."""
        if not self._own_hashes:
            return None
        parent_own: int | None = None
        if parent is not None:
            # A dict read is atomic (no lock needed): the entry is the parent's, old or new.
            # An offloaded block's parent may be on device.
            blk = self._blocks.get((medium, parent)) or self._blocks.get((DEFAULT_MEDIUM, parent))
            if blk is None or blk.own is None:
                return None
            parent_own = blk.own
        return block_hashes(
            tokens, block_size, parent=parent_own, lora=lora, extra_keys=extras or None
        )

    def removed(self, block_hashes: Sequence[int | bytes], *, medium: str | None = None) -> int:
        """These blocks left the cache on `medium` (vLLM `BlockRemoved`). Returns the sequence.
        Unknown hashes are passed on unchanged (a subscriber ignores them)."""
        hashes = [engine_hash(h) for h in block_hashes]
        med = medium or DEFAULT_MEDIUM
        msg = kv_events_pb2.BlockRemoved(block_hashes=hashes, medium=med)
        with self._lock:
            for h in hashes:
                self._blocks.pop((med, h), None)
            seq = self._append_locked(kv_events_pb2.KvEvent(removed=msg), len(hashes))
        self._notify()
        return seq

    def cleared(self) -> int:
        """The engine dropped its whole prefix cache (vLLM `AllBlocksCleared`). Returns the
        sequence."""
        with self._lock:
            self._blocks.clear()
            seq = self._append_locked(
                kv_events_pb2.KvEvent(cleared=kv_events_pb2.AllBlocksCleared()), 1
            )
        self._notify()
        return seq

    def close(self) -> None:
        """The engine is going away: open streams end (UNAVAILABLE) and no new ones start."""
        self.closed = True
        self._notify()

    def _append_locked(
        self, event: kv_events_pb2.KvEvent, blocks: int, col: ColumnStore | None = None
    ) -> int:
        self._head += 1
        event.sequence = self._head
        self._ring.append((event, blocks, col))
        self._ring_blocks += blocks
        while self._ring and (
            len(self._ring) > self._replay_events or self._ring_blocks > self._replay_blocks
        ):
            _, dropped, _ = self._ring.popleft()
            self._ring_blocks -= dropped
        return self._head

    # -- readers -------------------------------------------------------------------------------

    @property
    def head(self) -> int:
        """The last sequence assigned (0 before the first event)."""
        return self._head

    @property
    def num_blocks(self) -> int:
        """Blocks cached now (over all media)."""
        return len(self._blocks)

    def read(self, from_sequence: int, max_events: int) -> list[kv_events_pb2.KvEvent] | None:
        """Up to `max_events` events from `from_sequence` on (the ring's own objects: do not
        mutate); [] when there are none yet; None when the log cannot replay from there (fell
        out of the ring, or a sequence the log never assigned): the caller needs a snapshot."""
        entries = self.read_entries(from_sequence, max_events)
        return None if entries is None else [e for e, _ in entries]

    def read_entries(
        self, from_sequence: int, max_events: int
    ) -> list[tuple[kv_events_pb2.KvEvent, ColumnStore | None]] | None:
        """`read`, each event with its columnar form (`kv_columns.ColumnStore`) or None."""
        with self._lock:
            head = self._head
            if from_sequence > head + 1 or from_sequence <= 0:
                return None
            if from_sequence == head + 1:
                return []
            oldest = self._ring[0][0].sequence if self._ring else head + 1
            if from_sequence < oldest:
                return None
            start = from_sequence - oldest
            ring = self._ring
            return [
                (ring[i][0], ring[i][2]) for i in range(start, min(start + max_events, len(ring)))
            ]

    def snapshot(self) -> tuple[int, list[tuple[str, int, _Block]]]:
        """(sequence, cached blocks as (medium, engine hash, block)) taken atomically."""
        with self._lock:
            return self._head, [(m, h, b) for (m, h), b in self._blocks.items()]

    def add_listener(self, callback: Callable[[], None]) -> int:
        """Calls `callback()` (from the writer's thread, without the lock) after every event
        and on close; returns a handle for `remove_listener`. Keep it short and non-blocking."""
        with self._lock:
            self._next_listener += 1
            self._listeners[self._next_listener] = callback
            return self._next_listener

    def remove_listener(self, handle: int) -> None:
        with self._lock:
            self._listeners.pop(handle, None)

    def _notify(self) -> None:
        with self._lock:
            callbacks = list(self._listeners.values())
        for cb in callbacks:
            try:
                cb()
            except Exception:  # a listener of a closed loop must not break the writer
                log.debug("KV event listener failed", exc_info=True)


def _block_message(medium: str, h: int, b: _Block) -> kv_events_pb2.BlockStored:
    tokens = array("I")
    tokens.frombytes(b.tokens)
    msg = kv_events_pb2.BlockStored(
        block_hashes=[h],
        token_ids=tokens,
        block_size=b.block_size,
        lora_name=b.lora_name,
        extra_keys=[b.extra_key] if b.extra_key else [],
        medium=medium,
    )
    if b.parent is not None:
        msg.parent_block_hash = b.parent
    if b.lora_id is not None:
        msg.lora_id = b.lora_id
    if b.own is not None:
        msg.own_hashes.append(b.own)
        msg.hash_version = HASH_VERSION
    return msg


def _snapshot_messages(
    epoch: int, sequence: int, blocks: list[tuple[str, int, _Block]], chunk_tokens: int
) -> Iterator[kv_events_pb2.KvEventsMessage]:
    total = len(blocks)
    index = 0
    chunk: list[kv_events_pb2.BlockStored] = []
    tokens = 0
    for medium, h, b in blocks:
        chunk.append(_block_message(medium, h, b))
        tokens += b.block_size
        if tokens >= chunk_tokens:
            yield _chunk_message(epoch, sequence, index, False, total, chunk)
            index += 1
            chunk, tokens = [], 0
    yield _chunk_message(epoch, sequence, index, True, total, chunk)


def _chunk_message(
    epoch: int,
    sequence: int,
    index: int,
    last: bool,
    total: int,
    blocks: Iterable[kv_events_pb2.BlockStored],
) -> kv_events_pb2.KvEventsMessage:
    return kv_events_pb2.KvEventsMessage(
        epoch=epoch,
        sequence=sequence,
        head_sequence=sequence,
        snapshot=kv_events_pb2.KvSnapshotChunk(
            index=index, last=last, total_blocks=total, blocks=blocks
        ),
    )


class SubscriptionCursor:
    """The message sequence of one `Subscribe` stream over a `KvEventLog` (no I/O, no waits).

    `next_message()` returns the next message that is ready, or None when the subscriber is
    up to date. A subscriber that resumes (same epoch, a sequence still in the ring) gets the
    events from there; any other gets a snapshot first; one that falls out of the ring while
    streaming gets a new snapshot.

    Args:
        log: the engine's log.
        epoch / from_sequence: what the subscriber asked for (`SubscribeKvEventsRequest`).
        batch_events: most events per message.
        columnar: the subscriber reads `KvEventBatch.stored_columns`
            (`SubscribeKvEventsRequest.columnar_stores`): the common single-block stores go
            there (`kv_columns.encode_batch`).
        chunk_tokens: a snapshot chunk is closed once it holds this many tokens (bounds the
            message size: about 3 bytes per token id plus per-block overhead).
    """

    def __init__(
        self,
        log: KvEventLog,
        epoch: int,
        from_sequence: int,
        *,
        batch_events: int = 256,
        chunk_tokens: int = 262_144,
        columnar: bool = False,
    ) -> None:
        self._log = log
        self._batch = batch_events
        self._columnar = columnar
        self._chunk_tokens = chunk_tokens
        self._next = from_sequence if epoch == log.epoch else 0
        self._snapshot: Iterator[kv_events_pb2.KvEventsMessage] | None = None
        self.snapshots = 0  # snapshots started on this stream

    def next_message(self) -> kv_events_pb2.KvEventsMessage | None:
        if self._snapshot is not None:
            msg = next(self._snapshot, None)
            if msg is not None:
                return msg
            self._snapshot = None
        entries = self._log.read_entries(self._next, self._batch) if self._next else None
        if entries is None:
            self._start_snapshot()
            return self.next_message()
        if not entries:
            return None
        last = entries[-1][0].sequence
        self._next = last + 1
        return kv_events_pb2.KvEventsMessage(
            epoch=self._log.epoch,
            sequence=last,
            head_sequence=self._log.head,
            events=encode_batch(entries, self._columnar),
        )

    @property
    def in_snapshot(self) -> bool:
        """True while a snapshot's chunks are being sent."""
        return self._snapshot is not None

    def heartbeat(self) -> kv_events_pb2.KvEventsMessage:
        """A heartbeat message (the subscriber's position and the log's head)."""
        return kv_events_pb2.KvEventsMessage(
            epoch=self._log.epoch,
            sequence=max(self._next - 1, 0),
            head_sequence=self._log.head,
            heartbeat=kv_events_pb2.KvHeartbeat(),
        )

    def _start_snapshot(self) -> None:
        sequence, blocks = self._log.snapshot()
        self.snapshots += 1
        self._next = sequence + 1
        self._snapshot = _snapshot_messages(self._log.epoch, sequence, blocks, self._chunk_tokens)
