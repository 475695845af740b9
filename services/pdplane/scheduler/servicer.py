"""`pdplane.v1.Scheduler` over grpc.aio: translates protobuf <-> `SchedulerService` only."""

from __future__ import annotations

from collections.abc import Iterable

import grpc

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.errors import InvalidRequest, NoInstance
from pdplane.scheduler.service import ScheduleInput, SchedulerService
from pdplane.v1 import scheduler_pb2, scheduler_pb2_grpc

__all__ = ["SchedulerServicer", "instance_ref"]

_OUTCOME_NAMES = {
    scheduler_pb2.OUTCOME_UNSPECIFIED: "unspecified",
    scheduler_pb2.OUTCOME_SUCCESS: "success",
    scheduler_pb2.OUTCOME_FAILED: "failed",
    scheduler_pb2.OUTCOME_CANCELLED: "cancelled",
}


def instance_ref(c: Candidate) -> scheduler_pb2.InstanceRef:
    """The `InstanceRef` of a chosen candidate (what Schedule answers per side)."""
    return scheduler_pb2.InstanceRef(
        instance_id=c.instance_id, url=c.url, kv_endpoint=c.kv_endpoint, transport=c.transport
    )


def _outcomes(releases: Iterable[scheduler_pb2.ReleaseRequest]) -> list[tuple[str, str]]:
    """(request id, outcome name) per Release; InvalidRequest on an empty id or bad outcome."""
    out = []
    for release in releases:
        outcome = _OUTCOME_NAMES.get(release.outcome)
        if outcome is None:
            raise InvalidRequest(f"outcome: unknown value {release.outcome}")
        if not release.request_id:
            raise InvalidRequest("request_id: must not be empty")
        out.append((release.request_id, outcome))
    return out


class SchedulerServicer(scheduler_pb2_grpc.SchedulerServicer):
    """Schedule -> INVALID_ARGUMENT / UNAVAILABLE on the service's errors; Release never fails
    for an unknown id (released=false). Releases piggybacked on a Schedule are applied first."""

    def __init__(self, service: SchedulerService) -> None:
        self._service = service

    def _release_all(self, releases: Iterable[scheduler_pb2.ReleaseRequest]) -> int:
        release = self._service.release
        return sum(release(request_id, outcome) for request_id, outcome in _outcomes(releases))

    async def Schedule(
        self, request: scheduler_pb2.ScheduleRequest, context: grpc.aio.ServicerContext
    ) -> scheduler_pb2.ScheduleResponse:
        try:
            if request.releases:
                self._release_all(request.releases)
            decision = self._service.schedule(
                ScheduleInput(
                    request_id=request.request_id,
                    model=request.model,
                    prompt_tokens=request.prompt_tokens,
                    max_tokens=request.max_tokens,
                    routing_key=request.routing_key,
                    prefix_block_hashes=request.prefix_block_hashes,
                    exclude_instance_ids=frozenset(request.exclude_instance_ids),
                    prefill_policy=request.prefill_policy,
                    decode_policy=request.decode_policy,
                )
            )
        except InvalidRequest as exc:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except NoInstance as exc:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
        return scheduler_pb2.ScheduleResponse(
            prefill=instance_ref(decision.prefill),
            decode=instance_ref(decision.decode),
            reason=decision.reason,
        )

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
