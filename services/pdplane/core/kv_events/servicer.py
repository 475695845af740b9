"""gRPC servicers of `pdplane.v1.KvEvents` over a `KvEventLog`, for sync and asyncio servers.

`add_kv_events_servicer(server, log)` adds the service to any pdplane gRPC server: the
connector's KvTransfer server (sync `grpc.server`, inside vLLM) or the simulator's
(`grpc.aio.server`). Authentication and TLS are the server's own (`pdplane.core.grpc.util`
interceptors and ports), so KvEvents is guarded exactly like the service next to it.

A stream never blocks the log's writer: it waits on a per-stream wake-up (set by the log's
listener), sends what is ready, and a heartbeat after `heartbeat_s` of silence. gRPC's flow
control holds a slow subscriber's stream back; its cursor then falls out of the log's bounded
ring and the next message is a fresh snapshot (never a silent gap). A subscriber that asks
for `min_interval_ms` gets at most one events message per interval: the events of the interval
travel as one batch, so its cost follows that rate instead of the engine's event rate (the
first event after a quiet interval is sent at once).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncIterator, Iterator

import grpc

from pdplane.core.kv_events.log import KvEventLog, SubscriptionCursor
from pdplane.v1 import kv_events_pb2, kv_events_pb2_grpc

__all__ = [
    "SERVICE_NAME",
    "AioKvEventsServicer",
    "KvEventsServicer",
    "StreamOptions",
    "add_kv_events_servicer",
]

log = logging.getLogger(__name__)

SERVICE_NAME = "pdplane.v1.KvEvents"
_MAX_NAME = 128


class StreamOptions:
    """Limits of the Subscribe streams of one server.

    Args:
        heartbeat_s: a heartbeat after this long without a message (s).
        max_subscribers: concurrent streams; more are refused with RESOURCE_EXHAUSTED (a sync
            server runs each stream on one of its threads).
        batch_events: most events per message.
        chunk_tokens: a snapshot chunk closes at this many tokens (bounds message size).
    """

    def __init__(
        self,
        *,
        heartbeat_s: float = 1.0,
        max_subscribers: int = 8,
        batch_events: int = 256,
        chunk_tokens: int = 262_144,
    ) -> None:
        if heartbeat_s <= 0 or max_subscribers <= 0 or batch_events <= 0 or chunk_tokens <= 0:
            raise ValueError("stream options must be > 0")
        self.heartbeat_s = heartbeat_s
        self.max_subscribers = max_subscribers
        self.batch_events = batch_events
        self.chunk_tokens = chunk_tokens


class _Slots:
    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._used = 0
        self._lock = threading.Lock()

    def take(self) -> bool:
        with self._lock:
            if self._used >= self._limit:
                return False
            self._used += 1
            return True

    def give(self) -> None:
        with self._lock:
            self._used -= 1


def _cursor(
    log_: KvEventLog, request: kv_events_pb2.SubscribeKvEventsRequest, opts: StreamOptions
) -> SubscriptionCursor:
    return SubscriptionCursor(
        log_,
        request.epoch,
        request.from_sequence,
        batch_events=opts.batch_events,
        chunk_tokens=opts.chunk_tokens,
        columnar=request.columnar_stores,
    )


def _interval_s(request: kv_events_pb2.SubscribeKvEventsRequest, opts: StreamOptions) -> float:
    """The subscriber's `min_interval_ms` in seconds, capped at the heartbeat period."""
    return min(request.min_interval_ms / 1000.0, opts.heartbeat_s)


def _describe(request: kv_events_pb2.SubscribeKvEventsRequest, peer: str) -> str:
    who = "".join(c if c.isprintable() else "?" for c in request.subscriber[:_MAX_NAME])
    return f"{who or 'subscriber'}@{peer}"


class KvEventsServicer(kv_events_pb2_grpc.KvEventsServicer):
    """Sync servicer (a `grpc.server` thread per open stream)."""

    def __init__(self, log_: KvEventLog, options: StreamOptions | None = None) -> None:
        self._log = log_
        self._opts = options or StreamOptions()
        self._slots = _Slots(self._opts.max_subscribers)

    def Subscribe(
        self, request: kv_events_pb2.SubscribeKvEventsRequest, context: grpc.ServicerContext
    ) -> Iterator[kv_events_pb2.KvEventsMessage]:
        if self._log.closed:
            context.abort(grpc.StatusCode.UNAVAILABLE, "the KV event log is closed")
        if not self._slots.take():
            context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {self._opts.max_subscribers} KV event subscribers",
            )
        wake = threading.Event()
        ended = threading.Event()
        handle = self._log.add_listener(wake.set)

        def on_end() -> None:  # the RPC ended (cancelled, deadline): stop waiting
            ended.set()
            wake.set()

        context.add_callback(on_end)
        cursor = _cursor(self._log, request, self._opts)
        interval = _interval_s(request, self._opts)
        events_sent = -interval
        name = _describe(request, context.peer())
        log.info(
            "KV events: %s subscribed (epoch %d from %d)",
            name,
            request.epoch,
            request.from_sequence,
        )
        try:
            while context.is_active():
                wake.clear()
                if self._log.closed:
                    context.abort(grpc.StatusCode.UNAVAILABLE, "the KV event log is closed")
                hold = events_sent + interval - time.monotonic()
                if hold > 0 and not cursor.in_snapshot and ended.wait(hold):
                    break
                msg = cursor.next_message()
                if msg is not None:
                    if msg.HasField("events"):
                        events_sent = time.monotonic()
                    yield msg
                elif not wake.wait(self._opts.heartbeat_s):
                    yield cursor.heartbeat()
        finally:
            self._log.remove_listener(handle)
            self._slots.give()
            log.info("KV events: %s left after %d snapshot(s)", name, cursor.snapshots)


class AioKvEventsServicer(kv_events_pb2_grpc.KvEventsServicer):
    """Asyncio servicer (`grpc.aio.server`); the log may be written from any thread."""

    def __init__(self, log_: KvEventLog, options: StreamOptions | None = None) -> None:
        self._log = log_
        self._opts = options or StreamOptions()
        self._slots = _Slots(self._opts.max_subscribers)

    async def Subscribe(  # type: ignore[override]
        self, request: kv_events_pb2.SubscribeKvEventsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[kv_events_pb2.KvEventsMessage]:
        if self._log.closed:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the KV event log is closed")
        if not self._slots.take():
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"at most {self._opts.max_subscribers} KV event subscribers",
            )
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()

        def on_event() -> None:
            loop.call_soon_threadsafe(wake.set)

        handle = self._log.add_listener(on_event)
        cursor = _cursor(self._log, request, self._opts)
        interval = _interval_s(request, self._opts)
        events_sent = -interval
        name = _describe(request, context.peer())
        log.info(
            "KV events: %s subscribed (epoch %d from %d)",
            name,
            request.epoch,
            request.from_sequence,
        )
        try:
            while True:
                wake.clear()
                if self._log.closed:
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "the KV event log is closed")
                hold = events_sent + interval - time.monotonic()
                if hold > 0 and not cursor.in_snapshot:
                    await asyncio.sleep(hold)
                msg = cursor.next_message()
                if msg is not None:
                    if msg.HasField("events"):
                        events_sent = time.monotonic()
                    yield msg
                    continue
                try:
                    await asyncio.wait_for(wake.wait(), self._opts.heartbeat_s)
                except TimeoutError:
                    yield cursor.heartbeat()
        finally:
            self._log.remove_listener(handle)
            self._slots.give()
            log.info("KV events: %s left after %d snapshot(s)", name, cursor.snapshots)


def add_kv_events_servicer(
    server: grpc.Server | grpc.aio.Server,
    log_: KvEventLog,
    options: StreamOptions | None = None,
) -> str:
    """Adds `pdplane.v1.KvEvents` serving `log_` to `server` (sync or asyncio, before it
    starts). Returns the service's full name (for health and reflection lists)."""
    servicer: kv_events_pb2_grpc.KvEventsServicer
    if isinstance(server, grpc.aio.Server):
        servicer = AioKvEventsServicer(log_, options)
    else:
        servicer = KvEventsServicer(log_, options)
    kv_events_pb2_grpc.add_KvEventsServicer_to_server(servicer, server)
    return SERVICE_NAME
