"""Errors of a scheduling decision; the servicer maps them onto gRPC status codes.

All are the port's errors (`pdplane.scheduler.port`), so the local scheduler raises them as
they are: `InvalidRequest` is a ValueError, `NoInstance` a SchedulerUnavailable and `NoRoom`
both a NoInstance and a SchedulerBusy.
"""

from __future__ import annotations

from pdplane.scheduler.port import SchedulerBusy, SchedulerUnavailable

__all__ = ["NO_ROOM_KEY", "InvalidRequest", "NoInstance", "NoRoom"]

#: Trailing metadata key of a unary Schedule refused for capacity (`NoRoom`): gRPC answers
#: RESOURCE_EXHAUSTED by itself too (a request message over the server's limit), which room
#: never helps; only a RESOURCE_EXHAUSTED carrying this key is the scheduler's "all full now".
NO_ROOM_KEY = "pdplane-no-room"


class InvalidRequest(ValueError):
    """The request is malformed (gRPC INVALID_ARGUMENT); the message names the field."""


class NoInstance(SchedulerUnavailable):
    """No compatible instance for one side (gRPC UNAVAILABLE).

    `side` is "prefill", "decode" or "pair" (both sides exist but no layout/transport/length
    matches); the message names it, e.g. "no prefill instance for model tiny: ...".
    """

    def __init__(self, side: str, message: str) -> None:
        super().__init__(message)
        self.side = side


class NoRoom(NoInstance, SchedulerBusy):
    """No instance of one side has room now, but at least one would serve the request once
    its running requests end (gRPC RESOURCE_EXHAUSTED), e.g. "no decode instance for model
    tiny: 1 registered, all turned down (1 no KV room for 544 tokens)"."""
