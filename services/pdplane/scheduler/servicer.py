"""`pdplane.v1.Scheduler` over grpc.aio: translates protobuf <-> `Decider` only."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable, Iterable, Sequence

import grpc

from pdplane.core import tracing
from pdplane.scheduler.decision import Decider
from pdplane.scheduler.errors import NO_ROOM_KEY, InvalidRequest, NoInstance, NoRoom
from pdplane.scheduler.kv_index import KvInstanceStatus
from pdplane.scheduler.wire import (
    decision_to_pb,
    features_from_pb,
    kv_states_to_pb,
    releases_from_pb,
)
from pdplane.v1 import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["SchedulerServicer"]

log = logging.getLogger(__name__)

_DECISION = "pdplane.scheduler.decision"
_OK = grpc.StatusCode.OK.value[0]
_INVALID_ARGUMENT = grpc.StatusCode.INVALID_ARGUMENT.value[0]
_UNAVAILABLE = grpc.StatusCode.UNAVAILABLE.value[0]
_RESOURCE_EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
_INTERNAL = grpc.StatusCode.INTERNAL.value[0]
#: Marks a capacity refusal apart from gRPC's own RESOURCE_EXHAUSTED (errors.NO_ROOM_KEY).
_NO_ROOM = ((NO_ROOM_KEY, "1"),)
_MESSAGE_MAX = 1024  # characters of a ScheduleResult's error message
#: Calls of one ScheduleStream message decided before the event loop runs other work (at
#: ~0.1 ms a call, about 2 ms).
_TURN_CALLS = 16


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Schedule -> INVALID_ARGUMENT / UNAVAILABLE (no compatible instance) / RESOURCE_EXHAUSTED
    (compatible instances, all full now: a caller may wait and ask again; gRPC does not retry
    it) on the service's errors; Release never fails
    for an unknown id (released=false). Releases piggybacked on a Schedule are applied first.
    `kv_states` lists the prefix index's instances (`KvIndexManager.states`; None: no index)."""

    def __init__(
        self,
        service: Decider,
        kv_states: Callable[[], Sequence[KvInstanceStatus]] | None = None,
    ) -> None:
        self._service = service
        self._kv_states = kv_states

    def _release_all(self, releases: Iterable[scheduler_pb2.ReleaseRequest]) -> int:
        release = self._service.release
        return sum(
            release(request_id, outcome) for request_id, outcome in releases_from_pb(releases)
        )

    async def Schedule(
        self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ScheduleResponse:
        try:
            if request.releases:
                self._release_all(request.releases)
            with tracing.span(_DECISION, parent=tracing.grpc_parent(context), server=True):
                decision = self._service.schedule(features_from_pb(request))
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoRoom as exc:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc), trailing_metadata=_NO_ROOM
            )
        except NoInstance as exc:
            # A decision, not a lost scheduler: tells gRPC's client retry (remote.py) not to
            # try again elsewhere (gRPC retry design A6: a negative pushback means no retry).
            context.set_trailing_metadata((("grpc-retry-pushback-ms", "-1"),))
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return decision_to_pb(decision)

    async def ScheduleStream(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.ScheduleCalls],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.ScheduleResults]:
        # A message's calls (those the gateway queued while its last message was written) are
        # decided as one batch and answered together, in one message (one write), in call
        # order. A call's error is its result's code (the stream carries the other calls on).
        # Decisions take tens of microseconds, but a batch of hundreds would hold the event
        # loop for milliseconds: every `_TURN_CALLS` calls the loop serves the other streams
        # and calls first.
        async for batch in request_iterator:
            if batch.releases:
                try:
                    self._release_all(batch.releases)
                except InvalidRequest as exc:
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc)[:_MESSAGE_MAX])
            if batch.calls:
                answers = scheduler_pb2.ScheduleResults()
                add = answers.results.add
                for n, call in enumerate(batch.calls, 1):
                    self._decide(call, add(call_id=call.call_id))
                    if n % _TURN_CALLS == 0:
                        await asyncio.sleep(0)
                yield answers

    def _decide(
        self, call: scheduler_pb2.ScheduleCall, result: scheduler_pb2.ScheduleResult
    ) -> None:
        request = call.request
        try:
            if request.releases:
                self._release_all(request.releases)
            with tracing.span(_DECISION, parent=call.traceparent or None, server=True):
                decision = self._service.schedule(features_from_pb(request))
        except InvalidRequest as exc:
            _failed(result, _INVALID_ARGUMENT, exc)
        except NoRoom as exc:
            _failed(result, _RESOURCE_EXHAUSTED, exc)
        except NoInstance as exc:
            _failed(result, _UNAVAILABLE, exc)
        except Exception as exc:
            # One call's bug must not end the stream that the gateway's other calls share.
            log.exception("ScheduleStream call %s failed", request.request_id[:128])
            _failed(result, _INTERNAL, exc)
        else:
            result.response.CopyFrom(decision_to_pb(decision))

    async def Release(
        self, request: scheduler_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReleaseResponse:
        try:
            released = self._release_all((request,)) > 0
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return scheduler_pb2.ReleaseResponse(released=released)

    async def ReleaseBatch(
        self, request: scheduler_pb2.ReleaseBatchRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ReleaseBatchResponse:
        try:
            released = self._release_all(request.releases)
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return scheduler_pb2.ReleaseBatchResponse(released=released)

    async def ListKvStates(
        self, request: scheduler_pb2.ListKvStatesRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ListKvStatesResponse:
        if self._kv_states is None:
            await context.abort(
                grpc.StatusCode.FAILED_PRECONDITION, "this scheduler has no prefix index"
            )
        assert self._kv_states is not None
        return kv_states_to_pb(self._kv_states())


def _failed(result: scheduler_pb2.ScheduleResult, code: int, exc: Exception) -> None:
    result.code = code
    result.message = str(exc)[:_MESSAGE_MAX]
