"""uvicorn options of the gateway's HTTP server: client read timeouts and a connection cap.

uvicorn bounds an idle keep-alive connection (`timeout_keep_alive`) but not a client that opens a
connection and sends its request headers slowly or never (slowloris: 300 such connections were
held 93 s without a close, bounded only by the fd limit). `HeaderTimeoutProtocol` closes a
connection whose request headers are not complete `header_timeout_s` after it opened or after the
request's first byte; the body's read is bounded by the relay endpoints (`--body-timeout-s`, a
408). `--max-client-connections` caps connections plus running requests, as uvicorn's
`limit_concurrency` counts them: past it a request gets an OpenAI-style 503 (uvicorn's own
answer is plain text) and its connection is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from pdplane.gateway.errors import error_body
from pdplane.gateway.settings import GatewaySettings

__all__ = ["HeaderTimeoutProtocol", "server_options"]


class HeaderTimeoutProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol plus a deadline on each request's headers.

    `header_timeout_s` (s) is a class attribute: `server_options` makes a subclass per value.
    """

    header_timeout_s: float = 10.0
    #: connections plus running requests at once (`--max-client-connections`; None: no cap)
    max_client_connections: int | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._header_timer: asyncio.TimerHandle | None = None

    def _arm_header_timer(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._headers_late)

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._arm_header_timer()

    def on_headers_complete(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        cap = self.max_client_connections
        if cap is not None and (len(self.connections) >= cap or len(self.tasks) >= cap):
            # uvicorn runs `self.app` for the request whose headers just ended: the refusal.
            app, self.app = self.app, _over_the_cap(cap)
            try:
                super().on_headers_complete()
            finally:
                self.app = app
            return
        super().on_headers_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None
        super().connection_lost(exc)


def _over_the_cap(cap: int) -> Any:
    """The ASGI app answering a request past `--max-client-connections` `cap`: 503, an
    OpenAI-style error, the connection closed."""
    body = error_body(
        503, f"the gateway is at its connection limit (--max-client-connections {cap}); retry"
    )

    async def refuse(scope: Any, receive: Any, send: Any) -> None:
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    return refuse


def server_options(settings: GatewaySettings) -> dict[str, Any]:
    """`uvicorn.Config` keywords for the gateway's client-facing limits in `settings`."""
    protocol = type(
        "GatewayHttpProtocol",
        (HeaderTimeoutProtocol,),
        {
            "header_timeout_s": settings.header_timeout_s,
            "max_client_connections": settings.max_client_connections or None,
        },
    )
    # uvicorn's own `limit_concurrency` stays off: its refusal is plain text.
    return {"http": protocol, "timeout_keep_alive": settings.keep_alive_s}
