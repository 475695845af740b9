"""What each request brought to a sim and how it ended (served at `GET /sim/requests`)."""

from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Recorder", "RequestRecord"]


@dataclass(slots=True)
class RequestRecord:
    """One received request.

    Attributes:
        seq: arrival order within this sim (from 1).
        path: URL path, e.g. "/v1/chat/completions".
        request_id: the X-Request-Id header ("" when absent).
        body: the JSON body exactly as received (parsed).
        received_at: arrival time (Unix s).
        status: HTTP status sent (None while running or when the connection was dropped).
        finished: the handler has ended (response sent, failed or cancelled).
        cancelled: the client went away before the response was complete.
        fault: injected fault ("http500", "drop", "stall") or None.
        kv: what happened to KV: {"role": "producer", "transfer_id", "blocks"} or
            {"role": "consumer", "transfer_id", "result": "pulled" | "nixl" | "failed: ..."}.
        tokens_sent: output tokens delivered (streamed or in the body).
        queued_step: engine steps this sim had completed when the request entered its
            scheduler queue (None before that, or when it never did: a bad request, a fault).
        first_token_step: the number (from 1) of the engine step that sampled its first
            token (None until then). Steps count the engine's own progress, so
            `first_token_step - queued_step` is the steps it waited and prefilled, whatever
            the machine's load (which only makes steps last longer).
        first_token_at: when the handler had its first token (Unix s; None until then):
            with `received_at`, the time it spent in this sim before its first token.
    """

    seq: int
    path: str
    request_id: str
    body: Any
    received_at: float = field(default_factory=time.time)
    status: int | None = None
    finished: bool = False
    cancelled: bool = False
    fault: str | None = None
    kv: dict[str, Any] | None = None
    tokens_sent: int = 0
    queued_step: int | None = None
    first_token_step: int | None = None
    first_token_at: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class Recorder:
    """Keeps the last `limit` request records (0 keeps none but still counts)."""

    def __init__(self, limit: int) -> None:
        self._records: deque[RequestRecord] = deque(maxlen=max(limit, 0))
        self._limit = limit
        self._seq = itertools.count(1)

    def add(self, path: str, request_id: str, body: Any) -> RequestRecord:
        record = RequestRecord(next(self._seq), path, request_id, body)
        if self._limit:
            self._records.append(record)
        return record

    def records(self) -> list[RequestRecord]:
        return list(self._records)

    def clear(self) -> None:
        self._records.clear()
