"""`InstanceBlocks.apply_events` (runs of like events merged into one table update) and
`apply_batch` (columnar stores, `KvEventBatch.stored_columns`) against `InstanceBlocks.apply`
of each event in turn: the same entries, holders and `match` results."""

from __future__ import annotations

from array import array
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pdplane.core.kv_events.columns import (
    ColumnStore,
    batch_span,
    column_arrays,
    encode_batch,
    expand_batch,
)
from pdplane.core.prefix_hash import HASH_VERSION
from pdplane.scheduler.kv_index import KvState, PrefixIndex
from pdplane.v1 import kv_events_pb2

_BS = 2
_MEDIA = ["GPU", "CPU"]

# Few engine / own hash values (repeats, blocks moving to another own hash, keys 0 and 1)
# mixed with full-width ones.
_hash = st.one_of(*[st.integers(2, 7)] * 8, st.integers(0, 1), st.integers(0, 2**64 - 1))


@st.composite
def _event(draw: st.DrawFn) -> kv_events_pb2.KvEvent:
    kind = draw(st.sampled_from(["stored"] * 8 + ["removed"] * 3 + ["cleared"]))
    medium = draw(st.sampled_from(["", "", "", "GPU", "CPU"]))  # "" is GPU
    if kind == "cleared":
        return kv_events_pb2.KvEvent(cleared=kv_events_pb2.AllBlocksCleared())
    n = draw(st.sampled_from([1, 1, 1, 2, 3, 5]))
    hashes = draw(st.lists(_hash, min_size=n, max_size=n))
    if kind == "removed":
        return kv_events_pb2.KvEvent(
            removed=kv_events_pb2.BlockRemoved(block_hashes=hashes, medium=medium)
        )
    msg = kv_events_pb2.BlockStored(
        block_hashes=hashes,
        token_ids=draw(st.lists(st.integers(0, 3), min_size=n * _BS, max_size=n * _BS)),
        block_size=_BS,
        medium=medium,
    )
    if draw(st.booleans()):
        msg.parent_block_hash = draw(_hash)
    own = draw(st.sampled_from(["given"] * 6 + ["none", "old version", "short"]))
    if own != "none":
        msg.own_hashes.extend(draw(st.lists(_hash, min_size=n, max_size=n)))
        msg.hash_version = HASH_VERSION + 1 if own == "old version" else HASH_VERSION
        if own == "short":
            del msg.own_hashes[-1]
    return kv_events_pb2.KvEvent(stored=msg)


def _state(index: PrefixIndex) -> dict[str, object]:
    """Everything the index keeps, in comparable form (holder set ids are internal)."""
    masks = index.holder_sets.masks
    tables = {}
    for medium, table in index.tables.items():
        keys, sids = table.ids.items()
        tables[medium] = {k: masks[s] for k, s in zip(keys.tolist(), sids.tolist(), strict=True)}
    insts = {}
    for inst in index.instances():
        blocks = {}
        for medium, mapping in inst.blocks.items():
            k, v = mapping.items()
            if len(k):
                blocks[medium] = dict(zip(k.tolist(), v.tolist(), strict=True))
        insts[inst.instance_id] = (blocks, inst.orphans, inst.dropped)
    return {
        "entries": index.entries,
        "tables": {m: t for m, t in tables.items() if t},
        "instances": insts,
        "holder_sets": len(index.holder_sets),
    }


def _new_index(max_blocks: int) -> PrefixIndex:
    index = PrefixIndex(max_blocks=max_blocks)
    for name in ("i0", "i1"):
        index.set_state(index.add_instance(name), KvState.LIVE)
    return index


def _batches(
    events: list[tuple[int, kv_events_pb2.KvEvent]], sizes: list[int]
) -> Iterator[tuple[int, list[kv_events_pb2.KvEvent], int]]:
    """(instance, events, batch number) of consecutive events of one instance, cut to the
    drawn sizes (cycled)."""
    i = k = 0
    while i < len(events):
        n = events[i][0]
        j = i
        while j < len(events) and j - i < sizes[k % len(sizes)] and events[j][0] == n:
            j += 1
        yield n, [e for _, e in events[i:j]], k
        i, k = j, k + 1


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([0] * 5 + [1]), _event()), min_size=20, max_size=80),
    st.lists(st.integers(1, 30), min_size=1, max_size=20),  # batch sizes, cycled
    st.sampled_from([10_000, 10_000, 10_000, 8]),  # max_blocks: none, or one events reach
)
def test_batched_apply_matches_one_by_one(
    events: list[tuple[int, kv_events_pb2.KvEvent]], sizes: list[int], max_blocks: int
) -> None:
    one_by_one = _new_index(max_blocks)
    batched = _new_index(max_blocks)
    for n, event in events:
        inst = one_by_one.instance(f"i{n}")
        assert inst is not None
        inst.apply(event)
    for n, part, _ in _batches(events, sizes):
        inst = batched.instance(f"i{n}")
        assert inst is not None
        inst.apply_events(part)
    assert _state(batched) == _state(one_by_one)
    prompts: list[list[int]] = []
    for _, event in events:
        if event.HasField("stored") and event.stored.own_hashes:
            prompts.append(list(event.stored.own_hashes))
            prompts.extend([h] for h in event.stored.own_hashes)
    for prompt in prompts:
        for medium in _MEDIA:
            assert batched.match(prompt, medium=medium) == one_by_one.match(prompt, medium=medium)


def _stored(engine: int, own: int) -> kv_events_pb2.KvEvent:
    return kv_events_pb2.KvEvent(
        stored=kv_events_pb2.BlockStored(
            block_hashes=[engine],
            token_ids=[0] * _BS,
            block_size=_BS,
            own_hashes=[own],
            hash_version=HASH_VERSION,
        )
    )


def test_a_block_moving_inside_a_run_goes_event_by_event() -> None:
    """Engine block 5 moves from own hash 20 to 21, then block 6 stores 20: one by one, 20
    keeps its holder (taken off, then put back); one merged store would take it off last."""
    for before, run in (
        ([_stored(5, 20)], [_stored(5, 21), _stored(6, 20)]),
        ([], [_stored(5, 20), _stored(5, 21), _stored(5, 20)]),
    ):
        one_by_one = _new_index(100)
        batched = _new_index(100)
        for event in before + run:
            one_by_one.instance("i0").apply(event)  # type: ignore[union-attr]
        batched.instance("i0").apply_events(before)  # type: ignore[union-attr]
        batched.instance("i0").apply_events(run)  # type: ignore[union-attr]
        assert _state(batched) == _state(one_by_one)
        assert batched.match([20]) == {"i0": 1}


def test_a_run_past_the_memory_bound_drops_what_one_by_one_drops() -> None:
    run = [_stored(10 + i, 30 + i) for i in range(5)] + [_stored(10, 30)]  # 10: stored again
    one_by_one = _new_index(3)
    batched = _new_index(3)
    for event in run:
        one_by_one.instance("i0").apply(event)  # type: ignore[union-attr]
    batched.instance("i0").apply_events(run)  # type: ignore[union-attr]
    assert _state(batched) == _state(one_by_one)
    assert batched.entries == 3 and batched.instance("i0").dropped == 3  # type: ignore[union-attr]


def test_a_run_of_single_block_stores_is_one_table_update() -> None:
    """Many single-block stored events with own hashes, then their removals: the tables end
    as after each event in turn (the fast path, not the fallback, is taken)."""
    index = _new_index(10_000)
    inst = index.instance("i0")
    assert inst is not None
    stored = [
        kv_events_pb2.KvEvent(
            stored=kv_events_pb2.BlockStored(
                block_hashes=[100 + i],
                token_ids=[0] * _BS,
                block_size=_BS,
                own_hashes=[1000 + i],
                hash_version=HASH_VERSION,
            )
        )
        for i in range(50)
    ]
    inst.apply_events(stored)
    assert index.entries == 50
    assert index.match([1000 + i for i in range(50)]) == {"i0": 50}
    mapping, _ = inst.tables_of("GPU")
    k, v = mapping.items()
    assert dict(zip(k.tolist(), v.tolist(), strict=True)) == {100 + i: 1000 + i for i in range(50)}
    removed = [
        kv_events_pb2.KvEvent(removed=kv_events_pb2.BlockRemoved(block_hashes=[100 + i]))
        for i in range(0, 50, 2)
    ]
    inst.apply_events(removed)
    assert index.entries == 25
    assert index.match([1001]) == {"i0": 1}
    assert index.match([1000]) == {}
    assert np.all(index.tables["GPU"].ids.items()[0] % 2 == 1)


def _column_store(event: kv_events_pb2.KvEvent) -> ColumnStore | None:
    """The columnar form of `event` if it has the common form (as `KvEventLog` builds it)."""
    if event.WhichOneof("event") != "stored":
        return None
    msg = event.stored
    if len(msg.block_hashes) != 1 or len(msg.own_hashes) != 1:
        return None
    if not msg.HasField("parent_block_hash") or msg.HasField("lora_id") or msg.extra_keys:
        return None
    return ColumnStore(
        msg.block_hashes[0],
        msg.parent_block_hash,
        msg.own_hashes[0],
        array("I", msg.token_ids).tobytes(),
        msg.block_size,
        msg.medium,
        msg.hash_version,
    )


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from([0] * 5 + [1]), _event()), min_size=20, max_size=80),
    st.lists(st.integers(1, 30), min_size=1, max_size=20),  # batch sizes, cycled
    st.sampled_from([10_000, 10_000, 10_000, 8]),  # max_blocks: none, or one events reach
    st.lists(st.booleans(), min_size=1, max_size=20),  # batches sent columnar, cycled
)
def test_columnar_batches_match_one_by_one(
    events: list[tuple[int, kv_events_pb2.KvEvent]],
    sizes: list[int],
    max_blocks: int,
    columnar: list[bool],
) -> None:
    """Batches as the source encodes them (`kv_columns.encode_batch`, columnar or not), through
    the wire (serialized, parsed) and `InstanceBlocks.apply_batch`: the state of `apply` of
    each event in turn."""
    one_by_one = _new_index(max_blocks)
    batched = _new_index(max_blocks)
    for seq, (n, event) in enumerate(events, 1):
        event.sequence = seq
        inst = one_by_one.instance(f"i{n}")
        assert inst is not None
        inst.apply(event)
    for n, part, k in _batches(events, sizes):
        batch = encode_batch([(e, _column_store(e)) for e in part], columnar[k % len(columnar)])
        wire = kv_events_pb2.KvEventBatch.FromString(batch.SerializeToString())
        assert [e.sequence for e in expand_batch(wire)] == [e.sequence for e in part]
        inst = batched.instance(f"i{n}")
        assert inst is not None
        inst.apply_batch(wire)
    assert _state(batched) == _state(one_by_one)
    for _, event in events:
        if event.HasField("stored") and event.stored.own_hashes:
            prompt = list(event.stored.own_hashes)
            for medium in _MEDIA:
                assert batched.match(prompt, medium=medium) == one_by_one.match(
                    prompt, medium=medium
                )


def test_a_columnar_batch_interleaved_with_removals() -> None:
    """Columnar stores with plain removals between them: each stretch of stores lands before
    the removal that follows it in sequence order (a removed block is gone, a stored-again
    one is back)."""
    events = [_stored(100 + i, 1000 + i) for i in range(10)]
    for e in events:
        e.stored.parent_block_hash = 7
    removal = kv_events_pb2.KvEvent(removed=kv_events_pb2.BlockRemoved(block_hashes=[103]))
    seq = [*events[:5], removal, *events[5:], _stored(103, 1003)]
    seq[-1].stored.parent_block_hash = 7
    for s, e in enumerate(seq, 1):
        e.sequence = s
    batch = encode_batch([(e, _column_store(e)) for e in seq], True)
    assert batch.stored_columns.count == 11 and len(batch.events) == 1
    assert batch_span(batch, column_arrays(batch.stored_columns)[0]) == (1, 12)
    index = _new_index(100)
    inst = index.instance("i0")
    assert inst is not None
    inst.apply_batch(batch)
    reference = _new_index(100)
    for e in seq:
        reference.instance("i0").apply(e)  # type: ignore[union-attr]
    assert _state(index) == _state(reference)
    assert index.entries == 10 and index.match([1003]) == {"i0": 1}


def test_batch_span_refuses_gaps_and_repeats() -> None:
    plain = kv_events_pb2.KvEvent(sequence=2, cleared=kv_events_pb2.AllBlocksCleared())
    batch = kv_events_pb2.KvEventBatch(events=[plain])
    assert batch_span(batch, array("Q", [1, 3])) == (1, 3)
    for cols in ([1, 4], [2, 3], [3, 1], [1, 1, 3]):
        with pytest.raises(ValueError):
            batch_span(batch, array("Q", cols))
