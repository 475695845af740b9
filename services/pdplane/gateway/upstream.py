"""The gateway's one pooled HTTP client to the instances (aiohttp).

aiohttp was chosen over httpx by measurement: relaying one JSON answer plus one 17-event SSE
stream per request from a loopback server cost ~230 us of client CPU with aiohttp and ~3000 us
with httpx (2000 requests, 16 concurrent; see docs/gateway.md). One `ClientSession` is shared
by all requests; nothing is created per request but the request itself.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

import aiohttp

__all__ = ["UpstreamClient", "UpstreamTimeout", "UpstreamUnreachable"]

#: Below uvicorn's (and so vLLM's) 5 s keep-alive, so that a pooled connection is never reused
#: just as the server closes it (a POST on such a connection fails and cannot be retried).
_KEEPALIVE_S = 4.0


class UpstreamUnreachable(Exception):
    """The instance could not be reached or closed the connection before answering."""


class UpstreamTimeout(Exception):
    """The instance did not answer (or went silent) for longer than the configured timeout."""


class UpstreamClient:
    """Pooled HTTP/1.1 client for prefill and decode legs.

    Args:
        connect_timeout_s: bound on establishing a connection (s).
        max_connections: connection pool size across instances; 0 = unlimited.
    """

    def __init__(self, *, connect_timeout_s: float = 5.0, max_connections: int = 0) -> None:
        self._connect_timeout_s = connect_timeout_s
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

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

    async def close(self) -> None:
        """Closes the pool (idempotent)."""
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def open(
        self,
        url: str,
        body: bytes | AsyncIterator[bytes],
        headers: Mapping[str, str],
        *,
        read_timeout_s: float,
        total_timeout_s: float | None = None,
    ) -> aiohttp.ClientResponse:
        """POSTs `body` (JSON bytes, or an async iterator sent chunked) and waits for the headers.

        The caller owns the returned response: read or stream it, then `release()` or `close()`.
        `read_timeout_s` bounds every wait for bytes (s); `total_timeout_s` the whole exchange.

        Raises:
            UpstreamUnreachable: connection refused/reset or closed before the response headers.
            UpstreamTimeout: no response headers within the timeout.
        """
        timeout = aiohttp.ClientTimeout(
            total=total_timeout_s, connect=self._connect_timeout_s, sock_read=read_timeout_s
        )
        try:
            return await self._get_session().post(url, data=body, headers=headers, timeout=timeout)
        except TimeoutError as exc:
            raise UpstreamTimeout(f"no answer from {url} within {read_timeout_s:g} s") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnreachable(f"{url}: {exc or type(exc).__name__}") from exc

    @staticmethod
    async def read(resp: aiohttp.ClientResponse) -> bytes:
        """Reads the whole body of `resp` and releases the connection to the pool.

        Raises:
            UpstreamUnreachable: the connection broke before the body was complete.
            UpstreamTimeout: the body stalled longer than the read timeout.
        """
        try:
            return await resp.read()
        except TimeoutError as exc:
            raise UpstreamTimeout(f"{resp.url} stalled while sending its answer") from exc
        except aiohttp.ClientError as exc:
            raise UpstreamUnreachable(f"{resp.url}: {exc or type(exc).__name__}") from exc
        finally:
            resp.release()
