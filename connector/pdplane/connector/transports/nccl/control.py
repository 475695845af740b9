"""The two ends of a pair's control stream (`NcclKvTransfer.Pair`, a bidirectional gRPC stream).

Both ends send from a queue (never blocking the sender on the network) and read on a thread of
their own, handing each message to a callback; when the stream ends, for whatever reason, the
`on_end` callback runs exactly once with why, and whether the other side ended it cleanly (it
closed its half: the pair is closing, not broken). The caller's end (`CallerLink`) is a client call;
the server's end (`ServerLink`) is the response iterator a handler returns plus the request
iterator gRPC gave it.

Threads: per link, one reader (ours) and one sender (gRPC's request consumer on the caller's
side, the handler thread on the server's side). Every thread ends when the stream does.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import grpc

from pdplane.connector.transports.nccl.errors import NcclTransferError
from pdplane.v1 import kv_transfer_nccl_pb2

__all__ = ["CallerLink", "ServerLink"]

log = logging.getLogger(__name__)

_END: Any = object()  # queue sentinel: no more messages from this side


class _Broken:
    """Queue sentinel of a server end broken on purpose: the handler raises (an error status)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


OnMessage = Callable[[kv_transfer_nccl_pb2.NcclControl], None]
OnEnd = Callable[[str, bool], None]


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.Call):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


def _pump(
    messages: Iterable[kv_transfer_nccl_pb2.NcclControl],
    on_message: Callable[[kv_transfer_nccl_pb2.NcclControl], None],
    ended: str,
) -> tuple[str, bool]:
    """Feeds every message of one side of a control stream to `on_message` until it ends;
    returns why it ended and whether cleanly (`ended`, True) or not (the error, False)."""
    try:
        for message in messages:
            on_message(message)
    except grpc.RpcError as exc:
        return _describe(exc), False
    except Exception as exc:
        log.exception("control stream reader failed")
        return _describe(exc), False
    return ended, True


class _Ends:
    """Runs `on_end` once."""

    def __init__(self, on_end: OnEnd) -> None:
        self._on_end = on_end
        self._lock = threading.Lock()
        self.ended = False

    def __call__(self, reason: str, clean: bool) -> None:
        with self._lock:
            if self.ended:
                return
            self.ended = True
        try:
            self._on_end(reason, clean)
        except Exception:  # a bug in the handler must not kill the reader silently
            log.exception("control stream end handler failed")


class CallerLink:
    """The caller's end: opens the stream with `first` and reads the server's messages.

    Args:
        method: the stub's `Pair` multi-callable.
        metadata: call metadata (bearer token).
        first: the hello.
        on_message / on_end: see the module docstring (called on the reader thread).
        name: for thread names and logs.
    """

    def __init__(
        self,
        method: Any,
        metadata: tuple[tuple[str, str], ...],
        first: kv_transfer_nccl_pb2.NcclControl,
        on_message: OnMessage,
        on_end: OnEnd,
        name: str,
    ) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._queue.put(first)
        self._on_message = on_message
        self._ends = _Ends(on_end)
        self.alive = True
        self._call = method(iter(self._queue.get, _END), metadata=metadata)
        self._reader = threading.Thread(target=self._read, name=f"nccl-link-{name}", daemon=True)
        self._reader.start()

    def send(self, message: kv_transfer_nccl_pb2.NcclControl) -> None:
        """Queues `message`; raises NcclTransferError(UNAVAILABLE) once the stream ended."""
        if not self.alive:
            raise NcclTransferError("control stream closed", grpc.StatusCode.UNAVAILABLE)
        self._queue.put(message)

    def close(self, reason: str) -> None:
        """Ends this side (half-close): the server then frees its side and ends the stream."""
        self._queue.put(_END)

    def cancel(self, reason: str) -> None:
        """Breaks the stream now (both sides abort their communicator)."""
        self._queue.put(_END)
        self._call.cancel()

    def _read(self) -> None:
        reason, clean = "ended by the server", True
        try:
            reason, clean = _pump(self._call, self._on_message, reason)
        finally:
            self.alive = False
            self._queue.put(_END)  # ends gRPC's request consumer if it still waits
            self._ends(reason, clean)


class ServerLink:
    """The server's end, inside the `Pair` handler: `responses()` is what the handler returns;
    `start(requests)` reads the caller's messages on a thread of its own."""

    def __init__(self, on_message: OnMessage, on_end: OnEnd, name: str) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._on_message = on_message
        self._ends = _Ends(on_end)
        self._name = name
        self.alive = True

    def send(self, message: kv_transfer_nccl_pb2.NcclControl) -> None:
        """Queues `message`; raises NcclTransferError(UNAVAILABLE) once the stream ended."""
        if not self.alive:
            raise NcclTransferError("control stream closed", grpc.StatusCode.UNAVAILABLE)
        self._queue.put(message)

    def close(self, reason: str) -> None:
        """Asks the caller to end the stream (it does once its transfer is over)."""
        if self.alive:
            self._queue.put(
                kv_transfer_nccl_pb2.NcclControl(
                    close=kv_transfer_nccl_pb2.NcclClose(reason=reason)
                )
            )

    def cancel(self, reason: str) -> None:
        """Breaks the stream now from this side (the caller sees an error status, not a
        clean end, and aborts its communicator)."""
        self.alive = False
        self._queue.put(_Broken(reason))

    def responses(self) -> Iterator[kv_transfer_nccl_pb2.NcclControl]:
        """The handler's response stream: everything sent, until the stream ends."""
        while True:
            message = self._queue.get()
            if message is _END:
                return
            if isinstance(message, _Broken):
                raise RuntimeError(f"pair closed: {message.reason}")
            yield message

    def start(
        self,
        requests: Iterator[kv_transfer_nccl_pb2.NcclControl],
        before: Callable[[], None] | None = None,
    ) -> None:
        """Reads the caller's messages (after the hello) on a thread of its own, which first
        runs `before()` (the caller's messages wait for it). If `before` raises, the stream
        is broken (the caller sees an error status) and the link ends."""
        threading.Thread(
            target=self._read,
            args=(requests, before),
            name=f"nccl-link-{self._name}",
            daemon=True,
        ).start()

    def _read(
        self,
        requests: Iterator[kv_transfer_nccl_pb2.NcclControl],
        before: Callable[[], None] | None,
    ) -> None:
        reason, clean = "ended by the caller", True
        try:
            if before is not None:
                try:
                    before()
                except Exception as exc:
                    reason, clean = _describe(exc), False
                    self.cancel(reason)
                    return
            reason, clean = _pump(requests, self._on_message, reason)
        finally:
            self.alive = False
            self._queue.put(_END)  # the handler's response stream ends too
            self._ends(reason, clean)
