"""The remote `SchedulerPort`: asyncio gRPC client of a `pdplane scheduler` process.

scheduler = RemoteScheduler("127.0.0.1:50052")
decision = await scheduler.schedule(RequestFeatures("req-1", "tiny", 42, 16))
...  # decision.prefill.url, decision.decode.url, decision.reason
await scheduler.release("req-1", Outcome.SUCCESS)   # or, batched: release_nowait(...)
await scheduler.close()

`release_nowait` costs no call of its own on a busy gateway: queued Releases ride on the next
Schedule (`ScheduleRequest.releases`, applied before that decision) and, when no Schedule comes
within `release_batch_s`, go out together on the ScheduleStream (`ScheduleCalls.releases`) or,
without one, in one `ReleaseBatch`. A unary Release per request
measured as about a third of the scheduler's CPU and a sixth of the gateway's.

Schedule calls travel on one long-lived `ScheduleStream` (`pdplane.scheduler.schedule_stream`)
when the scheduler has it, else (UNIMPLEMENTED: an older scheduler) as unary calls.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import grpc

from pdplane.core import tracing
from pdplane.core.grpc.util import FAST_RECONNECT_OPTIONS, aio_channel, token_metadata
from pdplane.scheduler.errors import NO_ROOM_KEY
from pdplane.scheduler.port import (
    Decision,
    Outcome,
    RequestFeatures,
    SchedulerBusy,
    SchedulerError,
    SchedulerUnavailable,
)
from pdplane.scheduler.schedule_stream import ScheduleStream, StreamEnded
from pdplane.scheduler.wire import decision_from_pb, features_to_pb, outcome_to_pb
from pdplane.v1 import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["RemoteScheduler"]

_UINT32_MAX = 2**32 - 1
_STREAM_ATTEMPTS = 3  # as the unary retry policy's maxAttempts below
_STREAM_BACKOFF_S = 0.01  # doubled per attempt
#: The stream went away (its scheduler died, restarted or closed it): the call is tried again
#: on a new stream, which the channel opens on the next scheduler address.
_STREAM_GONE = (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)

#: With several scheduler addresses (`ipv4:10.0.0.1:50052,10.0.0.2:50052`, or a DNS name with
#: several records, such as a headless Service) gRPC's pick_first moves to the next one when
#: its scheduler goes away; a call that found it gone (UNAVAILABLE) is retried there by gRPC
#: itself, within the call's deadline. Scheduler replicas sharing in-flight state (`--peers`)
#: make the switch invisible to the decisions.
_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                # Not ScheduleStream: its calls are retried by `_schedule_streamed` (gRPC's
                # retry of a stream answered by an early status made that status INTERNAL).
                "name": [
                    {"service": "pdplane.v1.Scheduler", "method": method}
                    for method in ("Schedule", "Release", "ReleaseBatch", "ListKvStates")
                ],
                "retryPolicy": {
                    "maxAttempts": 3,
                    "initialBackoff": "0.01s",
                    "maxBackoff": "0.2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

log = logging.getLogger(__name__)


def _check_length(name: str, value: int) -> None:
    if not 0 <= value <= _UINT32_MAX:
        raise ValueError(f"{name} must be between 0 and {_UINT32_MAX} tokens, got {value}")


class RemoteScheduler:
    """Calls `pdplane.v1.Scheduler` over one shared grpc.aio channel.

    The channel is opened on first use (inside the caller's event loop). `timeout_s` bounds
    every call (seconds); a scheduler that does not answer in time counts as unavailable.
    `release_batch_s` (seconds) bounds how long a `release_nowait` waits for a Schedule to ride
    on before it is sent on its own (on the ScheduleStream, else in a `ReleaseBatch`).
    `stream` False sends every Schedule as a unary call (as against a scheduler without
    ScheduleStream).
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        tls_ca: str | Path | None = None,
        timeout_s: float = 5.0,
        release_batch_s: float = 0.05,
        stream: bool = True,
    ) -> None:
        self._address = address
        self._tls_ca = tls_ca
        self._metadata = token_metadata(token)
        self._timeout_s = timeout_s
        self._release_batch_s = release_batch_s
        self._channel: grpc.aio.Channel | None = None
        self._stub: scheduler_pb2_grpc.SchedulerStub | None = None
        self._pending: list[scheduler_pb2.ReleaseRequest] = []
        self._flush_timer: asyncio.TimerHandle | None = None
        self._flushes: set[asyncio.Task[Any]] = set()
        self._stream: ScheduleStream | None = None
        # Unary Schedules: asked for, or the scheduler answered UNIMPLEMENTED to ScheduleStream.
        self._unary = not stream

    def _get_stub(self) -> scheduler_pb2_grpc.SchedulerStub:
        if self._stub is None:
            # A restarted scheduler must be found within about a second: with gRPC's default
            # backoff the gateway answered 503 for 6.6 s after the scheduler was back.
            options = [*FAST_RECONNECT_OPTIONS, ("grpc.service_config", _SERVICE_CONFIG)]
            self._channel = aio_channel(self._address, self._tls_ca, options)
            self._stub = scheduler_pb2_grpc.SchedulerStub(self._channel)
        return self._stub

    async def schedule(self, features: RequestFeatures) -> Decision:
        """`SchedulerPort.schedule` over gRPC; Releases queued by `release_nowait` ride along.

        Lengths are checked here (they travel as uint32): ValueError when negative or larger.
        INVALID_ARGUMENT comes back as ValueError; the scheduler's RESOURCE_EXHAUSTED (instances,
        all full: `NO_ROOM_KEY`) as SchedulerBusy, gRPC's own (a message over the limit) as
        SchedulerError; UNAVAILABLE or a missed deadline (`timeout_s`) as SchedulerUnavailable;
        any other status as SchedulerError (`.code`).
        """
        _check_length("prompt_tokens", features.prompt_tokens)
        _check_length("max_tokens", features.max_tokens)
        releases = self._take_pending()
        request = features_to_pb(features)
        if releases:
            request.releases.extend(releases)
        try:
            if self._unary:
                response = await self._schedule_unary(request)
            else:
                response = await self._schedule_streamed(request)
        except grpc.aio.AioRpcError as exc:
            if releases and not _answered(exc):
                # They may not have arrived; an id released twice is harmless (released=false).
                self._queue(releases)
            raise _translate(exc) from None
        except asyncio.CancelledError:
            if releases:
                self._queue(releases)
            raise
        return decision_from_pb(response)

    async def _schedule_unary(
        self, request: scheduler_pb2.ScheduleRequest
    ) -> scheduler_pb2.ScheduleResponse:
        return await self._get_stub().Schedule(
            request, timeout=self._timeout_s, metadata=tracing.grpc_metadata(self._metadata)
        )

    async def _schedule_streamed(
        self, request: scheduler_pb2.ScheduleRequest
    ) -> scheduler_pb2.ScheduleResponse:
        """One Schedule on the shared stream; a call whose stream went away is tried again on a
        new one (`_STREAM_ATTEMPTS`, within `timeout_s`). Raises grpc.aio.AioRpcError with
        the status the unary call would have had (so that one mapping, `_translate`, serves
        both)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._timeout_s
        traceparent = tracing.current_traceparent() or ""
        backoff = _STREAM_BACKOFF_S
        for attempt in range(1, _STREAM_ATTEMPTS + 1):
            stream = self._open_stream()
            try:
                result = await stream.call(request, traceparent, max(deadline - loop.time(), 0))
            except StreamEnded as exc:
                if exc.code == grpc.StatusCode.UNIMPLEMENTED:
                    log.info("the scheduler has no ScheduleStream; using unary Schedule calls")
                    self._unary = True
                    return await self._schedule_unary(request)
                if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise _StreamCallError(exc.code, exc.details) from None
                if exc.code not in _STREAM_GONE:
                    # Refused when it opened (e.g. UNAUTHENTICATED; a refusal racing the first
                    # message sometimes reads as INTERNAL on the stream): this call goes
                    # unary, whose status is exact; the next call tries a stream again.
                    return await self._schedule_unary(request)
                left = deadline - loop.time()
                if attempt == _STREAM_ATTEMPTS or left <= 0:
                    raise _StreamCallError(exc.code, exc.details) from None
                await asyncio.sleep(min(backoff, left))
                backoff *= 2
                continue
            if result.code:
                code = _CODES.get(result.code, grpc.StatusCode.UNKNOWN)
                # The scheduler's own answer: a RESOURCE_EXHAUSTED here is its capacity refusal.
                no_room = code == grpc.StatusCode.RESOURCE_EXHAUSTED
                raise _StreamCallError(code, result.message, _NO_ROOM if no_room else ())
            return result.response
        raise AssertionError("unreachable")

    def _open_stream(self) -> ScheduleStream:
        stream = self._stream
        if stream is None or stream.ended:
            stream = self._stream = ScheduleStream(self._get_stub(), self._metadata)
        return stream

    async def release(self, request_id: str, outcome: Outcome) -> bool:
        """Ends the in-flight accounting of `request_id` (one unary Release).

        Returns False when the id was not in flight (harmless). Raises ValueError on an
        unknown outcome or empty id, SchedulerUnavailable / SchedulerError as `schedule`.
        """
        request = scheduler_pb2.ReleaseRequest(
            request_id=request_id, outcome=outcome_to_pb(outcome)
        )
        try:
            response = await self._get_stub().Release(
                request, timeout=self._timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            raise _translate(exc) from None
        return response.released

    def release_nowait(self, request_id: str, outcome: Outcome) -> None:
        """`release` without waiting: queued, then sent with the next `schedule` or, at the
        latest `release_batch_s` later, in one ReleaseBatch (failures are logged). Call from
        the event loop. Raises ValueError on an unknown outcome or empty id."""
        number = outcome_to_pb(outcome)
        if not request_id:
            raise ValueError("request_id must not be empty")
        self._queue([scheduler_pb2.ReleaseRequest(request_id=request_id, outcome=number)])

    def _queue(self, releases: list[scheduler_pb2.ReleaseRequest]) -> None:
        self._pending.extend(releases)
        if self._flush_timer is None:
            loop = asyncio.get_running_loop()
            self._flush_timer = loop.call_later(self._release_batch_s, self._flush_in_background)

    def _take_pending(self) -> list[scheduler_pb2.ReleaseRequest]:
        releases, self._pending = self._pending, []
        if self._flush_timer is not None:
            self._flush_timer.cancel()
            self._flush_timer = None
        return releases

    def _flush_in_background(self) -> None:
        self._flush_timer = None
        task = asyncio.get_running_loop().create_task(self.flush())
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def flush(self) -> int:
        """Sends every queued Release now: on the open ScheduleStream (not answered: returns
        0), else in one ReleaseBatch (returns how many were in flight).

        Failures are logged, not raised (0): the scheduler expires unreleased assignments."""
        releases = self._take_pending()
        if not releases:
            return 0
        stream = self._stream
        if stream is not None and not stream.ended and not self._unary:
            try:
                stream.release(releases)
                return 0
            except StreamEnded:
                pass  # gone meanwhile: the unary call below
        request = scheduler_pb2.ReleaseBatchRequest(releases=releases)
        try:
            response = await self._get_stub().ReleaseBatch(
                request, timeout=self._timeout_s, metadata=self._metadata
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("ReleaseBatch of %d releases failed: %s", len(releases), _translate(exc))
            return 0
        return response.released

    def problem(self) -> str | None:
        """ "scheduler unreachable at <address>" while the channel cannot connect (its state
        is TRANSIENT_FAILURE), else None. Opens the channel (and starts connecting) when it is
        not open yet; call from the event loop."""
        self._get_stub()
        assert self._channel is not None
        state = self._channel.get_state(try_to_connect=True)
        if state in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN):
            return f"scheduler unreachable at {self._address}"
        return None

    async def start(self) -> None:
        """Nothing to start: the channel opens on first use."""

    async def close(self) -> None:
        """Sends queued Releases, then closes the channel; the client may be used again
        afterwards (it reopens)."""
        await self.flush()
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.close()
        if self._flushes:
            await asyncio.wait(set(self._flushes), timeout=self._timeout_s)
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()


_NO_ROOM = ((NO_ROOM_KEY, "1"),)


def _no_room(exc: grpc.aio.AioRpcError) -> bool:
    """Whether `exc` is the scheduler's capacity refusal, not gRPC's own RESOURCE_EXHAUSTED
    (a request over the server's message limit, refused before the scheduler saw it)."""
    if exc.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
        return False
    trailing = exc.trailing_metadata()
    return trailing is not None and any(key == NO_ROOM_KEY for key, _ in trailing)


def _answered(exc: grpc.aio.AioRpcError) -> bool:
    """Whether the scheduler itself answered the Schedule, after it applied the Releases
    riding on it: those are not sent again. A busy fleet's waiting requests ask again every
    few ms; had every refusal re-queued its Releases, a Release could ride on a later
    Schedule past the retry of its request (same id) and end that retry's assignment. A
    message gRPC refused for its size carried Releases that were never applied."""
    return exc.code() == grpc.StatusCode.INVALID_ARGUMENT or _no_room(exc)


_CODES: dict[int, grpc.StatusCode] = {code.value[0]: code for code in grpc.StatusCode}


class _StreamCallError(grpc.aio.AioRpcError):
    """A streamed call's failure, shaped as the unary call's error so one mapping serves both."""

    def __init__(
        self, code: grpc.StatusCode, details: str, trailing: tuple[tuple[str, str], ...] = ()
    ) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), details)


def _translate(exc: grpc.aio.AioRpcError) -> Exception:
    code, details = exc.code(), exc.details() or ""
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(details)
    if _no_room(exc):
        return SchedulerBusy(details or code.name, code)
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return SchedulerUnavailable(details or code.name, code)
    return SchedulerError(details, code)
