"""Reading a client's request body, bounded in size and time (every route that takes one)."""

from __future__ import annotations

import asyncio

from starlette.types import Receive

from pdplane.gateway.errors import GatewayError

__all__ = ["CLIENT_CLOSED", "MAX_BODY", "ClientGone", "read_body"]

#: Largest accepted request body (bytes).
MAX_BODY = 64 * 1024 * 1024
#: Status recorded for requests whose client went away before an answer (nginx's convention).
CLIENT_CLOSED = 499


class ClientGone(Exception):
    """The client disconnected while its body was being read."""


async def read_body(receive: Receive, timeout_s: float) -> bytes:
    """The request body from the ASGI `receive` channel.

    Raises GatewayError 413 once it passes `MAX_BODY` bytes (nothing more is read), 408 when it
    takes longer than `timeout_s` (s), and ClientGone when the client disconnects first.
    """
    try:
        async with asyncio.timeout(timeout_s):
            return await _receive(receive)
    except TimeoutError:
        raise GatewayError(408, f"request body not received within {timeout_s:g} s") from None


async def _receive(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > MAX_BODY:
            raise GatewayError(413, f"request body larger than {MAX_BODY} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)
