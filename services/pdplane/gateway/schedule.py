"""Schedule: a (prefill, decode) pair for a request's next attempt, through the scheduler port.

A refusal because every compatible instance is full, or because the model has no usable pair
for a moment, waits in the admission queue (`pdplane.gateway.admission`), bounded by
`--queue-timeout-s`, before it is a 503. Each decision begins a new attempt: a new after-care
(`Request.care`), which this module settles itself only when the client leaves during the
Schedule (the scheduler may have counted the request already).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable

from pdplane.core import tracing
from pdplane.gateway.errors import bad_request, unavailable
from pdplane.gateway.request import Request
from pdplane.scheduler import Decision, RequestFeatures, SchedulerError, SchedulerUnavailable

__all__ = ["schedule"]


async def schedule(
    r: Request,
    queue: bool,
    prompt_tokens: int | None = None,
    max_tokens: int | None = None,
    wait_s: float | None = None,
) -> None:
    """A new decision for `r` (and a new after-care for it): sets `r.prefill`, `r.decode`,
    `r.decode_cached` and `r.care`.

    `queue`: whether a refusal for room waits in the admission queue; a retry answers with
    the failure it follows instead (`r.failed`), a take-over after the first token waits (its
    stream has no other way to an answer). A retry also waits when no instance is left but
    those that failed it (`r.excluded`); so does a request continued after its decode was lost
    (`wait_s` given: the longest wait in s instead of `--queue-timeout-s`, math.inf for a
    caller that bounds it, as `--migration-timeout-s` does). `prompt_tokens`, `max_tokens`: a
    resumed stream's (tokens; default the request's), capped by the model's length.

    Raises GatewayError (503 no pair, 400 invalid, or the failure a retry follows),
    asyncio.CancelledError after settling the attempt.
    """
    req, relay = r.req, r.relay
    r.care = care = relay.caretaker.begin(r.id)
    if prompt_tokens is None:
        prompt_tokens = req.prompt_tokens
    if max_tokens is None:
        max_tokens = req.max_tokens
    if r.max_model_len:
        prompt_tokens = min(prompt_tokens, r.max_model_len)
        max_tokens = min(max_tokens, r.max_model_len - prompt_tokens)
    ask, admission = relay.scheduler.schedule, relay.admission

    def failed() -> tuple[str, ...]:
        # A failed instance registered again since it failed is a new process.
        return admission.failed(req.model, r.excluded)

    features = RequestFeatures(
        r.id,
        req.model,
        prompt_tokens,
        max_tokens,
        routing_key=req.routing_key,
        exclude_instance_ids=failed(),
        prefix_hashes=req.prefix_hashes,
        first_token_from_prefill=r.first_token,
    )

    def again() -> Awaitable[Decision]:
        return ask(dataclasses.replace(features, exclude_instance_ids=failed()))

    # Whether it waits while only instances that failed it are left: a retry does (else the
    # failure it follows is the answer, below), a continued request does; a take-over does not.
    on_failed = not queue or wait_s is not None
    try:
        with tracing.span("pdplane.schedule"):
            if queue and admission.has_waiters(req.model):
                decision = await admission.admit(req.model, again, None, failed, on_failed, wait_s)
            else:
                try:
                    decision = await ask(features)
                except SchedulerUnavailable as refused:
                    if not admission.waits_on(req.model, refused, failed(), queue, on_failed):
                        raise
                    decision = await admission.admit(
                        req.model, again, refused, failed, on_failed, wait_s
                    )
    except asyncio.CancelledError as exc:
        # The scheduler may have counted the request before the client left; an unknown id
        # is harmless to Release.
        care.settle(exc)
        raise
    except SchedulerUnavailable as exc:
        if r.failed is not None:
            raise r.failed.error from None  # no other pair: the failure is the answer
        raise unavailable(exc.reason) from None
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    except SchedulerError as exc:
        raise unavailable(f"scheduler error: {exc}") from None
    if decision.warm is not None:
        relay.warms.send(req.model, req.prompt_ids, decision.warm)
    r.prefill, r.decode = decision.prefill, decision.decode
    r.decode_cached = decision.decode_cached_tokens
    if r.note is not None:
        r.note.decision = decision
