"""The gateway's prefix warm sender against a real HTTP server on loopback: one warm per
instance at a time (a stopped or slow instance is not sent the same prefix again), each with
its own X-Request-Id, and the result counted."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.upstream import UpstreamClient
from pdplane.gateway.warm import PrefixWarms
from pdplane.scheduler import WarmHint
from pdplane.v1 import scheduler_pb2


@dataclass
class Engine:
    """A loopback HTTP server that records each request's head and answers 200 once
    `answer` is set (until then it holds every request: an instance that stopped)."""

    url: str
    heads: list[bytes]
    answer: asyncio.Event


@pytest.fixture
async def engine() -> AsyncIterator[Engine]:
    heads: list[bytes] = []
    answer = asyncio.Event()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(
            next(
                line.split(b":", 1)[1]
                for line in head.split(b"\r\n")
                if line.lower().startswith(b"content-length:")
            )
        )
        await reader.readexactly(length)
        heads.append(head)
        await answer.wait()
        body = b'{"choices": []}'
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode()
            + b"\r\n\r\n"
            + body
        )
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        yield Engine(f"http://127.0.0.1:{port}", heads, answer)


def _hint(instance_id: str, url: str, tokens: int = 32) -> WarmHint:
    return WarmHint(scheduler_pb2.InstanceRef(instance_id=instance_id, url=url), tokens)


def _count(metrics: GatewayMetrics, result: str) -> float:
    value = metrics.registry.get_sample_value(
        "pdplane_gateway_prefix_warms_total", {"result": result}
    )
    return value or 0.0


async def _until(condition: Callable[[], bool], what: str) -> None:
    """Polls `condition` every 10 ms; fails the test naming `what` after 5 s."""
    try:
        async with asyncio.timeout(5):
            while not condition():
                await asyncio.sleep(0.01)
    except TimeoutError:
        pytest.fail(f"timed out waiting for {what}")


async def test_one_warm_per_instance_at_a_time_each_with_its_own_request_id(
    engine: Engine,
) -> None:
    metrics = GatewayMetrics()
    upstream = UpstreamClient()
    warms = PrefixWarms(upstream, {"content-type": "application/json"}, metrics, 30.0)
    ids = list(range(100, 164))
    try:
        warms.send("m", ids, _hint("p1", engine.url))
        await _until(lambda: len(engine.heads) == 1, "the first warm to arrive")
        warms.send("m", ids, _hint("p1", engine.url))  # p1 still computing the first
        assert _count(metrics, "dropped") == 1
        warms.send("m", ids, _hint("p2", engine.url))  # another instance: sent
        await _until(lambda: len(engine.heads) == 2, "the other instance's warm")
        engine.answer.set()
        await _until(lambda: _count(metrics, "sent") == 2, "both warms answered")
        warms.send("m", ids, _hint("p1", engine.url))  # p1's first warm is over: sent again
        await _until(lambda: _count(metrics, "sent") == 3, "p1's second warm")
        request_ids = [
            line.split(b":", 1)[1].strip()
            for head in engine.heads
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"x-request-id:")
        ]
        assert len(request_ids) == 3 and len(set(request_ids)) == 3
        assert all(r.startswith(b"pdplane-warm-") for r in request_ids)
    finally:
        await warms.close()
        await upstream.close()


async def test_a_prompt_shorter_than_the_hint_is_dropped_and_close_cancels_what_runs(
    engine: Engine,
) -> None:
    metrics = GatewayMetrics()
    upstream = UpstreamClient()
    warms = PrefixWarms(upstream, {"content-type": "application/json"}, metrics, 30.0)
    try:
        warms.send("m", [1, 2, 3], _hint("p1", engine.url, tokens=32))
        assert _count(metrics, "dropped") == 1
        warms.send("m", list(range(64)), _hint("p1", engine.url))
        await _until(lambda: len(engine.heads) == 1, "the warm to arrive")
    finally:
        await warms.close()  # the engine never answers: close must not wait for it
        await upstream.close()
    assert _count(metrics, "sent") == _count(metrics, "failed") == 0
