"""The subscriber's half of `KvEvents.Subscribe`: position, snapshot assembly, gap checks.

`KvStreamReader` consumes one stream's messages in order and drives a `KvEventSink` (the
scheduler's prefix index for one instance, or a test's replica). It remembers where to resume
(`request()`), assembles a snapshot's chunks into one begin/blocks.../end sequence, and raises
`StreamGap` on anything that would make the sink's state inexact (a missing sequence, a new
epoch without a snapshot, chunks out of order). After a `StreamGap` the caller reconnects: the
next `request()` asks for a snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pdplane.core.kv_events.columns import batch_span, column_arrays
from pdplane.v1 import kv_events_pb2

__all__ = ["KvEventSink", "KvStreamReader", "StreamGap"]


class StreamGap(Exception):
    """The stream broke its contract; the sink's state for this engine is not exact."""


class KvEventSink(Protocol):
    """What a subscriber does with one engine's stream."""

    def begin_snapshot(self, epoch: int, sequence: int, total_blocks: int) -> None:
        """A snapshot as of `sequence` starts: collect blocks, keep serving the old state."""

    def snapshot_blocks(self, blocks: Sequence[kv_events_pb2.BlockStored]) -> None:
        """Part of the snapshot: one single-block BlockStored per cached block."""

    def end_snapshot(self) -> None:
        """The snapshot is whole: replace the engine's state with it."""

    def apply(self, event: kv_events_pb2.KvEvent) -> None:
        """A live event, in sequence order, after the state it applies to."""

    def apply_events(self, events: Sequence[kv_events_pb2.KvEvent]) -> None:
        """Consecutive live events (one `KvEventBatch`), in sequence order: the same state as
        `apply` of each in turn."""

    def apply_batch(self, batch: kv_events_pb2.KvEventBatch) -> None:
        """A `KvEventBatch` with `stored_columns` (its sequences checked): the same state as
        `apply_events(kv_columns.expand_batch(batch))`."""


class KvStreamReader:
    """Applies one engine's Subscribe messages to `sink`, checking continuity.

    Attributes:
        epoch: the epoch the sink's state belongs to (0 = none yet).
        next_sequence: the next sequence the sink needs (0 = a snapshot is needed).
        synced: a snapshot was applied and every event since (the state is exact as of
            `next_sequence - 1`).
        head_sequence: the engine's latest sequence, as of the last message.
    """

    def __init__(self, sink: KvEventSink) -> None:
        self.sink = sink
        self.epoch = 0
        self.next_sequence = 0
        self.synced = False
        self.head_sequence = 0
        self.snapshots = 0
        self._snap_index = -1  # next chunk index expected; -1 = no snapshot in progress
        self._snap_sequence = 0

    @property
    def lag(self) -> int:
        """Events the engine had assigned that this state does not include yet."""
        return max(self.head_sequence - max(self.next_sequence - 1, 0), 0)

    def request(
        self, subscriber: str = "", min_interval_ms: int = 0
    ) -> kv_events_pb2.SubscribeKvEventsRequest:
        """The request that resumes this state (or asks for a snapshot); `min_interval_ms`:
        at most one events message per this many ms (the server batches; 0 = unbatched).
        It asks for columnar stores (the sink's `apply_batch`)."""
        if not self.synced:
            return kv_events_pb2.SubscribeKvEventsRequest(
                subscriber=subscriber, min_interval_ms=min_interval_ms, columnar_stores=True
            )
        return kv_events_pb2.SubscribeKvEventsRequest(
            epoch=self.epoch,
            from_sequence=self.next_sequence,
            subscriber=subscriber,
            min_interval_ms=min_interval_ms,
            columnar_stores=True,
        )

    def reset(self) -> None:
        """Forget the position (after a StreamGap or a reconnect that must start over)."""
        self.synced = False
        self.next_sequence = 0
        self._snap_index = -1

    def feed(self, msg: kv_events_pb2.KvEventsMessage) -> None:
        """Applies one message. Raises StreamGap (after `reset()`) on a contract violation."""
        kind = msg.WhichOneof("body")
        self.head_sequence = msg.head_sequence
        if kind == "snapshot":
            self._feed_snapshot(msg)
        elif kind == "events":
            self._feed_events(msg)
        elif kind == "heartbeat":
            if self._snap_index >= 0 or (self.synced and msg.epoch != self.epoch):
                self._gap(f"heartbeat of epoch {msg.epoch} inside a snapshot or a new epoch")
        else:
            self._gap("empty message")

    def _feed_snapshot(self, msg: kv_events_pb2.KvEventsMessage) -> None:
        chunk = msg.snapshot
        if chunk.index == 0:
            self._snap_index = 0
            self._snap_sequence = msg.sequence
            self.epoch = msg.epoch
            self.synced = False
            self.sink.begin_snapshot(msg.epoch, msg.sequence, chunk.total_blocks)
        elif (
            chunk.index != self._snap_index
            or msg.epoch != self.epoch
            or msg.sequence != self._snap_sequence
        ):
            self._gap(f"snapshot chunk {chunk.index} out of order")
        self.sink.snapshot_blocks(chunk.blocks)
        self._snap_index += 1
        if chunk.last:
            self._snap_index = -1
            self.sink.end_snapshot()
            self.snapshots += 1
            self.synced = True
            self.next_sequence = msg.sequence + 1

    def _feed_events(self, msg: kv_events_pb2.KvEventsMessage) -> None:
        batch = msg.events
        events = batch.events
        if not self.synced or self._snap_index >= 0:
            self._gap("events before a snapshot")
        if msg.epoch != self.epoch:
            self._gap(f"events of epoch {msg.epoch}, state of epoch {self.epoch}")
        columnar = batch.HasField("stored_columns") and batch.stored_columns.count > 0
        try:
            sequences = column_arrays(batch.stored_columns)[0] if columnar else ()
            first, n = batch_span(batch, sequences)
        except ValueError as exc:
            self._gap(str(exc))
        if not n:
            return
        if first != self.next_sequence:
            self._gap(f"expected sequence {self.next_sequence}, got {first}")
        try:
            if columnar:
                self.sink.apply_batch(batch)
            else:
                self.sink.apply_events(events)
        except Exception:
            self.reset()  # applied in part: the state is not exact, ask for a snapshot
            raise
        self.next_sequence = first + n

    def _gap(self, why: str) -> None:
        self.reset()
        raise StreamGap(why)
