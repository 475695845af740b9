"""ASGI pieces of the relay endpoints: client-disconnect watching and the SSE response.

Starlette does not cancel a handler when its client disconnects (and, under ASGI 2.4 servers,
a streaming response only notices on its next write). The gateway must cancel the upstream
requests promptly, so one listener task per request waits for `http.disconnect` and cancels the
request's own task while it is relaying. The work itself runs in the request's task: no extra
task and no `asyncio.wait` per stage, which measured as a visible share of a request's CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from pdplane.gateway.errors import unavailable
from pdplane.gateway.replies import SSE_DONE, StreamReply

__all__ = ["DisconnectWatch", "SSEResponse"]

T = TypeVar("T")

#: The end of a stream still open when the server's shutdown bound runs out.
_SHUTTING_DOWN = (
    unavailable("the server is shutting down; the stream ended before its last token").sse_event()
    + SSE_DONE
)
#: Longest wait to hand that end to a client that does not read (s).
_SHUTTING_DOWN_WRITE_S = 1.0


async def _say_shutting_down(send: Send) -> None:
    """Ends the response with `_SHUTTING_DOWN` (bounded); a connection already gone is
    left alone."""
    message = {"type": "http.response.body", "body": _SHUTTING_DOWN, "more_body": False}
    with contextlib.suppress(OSError, RuntimeError, TimeoutError):
        await asyncio.wait_for(send(message), _SHUTTING_DOWN_WRITE_S)


class DisconnectWatch:
    """Listens for the client's `http.disconnect` (after the body was read).

    Create it inside the request's task; `run` then cancels that task's work when the client
    goes away.
    """

    def __init__(self, receive: Receive) -> None:
        self._receive = receive
        self._owner = asyncio.current_task()
        self._running = False
        #: True once the client disconnected.
        self.gone = False
        self.task: asyncio.Task[None] = asyncio.get_running_loop().create_task(self._listen())

    async def _listen(self) -> None:
        while True:
            message = await self._receive()
            if message["type"] == "http.disconnect":
                self.gone = True
                if self._running and self._owner is not None:
                    self._owner.cancel()
                return

    async def run(self, work: Coroutine[Any, Any, T]) -> tuple[bool, T | None]:
        """Awaits `work` in the current task unless the client disconnects first.

        Returns (True, result), or (False, None) when the client went away: `work` was
        cancelled and its cleanup ran (or it never started). Exceptions of `work` propagate, and
        so does a cancellation from elsewhere (e.g. server shutdown).
        """
        if self.gone:
            work.close()
            return False, None
        self._running = True
        try:
            return True, await work
        except asyncio.CancelledError:
            # Ours only if the client left and nobody else asked to cancel this task as well.
            if not self.gone or self._owner is None or self._owner.uncancel() > 0:
                raise
            return False, None
        finally:
            self._running = False

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
        # The chunk ending in [DONE] goes out with the end of the response, in one write, once
        # the relay saw decode's stream end (so its accounting is done before the client's
        # receive() reports the response complete).
        held = b""
        async for chunk in self._reply.chunks:
            if held:
                await send({"type": "http.response.body", "body": held, "more_body": True})
                held = b""
            if chunk.endswith(SSE_DONE):
                held = chunk
            else:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": held, "more_body": False})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            try:
                await self._watch.run(self._pump(send))
            except asyncio.CancelledError:
                if self._watch.gone:
                    raise
                # The server's shutdown bound ran out (uvicorn cancels the request's task): the
                # stream ends as an answer, with its error event, and the cancellation is
                # consumed here, so the server logs no "Exception in ASGI application" for a
                # stream that ended as it should.
                await _say_shutting_down(send)
                task = asyncio.current_task()
                if task is not None:
                    task.uncancel()
        finally:
            await self._reply.aclose()
            self._watch.close()
            self._on_done()
