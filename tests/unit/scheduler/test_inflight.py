"""In-flight accounting: pending since the last report, release, replacement, expiry."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.inflight import InflightTracker


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def pair(make_candidate: Callable[..., Candidate]) -> tuple[Candidate, Candidate]:
    return make_candidate("p", "prefill", revision=5), make_candidate("d", "decode", revision=9)


def test_assignments_count_until_released(pair: tuple[Candidate, Candidate]) -> None:
    p, d = pair
    tracker = InflightTracker()
    tracker.add("r1", p, d, decode_blocks=3)
    tracker.add("r2", p, d, decode_blocks=2)
    assert (tracker.pending_requests(p), tracker.pending_requests(d)) == (2, 2)
    assert (tracker.pending_blocks(p), tracker.pending_blocks(d)) == (0, 5)
    assert tracker.inflight_by_instance() == {"p": 2, "d": 2}
    assert tracker.release("r1") is not None
    assert tracker.pending_requests(d) == 1 and tracker.pending_blocks(d) == 2
    assert tracker.release("r1") is None  # twice: harmless
    assert tracker.release("never-seen") is None
    tracker.release("r2")
    assert tracker.inflight_by_instance() == {} and len(tracker) == 0


def test_a_new_load_report_resets_pending_but_not_the_total(
    pair: tuple[Candidate, Candidate],
) -> None:
    p, d = pair
    tracker = InflightTracker()
    tracker.add("r1", p, d, decode_blocks=4)
    reported = dataclasses.replace(d, epoch=d.epoch + 1)  # next load report
    assert tracker.pending_requests(reported) == 0
    assert tracker.pending_blocks(reported) == 0
    tracker.add("r2", p, reported, decode_blocks=1)
    assert tracker.pending_requests(reported) == 1
    # Releasing a request counted in an older report leaves the new epoch's count alone.
    tracker.release("r1")
    assert tracker.pending_requests(reported) == 1
    assert tracker.inflight_by_instance() == {"p": 1, "d": 1}


def test_scheduling_an_id_again_replaces_its_assignment(
    pair: tuple[Candidate, Candidate], make_candidate: Callable[..., Candidate]
) -> None:
    p, d = pair
    d2 = make_candidate("d2", "decode", revision=3)
    tracker = InflightTracker()
    tracker.add("r1", p, d, decode_blocks=2)
    replaced = tracker.add("r1", p, d2, decode_blocks=2)
    assert replaced is not None and replaced.decode_id == "d"
    assert tracker.inflight_by_instance() == {"p": 1, "d2": 1}
    assert tracker.pending_blocks(d) == 0 and len(tracker) == 1


def test_unreleased_assignments_expire(pair: tuple[Candidate, Candidate]) -> None:
    p, d = pair
    clock = Clock()
    tracker = InflightTracker(timeout_s=10.0, clock=clock)
    tracker.add("old", p, d, decode_blocks=1)
    clock.now += 6
    tracker.add("young", p, d, decode_blocks=1)
    clock.now += 5
    assert [a.request_id for a in tracker.expire()] == ["old"]
    assert tracker.inflight_by_instance() == {"p": 1, "d": 1}
    clock.now += 10
    tracker.add("new", p, d, decode_blocks=1)  # adding also sweeps
    assert len(tracker) == 1 and tracker.release("young") is None


def test_timeout_must_be_positive() -> None:
    with pytest.raises(ValueError, match="> 0"):
        InflightTracker(timeout_s=0)
