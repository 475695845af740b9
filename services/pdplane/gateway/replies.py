"""What one relayed request ends in: a complete answer, a stream, or a retry on another pair."""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

from pdplane.gateway.errors import GatewayError

__all__ = ["SSE_DONE", "SSE_ERROR", "JsonReply", "RetryElsewhere", "StreamReply", "sse_event"]

#: The last event of a well-formed OpenAI stream.
SSE_DONE = b"data: [DONE]\n\n"
#: How an error event starts (vLLM's mid-stream error: `data: {"error": {...}}`, then
#: `[DONE]`; the gateway's own are written the same way).
SSE_ERROR = b'data: {"error"'


def sse_event(obj: dict[str, Any]) -> bytes:
    """One SSE event carrying `obj` as compact JSON, framed as vLLM frames its chunks."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


@dataclass(frozen=True, slots=True)
class JsonReply:
    """A complete answer: HTTP `status`, `body` bytes and their content type."""

    status: int
    body: bytes
    content_type: str = "application/json"


@dataclass(frozen=True, slots=True)
class StreamReply:
    """A streamed answer: iterate `chunks` (whole SSE events, bytes), then always `aclose()`.

    `aclose` also cleans up when `chunks` was never iterated (client gone before the first
    event): the upstream response is closed and the request released as cancelled.
    """

    chunks: AsyncGenerator[bytes, None]
    headers: dict[str, str]
    abandon: Callable[[], None]

    async def aclose(self) -> None:
        """Ends the stream (idempotent)."""
        await self.chunks.aclose()
        self.abandon()


class RetryElsewhere(Exception):
    """An attempt failed before anything reached the client; another pair may succeed."""

    def __init__(self, side: str, instance_id: str, error: GatewayError) -> None:
        super().__init__(error.message)
        self.side = side
        self.instance_id = instance_id
        self.error = error
