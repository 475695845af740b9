"""HoldTable: each hold ends exactly once, never while a pull reads it, and always in time."""

from __future__ import annotations

import threading

import pytest

from pdplane.connector.holds import HoldTable, HoldUnknown


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_complete_reports_finished_sending_exactly_once() -> None:
    table = HoldTable()
    assert table.add("req-1", "t1", [4, 5], timeout_s=60)
    assert table.pop_finished() == set()
    assert table.release("t1", "completed")
    assert table.pop_finished() == {"req-1"}
    assert table.pop_finished() == set()
    assert not table.release("t1", "completed again")
    assert table.pop_finished() == set()
    assert len(table) == 0


def test_hold_times_out() -> None:
    clock = Clock()
    table = HoldTable(clock)
    table.add("req-1", "t1", [1], timeout_s=5)
    table.add("req-2", "t2", [2], timeout_s=10)
    clock.now += 5.01
    assert table.pop_finished() == {"req-1"}
    clock.now += 5
    assert table.pop_finished() == {"req-2"}
    with pytest.raises(HoldUnknown):
        table.pin("t1")


def test_end_during_a_read_is_reported_after_the_read() -> None:
    table = HoldTable()
    table.add("req-1", "t1", [1, 2], timeout_s=60)
    hold = table.pin("t1")
    assert hold.block_ids == (1, 2)
    assert table.release("t1", "aborted")
    assert table.pop_finished() == set()  # blocks still on the wire
    with pytest.raises(HoldUnknown):
        table.pin("t1")  # but no new read may start
    table.unpin(hold)
    assert table.pop_finished() == {"req-1"}


def test_same_request_or_transfer_is_never_held_twice() -> None:
    table = HoldTable()
    assert table.add("req-1", "t1", [1], 60)
    assert not table.add("req-1", "t2", [2], 60)
    assert not table.add("req-2", "t1", [3], 60)
    table.release("t1", "done")
    assert not table.add("req-1", "t3", [1], 60)  # reported once already
    assert table.pop_finished() == {"req-1"}


def test_release_that_overtakes_the_hold_frees_it_on_arrival() -> None:
    table = HoldTable()
    assert not table.release("t1", "aborted", tombstone_s=30)
    table.add("req-1", "t1", [1], 60)
    assert table.pop_finished() == {"req-1"}


def test_pin_and_release_wait_briefly_for_a_hold_to_arrive() -> None:
    table = HoldTable()
    threading.Timer(0.1, lambda: table.add("req-1", "t1", [7], 60)).start()
    hold = table.pin("t1", wait_s=5)
    assert hold.block_ids == (7,)
    table.unpin(hold)
    threading.Timer(0.1, lambda: table.add("req-2", "t2", [8], 60)).start()
    assert table.release("t2", "completed", wait_s=5)
    assert table.pop_finished() == {"req-2"}


def test_unknown_transfer_is_refused_after_the_wait() -> None:
    table = HoldTable()
    with pytest.raises(HoldUnknown):
        table.pin("nope", wait_s=0.05)


def test_tombstones_expire() -> None:
    clock = Clock()
    table = HoldTable(clock)
    assert not table.release("t1", "aborted", tombstone_s=30)
    clock.now += 31
    assert table.pop_finished() == set()  # expiry pass
    table.add("req-1", "t1", [1], 60)
    assert table.pop_finished() == set()  # the stale abort no longer applies
    assert len(table) == 1
