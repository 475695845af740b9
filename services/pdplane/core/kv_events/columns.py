"""The columnar form of a batch's single-block stores (`KvEventBatch.stored_columns`).

A decode-time KV cache block is one single-block `BlockStored` event; as a plain `KvEvent` a
subscriber pays ~0.8 us of protobuf field reads for it before any table update. In
`BlockStoredColumns` (protos/pdplane/v1/kv_events.proto) the common ones travel as
little-endian arrays that a subscriber reads in one copy each.

* `ColumnStore`: what the source keeps of one such event (`KvEventLog` builds it when the
  event is logged, from the values it already has, so that encoding reads no protobuf).
* `encode_batch`: a batch of logged events as one `KvEventBatch`, columnar where it may be.
* `batch_span`: the batch's first sequence and event count, checking they are consecutive.
* `expand_batch`: the batch as plain `KvEvent`s in sequence order (the reference meaning:
  every columnar reader must reach the state that applying these one by one reaches).

Standard library only (the connector runs it inside vLLM's process).
"""

from __future__ import annotations

import operator
import sys
from array import array
from bisect import bisect_left
from collections.abc import Sequence
from itertools import islice
from typing import NamedTuple

from pdplane.v1 import kv_events_pb2

__all__ = ["ColumnStore", "batch_span", "column_arrays", "encode_batch", "expand_batch"]

_SWAP = sys.byteorder != "little"  # the wire layout is little-endian


class ColumnStore(NamedTuple):
    """One single-block store of the common form (see `BlockStoredColumns`)."""

    block_hash: int  # engine hash
    parent: int  # engine hash of the parent block
    own: int  # our own hash (`HASH_VERSION` of the log)
    tokens: bytes  # block_size x uint32, native byte order
    block_size: int
    medium: str
    hash_version: int


def _u64(values: array[int]) -> bytes:
    if _SWAP:
        values.byteswap()
    return values.tobytes()


def encode_batch(
    entries: Sequence[tuple[kv_events_pb2.KvEvent, ColumnStore | None]], columnar: bool
) -> kv_events_pb2.KvEventBatch:
    """`entries` (consecutive logged events, each with its `ColumnStore` or None) as one batch.

    With `columnar`, the stores that have a `ColumnStore` of the first one's block size,
    medium and hash version go to `stored_columns`, the rest stay plain events; without, all
    are plain (the form every subscriber reads). Cost: one tuple read per columnar event."""
    if not columnar:
        return kv_events_pb2.KvEventBatch(events=[e for e, _ in entries])
    first = next((c for _, c in entries if c is not None), None)
    if first is None:
        return kv_events_pb2.KvEventBatch(events=[e for e, _ in entries])
    plain: list[kv_events_pb2.KvEvent] = []
    seqs, hashes, parents, owns = array("Q"), array("Q"), array("Q"), array("Q")
    tokens: list[bytes] = []
    key = (first.block_size, first.medium, first.hash_version)
    for event, col in entries:
        if col is None or (col.block_size, col.medium, col.hash_version) != key:
            plain.append(event)
            continue
        seqs.append(event.sequence)
        hashes.append(col.block_hash)
        parents.append(col.parent)
        owns.append(col.own)
        tokens.append(col.tokens)
    tok = b"".join(tokens)
    if _SWAP:
        arr = array("I")
        arr.frombytes(tok)
        arr.byteswap()
        tok = arr.tobytes()
    return kv_events_pb2.KvEventBatch(
        events=plain,
        stored_columns=kv_events_pb2.BlockStoredColumns(
            count=len(seqs),
            sequences=_u64(seqs),
            block_hashes=_u64(hashes),
            parent_block_hashes=_u64(parents),
            own_hashes=_u64(owns),
            token_ids=tok,
            block_size=first.block_size,
            medium=first.medium,
            hash_version=first.hash_version,
        ),
    )


def column_arrays(
    cols: kv_events_pb2.BlockStoredColumns,
) -> tuple[array[int], array[int], array[int], array[int], array[int]]:
    """(sequences, engine hashes, parent hashes, own hashes, token ids) of `cols` as native
    arrays ("Q", "Q", "Q", "Q", "I"). Raises ValueError if a column's length is not what
    `count` and `block_size` say."""
    n = cols.count
    out = []
    for raw, code, want in (
        (cols.sequences, "Q", n),
        (cols.block_hashes, "Q", n),
        (cols.parent_block_hashes, "Q", n),
        (cols.own_hashes, "Q", n),
        (cols.token_ids, "I", n * cols.block_size),
    ):
        arr = array(code)
        if len(raw) != want * arr.itemsize:
            raise ValueError(f"a column of {len(raw)} bytes for {n} entries")
        arr.frombytes(raw)
        if _SWAP:
            arr.byteswap()
        out.append(arr)
    return out[0], out[1], out[2], out[3], out[4]


def batch_span(batch: kv_events_pb2.KvEventBatch, sequences: Sequence[int] = ()) -> tuple[int, int]:
    """(first sequence, events) of `batch`, whose `events` and column `sequences` (the
    decoded `stored_columns.sequences`; empty = none) must each be strictly ascending and
    together consecutive. (0, 0) for an empty batch. Raises ValueError otherwise.

    Cost: C-level comparisons over the columns, a binary search per plain event."""
    plain = [e.sequence for e in batch.events]
    n = len(plain) + len(sequences)
    if not n:
        return 0, 0
    if not sequences:
        first = plain[0]
        if plain != list(range(first, first + n)):
            bad = next(i for i, s in enumerate(plain) if s != first + i)
            raise ValueError(f"expected sequence {first + bad}, got {plain[bad]}")
        return first, n
    first = min(plain[0], sequences[0]) if plain else sequences[0]
    last = max(plain[-1], sequences[-1]) if plain else sequences[-1]
    # Two strictly ascending, disjoint parts of n values within [first, first + n - 1] are
    # exactly that range.
    ok = last - first == n - 1 and all(map(operator.lt, sequences, islice(sequences, 1, None)))
    ok = ok and all(map(operator.lt, plain, islice(plain, 1, None)))
    for s in plain if ok else ():
        i = bisect_left(sequences, s)
        if i < len(sequences) and sequences[i] == s:
            ok = False
            break
    if not ok:
        raise ValueError(f"sequences of the batch are not consecutive from {first}")
    return first, n


def expand_batch(batch: kv_events_pb2.KvEventBatch) -> list[kv_events_pb2.KvEvent]:
    """Every event of `batch` as a plain `KvEvent`, in sequence order. Raises ValueError on
    malformed columns (see `column_arrays`)."""
    if not batch.HasField("stored_columns") or not batch.stored_columns.count:
        return list(batch.events)
    cols = batch.stored_columns
    seqs, hashes, parents, owns, tokens = column_arrays(cols)
    bs = cols.block_size
    out = list(batch.events)
    for i, seq in enumerate(seqs):
        stored = kv_events_pb2.BlockStored(
            block_hashes=[hashes[i]],
            parent_block_hash=parents[i],
            token_ids=tokens[i * bs : (i + 1) * bs],
            block_size=bs,
            medium=cols.medium,
            own_hashes=[owns[i]],
            hash_version=cols.hash_version,
        )
        out.append(kv_events_pb2.KvEvent(sequence=seq, stored=stored))
    out.sort(key=lambda e: e.sequence)
    return out
