"""A test sink that rebuilds an engine's cached block set from a KvEvents stream."""

from __future__ import annotations

from collections.abc import Sequence

from pdplane.core.kv_events.columns import expand_batch
from pdplane.v1 import kv_events_pb2

Key = tuple[str, int]


class Replica:
    """`KvEventSink` keeping (medium, engine hash) -> (parent hash | None, token ids)."""

    def __init__(self) -> None:
        self.blocks: dict[Key, tuple[int | None, tuple[int, ...]]] = {}
        self._pending: dict[Key, tuple[int | None, tuple[int, ...]]] | None = None
        self.snapshots = 0
        self.applied = 0

    def begin_snapshot(self, epoch: int, sequence: int, total_blocks: int) -> None:
        self._pending = {}

    def snapshot_blocks(self, blocks: Sequence[kv_events_pb2.BlockStored]) -> None:
        assert self._pending is not None
        for b in blocks:
            self._store(self._pending, b)

    def end_snapshot(self) -> None:
        assert self._pending is not None
        self.blocks, self._pending = self._pending, None
        self.snapshots += 1

    def apply(self, event: kv_events_pb2.KvEvent) -> None:
        self.applied += 1
        kind = event.WhichOneof("event")
        if kind == "stored":
            self._store(self.blocks, event.stored)
        elif kind == "removed":
            for h in event.removed.block_hashes:
                self.blocks.pop((event.removed.medium, h), None)
        else:
            self.blocks.clear()

    def apply_events(self, events: Sequence[kv_events_pb2.KvEvent]) -> None:
        for event in events:
            self.apply(event)

    def apply_batch(self, batch: kv_events_pb2.KvEventBatch) -> None:
        self.apply_events(expand_batch(batch))

    @staticmethod
    def _store(
        into: dict[Key, tuple[int | None, tuple[int, ...]]], b: kv_events_pb2.BlockStored
    ) -> None:
        parent = b.parent_block_hash if b.HasField("parent_block_hash") else None
        bs = b.block_size
        for i, h in enumerate(b.block_hashes):
            into[(b.medium, h)] = (parent, tuple(b.token_ids[i * bs : (i + 1) * bs]))
            parent = h


def log_state(log) -> dict[Key, tuple[int | None, tuple[int, ...]]]:  # type: ignore[no-untyped-def]
    """The log's own cached set in the replica's form."""
    from array import array

    _, blocks = log.snapshot()
    out = {}
    for medium, h, b in blocks:
        toks = array("I")
        toks.frombytes(b.tokens)
        out[(medium, h)] = (b.parent, tuple(toks))
    return out
