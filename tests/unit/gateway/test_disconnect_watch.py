"""DisconnectWatch: a client disconnect cancels the work in the request's own task, nothing else."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdplane.gateway.asgi import DisconnectWatch


class _Client:
    """An ASGI `receive` whose disconnect the test triggers."""

    def __init__(self) -> None:
        self.left = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.left.wait()
        return {"type": "http.disconnect"}


async def test_disconnect_cancels_the_work_and_runs_its_cleanup() -> None:
    client, cleaned = _Client(), asyncio.Event()

    async def work() -> str:
        try:
            await asyncio.sleep(30)
        finally:
            cleaned.set()
        return "never"

    watch = DisconnectWatch(client.receive)
    asyncio.get_running_loop().call_later(0.01, client.left.set)
    assert await watch.run(work()) == (False, None)
    assert cleaned.is_set()
    await asyncio.sleep(0)  # the task itself is not left cancelled
    current = asyncio.current_task()
    assert current is not None and current.cancelling() == 0
    watch.close()


async def test_result_when_the_client_stays_and_a_later_disconnect_cancels_nothing() -> None:
    client = _Client()

    async def work() -> int:
        await asyncio.sleep(0)
        return 7

    watch = DisconnectWatch(client.receive)
    assert await watch.run(work()) == (True, 7)
    client.left.set()
    await asyncio.sleep(0.01)
    assert watch.gone
    assert await watch.run(work()) == (False, None)  # gone before it started: not run
    watch.close()


async def test_cancellation_from_elsewhere_propagates() -> None:
    client = _Client()

    async def request() -> tuple[bool, None]:
        watch = DisconnectWatch(client.receive)
        try:
            return await watch.run(asyncio.sleep(30))  # type: ignore[arg-type]
        finally:
            watch.close()

    task = asyncio.get_running_loop().create_task(request())
    await asyncio.sleep(0.01)
    task.cancel()  # e.g. server shutdown, client still connected
    with pytest.raises(asyncio.CancelledError):
        await task
