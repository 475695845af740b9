"""The gateway's HTTP/1.1 client against tiny aiohttp servers: reuse, bounds, errors."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from pdplane.gateway.upstream import UpstreamClient, UpstreamTimeout, UpstreamUnreachable
from tests.unit.gateway.conftest import Handler

Serve = Callable[[Handler], Awaitable[str]]
JSON = {"content-type": "application/json"}


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    c = UpstreamClient(connect_timeout_s=2.0)
    yield c
    await c.close()


async def test_keep_alive_connection_is_reused_and_bodies_arrive(
    serve: Serve, client: UpstreamClient
) -> None:
    peers: list[object] = []

    async def echo(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        return web.Response(body=await request.read(), content_type="application/json")

    url = await serve(echo) + "/v1/completions"
    for body in (b'{"a":1}', b'{"b":2}'):
        resp = await client.open(url, body, JSON, read_timeout_s=5)
        assert resp.status == 200 and resp.headers["content-type"].startswith("application/json")
        assert await client.read(resp) == body
    assert len(peers) == 2 and peers[0] == peers[1]  # one connection, from the pool


async def test_chunked_request_body_and_streamed_answer(
    serve: Serve, client: UpstreamClient
) -> None:
    async def stream_back(request: web.Request) -> web.StreamResponse:
        data = await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for part in (b"data: 1\n\n", b"data: " + data + b"\n\n", b"data: [DONE]\n\n"):
            await resp.write(part)
        return resp

    async def body() -> AsyncIterator[bytes]:
        yield b'{"x":'
        await asyncio.sleep(0.01)
        yield b"1}"

    resp = await client.open(
        await serve(stream_back) + "/v1/completions", body(), JSON, read_timeout_s=5
    )
    got = b"".join([chunk async for chunk in resp.chunks()])
    resp.release()
    assert got == b'data: 1\n\ndata: {"x":1}\n\ndata: [DONE]\n\n'


async def test_silence_mid_body_times_out(serve: Serve, client: UpstreamClient) -> None:
    async def stall(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await asyncio.sleep(30)
        return resp

    resp = await client.open(
        await serve(stall) + "/v1/completions", b"{}", JSON, read_timeout_s=0.2
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    chunks = []
    with pytest.raises(UpstreamTimeout):
        async for chunk in resp.chunks():
            chunks.append(chunk)
    resp.close()
    assert chunks == [b"data: 1\n\n"]
    assert 0.15 < loop.time() - started < 2.0


async def test_refused_connection_is_unreachable(client: UpstreamClient) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, not listening: connections are refused
        with pytest.raises(UpstreamUnreachable):
            await client.open(
                f"http://127.0.0.1:{port}/v1/completions", b"{}", JSON, read_timeout_s=1
            )


async def test_max_connections_makes_further_requests_wait(serve: Serve) -> None:
    gate = asyncio.Event()

    async def held(request: web.Request) -> web.StreamResponse:
        # The first answer's body stays open until the test lets it end: its connection is busy.
        resp = web.StreamResponse()
        resp.content_type = "application/json"
        await resp.prepare(request)
        await gate.wait()
        await resp.write(b"{}")
        await resp.write_eof()
        return resp

    url = await serve(held) + "/v1/completions"
    client = UpstreamClient(max_connections=1)
    try:
        first = await client.open(url, b"{}", JSON, read_timeout_s=5)
        second = asyncio.ensure_future(client.open(url, b"{}", JSON, read_timeout_s=5))
        await asyncio.sleep(0.1)
        assert not second.done()  # waits for the one connection slot
        gate.set()
        await client.read(first)
        resp = await asyncio.wait_for(second, 5)
        assert await client.read(resp) == b"{}"
    finally:
        await client.close()


async def test_a_connection_the_instance_closed_while_idle_is_not_reused(
    serve: Serve, client: UpstreamClient
) -> None:
    peers: list[object] = []

    async def close_after(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        await request.read()
        # Keep-alive on the wire, then the server drops the idle connection (its own timeout).
        loop = asyncio.get_running_loop()
        transport = request.transport
        assert transport is not None
        loop.call_later(0.05, transport.close)
        return web.json_response({})

    url = await serve(close_after) + "/v1/completions"
    await client.read(await client.open(url, b"{}", JSON, read_timeout_s=5))
    await asyncio.sleep(0.2)  # the server closed it meanwhile
    resp = await client.open(url, b"{}", JSON, read_timeout_s=5)  # must not fail on the dead one
    assert await client.read(resp) == b"{}"
    assert len(peers) == 2 and peers[0] != peers[1]  # a new connection


async def test_a_stream_bounded_by_its_idle_timeout_times_out_when_silent(
    serve: Serve, client: UpstreamClient
) -> None:
    async def stall(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse()
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        await asyncio.sleep(30)
        return resp

    resp = await client.open(await serve(stall) + "/v1/completions", b"{}", JSON, read_timeout_s=5)
    loop = asyncio.get_running_loop()
    started = loop.time()
    chunks = []
    with pytest.raises(UpstreamTimeout):
        async for chunk in resp.chunks(idle_timeout_s=0.2):
            chunks.append(chunk)
    resp.close()
    assert chunks == [b"data: 1\n\n"]
    assert 0.15 < loop.time() - started < 2.0


async def test_the_next_request_on_a_connection_after_a_stream_keeps_its_read_timeout(
    serve: Serve, client: UpstreamClient
) -> None:
    # A stream's idle bound stands in for the connection's read timeout while it lasts; the
    # connection's next request must be bounded by its own read timeout again.
    peers: list[object] = []

    async def stream_then_stall(request: web.Request) -> web.StreamResponse:
        peers.append(request.transport.get_extra_info("peername") if request.transport else None)
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: 1\n\n")
        if len(peers) > 1:
            await asyncio.sleep(30)
        await resp.write_eof()
        return resp

    url = await serve(stream_then_stall) + "/v1/completions"
    first = await client.open(url, b"{}", JSON, read_timeout_s=5)
    assert [c async for c in first.chunks(idle_timeout_s=1.0)] == [b"data: 1\n\n"]
    first.release()
    second = await client.open(url, b"{}", JSON, read_timeout_s=0.2)
    loop = asyncio.get_running_loop()
    started = loop.time()
    with pytest.raises(UpstreamTimeout):
        async for _ in second.chunks():
            pass
    second.close()
    assert len(peers) == 2 and peers[0] == peers[1]  # the same pooled connection
    assert 0.15 < loop.time() - started < 2.0
