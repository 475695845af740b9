"""The sim's receive buffer: all-or-nothing room, refusals remembered, TTL."""

from __future__ import annotations

import asyncio

from pdplane.sim.push import ReceiveBuffer, Taken


async def test_a_push_that_does_not_fit_is_refused_and_remembered() -> None:
    buffer = ReceiveBuffer(100)
    assert buffer.offer("a", "p0", 60)
    assert not buffer.offer("b", "p0", 60)
    assert buffer.headroom_bytes == 40 and buffer.refused == 1
    assert buffer.take("b") == (Taken.REFUSED, 0)
    assert buffer.take("b") == (Taken.ABSENT, 0)  # told once
    assert buffer.take("a", "someone-else") == (Taken.ABSENT, 0)  # only from its sender
    assert buffer.take("a", "p0") == (Taken.PUSHED, 60)
    assert buffer.headroom_bytes == 100


async def test_an_unclaimed_push_expires() -> None:
    buffer = ReceiveBuffer(100, ttl_s=0.01)
    buffer.offer("a", "p0", 50)
    for _ in range(100):
        if not buffer.used_bytes:
            break
        await asyncio.sleep(0.01)
    assert buffer.used_bytes == 0 and buffer.expired == 1
    assert buffer.take("a") == (Taken.ABSENT, 0)
