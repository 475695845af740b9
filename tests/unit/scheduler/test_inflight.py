"""In-flight accounting: pending since the last report, release, replacement, expiry."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.compat import split_sides
from pdplane.scheduler.inflight import InflightTracker
from pdplane.scheduler.latency import LatencyModel
from pdplane.scheduler.table import ModelTables


def eligible_decodes(
    candidates: list[Candidate], tracker: InflightTracker, tokens: int, push_tokens: int | None
) -> list[Candidate]:
    """The decodes the filter lets through, their tables' in-flight columns read from
    `tracker` (its pending blocks for the KV room check, its assigned ones for the buffer)."""
    tables = ModelTables(candidates)
    tables.decode.write_all(tracker)
    _, decode = split_sides(tables, tokens=tokens, exclude=(), push_tokens=push_tokens)
    return [tables.decode.candidates[row] for row in decode.rows]


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


def test_requests_released_after_a_report_give_their_kv_blocks_back(
    pair: tuple[Candidate, Candidate],
) -> None:
    # The stack that lost requests: a 64-block decode (128 tokens a block), 544-token requests
    # (5 blocks), 8 at a time. A report taken while 8 ran says 24 blocks free; once the 8 end,
    # the guard must not keep turning the next requests down until the next report.
    p, d = pair
    tracker = InflightTracker()
    d0 = dataclasses.replace(d, block_size=128, total_kv_blocks=64, free_kv_blocks=64)
    for i in range(8):
        tracker.add(f"r{i}", p, d0, decode_blocks=5)
    busy = dataclasses.replace(d0, epoch=d0.epoch + 1, free_kv_blocks=24)  # next report
    assert tracker.pending_blocks(busy) == 0  # the 8 are inside it
    for i in range(4):
        tracker.add(f"n{i}", p, busy, decode_blocks=5)
    assert tracker.pending_blocks(busy) == 20

    def turned_down() -> bool:
        return not eligible_decodes([busy], tracker, tokens=544, push_tokens=None)

    assert turned_down()  # 24 - 20 = 4 blocks left: no room for 5
    tracker.release("r0")  # counted in the report, its 5 blocks freed since
    assert tracker.pending_blocks(busy) == 15 and not turned_down()
    for i in range(1, 8):
        tracker.release(f"r{i}")
    for i in range(4):
        tracker.release(f"n{i}")
    # The credit never makes the report's free blocks exceed the decode's total.
    assert tracker.pending_blocks(busy) == 24 - 64
    assert tracker.pending_requests(busy) == 0 and len(tracker) == 0


def test_releases_before_the_report_was_seen_give_nothing_back(
    pair: tuple[Candidate, Candidate],
) -> None:
    # Released while the view still held the old report: the next report already shows the
    # blocks free, so they are not credited twice.
    p, d = pair
    tracker = InflightTracker()
    d0 = dataclasses.replace(d, block_size=16, total_kv_blocks=100, free_kv_blocks=100)
    tracker.add("r1", p, d0, decode_blocks=7)
    tracker.add("r2", p, d0, decode_blocks=3)
    tracker.release("r1")
    later = dataclasses.replace(d0, epoch=d0.epoch + 1, free_kv_blocks=97)
    assert tracker.pending_blocks(later) == 0
    tracker.release("r2")  # inside the later report: credited
    assert tracker.pending_blocks(later) == -3


def test_releases_of_requests_a_report_counted_give_no_receive_buffer_back(
    pair: tuple[Candidate, Candidate],
) -> None:
    # Push mode: a report's buffer headroom already excludes what its running requests
    # pushed; a request it counted that ends frees KV blocks, not buffer room. The pushes of
    # assignments made since the report sit in the buffer until decode takes them, so they
    # count against the headroom whatever ended meanwhile (with the KV credit instead, queued
    # requests admitted as room came overflowed buffers: 3-5 refused pushes in 1,016 requests
    # of the 1P7D seed case).
    p, d = pair
    tracker = InflightTracker()
    block = 1 << 20
    d0 = dataclasses.replace(
        d, block_size=128, total_kv_blocks=64, free_kv_blocks=64, kv_block_bytes=block
    )
    for i in range(8):
        tracker.add(f"r{i}", p, d0, decode_blocks=5)
    busy = dataclasses.replace(
        d0,
        epoch=d0.epoch + 1,
        free_kv_blocks=24,
        recv_capacity_bytes=20 * block,
        recv_headroom_bytes=12 * block,
    )
    roomy = dataclasses.replace(
        busy, instance_id="d-roomy", recv_headroom_bytes=20 * block, free_kv_blocks=64
    )
    assert tracker.pending_blocks(busy) == 0
    for n in ("n0", "n1"):  # 10 blocks pushed since the report: 2 of 12 left
        tracker.add(n, p, busy, decode_blocks=5)
    for i in range(8):
        tracker.release(f"r{i}")  # 40 KV blocks of credit, no buffer room
    assert tracker.pending_blocks(busy) < 0 and tracker.assigned_blocks(busy) == 10
    eligible = eligible_decodes([busy, roomy], tracker, tokens=544, push_tokens=544)
    assert eligible == [roomy]  # busy has KV room but no buffer room for 5 blocks


def test_a_report_taken_while_their_prompts_are_on_prefill_keeps_them_pending(
    pair: tuple[Candidate, Candidate],
) -> None:
    # Past saturation prompts wait seconds on prefill; a decode report taken meanwhile cannot
    # show the requests on their way there. Dropping them with the old epoch made that
    # decode look empty, take more, and swing between idle and twice its share.
    p, d = pair
    d = dataclasses.replace(d, total_kv_blocks=100, free_kv_blocks=100)
    clock = Clock()
    tracker = InflightTracker(clock=clock)
    tracker.add("r1", p, d, decode_blocks=4, prefill_tokens=2000, prefill_s=2.0)
    tracker.add("r2", p, d, decode_blocks=3, prefill_tokens=2000, prefill_s=2.0)  # done at +4
    tracker.add("r3", p, d, decode_blocks=5)  # no predicted prefill: assumed in the report
    clock.now += 3.0  # r1's prompt is computed, r2's not yet
    reported = dataclasses.replace(d, epoch=d.epoch + 1, free_kv_blocks=91)
    assert tracker.pending_blocks(reported) == 3
    assert tracker.pending_requests(reported) == 1
    tracker.release("r1")  # inside the report: its blocks credited
    assert tracker.pending_blocks(reported) == 3 - 4
    tracker.release("r2")  # counted since the report: no credit, its own blocks back
    assert tracker.pending_blocks(reported) == -4 and tracker.pending_requests(reported) == 0


def test_a_prefill_reporting_an_empty_queue_ends_the_wait(
    pair: tuple[Candidate, Candidate],
) -> None:
    # A prefill faster than predicted: once it reports nothing running or waiting, every
    # prompt it was sent is computed, so the decode's next report includes their requests.
    p, d = pair
    clock = Clock()
    tracker = InflightTracker(clock=clock)
    tracker.add("r1", p, d, decode_blocks=4, prefill_tokens=2000, prefill_s=2.0)
    clock.now += 0.5
    tracker.counts(dataclasses.replace(p, epoch=p.epoch + 1), decode=False)  # idle report
    assert tracker.busy_until("p") == clock.now
    assert tracker.pending_blocks(dataclasses.replace(d, epoch=d.epoch + 1)) == 0


def test_decode_context_is_the_mean_of_the_unreleased_assignments(
    pair: tuple[Candidate, Candidate],
) -> None:
    p, d = pair
    tracker = InflightTracker()
    tracker.add("r1", p, d, decode_blocks=4, decode_context=3000)
    tracker.add("r2", None, d, decode_blocks=2, decode_context=1000)
    tracker.add("r3", p, d, decode_blocks=2)  # not known: left out of the mean
    assert tracker.decode_context("d") == 2000
    assert tracker.counts(d, decode=True)[5] == 2000
    tracker.release("r1")
    assert tracker.decode_context("d") == 1000
    tracker.release("r2")
    assert tracker.decode_context("d") == 0 and tracker.decode_context("p") == 0


def test_a_peer_prompt_moves_the_prefill_queue_as_an_own_decision_does(
    pair: tuple[Candidate, Candidate],
) -> None:
    # The same rule as an own kv_aware decision (`LatencyModel.busy_s`): on an idle prefill a
    # whole step, behind a queue its share. A replica counting a peer's prompt as only its
    # share of a step had seen an instance still computing it as idle.
    p, d = pair
    clock = Clock()
    tracker = InflightTracker(clock=clock)
    model = LatencyModel("tiny-cpu")  # an API server time of 5.88 ms
    tracker.prefill_seconds = model.busy_s
    tracker.add_peer("peer", "r1", p, d, 4, prefill_tokens=100)
    whole = model.idle_s(100)
    assert tracker.busy_until("p") == pytest.approx(clock.now + whole)
    tracker.add_peer("peer", "r2", p, d, 4, prefill_tokens=100)
    assert tracker.busy_until("p") == pytest.approx(clock.now + whole + model.queue_s(100))
    clock.now = tracker.busy_until("p") - 0.002  # less left than the API server's time
    tracker.add_peer("peer", "r3", p, d, 4, prefill_tokens=100)
    assert tracker.busy_until("p") == pytest.approx(clock.now + whole)


def test_a_peer_snapshot_moves_no_prefill_queue(pair: tuple[Candidate, Candidate]) -> None:
    # A snapshot (a peer's assignments in flight when this replica connects) holds prompts
    # computed long ago: stacking them from now had made a prefill look busy for seconds.
    p, d = pair
    clock = Clock()
    tracker = InflightTracker(clock=clock)
    tracker.prefill_seconds = LatencyModel().busy_s
    for i in range(300):
        tracker.add_peer("peer", f"r{i}", p, d, 4, pending=False, prefill_tokens=2000)
    assert tracker.busy_until("p") == 0.0
    assert len(tracker) == 300
