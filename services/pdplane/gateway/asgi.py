"""ASGI pieces of the relay endpoints: client-disconnect watching and the SSE response.

Starlette does not cancel a handler when its client disconnects (and, under ASGI 2.4 servers,
a streaming response only notices on its next write). The gateway must cancel the upstream
requests promptly, so one listener per request waits for `http.disconnect` and cancels the work.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdplane.gateway.replies import StreamReply

__all__ = ["DisconnectWatch", "SSEResponse"]

T = TypeVar("T")


class DisconnectWatch:
    """Listens for the client's `http.disconnect` (after the body was read)."""

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self.task: asyncio.Task[None] = asyncio.get_running_loop().create_task(self._listen())

    async def _listen(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                return

    async def run(self, work: Awaitable[T]) -> tuple[bool, T | None]:
        """Awaits `work` unless the client disconnects first.

        Returns (True, result), or (False, None) after cancelling `work` (and letting its
        cleanup run) when the client went away. Exceptions of `work` propagate.
        """
        job = asyncio.ensure_future(work)
        try:
            await asyncio.wait((job, self.task), return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            job.cancel()
            with contextlib.suppress(BaseException):
                await job
            raise
        if job.done():
            return True, job.result()
        job.cancel()
        with contextlib.suppress(BaseException):
            await job
        return False, None

    def close(self) -> None:
        """Stops listening."""
        self.task.cancel()


class SSEResponse(Response):
    """Relays a StreamReply's events; cancels it when the client disconnects.

    `on_done()` runs once at the end, whatever happened.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        reply: StreamReply,
        watch: DisconnectWatch,
        headers: dict[str, str],
        on_done: Callable[[], Any],
    ) -> None:
        # No Response.__init__: it would add "content-length: 0" for the empty body.
        self.status_code = 200
        self.background = None
        self.init_headers({**reply.headers, **headers})
        self._reply = reply
        self._watch = watch
        self._on_done = on_done

    async def _pump(self, send: Send) -> None:
        async for chunk in self._reply.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            pump = asyncio.ensure_future(self._pump(send))
            try:
                await asyncio.wait((pump, self._watch.task), return_when=asyncio.FIRST_COMPLETED)
            finally:
                if not pump.done():
                    pump.cancel()
                with contextlib.suppress(BaseException):
                    await pump
        finally:
            await self._reply.aclose()
            self._watch.close()
            self._on_done()
