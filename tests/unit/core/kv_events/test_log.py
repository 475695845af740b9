"""KvEventLog, SubscriptionCursor and KvStreamReader without gRPC."""

from __future__ import annotations

import pytest

from pdplane.core.kv_events.log import (
    KvEventLog,
    SubscriptionCursor,
    canonical_extra_keys,
    engine_hash,
)
from pdplane.scheduler.kv_index.stream import KvStreamReader, StreamGap
from pdplane.v1 import kv_events_pb2
from tests.support.kv_replica import Replica, log_state

BS = 4


def _store(log: KvEventLog, hashes: list[int], parent: int | None = None, base: int = 0) -> int:
    toks = [base + i for i in range(len(hashes) * BS)]
    return log.stored(hashes, parent, toks, BS)


def _drain(cursor: SubscriptionCursor, reader: KvStreamReader) -> int:
    n = 0
    while (msg := cursor.next_message()) is not None:
        reader.feed(msg)
        n += 1
    return n


def test_sequences_are_monotonic_and_cached_set_follows_events() -> None:
    log = KvEventLog()
    assert log.head == 0
    assert _store(log, [1, 2, 3]) == 1
    assert log.removed([2]) == 2
    assert log.num_blocks == 2
    assert log.cleared() == 3
    assert log.num_blocks == 0
    assert log.head == 3


def test_parent_links_within_one_event() -> None:
    log = KvEventLog()
    _store(log, [10, 11], parent=9)
    state = log_state(log)
    assert state[("GPU", 10)][0] == 9
    assert state[("GPU", 11)] == (10, (4, 5, 6, 7))


def test_media_are_separate() -> None:
    log = KvEventLog()
    log.stored([1], None, [0] * BS, BS)
    log.stored([1], None, [0] * BS, BS, medium="CPU")
    log.removed([1], medium="CPU")
    assert set(log_state(log)) == {("GPU", 1)}


def test_bad_stored_input_is_refused() -> None:
    log = KvEventLog()
    with pytest.raises(ValueError):
        log.stored([1, 2], None, [0] * BS, BS)  # too few tokens
    with pytest.raises(ValueError):
        log.stored([1], None, [-1] * BS, BS)
    with pytest.raises(ValueError):
        log.stored([1], None, [0] * BS, BS, extra_keys=["a", "b"])
    assert log.head == 0


def test_engine_hash_forms() -> None:
    assert engine_hash(-1) == 2**64 - 1
    assert engine_hash(b"\x00" * 24 + (5).to_bytes(8, "big")) == 5
    assert canonical_extra_keys(None) == ""
    assert canonical_extra_keys(("salt", 3, b"\x01")) == '["salt",3,"01"]'


def test_new_subscriber_gets_snapshot_then_live_events() -> None:
    log = KvEventLog()
    _store(log, [1, 2])
    replica = Replica()
    reader = KvStreamReader(replica)
    cursor = SubscriptionCursor(log, 0, 0)
    _drain(cursor, reader)
    assert reader.synced and replica.snapshots == 1
    _store(log, [3], parent=2)
    log.removed([1])
    _drain(cursor, reader)
    assert replica.blocks == log_state(log)
    assert reader.next_sequence == log.head + 1
    assert replica.snapshots == 1 and replica.applied == 2


def test_resume_in_ring_replays_without_snapshot() -> None:
    log = KvEventLog()
    replica = Replica()
    reader = KvStreamReader(replica)
    _drain(SubscriptionCursor(log, 0, 0), reader)
    for i in range(5):
        _store(log, [100 + i])
    req = reader.request()
    _drain(SubscriptionCursor(log, req.epoch, req.from_sequence), reader)
    assert replica.snapshots == 1  # resumed: no second snapshot
    assert replica.blocks == log_state(log)


@pytest.mark.parametrize("case", ["too_old", "future", "other_epoch"])
def test_unreplayable_position_gets_a_snapshot(case: str) -> None:
    log = KvEventLog(replay_events=4)
    for i in range(10):
        _store(log, [i])
    epoch, seq = {
        "too_old": (log.epoch, 2),
        "future": (log.epoch, 99),
        "other_epoch": (log.epoch + 1, 5),
    }[case]
    cursor = SubscriptionCursor(log, epoch, seq)
    first = cursor.next_message()
    assert first is not None and first.WhichOneof("body") == "snapshot"
    assert first.sequence == log.head
    assert first.snapshot.total_blocks == 10


def test_subscriber_that_falls_out_of_the_ring_gets_a_new_snapshot() -> None:
    log = KvEventLog(replay_blocks=8)
    replica = Replica()
    reader = KvStreamReader(replica)
    cursor = SubscriptionCursor(log, 0, 0)
    _drain(cursor, reader)
    for i in range(20):  # 20 blocks > 8 kept: the cursor is behind the ring now
        _store(log, [1000 + i])
    _drain(cursor, reader)
    assert replica.snapshots == 2
    assert replica.blocks == log_state(log)
    assert reader.next_sequence == log.head + 1


def test_snapshot_chunks_are_bounded() -> None:
    log = KvEventLog()
    for i in range(50):
        _store(log, [i])
    cursor = SubscriptionCursor(log, 0, 0, chunk_tokens=10 * BS)
    chunks = []
    while (msg := cursor.next_message()) is not None:
        chunks.append(msg.snapshot)
    assert [c.index for c in chunks] == list(range(len(chunks)))
    assert all(len(c.blocks) <= 10 for c in chunks)
    assert chunks[-1].last and not any(c.last for c in chunks[:-1])
    assert sum(len(c.blocks) for c in chunks) == 50


def test_batches_are_bounded() -> None:
    log = KvEventLog()
    cursor = SubscriptionCursor(log, 0, 0, batch_events=3)
    assert cursor.next_message() is not None  # empty snapshot
    for i in range(7):
        _store(log, [i])
    sizes = []
    while (msg := cursor.next_message()) is not None:
        sizes.append(len(msg.events.events))
    assert sizes == [3, 3, 1]


def test_reader_detects_gaps() -> None:
    log = KvEventLog()
    reader = KvStreamReader(Replica())
    _drain(SubscriptionCursor(log, 0, 0), reader)
    _store(log, [1])
    _store(log, [2])
    skipped = kv_events_pb2.KvEventsMessage(
        epoch=log.epoch,
        sequence=2,
        head_sequence=2,
        events=kv_events_pb2.KvEventBatch(events=[log.read(2, 1)[0]]),  # type: ignore[index]
    )
    with pytest.raises(StreamGap):
        reader.feed(skipped)
    assert not reader.synced
    assert reader.request().from_sequence == 0  # asks for a snapshot


def test_reader_refuses_events_before_a_snapshot_and_other_epochs() -> None:
    log = KvEventLog()
    _store(log, [1])
    reader = KvStreamReader(Replica())
    events = kv_events_pb2.KvEventsMessage(
        epoch=log.epoch, sequence=1, events=kv_events_pb2.KvEventBatch(events=log.read(1, 1))
    )
    with pytest.raises(StreamGap):
        reader.feed(events)
    _drain(SubscriptionCursor(log, 0, 0), reader)
    hb = kv_events_pb2.KvEventsMessage(epoch=log.epoch + 1, heartbeat=kv_events_pb2.KvHeartbeat())
    with pytest.raises(StreamGap):
        reader.feed(hb)


def test_lag_counts_events_not_yet_applied() -> None:
    log = KvEventLog()
    reader = KvStreamReader(Replica())
    cursor = SubscriptionCursor(log, 0, 0, batch_events=1)
    _drain(cursor, reader)
    for i in range(5):
        _store(log, [i])
    msg = cursor.next_message()
    assert msg is not None
    reader.feed(msg)
    assert reader.lag == 4
