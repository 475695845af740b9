"""The gateway's one pooled HTTP client to the instances (aiohttp).

aiohttp was chosen over httpx by measurement: relaying one JSON answer plus one 17-event SSE
stream per request from a loopback server cost ~230 us of client CPU with aiohttp and ~3000 us
with httpx (2000 requests, 16 concurrent; see docs/gateway.md). One `ClientSession` is shared
by all requests; nothing is created per request but the request itself (its `ClientTimeout`
is built once per distinct bound). (A hand-written
HTTP/1.1 client on httptools measured ~0.2 ms/request cheaper still; the project keeps a
well-kept library on this path; docs/benchmarks/relay.md has what the two legs cost now.)

Errors: `UpstreamUnreachable` (connection refused/reset/closed before or while answering),
`UpstreamTimeout` (no bytes for `read_timeout_s`, or the whole exchange past `total_timeout_s`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Mapping

import aiohttp

__all__ = ["UpstreamClient", "UpstreamResponse", "UpstreamTimeout", "UpstreamUnreachable"]

#: Below uvicorn's (and so vLLM's) 5 s keep-alive, so that a pooled connection is never reused
#: just as the server closes it (a POST on such a connection fails and cannot be retried).
_KEEPALIVE_S = 4.0
_TIMEOUTS_KEPT = 16


class UpstreamUnreachable(Exception):
    """The instance could not be reached or closed the connection before answering.

    Attributes:
        accepted: the instance took the request and then went away before its headers (the
            server disconnected; vLLM sends a non-streamed answer's headers with its body), as
            opposed to a connection refused or reset on the way in.
    """

    def __init__(self, message: str, accepted: bool = False) -> None:
        super().__init__(message)
        self.accepted = accepted


class UpstreamTimeout(Exception):
    """The instance did not answer (or went silent) for longer than the configured timeout."""


class _IdleWatchdog:
    """Cancels the current task once one read has waited `idle_s` (s).

    The stream stamps `since` (loop time) when a read starts and clears it when the read
    returns (time spent by the consumer between reads does not count); one timer re-arms
    itself only when it fires. An `asyncio.timeout` around every read (a Timeout object, a
    timer armed and cancelled per chunk) is the same bound at a cost per chunk. `expired()`
    tells a CancelledError that is this watchdog's (as `asyncio.timeout` does, via `uncancel`).
    """

    __slots__ = ("_fired", "_handle", "_idle_s", "_task", "loop", "since")

    def __init__(self, idle_s: float) -> None:
        self.loop = asyncio.get_running_loop()
        self._task = asyncio.current_task()
        self._idle_s = idle_s
        self._fired = False
        self.since: float | None = None
        self._handle: asyncio.TimerHandle | None = self.loop.call_later(idle_s, self._check)

    def _check(self) -> None:
        now = self.loop.time()
        deadline = now + self._idle_s if self.since is None else self.since + self._idle_s
        if now < deadline:
            self._handle = self.loop.call_at(deadline, self._check)
            return
        self._handle = None
        if self._task is not None and not self._task.done():
            self._fired = True
            self._task.cancel()

    def expired(self) -> bool:
        """True when the pending CancelledError is the watchdog's alone (then consumed)."""
        if not self._fired or self._task is None:
            return False
        self._fired = False
        return self._task.uncancel() == 0

    def stop(self) -> None:
        """Disarms the timer (idempotent)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None


class UpstreamResponse:
    """An instance's answer once its headers arrived; the caller reads or streams the body,
    then calls `release()` (connection back to the pool) or `close()` (connection dropped,
    which aborts an unfinished request in vLLM).

    Attributes:
        status: HTTP status code.
        headers: response headers (case-insensitive lookup).
    """

    __slots__ = ("_resp", "headers", "status")

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self._resp = resp
        self.status = resp.status
        self.headers: Mapping[str, str] = resp.headers

    async def chunks(self, idle_timeout_s: float | None = None) -> AsyncGenerator[bytes, None]:
        """The body as it arrives: each item is everything received since the last one.

        `idle_timeout_s` bounds each wait for the next bytes (s), below the request's own read
        timeout (a stream's silence between chunks; None = only the request's).

        Raises UpstreamUnreachable (broken off) or UpstreamTimeout (silent) mid-body."""
        content = self._resp.content
        watchdog = None
        if idle_timeout_s is not None:
            watchdog = _IdleWatchdog(idle_timeout_s)
            self._watchdog_replaces_read_timeout(idle_timeout_s)
        try:
            while True:
                if watchdog is None:
                    chunk = await content.readany()
                else:
                    watchdog.since = watchdog.loop.time()
                    chunk = await content.readany()
                    watchdog.since = None
                if not chunk:
                    return
                yield chunk
        except asyncio.CancelledError as exc:
            if watchdog is not None and watchdog.expired():
                raise UpstreamTimeout(f"{self._resp.url} went silent") from exc
            raise
        except TimeoutError as exc:
            raise UpstreamTimeout(f"{self._resp.url} went silent") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnreachable(f"{self._resp.url}: {exc or type(exc).__name__}") from exc
        finally:
            if watchdog is not None:
                watchdog.stop()

    def _watchdog_replaces_read_timeout(self, idle_timeout_s: float) -> None:
        # aiohttp's `sock_read` re-arms a timer on every packet received (a cancel and a
        # call_later per chunk). A stream's watchdog bounds each read by `idle_timeout_s`, at
        # most the request's read timeout (`Attempt`), so it is the same bound or a tighter one:
        # the connection's read timeout is switched off for the rest of this response (aiohttp
        # sets it again for the connection's next request). The timer armed by the last packet
        # lapses at the next one.
        conn = self._resp.connection
        protocol = conn.protocol if conn is not None else None
        if protocol is None:
            return
        read_timeout = protocol.read_timeout
        if read_timeout is not None and idle_timeout_s <= read_timeout:
            protocol.read_timeout = None

    async def read(self) -> bytes:
        """The whole body (raises as `chunks`)."""
        try:
            return await self._resp.read()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"{self._resp.url} stalled while sending its answer") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnreachable(f"{self._resp.url}: {exc or type(exc).__name__}") from exc

    def release(self) -> None:
        """Done with the answer: the connection goes back to the pool if it can be reused."""
        self._resp.release()

    def close(self) -> None:
        """Drops the connection (an unfinished request is aborted upstream)."""
        self._resp.close()


class UpstreamClient:
    """Pooled HTTP/1.1 client for prefill and decode legs (one per gateway, on its loop).

    Args:
        connect_timeout_s: bound on establishing a connection (s).
        max_connections: connection pool size across instances; 0 = unlimited.
    """

    def __init__(self, *, connect_timeout_s: float = 5.0, max_connections: int = 0) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None
        # (read, total) -> its ClientTimeout: the relay's few configured bounds, built once each
        # (at most _TIMEOUTS_KEPT of them, so that computed bounds cannot grow it).
        self._timeouts: dict[tuple[float, float | None], aiohttp.ClientTimeout] = {}

    def _timeout(self, read_s: float, total_s: float | None) -> aiohttp.ClientTimeout:
        timeout = self._timeouts.get((read_s, total_s))
        if timeout is None:
            timeout = aiohttp.ClientTimeout(
                total=total_s, connect=self._connect_timeout_s, sock_read=read_s
            )
            if len(self._timeouts) < _TIMEOUTS_KEPT:
                self._timeouts[(read_s, total_s)] = timeout
        return timeout

    def _get_session(self) -> aiohttp.ClientSession:
        # Created lazily so that it binds to the running event loop.
        if self._session is None:
            connector = aiohttp.TCPConnector(
                limit=self._max_connections,
                limit_per_host=0,
                keepalive_timeout=_KEEPALIVE_S,
                ttl_dns_cache=300,
            )
            self._session = aiohttp.ClientSession(
                connector=connector,
                auto_decompress=False,
                # No Accept-Encoding: answers are relayed as bytes and prefill's is parsed.
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
            )
        return self._session

    async def open(
        self,
        url: str,
        body: bytes | AsyncIterator[bytes],
        headers: Mapping[str, str],
        *,
        read_timeout_s: float,
        total_timeout_s: float | None = None,
        method: str = "POST",
    ) -> UpstreamResponse:
        """POSTs `body` (JSON bytes, or an async iterator sent chunked) and waits for the headers
        (`method="GET"` sends no body: the read-only routes).

        The caller owns the returned response: read or stream it, then `release()` or `close()`.
        `read_timeout_s` bounds every wait for bytes (s); `total_timeout_s` the whole exchange.

        Raises:
            UpstreamUnreachable: connection refused/reset or closed before the response headers.
            UpstreamTimeout: no response headers within the timeout.
        """
        timeout = self._timeout(read_timeout_s, total_timeout_s)
        try:
            resp = await self._get_session().request(
                method,
                url,
                data=body if method != "GET" else None,
                headers=headers,
                timeout=timeout,
            )
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no answer from {url} within {read_timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            accepted = isinstance(exc, aiohttp.ServerDisconnectedError)
            raise UpstreamUnreachable(f"{url}: {exc or type(exc).__name__}", accepted) from exc
        return UpstreamResponse(resp)

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
        """Closes the pool (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None
