"""The request path: one request relayed through a scheduled (prefill, decode) pair, top to
bottom (no FastAPI here: asyncio, the upstream client and the scheduler port).

`Relay.handle(req, ...)` runs `_Request.run`:

1. **schedule** (`_schedule`): `Schedule` through the scheduler port. A refusal because every
   compatible instance is full waits in the admission queue (`pdplane.gateway.admission`),
   bounded, before it is a 503.
2. **one attempt on the pair** (`_attempt`), by mode:
   - *decode only*: the decision has no prefill (decode holds all but a few prompt tokens):
     the client's body goes to decode as it came, and decode computes the rest;
   - *concurrent* (`--dispatch concurrent`): decode's request is opened while prefill runs;
     the `kv_transfer_params` only prefill can issue follow when it answers (`_concurrent`);
   - *sequential* (default): the prefill leg (`_prefill_leg`), then the decode leg with the
     client's body plus prefill's `kv_transfer_params` (`pdplane.gateway.bodies`);
   - *first token from prefill* (sequential, streamed, `bodies.takes_first_token`): prefill's
     token is written at once and decode, opened after it, continues from it
     (`_first_token`, `_open_continuation`; the events are `pdplane.gateway.splice`'s).
3. **the reply**: decode's JSON as it came, or its SSE relayed whole events at a time
   (`_stream`).
4. **after-care** (`pdplane.gateway.aftercare.Aftercare`, one per Schedule): the one outcome
   decision, `Release(outcome)` and, unless decode pulled it, prefill's KV freed through
   `KvTransfer.AbortTransfer`; the path settles it wherever an attempt ends.

Failures before any byte reached the client: an instance that cannot be reached (refused,
reset, closed before answering) -> another pair, at most `max_retries` times, excluding it
(`RetryElsewhere`), else 502; silent for `upstream_timeout_s` -> 504 (no retry: it may still
be computing); an instance's 4xx -> that status and body unchanged; 5xx -> 502 naming it;
prefill's answer without usable `kv_transfer_params` -> 502. Once the first token from prefill
went out, a decode that cannot be reached is replaced, within the same retries, by another
decode computing the whole prompt (`_open_continuation`); any other failure before decode's
first byte is one SSE error event. A decode that fails after its first byte ends the stream
with one error event (`_decode_lost`: the one place where a stream's decode is lost).
Cancellation (client gone): upstream connections closed (vLLM aborts the request), prefill's
KV freed, Release "cancelled".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from pydantic_core import from_json

from pdplane.core import tracing
from pdplane.core.kv_params import DecodeRequestParams, KvParamsError
from pdplane.gateway import usage_details
from pdplane.gateway.admission import AdmissionQueue
from pdplane.gateway.aftercare import Aftercare, Caretaker, KvAborter
from pdplane.gateway.bodies import (
    continuation_body,
    decode_body,
    decode_body_parts,
    prefill_body,
    takes_first_token,
)
from pdplane.gateway.config import RelayConfig
from pdplane.gateway.errors import (
    GatewayError,
    UpstreamReply,
    bad_gateway,
    bad_request,
    gateway_timeout,
    unavailable,
)
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.prompt_ids import Tokenizers
from pdplane.gateway.replies import SSE_DONE, JsonReply, RetryElsewhere, StreamReply
from pdplane.gateway.route_note import RouteNote
from pdplane.gateway.splice import FirstToken, Splice
from pdplane.gateway.upstream import (
    UpstreamClient,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from pdplane.gateway.validation import COMPLETIONS, ClientRequest
from pdplane.scheduler import (
    InstanceRef,
    Outcome,
    RequestFeatures,
    SchedulerBusy,
    SchedulerError,
    SchedulerPort,
    SchedulerUnavailable,
)

__all__ = ["Relay"]

log = logging.getLogger(__name__)

_SSE_HEADERS = {"content-type": "text/event-stream"}
#: How an upstream error event starts (vLLM: `data: {"error": {...}}`, spaced or not).
_ERROR_EVENT = b'data: {"error"'


class Relay:
    """Relays requests through scheduled (prefill, decode) pairs; what all requests share.

    Args:
        scheduler: the scheduler port (remote or local, `pdplane.scheduler.open_scheduler`).
        upstream: the pooled HTTP client to the instances.
        aborter: AbortTransfer client for KV held by prefill instances.
        metrics: where latencies, retries and cancellations are recorded.
        config: dispatch mode, timeouts, retries.
        tokenizers: the served models' tokenizers, if the gateway has them (the first token
            from prefill asks them whether a token without text ends inside a character).
    """

    def __init__(
        self,
        scheduler: SchedulerPort,
        upstream: UpstreamClient,
        aborter: KvAborter,
        metrics: GatewayMetrics,
        config: RelayConfig,
        tokenizers: Tokenizers | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.upstream = upstream
        self.aborter = aborter
        self.metrics = metrics
        self.config = config
        self.tokenizers = tokenizers
        self.admission = AdmissionQueue(config.queue_timeout_s, config.max_queued_requests, metrics)
        self.caretaker = Caretaker(scheduler, aborter, metrics, self.admission.wake)
        #: Headers of every leg but `x-request-id` (a bearer token for `--upstream-api-key`).
        self.headers = {"content-type": "application/json"}
        if config.upstream_api_key:
            self.headers["authorization"] = f"Bearer {config.upstream_api_key}"

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
        return await _Request(self, req, request_id, started, max_model_len, note).run()

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Waits (bounded, s) for background AbortTransfer calls; used at shutdown."""
        await self.caretaker.drain(timeout_s)


class _Request:
    """One request through the relay: its tries on scheduled pairs, its reply, its stream.

    Per try: `care` (the try's after-care), `prefill` / `decode` (its pair), `cached`
    (prefill's prefix cache hit for `--enable-prompt-tokens-details`; with no prefill leg the
    scheduler's count of decode's, `decode_cached`, which decode's own report overrides),
    `prefilled_at`.
    """

    care: Aftercare  # set by each `_schedule`, with:
    decode: InstanceRef

    __slots__ = (
        "cached",
        "care",
        "decode",
        "decode_answered_ns",
        "decode_cached",
        "excluded",
        "failed",
        "first_token",
        "headers",
        "id",
        "max_model_len",
        "note",
        "prefill",
        "prefilled_at",
        "relay",
        "req",
        "resp",
        "started",
        "streaming",
        "timeout_s",
        "tries_left",
    )

    def __init__(
        self,
        relay: Relay,
        req: ClientRequest,
        request_id: str,
        started: float,
        max_model_len: int,
        note: RouteNote | None,
    ) -> None:
        self.relay = relay
        self.req = req
        self.id = request_id
        self.started = started
        self.max_model_len = max_model_len  # the model's (tokens; 0 = unknown)
        self.note = note
        self.tries_left = relay.config.max_retries
        self.excluded: list[str] = []  # instances that failed this request
        self.failed: RetryElsewhere | None = None  # the failure the current try follows
        self.headers = {**relay.headers, "x-request-id": request_id}
        self.timeout_s = relay.config.upstream_timeout_s
        # The first token from prefill: sequential dispatch only, as decode's prompt then
        # holds it. More tokens asked than the model holds take the usual path: decode, asked
        # one less, would serve max_model_len + 1 and name the wrong number when it refuses.
        self.first_token = (
            relay.config.first_token == "prefill"
            and relay.config.dispatch == "sequential"
            and not (max_model_len and req.max_tokens > max_model_len)
            and takes_first_token(req)
        )
        self.prefill: InstanceRef | None = None  # None: decode computes the prompt itself
        self.cached: int | None = None
        self.decode_cached = 0  # the decision's decode_cached_tokens (tokens)
        self.prefilled_at = 0.0  # time.perf_counter() at prefill's answer (its first token)
        self.decode_answered_ns = 0  # time.time_ns() at decode's response headers
        self.resp: UpstreamResponse | None = None  # decode's, once a stream has it
        self.streaming = False  # set once the stream generator started (it then settles)

    async def run(self) -> JsonReply | StreamReply:
        """Schedule and attempt, again on another pair after an instance could not be
        reached (at most `max_retries` times); see `Relay.handle`."""
        while True:
            await self._schedule(queue=self.failed is None)
            try:
                return await self._attempt()
            except RetryElsewhere as failed:
                self._retrying(failed, "retrying on another pair")
                if self.tries_left <= 0:
                    raise failed.error from None
                self.tries_left -= 1
                self.failed = failed

    def _retrying(self, failed: RetryElsewhere, how: str) -> None:
        log.warning("request %s: %s; %s", self.id, failed, how)
        self.relay.metrics.retries.labels(failed.side).inc()
        self.excluded.append(failed.instance_id)

    # -- 1. schedule ---------------------------------------------------------------------

    async def _schedule(self, queue: bool) -> None:
        """A new decision for this request (and a new after-care for it). `queue`: whether a
        refusal for room waits in the admission queue; a retry answers with the failure it
        follows instead, a take-over after the first token waits (its stream has no other
        way to an answer)."""
        req, relay = self.req, self.relay
        self.care = care = relay.caretaker.begin(self.id)
        prompt_tokens, max_tokens = req.prompt_tokens, req.max_tokens
        if self.max_model_len:
            prompt_tokens = min(prompt_tokens, self.max_model_len)
            max_tokens = min(max_tokens, self.max_model_len - prompt_tokens)
        features = RequestFeatures(
            self.id,
            req.model,
            prompt_tokens,
            max_tokens,
            routing_key=req.routing_key,
            exclude_instance_ids=tuple(self.excluded),
            prefix_hashes=req.prefix_hashes,
        )
        schedule, admission = relay.scheduler.schedule, relay.admission
        try:
            with tracing.span("pdplane.schedule"):
                if queue and admission.has_waiters(req.model):
                    decision = await admission.admit(req.model, lambda: schedule(features), None)
                else:
                    try:
                        decision = await schedule(features)
                    except SchedulerBusy as busy:
                        if not queue:
                            raise  # a retry: the failure it follows is the answer (below)
                        decision = await admission.admit(
                            req.model, lambda: schedule(features), busy
                        )
        except asyncio.CancelledError as exc:
            # The scheduler may have counted the request before the client left; an unknown id
            # is harmless to Release.
            care.settle(exc)
            raise
        except SchedulerUnavailable as exc:
            if self.failed is not None:
                raise self.failed.error from None  # no other pair: the failure is the answer
            raise unavailable(exc.reason) from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        except SchedulerError as exc:
            raise unavailable(f"scheduler error: {exc}") from None
        self.prefill, self.decode = decision.prefill, decision.decode
        self.decode_cached = decision.decode_cached_tokens
        if self.note is not None:
            self.note.decision = decision

    # -- 2. one attempt on the pair ------------------------------------------------------

    async def _attempt(self) -> JsonReply | StreamReply:
        """Both legs on the scheduled pair, by mode; the answer, or a stream that settles the
        attempt when it ends. Raises RetryElsewhere, GatewayError, UpstreamReply, or
        CancelledError, the attempt settled."""
        error: BaseException | None = None
        handed_off = False
        resp: UpstreamResponse | None = None
        self.prefilled_at, self.cached = 0.0, None
        try:
            if self.prefill is None:  # decode only
                if self.relay.config.prompt_tokens_details:
                    self.cached = usage_details.decode_hit(
                        self.decode_cached, self.req.prompt_tokens, self.req.prefix_hashes
                    )
                resp = await self._open_decode(self.req.raw)
            elif self.relay.config.dispatch == "concurrent":
                resp = await self._concurrent()
            else:  # sequential
                answer, kv = await self._prefill_leg()
                if self.first_token:
                    reply = self._first_token(answer, kv)
                    if reply is not None:
                        handed_off = True
                        return reply
                resp = await self._open_decode(decode_body(self.req.raw, self.req.body, kv))
            if resp.status >= 400:
                await self._decode_error(resp)
            if not self.req.stream:
                return await self._json_reply(resp)
            handed_off = True
            if self.first_token and self.prefill is not None:
                # Eligible, but the first token came from decode: counted once per request,
                # where its stream begins (an attempt that raises counts nothing).
                self.relay.metrics.first_from_decode.inc()
            self.resp = resp
            return StreamReply(self._stream(None), _SSE_HEADERS, self._abandon)
        except BaseException as exc:
            error = exc
            raise
        finally:
            if not handed_off:
                if resp is not None:
                    resp.close()
                self.care.settle(error)

    @contextmanager
    def _leg_errors(self, side: str, ref: InstanceRef) -> Iterator[None]:
        """Unreachable -> RetryElsewhere (the retry frees prefill's KV); silent -> 504."""
        try:
            yield
        except UpstreamUnreachable as exc:
            err = bad_gateway(f"{side} instance {ref.instance_id} unreachable: {exc}")
            raise RetryElsewhere(side, ref.instance_id, err) from None
        except UpstreamTimeout:
            raise gateway_timeout(
                f"{side} instance {ref.instance_id} did not answer within {self.timeout_s:g} s"
            ) from None

    async def _prefill_leg(self) -> tuple[dict[str, Any], bytes]:
        """The prefill leg: prefill's answer (parsed) and its kv_transfer_params (JSON bytes,
        as returned); prefill then holds the prompt's KV for decode (`care.hold_kv`)."""
        t0 = time.perf_counter()
        p, d = self.prefill, self.decode
        assert p is not None, "a prefill leg without a prefill instance"
        body = prefill_body(
            self.req.endpoint,
            self.req.body,
            self.id,
            d.instance_id,
            d.kv_endpoint,
            token_ids=self.first_token,
        )
        upstream = self.relay.upstream
        with tracing.span("pdplane.prefill_leg"), self._leg_errors("prefill", p):
            resp = await upstream.open(
                p.url + self.req.endpoint,
                body,
                tracing.inject_headers(self.headers),
                read_timeout_s=self.timeout_s,
                total_timeout_s=self.timeout_s,
            )
            data = await upstream.read(resp)
        self.prefilled_at = time.perf_counter()
        self.relay.metrics.prefill_leg.observe(self.prefilled_at - t0)
        if resp.status >= 400:
            if resp.status < 500:
                raise UpstreamReply(resp.status, data, resp.headers.get("content-type", ""))
            raise _status_error("prefill", p.instance_id, resp.status, data)
        try:
            answer = from_json(data)
            kv = answer.get("kv_transfer_params")
            if not isinstance(kv, dict):
                raise KvParamsError("kv_transfer_params missing or not an object")
            self.care.hold_kv(DecodeRequestParams.from_dict(kv))
        except (ValueError, AttributeError) as exc:
            raise bad_gateway(
                f"prefill instance {p.instance_id} returned no usable kv_transfer_params: {exc}"
            ) from None
        if self.relay.config.prompt_tokens_details:
            self.cached = usage_details.cached_tokens_of(answer)
        tracing.stamp_kv_params(kv)
        return answer, json.dumps(kv, separators=(",", ":")).encode()

    async def _open_decode(self, body: Any, endpoint: str = "") -> UpstreamResponse:
        """Opens the decode leg on `endpoint` (default: the client's) with `body` (bytes, or
        an async iterator of them sent chunked); returns once decode's headers arrived."""
        t0 = time.perf_counter()
        d = self.decode
        with tracing.span("pdplane.decode_leg"), self._leg_errors("decode", d):
            resp = await self.relay.upstream.open(
                d.url + (endpoint or self.req.endpoint),
                body,
                tracing.inject_headers(self.headers),
                read_timeout_s=self.timeout_s,
            )
        self.relay.metrics.decode_leg.observe(time.perf_counter() - t0)
        self.decode_answered_ns = time.time_ns()
        return resp

    async def _concurrent(self) -> UpstreamResponse:
        """Opens the decode request while prefill runs: headers and the body without
        kv_transfer_params go out at once, the rest when prefill answers (chunked)."""
        head, tail = decode_body_parts(self.req.raw, self.req.body)
        params: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def body() -> AsyncGenerator[bytes, None]:
            yield head
            yield await params + tail

        decode = asyncio.ensure_future(self._open_decode(body()))
        try:
            _, kv = await self._prefill_leg()
        except BaseException:
            decode.cancel()
            await asyncio.gather(decode, return_exceptions=True)
            raise
        params.set_result(kv)
        return await decode

    async def _decode_error(self, resp: UpstreamResponse) -> None:
        """Decode refused the request: prefill's KV is freed now; raises its 4xx as it came
        (UpstreamReply) or a 502 naming it."""
        try:
            data = await self.relay.upstream.read(resp)
        except (UpstreamUnreachable, UpstreamTimeout):
            data = b""
        self.care.free_kv(f"decode answered {resp.status}")
        if resp.status < 500:
            raise UpstreamReply(resp.status, data, resp.headers.get("content-type", ""))
        raise _status_error("decode", self.decode.instance_id, resp.status, data)

    # -- 3. the reply --------------------------------------------------------------------

    async def _json_reply(self, resp: UpstreamResponse) -> JsonReply:
        name = self.decode.instance_id
        try:
            body = await self.relay.upstream.read(resp)
        except UpstreamUnreachable as exc:
            raise bad_gateway(f"decode instance {name} failed before answering: {exc}") from None
        except UpstreamTimeout:
            raise gateway_timeout(
                f"decode instance {name} went silent for {self.timeout_s:g} s"
            ) from None
        self.care.succeeded()
        metrics = self.relay.metrics
        if self.prefilled_at:  # prefill computed the first token (vLLM counts it then)
            metrics.ttft.observe(self.prefilled_at - self.started)
        body = usage_details.rewrite_json(body, self.cached, self.prefill is None)
        metrics.e2e.observe(time.perf_counter() - self.started)
        return JsonReply(200, body, resp.headers.get("content-type", "application/json"))

    def _first_token(self, answer: dict[str, Any], kv: bytes) -> StreamReply | None:
        """The stream from prefill's first token on (decode is opened inside it, after the
        token went out); None when decode cannot continue it (the usual path then)."""
        first = FirstToken.of(self.req.endpoint, answer)
        splice = self._splice(first) if first is not None else None
        if first is None or splice is None:
            return None
        self.relay.metrics.first_from_prefill.inc()
        if first.ends_request(self.req, self.max_model_len):
            # Decode is not asked: prefill's KV is freed now.
            self.care.free_kv("the request ended at its first token")
            self.care.succeeded()
            return StreamReply(self._stream(splice), _SSE_HEADERS, self._abandon)
        return StreamReply(self._stream(splice, (first, kv)), _SSE_HEADERS, self._abandon)

    def _splice(self, first: FirstToken) -> Splice | None:
        """The client's stream from prefill's `first` on; None when decode cannot continue it
        (`FirstToken.continuable`). Only a first token without text asks the tokenizer:
        whether it ends inside a character, which `Splice` then rebuilds with the client's
        detokenizer settings (special tokens skipped unless the client keeps them)."""
        kept = client = None
        tokenizers = self.relay.tokenizers
        if not first.text and tokenizers is not None:
            tokenizer = tokenizers.get(self.req.model)
            if tokenizer is not None:
                skip = self.req.body.get("skip_special_tokens") is not False
                kept = partial(tokenizer.decode, skip_special_tokens=False)
                client = partial(tokenizer.decode, skip_special_tokens=skip)
        if not first.continuable(kept, client):
            return None
        return Splice(
            self.req, first, client if first.inside_character(kept) else None, self.cached
        )

    async def _stream(
        self, splice: Splice | None, continuation: tuple[FirstToken, bytes] | None = None
    ) -> AsyncGenerator[bytes, None]:
        """The client's SSE; settles the attempt when it ends. Decode's events (`self.resp`)
        are relayed whole events at a time as they arrive. With `splice`, the first token's
        events go first and decode's are rewritten; with `continuation` (the first token,
        prefill's kv_transfer_params) decode is opened once the first token went out; with
        `splice` alone the first token ended the request (its whole stream is the splice's)."""
        self.streaming = True
        metrics = self.relay.metrics
        error: BaseException | None = None
        first_at = last_at = 0.0
        events = 0
        done = failed = from_decode = False
        try:
            if splice is not None:
                first_at = time.perf_counter()
                metrics.ttft.observe(first_at - self.started)
                if continuation is None:
                    yield splice.ending()
                    metrics.e2e.observe(time.perf_counter() - self.started)
                    return
                events = 1
                yield splice.opening()
                try:
                    self.resp = await self._open_continuation(*continuation, splice.token_ids)
                except GatewayError as exc:
                    yield exc.sse_event()
                    return
            resp = self.resp
            assert resp is not None
            name = self.decode.instance_id
            idle_s = min(self.relay.config.stream_idle_timeout_s, self.timeout_s)
            carry = b""
            try:
                async for chunk in resp.chunks(idle_s):
                    data = carry + chunk if carry else chunk
                    cut = data.rfind(b"\n\n") + 2
                    if cut == 1:  # no complete event yet
                        carry = data
                        continue
                    out, carry = data[:cut], data[cut:]
                    last_at = time.perf_counter()
                    if not events:
                        first_at = last_at
                        metrics.ttft.observe(first_at - self.started)
                    if not from_decode:
                        from_decode = True
                        tracing.record_span("pdplane.first_byte", self.decode_answered_ns)
                    events += out.count(b"\n\n")
                    done = out.endswith(SSE_DONE)
                    # vLLM ends a failed request's stream with an error event, then [DONE].
                    failed = failed or _ERROR_EVENT in out
                    if splice is None:
                        yield usage_details.rewrite_events(out, self.cached, self.prefill is None)
                    else:
                        yield splice.rewrite(out)
            except (UpstreamTimeout, UpstreamUnreachable) as exc:
                yield self._decode_lost(name, exc, idle_s)
                return
            if not done:
                yield bad_gateway(
                    f"decode instance {name} ended the stream before [DONE]"
                ).sse_event()
                return
            if failed:
                return
            self.care.succeeded()
            metrics.e2e.observe(time.perf_counter() - self.started)
            if events > 2:  # ignore [DONE]; one event per token otherwise
                metrics.tpot.observe((last_at - first_at) / (events - 2))
        except BaseException as exc:
            error = exc
            raise
        finally:
            outcome = self.care.settle(error)
            if self.resp is not None:
                if outcome is Outcome.SUCCESS:
                    self.resp.release()
                else:
                    self.resp.close()

    def _decode_lost(self, name: str, exc: Exception, idle_s: float) -> bytes:
        """A stream's decode failed after its first byte (connection lost, or silent past
        `--stream-idle-timeout-s`): the event that ends the client's stream. (Continuing on
        another decode from the prompt plus the tokens already sent would start here.)"""
        if isinstance(exc, UpstreamTimeout):
            return gateway_timeout(
                f"decode instance {name} sent nothing for {idle_s:g} s"
            ).sse_event()
        return bad_gateway(f"decode instance {name} failed mid-stream: {exc}").sse_event()

    async def _open_continuation(
        self, first: FirstToken, kv: bytes, token_ids: bool
    ) -> UpstreamResponse:
        """Decode's leg of a stream whose first token (prefill's) reached the client: decode
        continues from prefill's prompt ids + `first`, loading prefill's KV (`kv`: its
        kv_transfer_params, JSON bytes).

        A decode that cannot be reached is replaced, within the request's retries left, by
        another the scheduler picks (the failed ones excluded, waiting for room if need be),
        which computes the whole prompt itself: the failed try is released as failed and
        prefill's KV freed, as for any retry, and the client's stream goes on. Anything else
        before decode's first byte (a timeout, an error status) is the answer: raises
        GatewayError, whose event ends the stream (the status and decode's message for 4xx,
        502 for 5xx, 504 for silence). `token_ids`: decode streams its tokens' ids
        (`Splice.token_ids`).
        """
        prompt = first.decode_prompt
        body = continuation_body(self.req, prompt, kv, token_ids)
        while True:
            try:
                resp = await self._open_decode(body, COMPLETIONS)
            except RetryElsewhere as failed:
                self.care.settle(failed)  # Release first, so the next Schedule excludes it
                if self.tries_left <= 0:
                    raise failed.error from None
                self.tries_left -= 1
                self._retrying(failed, "another decode takes over")
                self.failed = failed
                await self._schedule(queue=True)
                body = continuation_body(self.req, prompt, None, token_ids)
                continue
            if resp.status < 400:
                return resp
            try:
                await self._decode_error(resp)
            except UpstreamReply as reply:
                excerpt = reply.body[:300].decode(errors="replace")
                raise GatewayError(
                    reply.status,
                    f"decode instance {self.decode.instance_id} answered {reply.status}: {excerpt}",
                ) from None
            finally:
                resp.close()

    def _abandon(self) -> None:
        # The reply was closed before its stream started (the client left first), so the
        # stream's own `finally` never runs: settle here, as a closed stream would.
        if not self.streaming:
            self.streaming = True
            if self.resp is not None:
                self.resp.close()
            self.care.settle(GeneratorExit())


def _status_error(side: str, instance_id: str, status: int, body: bytes) -> GatewayError:
    excerpt = body[:300].decode(errors="replace")
    return bad_gateway(f"{side} instance {instance_id} answered {status}: {excerpt}")
