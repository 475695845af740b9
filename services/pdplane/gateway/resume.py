"""A stream continued on another decode after its decode leg was lost (request migration).

From the transcript of what the client already has (`pdplane.gateway.migration`): the lost
attempt is released failed; a new decision for the prompt plus the tokens sent (the lost
decode and any that failed this request excluded); that decision's prefill leg when it has one
(the resumed prompt's KV; its prefix cache hit on the original prompt makes it short); then the
new decode leg on `/v1/completions` (`pdplane.gateway.bodies.resumed_body`). The new leg's events
continue the client's stream through a `Splice` with a `Seam` (what the client has dropped).
Bounded by `--migration-limit` (per request: `count_migration`) and `--migration-timeout-s`
(from the first loss), never a loop; each resume is a span and one log line naming both decodes.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from functools import partial
from typing import Any

from pdplane.core import tracing
from pdplane.gateway.bodies import resumed_body, with_token_ids
from pdplane.gateway.errors import GatewayError, gateway_timeout
from pdplane.gateway.legs import open_decode, prefill_leg, refused_mid_stream
from pdplane.gateway.migration import Loss, Transcript, stop_seam, whole_characters
from pdplane.gateway.replies import RetryElsewhere
from pdplane.gateway.request import Request
from pdplane.gateway.schedule import schedule
from pdplane.gateway.seam import Seam
from pdplane.gateway.splice import Splice
from pdplane.gateway.upstream import UpstreamResponse
from pdplane.gateway.validation import COMPLETIONS

__all__ = ["count_migration", "migrate"]

log = logging.getLogger(__name__)


def count_migration(r: Request, loss: Loss, instance_id: str) -> None:
    """One more resume of `r` after `loss` of `instance_id`; raises GatewayError (the
    client's one error) when `--migration-limit` or `--migration-timeout-s` is spent."""
    config, metrics = r.relay.config, r.relay.metrics
    now = time.perf_counter()
    budget = r.budget
    if not budget.since:
        budget.since = now
    if budget.used >= config.migration_limit:
        metrics.migration_failures.labels("limit").inc()
        log.warning(
            "request %s: %s; not continued (--migration-limit %d spent)",
            r.id,
            loss.message,
            config.migration_limit,
        )
        raise GatewayError(
            loss.status,
            f"{loss.message}; not continued on another decode: "
            f"--migration-limit {config.migration_limit} spent",
        )
    if now - budget.since > config.migration_timeout_s:
        metrics.migration_failures.labels("timeout").inc()
        raise gateway_timeout(
            f"{loss.message}; not continued on another decode within "
            f"--migration-timeout-s {config.migration_timeout_s:g}"
        )
    budget.used += 1
    metrics.migrations.labels(loss.reason).inc()


async def migrate(
    r: Request, transcript: Transcript, loss: Loss, counted: bool = False
) -> Splice | None:
    """Continues `r`'s stream, whose decode leg was lost (`loss`), on another decode; returns
    the splice that continues the client's stream with the new leg's events (`r.resp`). A
    stream that had sent the client nothing (`transcript.started` False: its decode was lost
    inside its first event) runs again whole instead: the client's request on a new pair,
    whose events go to the client as they come (returns None).

    Tries again on another decode when the new one fails too, within `--migration-limit` and
    `--migration-timeout-s`; raises GatewayError when either is spent, when no decode is left,
    or when the new leg is refused. `counted`: the loss was counted already (the shared
    decode of a streamed n > 1's choices, `pdplane.gateway.choice_legs`).
    """
    metrics, config = r.relay.metrics, r.relay.config
    lost = r.decode.instance_id
    tokenizer = r.tokenizer
    overlap = repeated = 0
    fresh = not transcript.started
    if tokenizer is not None and transcript.prompt_ids is not None:
        decode = partial(tokenizer.decode, skip_special_tokens=False)
        context, sent_ids = transcript.prompt_ids, transcript.sent
        if transcript.lookback is not None:
            # Resume before the text vLLM held back (or that may start a stop string).
            keep, overlap = stop_seam(
                context, sent_ids, transcript.delivered, transcript.lookback, decode
            )
            if r.req.body.get("logprobs") not in (None, False):
                repeated = len(sent_ids) - keep
        else:
            keep = whole_characters(context, sent_ids, decode)
        transcript.rewind(keep)
    prompt = None if fresh else transcript.resumed_prompt()
    recomputed = r.req.prompt_tokens if prompt is None else len(prompt)
    sent = len(transcript.sent)
    cached = r.cached  # the client's prompt's, not the resumed prompt's
    while True:
        if r.resp is not None:
            r.resp.close()
        r.care.settle(RuntimeError(loss.message))  # Release failed, before Schedule
        if not counted:
            count_migration(r, loss, lost)
        counted = False
        r.exclude(lost)
        body = None if prompt is None else resumed_body(r.req, prompt, sent, r.choice)
        left = config.migration_timeout_s - (time.perf_counter() - r.budget.since)
        attributes = {
            "pdplane.lost_decode": lost,
            "pdplane.reason": loss.reason,
            "pdplane.tokens_sent": sent,
        }
        try:
            async with asyncio.timeout(max(left, 0.001)):
                with tracing.span("pdplane.migration", attributes=attributes):
                    r.resp = await _resumed_legs(r, body, not loss.decode_alive)
        except RetryElsewhere as failed:
            lost, loss = failed.instance_id, Loss("lost", 502, failed.error.message)
            continue
        except TimeoutError:
            r.care.settle(TimeoutError())  # frees a prefill leg given up on, too
            metrics.migration_failures.labels("timeout").inc()
            raise gateway_timeout(
                f"{loss.message}; not continued on another decode within "
                f"--migration-timeout-s {config.migration_timeout_s:g}"
            ) from None
        except GatewayError as exc:
            metrics.migration_failures.labels("unavailable").inc()
            log.warning("request %s: %s; not continued: %s", r.id, loss.message, exc)
            raise GatewayError(
                exc.status if exc.status < 500 else loss.status,
                f"{loss.message}; not continued on another decode: {exc.message}",
            ) from None
        metrics.migration_recomputed.inc(recomputed)
        prefill = r.prefill.instance_id if r.prefill is not None else "none"
        if prompt is None:
            # Run again whole: the new attempt's prefix cache hit is the client's (r.cached).
            log.warning(
                "request %s: %s before its first token; run again on decode %s (prefill %s)",
                r.id,
                loss.message,
                r.decode.instance_id,
                prefill,
            )
            return None
        log.warning(
            "request %s: %s after %d tokens (%s); continued on decode %s (prefill %s), "
            "%d tokens recomputed",
            r.id,
            loss.message,
            sent,
            loss.reason,
            r.decode.instance_id,
            prefill,
            len(prompt),
        )
        r.cached = cached
        # completions' text_offset goes on from the client's (the leg counts from 0)
        offset = transcript.next_offset if transcript.offsets is not None else None
        seam = Seam(overlap, repeated, offset)
        return Splice(r.req, transcript.as_first_token(), None, cached, sent, seam)


async def _resumed_legs(r: Request, body: dict[str, Any] | None, wait: bool) -> UpstreamResponse:
    """The new legs of a resumed stream (`body`: `resumed_body`'s; None: the client's request
    again, whole): Schedule, prefill's leg when the decision has one, decode's response
    headers. `wait`: with no decode but the lost one, wait for one (the only decode
    restarting) within the time budget `migrate` holds this to; else that is a GatewayError
    at once (a decode that sent its own error event is alive: no restart of it is coming).
    Raises RetryElsewhere (an instance unreachable: the next decode is tried), GatewayError."""
    try:
        endpoint = "" if body is None else COMPLETIONS  # "": the client's
        await schedule(
            r,
            queue=True,
            prompt_tokens=None if body is None else len(body["prompt"]),
            max_tokens=None if body is None else body["max_tokens"] or 0,
            wait_s=math.inf if wait else None,
        )
        kv = None
        if r.prefill is not None:
            _, kv = await prefill_leg(r, endpoint, body)
        if body is None:
            data = with_token_ids(r.req.raw, r.req.body, kv)
        else:
            data = json.dumps(body, separators=(",", ":")).encode()
            if kv is not None:
                data = data[:-1] + b',"kv_transfer_params":' + kv + b"}"
        resp = await open_decode(r, data, endpoint)
        if resp.status < 400:
            return resp
        await refused_mid_stream(r, resp)
    except (RetryElsewhere, asyncio.CancelledError):
        # `migrate` settles the attempt: with the failure (and tries the next decode), its
        # time budget spent; or the stream's end does, the client gone.
        raise
    except BaseException as exc:
        r.care.settle(exc)
        raise
