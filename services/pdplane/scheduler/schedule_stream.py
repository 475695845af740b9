"""One long-lived `Scheduler.ScheduleStream` of a gateway: calls matched to answers by id.

stream = ScheduleStream(stub, metadata)
result = await stream.call(request, traceparent, timeout_s=5.0)   # a ScheduleResult
...
await stream.close()

A unary Schedule costs a gRPC call each (setup, metadata, deadline, status on both ends); on
one stream a decision is one message each way, which saves the scheduler process most of its
per-call cost (measured: -16 % of the remote CPU per request, `git show
a4bcc95:docs/benchmarks.md`). Calls made while a message is being written leave together in the
next one (`ScheduleCalls`), and the scheduler answers each message's calls in one
`ScheduleResults`. The
stream carries the token metadata once, when it opens; the trace context rides in each
`ScheduleCall`. `RemoteScheduler` owns the retries and the fallback to the unary call.
"""

from __future__ import annotations

import asyncio
import itertools

import grpc

from pdplane.v1 import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["ScheduleStream", "StreamEnded"]

Metadata = tuple[tuple[str, str], ...]


class StreamEnded(Exception):
    """The stream ended before the call's answer came. `code`: the stream's status (OK when
    the scheduler closed it, UNAVAILABLE when it went away, UNIMPLEMENTED when it has no
    ScheduleStream, DEADLINE_EXCEEDED when the call's own timeout passed first)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}" if details else code.name)
        self.code = code
        self.details = details


class ScheduleStream:
    """A `ScheduleStream` RPC opened on `stub` (inside the running event loop).

    Any number of `call`s may be in flight at once; `ended` turns True when the stream is gone
    (every call then in flight fails with StreamEnded, and the owner opens a new one).
    """

    def __init__(self, stub: scheduler_pb2_grpc.SchedulerStub, metadata: Metadata) -> None:
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[scheduler_pb2.ScheduleResult]] = {}
        # grpc.aio allows one write in flight per call: the calls queued while a message is
        # being written leave together, in the next one.
        self._queued: list[tuple[int, scheduler_pb2.ScheduleRequest, str]] = []
        self._releases: list[scheduler_pb2.ReleaseRequest] = []
        self._wakeup: asyncio.Future[None] | None = None
        self._closing = False
        self._loop = asyncio.get_running_loop()
        self._call = stub.ScheduleStream(self._requests(), metadata=metadata)
        self.ended = False
        self._reader = self._loop.create_task(self._read())

    def _wake(self) -> None:
        wakeup, self._wakeup = self._wakeup, None
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    async def _requests(self):  # type: ignore[no-untyped-def]
        while not self._closing:
            if not self._queued and not self._releases:
                self._wakeup = self._loop.create_future()
                await self._wakeup
                continue
            queued, self._queued = self._queued, []
            batch = scheduler_pb2.ScheduleCalls()
            if self._releases:
                batch.releases.extend(self._releases)
                self._releases = []
            add = batch.calls.add
            for call_id, request, traceparent in queued:
                add(call_id=call_id, request=request, traceparent=traceparent)
            yield batch

    async def _read(self) -> None:
        error = StreamEnded(grpc.StatusCode.OK, "the scheduler ended the stream")
        pending = self._pending
        try:
            async for answers in self._call:
                for result in answers.results:
                    future = pending.pop(result.call_id, None)
                    if future is not None and not future.done():
                        future.set_result(result)
        except grpc.aio.AioRpcError as exc:
            error = StreamEnded(exc.code(), exc.details() or "")
        except asyncio.CancelledError:
            error = StreamEnded(grpc.StatusCode.CANCELLED, "the stream was closed")
        finally:
            self.ended = True
            self._closing = True
            self._wake()  # ends the request generator, which may wait for calls
            for future in pending.values():
                if not future.done():
                    future.set_exception(error)
            pending.clear()

    async def call(
        self, request: scheduler_pb2.ScheduleRequest, traceparent: str, timeout_s: float
    ) -> scheduler_pb2.ScheduleResult:
        """Sends one ScheduleCall (with the calls queued beside it); returns its ScheduleResult
        (whatever its code).

        Raises StreamEnded when the stream ends first, or with DEADLINE_EXCEEDED after
        `timeout_s` seconds without an answer (a late answer is then dropped)."""
        if self.ended:
            raise StreamEnded(grpc.StatusCode.UNAVAILABLE, "the stream has ended")
        call_id = next(self._ids)
        loop = self._loop
        future: asyncio.Future[scheduler_pb2.ScheduleResult] = loop.create_future()
        self._pending[call_id] = future
        self._queued.append((call_id, request, traceparent))
        if self._wakeup is not None:
            self._wake()
        timer = loop.call_later(timeout_s, _expire, future, timeout_s)
        try:
            return await future
        finally:
            timer.cancel()
            self._pending.pop(call_id, None)

    def release(self, releases: list[scheduler_pb2.ReleaseRequest]) -> None:
        """Sends `releases` in the next message, unanswered (fire and forget: the scheduler
        expires an assignment whose Release is lost with the stream). Raises StreamEnded
        when the stream is gone."""
        if self.ended:
            raise StreamEnded(grpc.StatusCode.UNAVAILABLE, "the stream has ended")
        self._releases.extend(releases)
        if self._wakeup is not None:
            self._wake()

    async def close(self) -> None:
        """Ends the stream; calls still in flight fail with StreamEnded (CANCELLED)."""
        self._closing = True
        self._wake()
        self._call.cancel()
        await asyncio.gather(self._reader, return_exceptions=True)


def _expire(future: asyncio.Future[scheduler_pb2.ScheduleResult], timeout_s: float) -> None:
    if not future.done():
        future.set_exception(
            StreamEnded(grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s:.3g} s")
        )
