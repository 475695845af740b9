"""The relay driven directly (no HTTP front): cleanup paths the HTTP layer rarely hits."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import pytest
from aiohttp import web

from pdplane.core.kv_params import PrefillRequestParams
from pdplane.gateway.aftercare import KvAborter
from pdplane.gateway.config import RelayConfig
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.relay import Relay
from pdplane.gateway.replies import StreamReply
from pdplane.gateway.upstream import UpstreamClient
from pdplane.gateway.validation import COMPLETIONS, parse_request
from tests.unit.gateway.conftest import MODEL, FakeScheduler, Handler, good_prefill, sse_decode

Serve = Callable[[Handler], Awaitable[str]]


async def test_stream_closed_before_its_first_event_releases_and_frees_kv(serve: Serve) -> None:
    sched = FakeScheduler([(await serve(good_prefill), await serve(sse_decode))])
    upstream = UpstreamClient()
    aborter = KvAborter(timeout_s=0.5)
    metrics = GatewayMetrics()
    relay = Relay(sched, upstream, aborter, metrics, RelayConfig())
    raw = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    try:
        reply = await relay.handle(parse_request(COMPLETIONS, raw), "r1", time.perf_counter(), 0)
        assert isinstance(reply, StreamReply)
        await reply.aclose()  # the client left before the first event was pulled
        await reply.aclose()  # idempotent
        await relay.drain()
    finally:
        await upstream.close()
        await aborter.close()
    assert sched.log == [("schedule", []), ("release", "cancelled")]
    # AbortTransfer went to the (fake, unreachable) prefill KV endpoint: attempted, not freed.
    assert metrics.kv_aborts.labels("not_freed")._value.get() == 1
    assert metrics.cancellations._value.get() == 1


async def test_client_leaving_during_schedule_releases_and_counts_a_cancellation() -> None:
    sched = FakeScheduler([("http://127.0.0.1:1", "http://127.0.0.1:1")], delay_s=30)
    upstream, aborter, metrics = UpstreamClient(), KvAborter(timeout_s=0.5), GatewayMetrics()
    relay = Relay(sched, upstream, aborter, metrics, RelayConfig())
    raw = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3}).encode()
    task = asyncio.create_task(
        relay.handle(parse_request(COMPLETIONS, raw), "r1", time.perf_counter(), 0)
    )
    try:
        for _ in range(1000):  # until the Schedule call is under way
            if sched.log:
                break
            await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        await upstream.close()
        await aborter.close()
    assert sched.log == [("schedule", []), ("release", "cancelled")]
    assert metrics.cancellations._value.get() == 1


async def test_first_tokens_are_counted_once_per_request_not_per_attempt(serve: Serve) -> None:
    # Prefill answers without token ids (the first token then comes from decode); the first
    # decode cannot be reached, so the request is retried on another pair: one request, one
    # count.
    prefill, decode = await serve(good_prefill), await serve(sse_decode)
    sched = FakeScheduler([(prefill, "http://127.0.0.1:1"), (prefill, decode)])
    upstream, aborter, metrics = UpstreamClient(), KvAborter(timeout_s=0.5), GatewayMetrics()
    relay = Relay(sched, upstream, aborter, metrics, RelayConfig(first_token="prefill"))
    raw = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    try:
        reply = await relay.handle(parse_request(COMPLETIONS, raw), "r1", time.perf_counter(), 0)
        assert isinstance(reply, StreamReply)
        assert b"".join([c async for c in reply.chunks]).endswith(b"data: [DONE]\n\n")
        await relay.drain()
    finally:
        await upstream.close()
        await aborter.close()
    assert [entry for entry in sched.log if entry[0] == "schedule"] == [
        ("schedule", []),
        ("schedule", ["d"]),
    ]
    assert metrics.first_from_decode._value.get() == 1
    assert metrics.first_from_prefill._value.get() == 0


class _RecordingAborter(KvAborter):
    """Records AbortTransfer calls instead of sending them."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, str, str]] = []

    async def abort(self, kv_endpoint: str, transfer_id: str, reason: str) -> bool:
        self.calls.append((kv_endpoint, transfer_id, reason))
        return True


@pytest.mark.parametrize("point", ["before_headers", "mid_body"])
async def test_a_request_cancelled_while_prefill_answers_frees_the_kv_prefill_holds(
    serve: Serve, point: str
) -> None:
    # Prefill finished (it holds the KV under the transfer id the gateway gave it) and its
    # answer is on the way when the request is cancelled: the answer is never read, so only
    # that id lets the gateway free the KV.
    held: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def finished_prefill(request: web.Request) -> web.StreamResponse:
        params = PrefillRequestParams.from_dict((await request.json())["kv_transfer_params"])
        assert params.transfer_id is not None, "the gateway chose no transfer id"
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.content_length = 1000
        if point == "mid_body":
            await resp.prepare(request)
            await resp.write(b'{"choices":[{"text":"x"}],')
        held.set_result(params.transfer_id)
        await asyncio.Event().wait()  # the rest never comes: the gateway gives up first
        return resp

    sched = FakeScheduler([(await serve(finished_prefill), await serve(sse_decode))])
    upstream, aborter, metrics = UpstreamClient(), _RecordingAborter(), GatewayMetrics()
    relay = Relay(sched, upstream, aborter, metrics, RelayConfig())
    raw = json.dumps({"model": MODEL, "prompt": "hi", "max_tokens": 3, "stream": True}).encode()
    task = asyncio.create_task(
        relay.handle(parse_request(COMPLETIONS, raw), "r1", time.perf_counter(), 0)
    )
    try:
        transfer_id = await asyncio.wait_for(held, 5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await relay.drain()
    finally:
        await upstream.close()
        await aborter.close()
    assert aborter.calls == [("127.0.0.1:1", transfer_id, "cancelled")]
    assert sched.log == [("schedule", []), ("release", "cancelled")]
