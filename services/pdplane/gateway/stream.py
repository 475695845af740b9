"""The client's stream: decode's SSE relayed whole events at a time, across lost decodes.

`stream` is the client's SSE generator: the first token from prefill when it has one (its
events are `pdplane.gateway.splice`'s, and decode is opened once it went out:
`pdplane.gateway.takeover`), then `relay_legs`, then the attempt settled however it ended.
`relay_legs` relays decode's events as they arrive, cut at the last complete event of each
read (a read often ends mid-event; vLLM writes one event per token). A leg lost before its
`[DONE]` (connection reset or closed, vLLM's error event, silence past
`--stream-idle-timeout-s`, its instance leaving or drained past its grace) continues on another
decode from the tokens the client has (`pdplane.gateway.resume`; a streamed n > 1's choices
each on their own, `pdplane.gateway.choice_legs`) when the stream is migratable, else ends with
one error event.
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator

from pdplane.core import tracing
from pdplane.gateway import usage_details
from pdplane.gateway.choice_legs import fan_out
from pdplane.gateway.errors import GatewayError
from pdplane.gateway.fanout import Choices
from pdplane.gateway.migration import Loss, Transcript
from pdplane.gateway.replies import SSE_DONE, SSE_ERROR
from pdplane.gateway.request import Request, Tally
from pdplane.gateway.resume import migrate
from pdplane.gateway.splice import FirstToken, Splice
from pdplane.gateway.takeover import open_continuation
from pdplane.gateway.upstream import UpstreamTimeout, UpstreamUnreachable

__all__ = ["relay_legs", "stream"]


def _failed(error: GatewayError) -> bytes:
    """The end of a stream the gateway cannot finish: `error`'s event, then `[DONE]` (as vLLM
    ends a stream whose request failed)."""
    return error.sse_event() + SSE_DONE


async def stream(
    r: Request, splice: Splice | None, continuation: tuple[FirstToken, bytes] | None = None
) -> AsyncGenerator[bytes, None]:
    """The client's SSE; settles the attempt when it ends. Decode's events (`r.resp`) are
    relayed whole events at a time as they arrive (`relay_legs`). With `splice`, the first
    token's events go first and decode's are rewritten; with `continuation` (the first token,
    prefill's kv_transfer_params) decode is opened once the first token went out; with
    `splice` alone the first token ended the request (its whole stream is the splice's).
    Observes TTFT, end-to-end latency and TPOT (s) of a stream that ended whole."""
    r.streaming = True
    metrics = r.relay.metrics
    error: BaseException | None = None
    tally = Tally()
    try:
        if splice is not None:
            tally.first_at = time.perf_counter()
            metrics.ttft.observe(tally.first_at - r.started)
            if continuation is None:
                yield splice.ending()
                metrics.e2e.observe(time.perf_counter() - r.started)
                return
            tally.events = 1
            yield splice.opening()
            try:
                r.resp = await open_continuation(
                    r, *continuation, splice.token_ids or r.transcript is not None
                )
            except GatewayError as exc:
                yield _failed(exc)
                return
        async for out in relay_legs(r, splice, tally):
            yield out
        if not tally.ok:
            return
        r.care.succeeded()
        metrics.e2e.observe(time.perf_counter() - r.started)
        if tally.events > 2:  # ignore [DONE]; one event per token otherwise
            metrics.tpot.observe((tally.last_at - tally.first_at) / (tally.events - 2))
    except BaseException as exc:
        error = exc
        raise
    finally:
        r.settle_stream(error)


async def relay_legs(
    r: Request, splice: Splice | None, tally: Tally, loss: Loss | None = None
) -> AsyncGenerator[bytes, None]:
    """Decode's legs of `r`'s stream, relayed: `r.resp`'s events (rewritten by `splice` if
    given), and after a leg lost before its `[DONE]` another decode's continuing from the
    tokens sent, within `--migration-limit`. A `loss` given first: the leg was lost already
    (a choice of n > 1 whose loss `fan_out` counted). `tally.ok` tells whether the stream
    ended whole; else its last event was the one error event."""
    metrics = r.relay.metrics
    transcript = r.transcript
    resumed = counted = loss is not None
    done = failed = False
    idle_s = min(r.relay.config.stream_idle_timeout_s, r.timeout_s)
    while True:
        if loss is None:
            resp = r.resp
            assert resp is not None
            name = r.decode.instance_id
            carry = b""
            r.evicted = ""
            # Watched even when it cannot move (--migration-limit 0): a decode that leaves
            # ends the stream with an error event then, not after --stream-idle-timeout-s.
            r.relay.departures.add(name, r)
            chunks = resp.chunks(idle_s)
            try:
                async for chunk in chunks:
                    data = carry + chunk if carry else chunk
                    cut = data.rfind(b"\n\n") + 2
                    if cut == 1:  # no complete event yet
                        carry = data
                        continue
                    out, carry = data[:cut], data[cut:]
                    last_at = tally.last_at = time.perf_counter()
                    if not tally.events:
                        tally.first_at = last_at
                        metrics.ttft.observe(tally.first_at - r.started)
                    if not tally.from_decode:
                        tally.from_decode = True
                        tracing.record_span("pdplane.first_byte", r.decode_answered_ns)
                    if transcript is not None:
                        at = out.find(SSE_ERROR)
                        if at >= 0:
                            # vLLM's error event (then [DONE]): held back, the stream
                            # continues elsewhere; relayed only if it cannot.
                            event = out[at:]  # and [DONE], relayed as sent
                            if not event.endswith(SSE_DONE):
                                event += SSE_DONE
                            loss = Loss(
                                "error_event",
                                502,
                                f"decode {name} sent an error event mid-stream",
                                event,
                            )
                            out = out[:at]
                        transcript.observe(out, resumed)
                        if splice is None or splice.passes_token_ids:
                            out = transcript.strip(out)
                    tally.events += out.count(b"\n\n")
                    done = out.endswith(SSE_DONE)
                    # vLLM ends a failed request's stream with an error event, then [DONE].
                    failed = failed or SSE_ERROR in out
                    if out:
                        if splice is None:
                            out = usage_details.rewrite_events(out, r.cached, r.prefill is None)
                        else:
                            out = splice.rewrite(out)
                        if transcript is not None and transcript.reads_text:
                            transcript.deliver(out)
                        yield out
                    if loss is not None:
                        break
            except (UpstreamTimeout, UpstreamUnreachable) as exc:
                loss = r.decode_lost(name, exc, idle_s)
            finally:
                await chunks.aclose()
                r.relay.departures.discard(name, r)
            if loss is None and not done:
                loss = r.decode_lost(name, None, idle_s)
            if loss is None:
                tally.ok = not failed
                return
        # A stream that sent nothing yet runs again whole (`migrate`).
        fresh = isinstance(transcript, Transcript) and not transcript.started
        if transcript is None or not (fresh or transcript.resumable()):
            yield loss.event or _failed(GatewayError(loss.status, loss.message))
            return
        if transcript.finished and not loss.event:
            # The last token went out: the stream only misses its usage and [DONE].
            first = transcript.as_first_token()
            yield Splice(r.req, first, None, r.cached, transcript.tokens).closing()
            tally.ok = True
            return
        lost_at = time.perf_counter()
        try:
            if isinstance(transcript, Choices):
                fan = fan_out(r, transcript, loss, relay_legs)
            else:
                splice = await migrate(r, transcript, loss, counted)
        except GatewayError as exc:
            yield loss.event or _failed(exc)
            return
        metrics.migration_seconds.observe(time.perf_counter() - lost_at)
        if isinstance(transcript, Choices):
            async for out in fan.events():
                yield out
            tally.ok = fan.ok
            return
        resumed, counted, loss = not fresh, False, None
