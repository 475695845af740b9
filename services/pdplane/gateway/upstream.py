"""The gateway's one pooled HTTP/1.1 client to the instances: asyncio protocols + httptools.

The gateway's requests to the instances are always the same shape (one POST of a JSON body,
an answer read whole or relayed chunk by chunk), so the general machinery of a full client
(request/response object graphs, per-request timeout timers re-armed on every chunk, header
multidicts, tracing hooks) is pure overhead there: aiohttp's request path measured as ~40% of
the gateway's CPU per request. Here a request is one `transport.write` of pre-formatted bytes,
the answer is parsed by httptools (the parser uvicorn serves with), body chunks are handed over
as they arrive, and the silence timeout is one lazily re-armed timer per request.

Errors: `UpstreamUnreachable` (connection refused/reset/closed before or while answering,
malformed answer), `UpstreamTimeout` (no bytes for `read_timeout_s`, or the whole exchange
past `total_timeout_s`).

History: aiohttp replaced httpx here first (relaying one JSON answer plus one 17-event SSE
stream cost ~230 us of client CPU with aiohttp, ~3000 us with httpx); this client replaced
aiohttp (see docs/benchmarks.md for the before/after in one run).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator, Mapping
from urllib.parse import urlsplit

import httptools

__all__ = ["UpstreamClient", "UpstreamResponse", "UpstreamTimeout", "UpstreamUnreachable"]

#: Below uvicorn's (and so vLLM's) 5 s keep-alive, so that a pooled connection is never reused
#: just as the server closes it (a POST on such a connection fails and cannot be retried).
_KEEPALIVE_S = 4.0
#: Buffered, unread answer bytes above which the socket stops being read (back-pressure).
_HIGH_WATER = 256 * 1024


class UpstreamUnreachable(Exception):
    """The instance could not be reached or closed the connection before answering."""


class UpstreamTimeout(Exception):
    """The instance did not answer (or went silent) for longer than the configured timeout."""


def _ends_at_close(headers: Mapping[str, str]) -> bool:
    return "content-length" not in headers and "chunked" not in headers.get("transfer-encoding", "")


class _Target:
    """A parsed base of a URL: where to connect and the Host header."""

    __slots__ = ("host", "key", "netloc", "path", "port", "ssl")

    def __init__(self, url: str) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise UpstreamUnreachable(f"{url}: not an http(s) URL")
        self.host = parts.hostname
        self.ssl = parts.scheme == "https"
        self.port = parts.port or (443 if self.ssl else 80)
        self.netloc = parts.netloc
        self.path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        self.key = (self.host, self.port, self.ssl)


class _Connection(asyncio.Protocol):
    """One keep-alive connection; carries at most one response at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop, key: tuple[str, int, bool]) -> None:
        self.loop = loop
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: UpstreamResponse | None = None
        self.lost = False
        self.idle_since = 0.0
        self.pool: _Pool | None = None  # set while idle in a pool

    # -- asyncio.Protocol ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None:  # bytes while idle: the connection is out of step, drop it
            self.close()
            return
        resp.last_activity = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as exc:
            resp.fail(UpstreamUnreachable(f"{resp.url}: malformed answer: {exc}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.pool is not None:
            self.pool.discard(self)
            self.pool = None
        resp = self.response
        if resp is None or resp.complete:
            return
        if resp.status and not exc and _ends_at_close(resp.headers):
            resp.finish()  # an answer without length or chunking ends where the connection does
            return
        why = f": {exc}" if exc else ""
        resp.fail(UpstreamUnreachable(f"{resp.url}: connection closed by the instance{why}"))

    def pause_writing(self) -> None:  # the request bodies are small; nothing to throttle
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks -------------------------------------------------------------

    def on_header(self, name: bytes, value: bytes) -> None:
        assert self.response is not None
        self.response.headers[name.decode("latin-1").lower()] = value.decode("latin-1")

    def on_headers_complete(self) -> None:
        resp = self.response
        assert resp is not None
        resp.status = self.parser.get_status_code()
        resp.keep_alive = self.parser.should_keep_alive()
        resp.headers_done()

    def on_body(self, body: bytes) -> None:
        assert self.response is not None
        self.response.feed(body)

    def on_message_complete(self) -> None:
        assert self.response is not None
        self.response.finish()

    def close(self) -> None:
        self.lost = True
        if self.transport is not None:
            self.transport.close()


class UpstreamResponse:
    """An answer being received. Read it with `read()` or `chunks()`, then `release()` (back to
    the pool when complete) or `close()` (drops the connection).

    Attributes:
        status: HTTP status code.
        headers: response headers, names lower-case (last value wins).
        url: the requested URL (for messages).
    """

    def __init__(
        self,
        conn: _Connection,
        pool: _Pool,
        url: str,
        read_timeout_s: float,
        slots: asyncio.Semaphore | None,
    ) -> None:
        self._conn = conn
        self._pool = pool
        self._slots = slots
        self.url = url
        self.status = 0
        self.headers: dict[str, str] = {}
        self.keep_alive = False
        self.complete = False
        self.last_activity = conn.loop.time()
        self._error: Exception | None = None
        self._buffer: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._headers_done = False
        self._read_timeout_s = read_timeout_s
        self._timer: asyncio.TimerHandle | None = None
        self._total_timer: asyncio.TimerHandle | None = None
        self._released = False

    # -- fed by the connection -----------------------------------------------------------

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def headers_done(self) -> None:
        self._headers_done = True
        self._wake()

    def feed(self, data: bytes) -> None:
        self._buffer.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER and not self._paused and self._conn.transport:
            self._paused = True
            self._conn.transport.pause_reading()
        self._wake()

    def finish(self) -> None:
        self.complete = True
        self._stop_timers()
        self._wake()

    def fail(self, error: Exception) -> None:
        if self._error is None and not self.complete:
            self._error = error
        self._stop_timers()
        self._wake()

    # -- timeouts ------------------------------------------------------------------------

    def start_timers(self, total_timeout_s: float | None) -> None:
        loop = self._conn.loop
        self._timer = loop.call_at(self.last_activity + self._read_timeout_s, self._check_silence)
        if total_timeout_s is not None:
            self._total_timer = loop.call_later(total_timeout_s, self._expire, total_timeout_s)

    def _check_silence(self) -> None:
        # Re-armed lazily: data arrival only stamps `last_activity`, no timer work per chunk.
        due = self.last_activity + self._read_timeout_s
        if self._conn.loop.time() < due:
            self._timer = self._conn.loop.call_at(due, self._check_silence)
            return
        self._timer = None
        self.fail(UpstreamTimeout(f"{self.url} silent for {self._read_timeout_s:g} s"))
        self._conn.close()

    def _expire(self, total_timeout_s: float) -> None:
        self._total_timer = None
        self.fail(UpstreamTimeout(f"{self.url} not done within {total_timeout_s:g} s"))
        self._conn.close()

    def _stop_timers(self) -> None:
        for timer in (self._timer, self._total_timer):
            if timer is not None:
                timer.cancel()
        self._timer = self._total_timer = None

    # -- consumer side -------------------------------------------------------------------

    async def _wait(self) -> None:
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    async def wait_headers(self) -> None:
        """Waits for the status line and headers; raises the connection's error."""
        while not self._headers_done:
            if self._error is not None:
                raise self._error
            await self._wait()

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: each item is everything received since the last one.

        Raises UpstreamUnreachable (broken off) or UpstreamTimeout (silent) mid-body."""
        while True:
            if self._buffer:
                data = self._buffer[0] if len(self._buffer) == 1 else b"".join(self._buffer)
                self._buffer.clear()
                self._buffered = 0
                if self._paused and self._conn.transport is not None:
                    self._paused = False
                    self._conn.transport.resume_reading()
                yield data
            elif self.complete:
                return
            elif self._error is not None:
                raise self._error
            else:
                await self._wait()

    async def read(self) -> bytes:
        """The whole body (raises as `chunks`)."""
        parts = [chunk async for chunk in self.chunks()]
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        """Done with the answer: the connection goes back to the pool if it can be reused."""
        if self._released:
            return
        self._released = True
        self._stop_timers()
        if self._slots is not None:
            self._slots.release()
        conn = self._conn
        conn.response = None
        if self.complete and self.keep_alive and not self._buffer and not conn.lost:
            conn.idle_since = conn.loop.time()
            self._pool.put(conn)
        else:
            conn.close()

    def close(self) -> None:
        """Drops the connection (an unfinished request is aborted upstream)."""
        if self._released:
            return
        self._released = True
        self._stop_timers()
        if self._slots is not None:
            self._slots.release()
        self._conn.response = None
        self._conn.close()


class _Pool:
    """Idle connections by (host, port, tls)."""

    def __init__(self) -> None:
        self.idle: dict[tuple[str, int, bool], list[_Connection]] = {}

    def put(self, conn: _Connection) -> None:
        conn.pool = self
        self.idle.setdefault(conn.key, []).append(conn)

    def discard(self, conn: _Connection) -> None:
        """Forgets an idle connection the instance closed (keep-alive expiry)."""
        idle = self.idle.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)

    def get(self, key: tuple[str, int, bool], now: float) -> _Connection | None:
        idle = self.idle.get(key)
        while idle:
            conn = idle.pop()  # most recently used first: least likely to have expired
            conn.pool = None
            if not conn.lost and now - conn.idle_since < _KEEPALIVE_S:
                return conn
            conn.close()
        return None

    def close(self) -> None:
        for conns in self.idle.values():
            for conn in conns:
                conn.close()
        self.idle.clear()


class UpstreamClient:
    """Pooled HTTP/1.1 client for prefill and decode legs (one per gateway, on its loop).

    Args:
        connect_timeout_s: bound on establishing a connection (s).
        max_connections: connections busy with a request at once, across instances (further
            requests wait for one); 0 = unlimited.
    """

    def __init__(self, *, connect_timeout_s: float = 5.0, max_connections: int = 0) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._slots = asyncio.Semaphore(max_connections) if max_connections else None
        self._targets: dict[str, _Target] = {}
        self._pool = _Pool()
        self._ssl: ssl.SSLContext | None = None

    def _target(self, url: str) -> _Target:
        target = self._targets.get(url)
        if target is None:
            if len(self._targets) > 4096:  # URLs are instance base + endpoint: a small set
                self._targets.clear()
            target = self._targets[url] = _Target(url)
        return target

    async def _connect(self, target: _Target) -> _Connection:
        loop = asyncio.get_running_loop()
        if target.ssl and self._ssl is None:
            self._ssl = ssl.create_default_context()
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(loop, target.key),
                    target.host,
                    target.port,
                    ssl=self._ssl if target.ssl else None,
                )
        except TimeoutError:
            raise UpstreamTimeout(
                f"no connection to {target.netloc} within {self._connect_timeout_s:g} s"
            ) from None
        except OSError as exc:
            raise UpstreamUnreachable(f"{target.netloc}: {exc}") from None
        return conn

    async def open(
        self,
        url: str,
        body: bytes | AsyncIterator[bytes],
        headers: Mapping[str, str],
        *,
        read_timeout_s: float,
        total_timeout_s: float | None = None,
    ) -> UpstreamResponse:
        """POSTs `body` (bytes, or an async iterator sent chunked) and waits for the headers.

        The caller owns the returned response: read or stream it, then `release()` or `close()`.
        `read_timeout_s` bounds every wait for bytes (s); `total_timeout_s` the whole exchange.

        Raises:
            UpstreamUnreachable: connection refused/reset or closed before the response headers.
            UpstreamTimeout: no connection or no response headers within the timeouts.
        """
        target = self._target(url)
        loop = asyncio.get_running_loop()
        if self._slots is not None:
            await self._slots.acquire()
        try:
            conn = self._pool.get(target.key, loop.time()) or await self._connect(target)
        except BaseException:
            if self._slots is not None:
                self._slots.release()
            raise
        resp = UpstreamResponse(conn, self._pool, url, read_timeout_s, self._slots)
        conn.response = resp
        conn.parser = httptools.HttpResponseParser(conn)
        head = [f"POST {target.path} HTTP/1.1\r\nHost: {target.netloc}\r\n"]
        head += [f"{name}: {value}\r\n" for name, value in headers.items()]
        writer: asyncio.Task[None] | None = None
        try:
            assert conn.transport is not None
            if isinstance(body, bytes):
                head.append(f"Content-Length: {len(body)}\r\n\r\n")
                conn.transport.write("".join(head).encode("latin-1") + body)
            else:
                head.append("Transfer-Encoding: chunked\r\n\r\n")
                conn.transport.write("".join(head).encode("latin-1"))
                writer = loop.create_task(_write_chunked(conn.transport, body))
            resp.start_timers(total_timeout_s)
            await resp.wait_headers()
        except BaseException:
            resp.close()
            if writer is not None:
                writer.cancel()
            raise
        if writer is not None and not writer.done():
            # The answer came before the whole body went out: nothing more will be read.
            writer.cancel()
        return resp

    @staticmethod
    async def read(resp: UpstreamResponse) -> bytes:
        """Reads the whole body of `resp` and releases the connection to the pool.

        Raises:
            UpstreamUnreachable: the connection broke before the body was complete.
            UpstreamTimeout: the body stalled longer than the read timeout.
        """
        try:
            return await resp.read()
        finally:
            resp.release()

    async def close(self) -> None:
        """Closes every idle connection (idempotent)."""
        self._pool.close()


async def _write_chunked(transport: asyncio.Transport, body: AsyncIterator[bytes]) -> None:
    async for chunk in body:
        if chunk:
            transport.write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
    transport.write(b"0\r\n\r\n")
