"""The choices of a streamed n > 1 whose decode was lost: each unfinished one on its own leg.

vLLM streams all choices from one decode, so they are lost together; each unfinished choice
continues as a stream of one choice does (`pdplane.gateway.resume`), as a request of its own
(`Request.for_choice`: its own id, Schedule and Release, the request's migration budget), and
`pdplane.gateway.fanout.FanOut` writes their events into the client's one stream. Losing the
shared decode counts one migration however many choices it carried.

The relay loop that runs each choice's leg is passed in (`RelayLegs`, the stream module's
`relay_legs`): it calls back here when a stream of choices loses its decode.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from pdplane.gateway.fanout import Choices, FanOut, Leg
from pdplane.gateway.migration import Loss, Transcript
from pdplane.gateway.request import Request, Tally
from pdplane.gateway.resume import count_migration
from pdplane.gateway.splice import Splice

__all__ = ["RelayLegs", "fan_out"]

#: The stream loop: (request, splice, tally, a loss to resume from first) -> the events.
RelayLegs = Callable[[Request, Splice | None, Tally, Loss | None], AsyncGenerator[bytes, None]]


def fan_out(r: Request, choices: Choices, loss: Loss, relay_legs: RelayLegs) -> FanOut:
    """A streamed n > 1 whose decode leg was lost (`loss`): the lost attempt is released
    failed and counted as one migration, and each unfinished choice continues on its own leg
    (`relay_legs` on `Request.for_choice`), all at once. Raises GatewayError when
    `--migration-limit` or `--migration-timeout-s` is spent."""
    if r.resp is not None:
        r.resp.close()
    r.care.settle(RuntimeError(loss.message))
    count_migration(r, loss, r.decode.instance_id)
    legs = [_choice_leg(r, i, t, loss, relay_legs) for i, t in choices.unfinished()]

    def ending() -> bytes:
        first = choices.as_first_token()
        return Splice(r.req, first, None, r.cached, choices.tokens).closing()

    return FanOut(legs, ending)


def _choice_leg(
    r: Request, index: int, transcript: Transcript, loss: Loss, relay_legs: RelayLegs
) -> Leg:
    """Choice `index` (`transcript`: its stream so far) resumed at once as a stream of one
    choice; its attempt is settled when its events end, however they end."""
    child = r.for_choice(index, transcript)
    abandoned: list[bool] = []

    async def events() -> AsyncGenerator[bytes, None]:
        tally = Tally()
        error: BaseException | None = None
        try:
            async for out in relay_legs(child, None, tally, loss):
                yield out
            if tally.ok:
                child.care.succeeded()
        except BaseException as exc:
            error = exc
            raise
        finally:
            # closed because another choice failed: released failed, not cancelled (its
            # attempt may be mid-way: settled here, once it has stopped, its KV is known)
            if abandoned:
                error = RuntimeError("another choice of the stream failed")
            child.settle_stream(error)

    return Leg(index, events(), lambda: abandoned.append(True))
