"""Must show: decode's events reach the client as they arrive, never held back for the next
one; the events that one read from decode brings are relayed as one piece."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import aiohttp
from aiohttp import web

from pdplane.gateway.aftercare import KvAborter
from pdplane.gateway.config import RelayConfig
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.relay import Relay
from pdplane.gateway.replies import StreamReply
from pdplane.gateway.testing import running_gateway
from pdplane.gateway.upstream import UpstreamClient
from pdplane.gateway.validation import COMPLETIONS, parse_request
from tests.unit.gateway.conftest import MODEL, VIEW, FakeScheduler, Handler, good_prefill

Serve = Callable[[Handler], Awaitable[str]]

_FIRST = b'data: {"choices":[{"text":"a"}]}\n\n'
_BURST = b'data: {"choices":[{"text":"b"}]}\n\ndata: {"choices":[{"text":"c"}]}\n\n'
_DONE = b"data: [DONE]\n\n"


def _gated_decode(first: bytes, release: asyncio.Event) -> Handler:
    """A decode instance that writes `first`, then waits for `release`, then ends the stream."""

    async def handler(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(first)
        await release.wait()
        await resp.write(_DONE)
        return resp

    return handler


async def test_a_lone_event_reaches_the_client_before_decode_sends_the_next(
    serve: Serve,
) -> None:
    release = asyncio.Event()
    sched = FakeScheduler(
        [(await serve(good_prefill), await serve(_gated_decode(_FIRST, release)))]
    )
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW) as url:
        async with (
            aiohttp.ClientSession() as client,
            client.post(f"{url}/v1/completions", json=body) as resp,
        ):
            assert resp.status == 200
            got = b""
            while not got.endswith(b"\n\n"):  # decode holds its next event meanwhile
                chunk = await asyncio.wait_for(resp.content.readany(), 10)
                assert chunk, "the stream ended before its first event"
                got += chunk
            assert got == _FIRST and not release.is_set()
            release.set()
            rest = await asyncio.wait_for(resp.content.read(), 10)
    assert rest == _DONE
    assert sched.log[-1] == ("release", "success")


async def test_the_events_of_one_read_from_decode_are_relayed_as_one_chunk(
    serve: Serve,
) -> None:
    release = asyncio.Event()
    decode = await serve(_gated_decode(_BURST, release))
    sched = FakeScheduler([(await serve(good_prefill), decode)])
    upstream, aborter = UpstreamClient(), KvAborter(timeout_s=0.5)
    relay = Relay(sched, upstream, aborter, GatewayMetrics(), RelayConfig())
    raw = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    try:
        reply = await relay.handle(parse_request(COMPLETIONS, raw), "r1", time.perf_counter(), 0)
        assert isinstance(reply, StreamReply)
        try:
            # Both events came in one write: one item, yielded while decode still holds [DONE].
            assert await asyncio.wait_for(reply.chunks.__anext__(), 10) == _BURST
            release.set()
            assert [c async for c in reply.chunks] == [_DONE]
        finally:
            await reply.aclose()
        await relay.drain()
    finally:
        await upstream.close()
        await aborter.close()
    assert sched.log == [("schedule", []), ("release", "success")]
