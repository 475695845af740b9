"""A `KvEventBatch` applied to one instance at once: runs of like events, one table update each.

Why: a single-block event costs ~3 us through `InstanceBlocks.apply` (protobuf field access
and one table call per event), and decode-time blocks and evictions are single-block events.
Merged, a run costs its field reads plus one kernel update for the whole run.

What is merged (order is kept exactly; only consecutive events of one kind are merged):

* consecutive `stored` events of one medium that carry our own hashes (`own_hashes` in our
  `HASH_VERSION`, one per block): one `HolderTable.store` of their concatenated engine and own
  hashes. With the own hashes given the parent chain plays no part in the update. The store is
  exact for a run unless a block moves to another own hash inside it or from before it (then
  the run is applied event by event; `kernels.store_conflicts`), or the memory bound would cut
  it (event by event too, so the same blocks are dropped);
* consecutive `removed` events of one medium: one `InstanceBlocks.removed` (a removal is a set
  difference: order inside the run does not matter).

`cleared` events and `stored` events without own hashes (the index hashes their token ids,
chained on their parent's own hash) end the run and take `InstanceBlocks`' own path.

`apply_batch` takes a batch whose common single-block stores came as columns
(`KvEventBatch.stored_columns`, `pdplane.core.kv_events.columns`): the columns are read as arrays in
one copy each, and every stretch of column entries between two plain events (in sequence
order) is one store run as above, without a protobuf read per event.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

import numpy as np

from pdplane.core.kv_events.columns import expand_batch
from pdplane.core.kv_events.log import DEFAULT_MEDIUM
from pdplane.core.prefix_hash import HASH_VERSION
from pdplane.scheduler.kv_index.holders import HolderTable
from pdplane.scheduler.kv_index.kernels import store_conflicts
from pdplane.scheduler.kv_index.u64map import U64Map
from pdplane.v1 import kv_events_pb2

__all__ = ["InstanceSink", "apply_batch", "apply_events"]

_NONE, _STORED, _REMOVED = 0, 1, 2


class _Bound(Protocol):
    """What of `PrefixIndex` a run's store reads and updates (its memory bound)."""

    max_blocks: int
    entries: int


class InstanceSink(Protocol):
    """What of `pdplane.scheduler.kv_index.index.InstanceBlocks` this module uses (a protocol,
    so that index.py can call into this module without the two importing each other)."""

    bit: int

    @property
    def index(self) -> _Bound: ...

    def stored(self, msg: kv_events_pb2.BlockStored) -> None: ...

    def stored_own(self, medium: str, engine_hashes: Sequence[int], own: Sequence[int]) -> None: ...

    def removed(self, engine_hashes: Sequence[int], medium: str = ...) -> None: ...

    def clear(self) -> None: ...

    def tables_of(self, medium: str) -> tuple[U64Map, HolderTable]: ...


def apply_events(inst: InstanceSink, events: Iterable[kv_events_pb2.KvEvent]) -> None:
    """Applies `events` (in sequence order) to `inst`: the same state as `inst.apply` of
    each event in turn (tests/unit/scheduler/test_kv_index_batch.py checks it)."""
    eng: list[int] = []  # the run's engine hashes
    own: list[int] = []  # the run's own hashes (stored runs)
    run: list[kv_events_pb2.BlockStored] = []  # the run's events (stored runs)
    run_kind = _NONE
    run_medium = ""
    # Bound methods and constants as locals: this loop runs once per event (~1 us budget).
    # One block is appended by index: `extend` of a protobuf repeated field costs ~4x that.
    eng_extend, own_extend, run_append = eng.extend, own.extend, run.append
    eng_append, own_append = eng.append, own.append
    version, default_medium = HASH_VERSION, DEFAULT_MEDIUM

    def flush() -> None:
        if run_kind == _STORED:
            _store_run(inst, run_medium, eng, own, run)
        elif run_kind == _REMOVED:
            inst.removed(eng, run_medium)
        eng.clear()
        own.clear()
        run.clear()

    for event in events:
        kind = event.WhichOneof("event")
        if kind == "stored":
            msg = event.stored
            given = msg.own_hashes
            n = len(given)
            if n and msg.hash_version == version:
                blocks = msg.block_hashes
                if n == len(blocks):
                    medium = msg.medium or default_medium
                    if run_kind != _STORED or medium != run_medium:
                        flush()
                        run_kind, run_medium = _STORED, medium
                    if n == 1:
                        eng_append(blocks[0])
                        own_append(given[0])
                    else:
                        eng_extend(blocks)
                        own_extend(given)
                    run_append(msg)
                    continue
            flush()
            run_kind = _NONE
            inst.stored(msg)
        elif kind == "removed":
            removed = event.removed
            medium = removed.medium or default_medium
            if run_kind != _REMOVED or medium != run_medium:
                flush()
                run_kind, run_medium = _REMOVED, medium
            hashes = removed.block_hashes
            if len(hashes) == 1:
                eng_append(hashes[0])
            else:
                eng_extend(hashes)
        elif kind == "cleared":
            flush()
            run_kind = _NONE
            inst.clear()
    flush()


def apply_batch(inst: InstanceSink, batch: kv_events_pb2.KvEventBatch) -> None:
    """Applies every event of `batch`, plain and columnar, in sequence order to `inst`: the
    same state as `apply_events(inst, kv_columns.expand_batch(batch))` (the hypothesis test
    in tests/unit/scheduler/test_kv_index_batch.py checks it). The batch's sequences must be
    valid (`kv_columns.batch_span`: the stream reader checks them). Raises ValueError on a
    column of the wrong length."""
    events = batch.events
    if not batch.HasField("stored_columns") or not batch.stored_columns.count:
        apply_events(inst, events)
        return
    cols = batch.stored_columns
    if cols.hash_version != HASH_VERSION:  # not our own hashes: the index hashes the tokens
        apply_events(inst, expand_batch(batch))
        return
    n = cols.count
    # Writable native copies (the tables' kernels take native uint64 arrays).
    seq, eng, own = (
        np.frombuffer(raw, "<u8").astype(np.uint64)
        for raw in (cols.sequences, cols.block_hashes, cols.own_hashes)
    )
    if not len(seq) == len(eng) == len(own) == n:
        raise ValueError(f"columns of {len(seq)}, {len(eng)}, {len(own)} entries for {n}")
    medium = cols.medium or DEFAULT_MEDIUM
    done = 0  # column entries applied
    if events:
        # cuts[i]: how many column entries come before events[i] in sequence order.
        cuts = np.searchsorted(seq, [e.sequence for e in events]).tolist()
        i = 0
        while i < len(events):
            cut = cuts[i]
            if cut > done:
                _store_columns(inst, medium, eng[done:cut], own[done:cut])
                done = cut
            j = i + 1
            while j < len(events) and cuts[j] == cut:
                j += 1
            apply_events(inst, events[i:j])
            i = j
    if done < n:
        _store_columns(inst, medium, eng[done:], own[done:])


def _store_merged(inst: InstanceSink, medium: str, eng: np.ndarray, own: np.ndarray) -> bool:
    """One table update for a run of single stores (uint64 arrays), if it is exact and within
    the memory bound; False = nothing done, apply the run event by event."""
    index = inst.index
    if len(own) <= 1 or len(own) > index.max_blocks - index.entries:
        return False
    mapping, table = inst.tables_of(medium)
    ekeys, evals, ebits = mapping.arrays
    if store_conflicts(ekeys, evals, ebits, eng, own):
        return False
    added = table.store(mapping, eng, own, inst.bit)
    assert added is not None, "keys 0 / 1 are conflicts"
    index.entries += added
    return True


def _store_columns(inst: InstanceSink, medium: str, eng: np.ndarray, own: np.ndarray) -> None:
    if not _store_merged(inst, medium, eng, own):
        for e, o in zip(eng.tolist(), own.tolist(), strict=True):
            inst.stored_own(medium, [e], [o])


def _store_run(
    inst: InstanceSink,
    medium: str,
    eng: list[int],
    own: list[int],
    run: list[kv_events_pb2.BlockStored],
) -> None:
    if len(run) > 1 and _store_merged(
        inst,
        medium,
        np.fromiter(eng, np.uint64, len(eng)),
        np.fromiter(own, np.uint64, len(own)),
    ):
        return
    for msg in run:  # one event, or a run that must go event by event
        inst.stored(msg)
