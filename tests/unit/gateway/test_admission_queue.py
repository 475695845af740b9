"""Must show: waiters are admitted in arrival order, only the head asks again, and a release
admits as many as fit at once (no per-waiter polling)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from pdplane.gateway.admission import AdmissionQueue
from pdplane.gateway.errors import GatewayError
from pdplane.gateway.fleet_view import FleetView, ModelState
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.scheduler import SchedulerBusy, SchedulerUnavailable


class _Fleet:
    """A decode with `room` free places; `schedule` takes one or refuses (SchedulerBusy)."""

    def __init__(self) -> None:
        self.room = 0
        self.calls: list[str] = []

    def schedule(self, name: str) -> Any:
        async def call() -> str:
            self.calls.append(name)
            if self.room <= 0:
                raise SchedulerBusy("no KV room")
            self.room -= 1
            return name

        return call


async def _until(condition: Any) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition not met")


async def test_a_release_admits_waiters_in_arrival_order_as_room_allows() -> None:
    queue, fleet = AdmissionQueue(30.0, 10, GatewayMetrics()), _Fleet()
    names = ["a", "b", "c", "d"]
    tasks = []
    for n, name in enumerate(names, 1):
        tasks.append(asyncio.create_task(queue.admit("m", fleet.schedule(name), None)))
        await _until(lambda n=n: len(queue) == n)
    fleet.calls.clear()
    await asyncio.sleep(0.1)  # four poll periods of the head
    assert set(fleet.calls) == {"a"}  # only the head asks again; the others sleep
    fleet.room = 2
    queue.wake()
    done = [await tasks[0], await tasks[1]]
    assert done == ["a", "b"]
    await asyncio.sleep(0.05)
    assert not tasks[2].done() and len(queue) == 2
    fleet.room = 2
    queue.wake()
    assert [await tasks[2], await tasks[3]] == ["c", "d"]
    assert len(queue) == 0 and not queue.has_waiters("m")


async def test_a_cancelled_waiter_leaves_and_the_next_becomes_head() -> None:
    queue, fleet = AdmissionQueue(30.0, 10, GatewayMetrics()), _Fleet()
    first = asyncio.create_task(queue.admit("m", fleet.schedule("a"), None))
    await _until(lambda: len(queue) == 1)
    second = asyncio.create_task(queue.admit("m", fleet.schedule("b"), None))
    await _until(lambda: len(queue) == 2)
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert len(queue) == 1
    fleet.room = 1  # found by the new head's own poll, without a wake
    assert await second == "b"
    assert fleet.calls[-1] == "b"


async def test_queueing_off_and_a_full_queue_answer_503_at_once() -> None:
    fleet = _Fleet()
    with pytest.raises(GatewayError, match="no KV room") as info:
        await AdmissionQueue(0.0, 10, GatewayMetrics()).admit(
            "m", fleet.schedule("a"), SchedulerBusy("no KV room")
        )
    assert info.value.status == 503 and fleet.calls == []
    queue = AdmissionQueue(0.2, 0, GatewayMetrics())
    with pytest.raises(GatewayError, match="not queued: 0 requests already wait"):
        await queue.admit("m", fleet.schedule("a"), SchedulerBusy("no KV room"))


async def test_no_model_stays_behind_however_its_waiters_end() -> None:
    # Model names come from clients: a queue and a reason per name must not outlive its
    # waiters (timeout, a non-capacity error at the head, a client leaving).
    queue = AdmissionQueue(0.05, 10, GatewayMetrics())

    async def gone() -> Any:
        raise SchedulerUnavailable("no decode instance")

    with pytest.raises(GatewayError):
        await queue.admit("timed-out", _Fleet().schedule("a"), SchedulerBusy("full"))
    with pytest.raises(SchedulerUnavailable):
        await queue.admit("vanished", gone, SchedulerBusy("full"))
    left = asyncio.create_task(queue.admit("left", _Fleet().schedule("b"), None))
    await _until(lambda: len(queue) == 1)
    left.cancel()
    with pytest.raises(asyncio.CancelledError):
        await left
    assert len(queue) == 0
    assert not queue._queues and not queue._reasons


def _view(decode_registered_ns: int, changed_at: float = 0.0) -> FleetView:
    """One prefill `p` and one decode `d` of model `m`, the decode registered at the given
    time (0: none)."""
    registered = {"p": 1}
    if decode_registered_ns:
        registered["d"] = decode_registered_ns
    state = ModelState(
        prefill=1,
        decode=1 if decode_registered_ns else 0,
        paired=bool(decode_registered_ns),
        max_model_len=2048,
        created=0,
        prefill_ids=frozenset({"p"}),
        decode_ids=frozenset({"d"} if decode_registered_ns else ()),
        registered_ns=registered,
        changed_at=changed_at,
    )
    return FleetView(models={"m": state}, ready=True)


def test_an_instance_is_excluded_as_the_process_that_failed_until_it_registers_again() -> None:
    views = [_view(100)]
    queue = AdmissionQueue(30.0, 10, GatewayMetrics(), lambda: views[-1])
    failed = {"d": queue.incarnation("m", "d")}
    assert failed == {"d": 100}
    assert queue.failed("m", failed) == ("d",)  # still the process that failed
    views.append(_view(0))  # its lease expired: a scheduler may still list it
    assert queue.failed("m", failed) == ("d",)
    views.append(_view(200))  # restarted under the same id
    assert queue.failed("m", failed) == ()
    # one that failed while the view did not list it: any registration seen later is new
    assert queue.failed("m", {"d": 0}) == ()


def test_a_refusal_the_view_contradicts_waits_only_while_the_instances_just_changed() -> None:
    views = [_view(100, changed_at=time.monotonic())]
    queue = AdmissionQueue(30.0, 10, GatewayMetrics(), lambda: views[-1])
    refusal = SchedulerUnavailable("no decode instance (the scheduler has not seen it yet)")
    assert queue.waits_on("m", refusal)
    views.append(_view(100, changed_at=time.monotonic() - 60))
    assert not queue.waits_on("m", refusal)  # not a lag: the refusal is the answer
    # only the instance that failed the request is left: a retry waits, a take-over does not
    assert queue.waits_on("m", refusal, ("d",), room=False)
    assert not queue.waits_on("m", refusal, ("d",), on_failed=False)
