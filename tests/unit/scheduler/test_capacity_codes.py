"""Must show: a capacity refusal travels as RESOURCE_EXHAUSTED and comes back SchedulerBusy.

A scheduler answers "compatible instances, all full now" (`NoRoom`) as RESOURCE_EXHAUSTED on
the unary Schedule and on the ScheduleStream; the remote port reads it as `SchedulerBusy`,
and UNAVAILABLE (no compatible instance, or an older scheduler's refusal) as a plain
`SchedulerUnavailable`, so a gateway facing an older scheduler answers 503 at once as before.
"""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from pdplane.scheduler.errors import NO_ROOM_KEY, NoInstance, NoRoom
from pdplane.scheduler.port import SchedulerBusy, SchedulerError, SchedulerUnavailable
from pdplane.scheduler.remote import _StreamCallError, _translate
from pdplane.scheduler.servicer import SchedulerServicer
from pdplane.v1 import scheduler_pb2


class _Refusing:
    def __init__(self, error: Exception) -> None:
        self.error = error

    def schedule(self, features: Any) -> Any:
        raise self.error

    def release(self, request_id: str, outcome: Any) -> bool:
        return False


def _call() -> scheduler_pb2.ScheduleCall:
    request = scheduler_pb2.ScheduleRequest(request_id="r", model="tiny", prompt_tokens=8)
    return scheduler_pb2.ScheduleCall(call_id=1, request=request)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (NoRoom("decode", "no decode instance: 1 no KV room"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (NoInstance("decode", "no decode instance: 1 draining"), grpc.StatusCode.UNAVAILABLE),
    ],
)
def test_the_stream_answers_a_refusal_with_its_code(error: Exception, code: Any) -> None:
    servicer = SchedulerServicer(_Refusing(error))  # type: ignore[arg-type]
    result = scheduler_pb2.ScheduleResult()
    servicer._decide(_call(), result)
    assert result.code == code.value[0]
    assert result.message == str(error)


class _Aborted(Exception):
    pass


class _Context:
    def __init__(self) -> None:
        self.code: grpc.StatusCode | None = None
        self.trailing: dict[str, str] = {}

    def set_trailing_metadata(self, metadata: Any) -> None:
        pass

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: Any = ()) -> None:
        self.code = code
        self.trailing = dict(trailing_metadata)
        raise _Aborted(details)


@pytest.mark.parametrize(
    ("error", "code"),
    [
        (NoRoom("decode", "1 no KV room"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (NoInstance("decode", "none registered"), grpc.StatusCode.UNAVAILABLE),
    ],
)
async def test_the_unary_call_answers_a_refusal_with_its_code(error: Exception, code: Any) -> None:
    servicer = SchedulerServicer(_Refusing(error))  # type: ignore[arg-type]
    context = _Context()
    with pytest.raises(_Aborted):
        await servicer.Schedule(_call().request, context)  # type: ignore[arg-type]
    assert context.code == code
    # gRPC's own RESOURCE_EXHAUSTED (a message over the limit) does not carry it.
    assert (NO_ROOM_KEY in context.trailing) == isinstance(error, NoRoom)


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (grpc.StatusCode.RESOURCE_EXHAUSTED, SchedulerError),  # gRPC's own: no key
        (grpc.StatusCode.UNAVAILABLE, SchedulerUnavailable),
        (grpc.StatusCode.DEADLINE_EXCEEDED, SchedulerUnavailable),
        (grpc.StatusCode.UNAUTHENTICATED, SchedulerError),
    ],
)
def test_the_remote_port_reads_the_code(code: grpc.StatusCode, kind: type) -> None:
    error = _translate(_StreamCallError(code, "no decode instance: 1 no KV room"))
    assert type(error) is kind
    assert error.reason == "no decode instance: 1 no KV room"  # type: ignore[attr-defined]


def test_the_remote_port_reads_the_schedulers_capacity_refusal_as_busy() -> None:
    code = grpc.StatusCode.RESOURCE_EXHAUSTED
    error = _translate(_StreamCallError(code, "1 no KV room", ((NO_ROOM_KEY, "1"),)))
    assert type(error) is SchedulerBusy


def test_no_room_is_a_busy_no_instance() -> None:
    error = NoRoom("decode", "full")
    assert isinstance(error, NoInstance) and isinstance(error, SchedulerBusy)
    assert not isinstance(NoInstance("decode", "none"), SchedulerBusy)
