"""The decode-side push receive buffer: bounded room, all-or-nothing reservation, state
machine (receiving -> ready -> taken | freed), TTL, late pushes after a pull."""

from __future__ import annotations

import threading

import grpc
import pytest

from pdplane.connector.transports.tcp.buffer import PushBuffer, PushRefused, PushState

BLOCK = [100, 100]  # bytes per block of each of 2 layers


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _fill(buf: PushBuffer, tid: str, n: int, sender: str = "p0") -> None:
    entry = buf.reserve(tid, sender, n, BLOCK)
    for layer in range(2):
        entry.write(layer, 0, n, bytes([layer + 1]) * (n * 100))
    buf.commit(entry)


def test_a_push_that_does_not_fit_is_refused_with_resource_exhausted() -> None:
    buf = PushBuffer(capacity_bytes=1000)
    buf.reserve("t1", "p0", 4, BLOCK)  # 800 bytes
    with pytest.raises(PushRefused) as info:
        buf.reserve("t2", "p0", 2, BLOCK)  # 400 more: over
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert buf.used_bytes == 800 and buf.refused == 1 and len(buf) == 1


def test_a_refused_transfer_is_known_at_once_to_its_decode_request() -> None:
    buf = PushBuffer(capacity_bytes=100)
    with pytest.raises(PushRefused):
        buf.reserve("t1", "p0", 1, BLOCK)
    # no waiting for a push that will never come
    assert buf.claim("t1", "p0", wait_s=30.0) is None


def test_ready_push_is_taken_once_and_frees_its_room() -> None:
    buf = PushBuffer(capacity_bytes=1000)
    _fill(buf, "t1", 2)
    entry = buf.claim("t1", "p0", wait_s=0)
    assert entry is not None and entry.state is PushState.GONE
    assert bytes(entry.layers[1][:3]) == b"\x02\x02\x02"
    assert buf.used_bytes == 0
    assert buf.claim("t1", "p0", wait_s=0) is None
    with pytest.raises(PushRefused) as info:  # the same transfer cannot be pushed again
        buf.reserve("t1", "p0", 2, BLOCK)
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS


def test_take_waits_for_a_push_still_arriving() -> None:
    buf = PushBuffer(capacity_bytes=1000)
    entry = buf.reserve("t1", "p0", 1, BLOCK)
    got: list[object] = []
    taker = threading.Thread(target=lambda: got.append(buf.claim("t1", "p0", wait_s=5.0)))
    taker.start()
    entry.write(0, 0, 1, b"a" * 100)
    entry.write(1, 0, 1, b"b" * 100)
    buf.commit(entry)
    taker.join(5.0)
    assert not taker.is_alive() and got == [entry]


def test_take_gives_up_after_its_wait_and_discard_frees_the_partial_push() -> None:
    buf = PushBuffer(capacity_bytes=1000)
    entry = buf.reserve("t1", "p0", 1, BLOCK)
    entry.write(0, 0, 1, b"a" * 100)
    assert buf.claim("t1", "p0", wait_s=0.05) is None
    buf.discard("t1", "pulled instead")
    assert buf.used_bytes == 0 and len(buf) == 0
    with pytest.raises(PushRefused) as info:  # the stream's next chunk is refused
        entry.write(1, 0, 1, b"b" * 100)
    assert info.value.code == grpc.StatusCode.ABORTED


def test_an_incomplete_push_is_freed_at_commit() -> None:
    buf = PushBuffer(capacity_bytes=1000)
    entry = buf.reserve("t1", "p0", 2, BLOCK)
    entry.write(0, 0, 2, b"a" * 200)
    with pytest.raises(PushRefused, match="2 layer-blocks missing"):
        buf.commit(entry)
    assert buf.used_bytes == 0 and buf.claim("t1", "p0", 0) is None


@pytest.mark.parametrize(
    ("layer", "first", "count", "size", "match"),
    [
        (2, 0, 1, 100, "layer 2 of 2"),
        (0, 1, 2, 200, "out of range"),
        (0, 0, 1, 99, "expected 100"),
    ],
)
def test_malformed_chunks_are_refused(
    layer: int, first: int, count: int, size: int, match: str
) -> None:
    entry = PushBuffer(capacity_bytes=1000).reserve("t1", "p0", 2, BLOCK)
    with pytest.raises(PushRefused, match=match) as info:
        entry.write(layer, first, count, b"x" * size)
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_block_sent_twice_is_refused() -> None:
    entry = PushBuffer(capacity_bytes=1000).reserve("t1", "p0", 2, BLOCK)
    entry.write(0, 0, 1, b"x" * 100)
    with pytest.raises(PushRefused, match="twice"):
        entry.write(0, 0, 2, b"x" * 200)


def test_a_push_from_another_sender_is_not_used() -> None:
    buf = PushBuffer(capacity_bytes=1000)
    _fill(buf, "t1", 1, sender="intruder")
    assert buf.claim("t1", "p0", wait_s=0) is None
    assert buf.used_bytes == 0


def test_unclaimed_pushes_expire_after_the_ttl() -> None:
    clock = FakeClock()
    buf = PushBuffer(capacity_bytes=1000, ttl_s=5.0, clock=clock)
    _fill(buf, "t1", 2)
    assert buf.expire() == 0
    clock.now += 5.0
    assert buf.expire() == 1
    assert buf.used_bytes == 0 and buf.claim("t1", "p0", 0) is None
    _fill(buf, "t2", 5)  # the room is back


def test_a_late_push_after_a_pull_is_refused() -> None:
    buf = PushBuffer(capacity_bytes=1000)
    buf.discard("t1", "pulled instead")
    with pytest.raises(PushRefused) as info:
        buf.reserve("t1", "p0", 1, BLOCK)
    assert info.value.code == grpc.StatusCode.ALREADY_EXISTS
    assert buf.used_bytes == 0


def test_zero_capacity_refuses_every_push() -> None:
    with pytest.raises(PushRefused) as info:
        PushBuffer(capacity_bytes=0).reserve("t1", "p0", 1, BLOCK)
    assert info.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
