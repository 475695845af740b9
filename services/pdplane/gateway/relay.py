"""The request path: one request relayed through a scheduled (prefill, decode) pair, top to
bottom (no FastAPI here: asyncio, the upstream client and the scheduler port).

`Relay.handle(req, ...)` runs `_run` on a `pdplane.gateway.request.Request`:

1. **schedule** (`pdplane.gateway.schedule`): `Schedule` through the scheduler port. A
   refusal because every compatible instance is full, or the model has no usable pair for a
   moment, waits in the admission queue (`pdplane.gateway.admission`), bounded, before it is
   a 503.
2. **one attempt on the pair** (`_attempt`), by mode; the legs are `pdplane.gateway.legs`':
   - *decode only*: the decision has no prefill (decode holds all but a few prompt tokens):
     the client's body goes to decode as it came, and decode computes the rest;
   - *concurrent* (`--dispatch concurrent`): decode's request is opened while prefill runs;
     the `kv_transfer_params` only prefill can issue follow when it answers;
   - *sequential* (default): the prefill leg, then the decode leg with the client's body plus
     prefill's `kv_transfer_params` (`pdplane.gateway.bodies`);
   - *first token from prefill* (sequential, streamed, `bodies.takes_first_token`): prefill's
     token is written at once and decode, opened after it, continues from it (`_first_token`,
     `pdplane.gateway.takeover`; the events are `pdplane.gateway.splice`'s).
3. **the reply**: decode's JSON as it came (`pdplane.gateway.json_reply`), or its SSE relayed
   whole events at a time (`pdplane.gateway.stream`).
4. **after-care** (`pdplane.gateway.aftercare.Aftercare`, one per Schedule): the one outcome
   decision, `Release(outcome)` and, unless decode pulled it, prefill's KV freed through
   `KvTransfer.AbortTransfer`; the path settles it wherever an attempt ends.

Failures before any byte reached the client: an instance that cannot be reached (refused,
reset, closed before answering) -> another pair, at most `max_retries` times, excluding it
(`RetryElsewhere`), else 502; silent for `upstream_timeout_s` -> 504 (no retry: it may still
be computing); an instance's 4xx -> that status and body unchanged; 5xx -> 502 naming it;
prefill's answer without usable `kv_transfer_params` -> 502. Once the first token from prefill
went out, a decode that cannot be reached is replaced, within the same retries, by another
decode computing the whole prompt (`pdplane.gateway.takeover`); any other failure before
decode's first byte is one SSE error event. A decode lost after its first byte is replaced by
another that continues from the prompt plus the tokens sent (`pdplane.gateway.resume`; the
choices of n > 1 each on their own, `pdplane.gateway.choice_legs`), within `--migration-limit`
and `--migration-timeout-s` (waiting for a decode when no other serves: the only one
restarting); then one error event ends the stream. A non-streamed request whose decode died
while computing it, or a stream of one choice whose decode was lost before any of its events
reached the client, runs again on another pair, within the same limits.
Cancellation (client gone): upstream connections closed (vLLM aborts the request), prefill's
KV freed (a prefill call in flight by the transfer id the gateway gave it), Release
"cancelled".
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any

from pdplane.gateway import usage_details
from pdplane.gateway.bodies import decode_body, with_token_ids
from pdplane.gateway.errors import bad_gateway, gateway_timeout
from pdplane.gateway.json_reply import json_reply
from pdplane.gateway.legs import decode_error, open_concurrently, open_decode, prefill_leg
from pdplane.gateway.migration import Transcript
from pdplane.gateway.replies import JsonReply, RetryElsewhere, StreamReply
from pdplane.gateway.request import DecodeLost, Request, Shared
from pdplane.gateway.resume import count_migration
from pdplane.gateway.route_note import RouteNote
from pdplane.gateway.schedule import schedule
from pdplane.gateway.splice import FirstToken, splice_for
from pdplane.gateway.stream import stream
from pdplane.gateway.upstream import UpstreamResponse
from pdplane.gateway.validation import ClientRequest

__all__ = ["Relay"]

log = logging.getLogger(__name__)

_SSE_HEADERS = {"content-type": "text/event-stream"}


class Relay(Shared):
    """Relays requests through scheduled (prefill, decode) pairs (arguments: `Shared`'s)."""

    async def handle(
        self,
        req: ClientRequest,
        request_id: str,
        started: float,
        max_model_len: int,
        note: RouteNote | None = None,
    ) -> JsonReply | StreamReply:
        """Relays `req` under `request_id`; `started` = arrival (time.perf_counter()); `note`
        gets every decision taken for it (the last one stays).

        `max_model_len` (tokens) caps the lengths sent to Schedule so that a request too long
        for the model still reaches an instance, whose own 400 is the authoritative answer.
        Returns a `JsonReply` (non-streamed answers) or a `StreamReply` (SSE, which settles
        the request when it ends). Raises GatewayError (400/502/503/504), UpstreamReply (an
        instance's 4xx, passed through), asyncio.CancelledError after cleaning up.
        """
        return await _run(Request(self, req, request_id, started, max_model_len, note))

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Waits (bounded, s) for background AbortTransfer calls and cancels the prefix warms
        still running; used at shutdown."""
        await self.warms.close()
        await self.caretaker.drain(timeout_s)


async def _run(r: Request) -> JsonReply | StreamReply:
    """Schedule and attempt, again on another pair after an instance could not be reached (at
    most `max_retries` times) or a non-streamed answer was lost with its decode (within
    `--migration-limit`); see `Relay.handle`."""
    while True:
        if r.budget.since:
            await _schedule_again(r)
        else:
            await schedule(r, queue=r.failed is None)
        try:
            return await _attempt(r)
        except DecodeLost as lost:
            # A non-streamed answer lost with its decode: the client saw nothing, so the
            # whole request runs again on another pair (exact, seeded sampling included).
            count_migration(r, lost.loss, lost.instance_id)
            log.warning("request %s: %s; running it again on another pair", r.id, lost)
            r.relay.metrics.migration_recomputed.inc(r.req.prompt_tokens)
            r.exclude(lost.instance_id)
            # No decode for the time budget: the loss is the answer, not the scheduler's 503.
            r.failed = RetryElsewhere("decode", lost.instance_id, bad_gateway(lost.loss.message))
        except RetryElsewhere as failed:
            r.retrying(failed, "retrying on another pair")
            if r.tries_left <= 0:
                raise failed.error from None
            r.tries_left -= 1
            r.failed = failed


async def _schedule_again(r: Request) -> None:
    """Schedule for a non-streamed request whose decode was lost (`r.budget.since` set): as a
    stream continued elsewhere, it waits for room or for a decode (the only one restarting),
    within what is left of `--migration-timeout-s` from the first loss. Raises GatewayError
    504 when none came in time (naming the loss), else as `schedule`."""
    config = r.relay.config
    left = config.migration_timeout_s - (time.perf_counter() - r.budget.since)
    try:
        async with asyncio.timeout(max(left, 0.001)):
            await schedule(r, queue=True, wait_s=math.inf)
    except TimeoutError:
        r.relay.metrics.migration_failures.labels("timeout").inc()
        lost = r.failed.error.message if r.failed is not None else "decode lost"
        raise gateway_timeout(
            f"{lost}; not run again on another decode within "
            f"--migration-timeout-s {config.migration_timeout_s:g}"
        ) from None


async def _attempt(r: Request) -> JsonReply | StreamReply:
    """Both legs on the scheduled pair, by mode; the answer, or a stream that settles the
    attempt when it ends. Raises RetryElsewhere, DecodeLost, GatewayError, UpstreamReply, or
    CancelledError, the attempt settled."""
    error: BaseException | None = None
    handed_off = False
    resp: UpstreamResponse | None = None
    r.prefilled_at, r.cached = 0.0, None
    try:
        if r.prefill is None:  # decode only
            if r.relay.config.prompt_tokens_details:
                r.cached = usage_details.decode_hit(
                    r.decode_cached, r.req.prompt_tokens, r.req.prefix_hashes
                )
            raw = r.req.raw
            if r.transcript is not None:
                raw = with_token_ids(raw, r.req.body, None)
            resp = await open_decode(r, raw)
        elif r.relay.config.dispatch == "concurrent":
            resp = await open_concurrently(r)
        else:  # sequential
            answer, kv = await prefill_leg(r)
            if r.first_token:
                reply = _first_token(r, answer, kv)
                if reply is not None:
                    handed_off = True
                    return reply
            if r.transcript is not None:
                body = with_token_ids(r.req.raw, r.req.body, kv)
            else:
                body = decode_body(r.req.raw, r.req.body, kv)
            resp = await open_decode(r, body)
        if resp.status >= 400:
            await decode_error(r, resp)
        if not r.req.stream:
            return await json_reply(r, resp)
        handed_off = True
        if r.first_token and r.prefill is not None:
            # Eligible, but the first token came from decode: counted once per request,
            # where its stream begins (an attempt that raises counts nothing).
            r.relay.metrics.first_from_decode.inc()
        r.resp = resp
        return StreamReply(stream(r, None), _SSE_HEADERS, r.abandon)
    except BaseException as exc:
        error = exc
        raise
    finally:
        if not handed_off:
            if resp is not None:
                resp.close()
            r.care.settle(error)


def _first_token(r: Request, answer: dict[str, Any], kv: bytes) -> StreamReply | None:
    """The stream from prefill's first token on (decode is opened inside it, after the token
    went out); None when decode cannot continue it (the usual path then)."""
    first = FirstToken.of(r.req.endpoint, answer)
    if first is None:
        return None
    tokenizers = r.relay.tokenizers
    tokenizer = tokenizers.get(r.req.model) if tokenizers is not None else None
    splice = splice_for(r.req, first, tokenizer, r.cached)
    if splice is None:
        return None
    r.relay.metrics.first_from_prefill.inc()
    if r.transcript is not None:
        r.transcript = Transcript(first)
    if first.ends_request(r.req, r.max_model_len):
        # Decode is not asked: prefill's KV is freed now.
        r.care.free_kv("the request ended at its first token")
        r.care.succeeded()
        return StreamReply(stream(r, splice), _SSE_HEADERS, r.abandon)
    return StreamReply(stream(r, splice, (first, kv)), _SSE_HEADERS, r.abandon)
