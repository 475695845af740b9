"""The request path: one request relayed through a scheduled (prefill, decode) pair, top to
bottom (no FastAPI here: asyncio, the upstream client and the scheduler port).

`Relay.handle(req, ...)` runs `_Request.run`:

1. **schedule** (`_schedule`): `Schedule` through the scheduler port. A refusal because every
   compatible instance is full, or the model has no usable pair for a moment, waits in the
   admission queue (`pdplane.gateway.admission`), bounded, before it is a 503.
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
first byte is one SSE error event. A decode lost after its first byte (`_decode_lost` says
why) is replaced by another that continues from the prompt plus the tokens sent (`_migrate`,
`pdplane.gateway.migration`), within `--migration-limit` and `--migration-timeout-s`; then one
error event ends the stream. A non-streamed request whose decode died while computing it runs
again on another pair, within the same limit.
Cancellation (client gone): upstream connections closed (vLLM aborts the request), prefill's
KV freed, Release "cancelled".
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import time
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any, NoReturn

from pydantic_core import from_json

from pdplane.core import tracing
from pdplane.core.kv_params import DecodeRequestParams, KvParamsError, make_transfer_id
from pdplane.gateway import usage_details
from pdplane.gateway.admission import AdmissionQueue
from pdplane.gateway.aftercare import Aftercare, Caretaker, KvAborter
from pdplane.gateway.bodies import (
    continuation_body,
    decode_body,
    decode_body_parts,
    migratable,
    prefill_body,
    resumed_body,
    takes_first_token,
    with_token_ids,
)
from pdplane.gateway.config import RelayConfig
from pdplane.gateway.departures import Departures
from pdplane.gateway.errors import (
    GatewayError,
    UpstreamReply,
    bad_gateway,
    bad_request,
    gateway_timeout,
    unavailable,
)
from pdplane.gateway.fanout import Choices, FanOut, Leg
from pdplane.gateway.fleet_view import FleetView
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.migration import (
    Budget,
    Loss,
    Transcript,
    stop_lookback,
    stop_seam,
    whole_characters,
)
from pdplane.gateway.prompt_ids import Tokenizers
from pdplane.gateway.replies import SSE_DONE, JsonReply, RetryElsewhere, StreamReply
from pdplane.gateway.route_note import RouteNote
from pdplane.gateway.seam import Seam
from pdplane.gateway.splice import FirstToken, Splice
from pdplane.gateway.upstream import (
    UpstreamClient,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from pdplane.gateway.validation import COMPLETIONS, ClientRequest
from pdplane.scheduler import (
    Decision,
    InstanceRef,
    Outcome,
    RequestFeatures,
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
        fleet: the registry's view: a model without a usable pair waits in the admission
            queue (None: only refusals for room wait).
    """

    def __init__(
        self,
        scheduler: SchedulerPort,
        upstream: UpstreamClient,
        aborter: KvAborter,
        metrics: GatewayMetrics,
        config: RelayConfig,
        tokenizers: Tokenizers | None = None,
        fleet: Callable[[], FleetView] | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.upstream = upstream
        self.aborter = aborter
        self.metrics = metrics
        self.config = config
        self.tokenizers = tokenizers
        self.admission = AdmissionQueue(
            config.queue_timeout_s, config.max_queued_requests, metrics, fleet
        )
        self.caretaker = Caretaker(scheduler, aborter, metrics, self.admission.wake)
        #: streams by decode, moved off decodes that leave the registry or drain
        self.departures = Departures(config.drain_grace_s)
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
        "arrived_ns",
        "budget",
        "cached",
        "care",
        "choice",
        "decode",
        "decode_answered_ns",
        "decode_cached",
        "evicted",
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
        "tokenizer",
        "transcript",
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
        self.arrived_ns = time.time_ns()  # wall clock: compared with registration times
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
        # Migration: the client's stream so far (None: this request is not resumed
        # elsewhere), resumes so far, when the first loss happened, why the leg was closed.
        # The model's tokenizer when the stream may migrate (kept: the fleet's may change).
        self.tokenizer = (
            relay.tokenizers.get(req.model)
            if relay.config.migration_limit and req.stream and relay.tokenizers is not None
            else None
        )
        self.transcript: Transcript | Choices | None = None
        if relay.config.migration_limit and migratable(req, self.tokenizer is not None):
            lookback = stop_lookback(req.body)
            offsets = req.endpoint == COMPLETIONS and req.body.get("logprobs") is not None
            n = req.body.get("n")
            self.transcript = (
                Choices(n, lookback, offsets)
                if isinstance(n, int) and n > 1
                else Transcript(lookback=lookback, text_offsets=offsets)
            )
        self.budget = Budget()  # shared with the choices of a streamed n > 1
        self.choice = 0  # the choice this request continues (n > 1, `_choice_leg`)
        self.evicted = ""

    async def run(self) -> JsonReply | StreamReply:
        """Schedule and attempt, again on another pair after an instance could not be
        reached (at most `max_retries` times); see `Relay.handle`."""
        while True:
            await self._schedule(queue=self.failed is None)
            try:
                return await self._attempt()
            except _DecodeLost as lost:
                # A non-streamed answer lost with its decode: the client saw nothing, so the
                # whole request runs again on another pair (exact, seeded sampling included).
                self._count_migration(lost.loss, lost.instance_id)
                log.warning("request %s: %s; running it again on another pair", self.id, lost)
                self.relay.metrics.migration_recomputed.inc(self.req.prompt_tokens)
                self.excluded.append(lost.instance_id)
                # No other decode: the loss is the answer (502), not the scheduler's 503.
                self.failed = RetryElsewhere(
                    "decode", lost.instance_id, bad_gateway(lost.loss.message)
                )
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

    async def _schedule(
        self, queue: bool, prompt_tokens: int | None = None, max_tokens: int | None = None
    ) -> None:
        """A new decision for this request (and a new after-care for it). `queue`: whether a
        refusal for room waits in the admission queue; a retry answers with the failure it
        follows instead, a take-over after the first token waits (its stream has no other
        way to an answer). `prompt_tokens`, `max_tokens`: a resumed stream's (default the
        request's)."""
        req, relay = self.req, self.relay
        self.care = care = relay.caretaker.begin(self.id)
        if prompt_tokens is None:
            prompt_tokens = req.prompt_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens
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

        def failed() -> tuple[str, ...]:
            # A failed instance registered again since the request came is a new process.
            return admission.failed(req.model, self.excluded, self.arrived_ns)

        def again() -> Awaitable[Decision]:
            return schedule(dataclasses.replace(features, exclude_instance_ids=failed()))

        try:
            with tracing.span("pdplane.schedule"):
                if queue and admission.has_waiters(req.model):
                    decision = await admission.admit(req.model, again, None)
                else:
                    try:
                        decision = await schedule(features)
                    except SchedulerUnavailable as refused:
                        # A retry waits only when no instance is left but those that failed
                        # it; else the failure it follows is the answer (below).
                        gone = () if queue else failed()
                        if not admission.waits_on(req.model, refused, gone, queue):
                            raise
                        decision = await admission.admit(
                            req.model, again, refused, failed if not queue else tuple
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
                raw = self.req.raw
                if self.transcript is not None:
                    raw = with_token_ids(raw, self.req.body, None)
                resp = await self._open_decode(raw)
            elif self.relay.config.dispatch == "concurrent":
                resp = await self._concurrent()
            else:  # sequential
                answer, kv = await self._prefill_leg()
                if self.first_token:
                    reply = self._first_token(answer, kv)
                    if reply is not None:
                        handed_off = True
                        return reply
                if self.transcript is not None:
                    body = with_token_ids(self.req.raw, self.req.body, kv)
                else:
                    body = decode_body(self.req.raw, self.req.body, kv)
                resp = await self._open_decode(body)
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

    def _restartable(self) -> bool:
        """Whether a non-streamed request whose decode is lost runs again on another pair
        (within `--migration-limit`): the client has seen nothing of it."""
        return not self.req.stream and self.relay.config.migration_limit > 0

    @contextmanager
    def _leg_errors(self, side: str, ref: InstanceRef) -> Iterator[None]:
        """Unreachable -> RetryElsewhere (the retry frees prefill's KV); silent -> 504."""
        try:
            yield
        except UpstreamUnreachable as exc:
            if exc.accepted and side == "decode" and self._restartable():
                # A non-streamed request's decode died while computing it: run it again.
                message = f"decode instance {ref.instance_id} failed before answering: {exc}"
                raise _DecodeLost(ref.instance_id, Loss("lost", 502, message)) from None
            err = bad_gateway(f"{side} instance {ref.instance_id} unreachable: {exc}")
            raise RetryElsewhere(side, ref.instance_id, err) from None
        except UpstreamTimeout:
            raise gateway_timeout(
                f"{side} instance {ref.instance_id} did not answer within {self.timeout_s:g} s"
            ) from None

    async def _prefill_leg(
        self, endpoint: str = "", client_body: dict[str, Any] | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """The prefill leg: prefill's answer (parsed) and its kv_transfer_params (JSON bytes,
        as returned); prefill then holds the prompt's KV for decode (`care.hold_kv`).
        `endpoint`, `client_body`: a resumed stream's (default the client's).

        From the moment the call goes out until its answer is read, the attempt's after-care
        knows the transfer id prefill is to hold the KV under (`care.expect_kv`): an attempt
        that gives the call up (cancelled: the client left, a time budget ran out, another
        choice of the stream failed; or timed out) frees it by that id, whether prefill was
        still computing (vLLM aborts it when the connection closes; the abort then finds
        nothing, and ends the hold if it comes later) or had finished and holds the KV."""
        t0 = time.perf_counter()
        p, d, care = self.prefill, self.decode, self.care
        assert p is not None, "a prefill leg without a prefill instance"
        endpoint = endpoint or self.req.endpoint
        transfer_id = make_transfer_id(self.id)
        body = prefill_body(
            endpoint,  # type: ignore[arg-type]
            self.req.body if client_body is None else client_body,
            self.id,
            d.instance_id,
            d.kv_endpoint,
            # a resumed prompt's prefill too: its answer continues the stream's own
            token_ids=self.first_token or client_body is not None,
            transfer_id=transfer_id,
        )
        upstream = self.relay.upstream
        care.expect_kv(p.kv_endpoint, transfer_id)
        with tracing.span("pdplane.prefill_leg"), self._leg_errors("prefill", p):
            try:
                resp = await upstream.open(
                    p.url + endpoint,
                    body,
                    tracing.inject_headers(self.headers),
                    read_timeout_s=self.timeout_s,
                    total_timeout_s=self.timeout_s,
                )
            except UpstreamUnreachable as exc:
                if not exc.accepted:  # refused or reset on the way in: prefill never ran it
                    care.nothing_held()
                raise
            data = await upstream.read(resp)
        self.prefilled_at = time.perf_counter()
        self.relay.metrics.prefill_leg.observe(self.prefilled_at - t0)
        if resp.status >= 400:
            care.nothing_held()  # vLLM holds KV only for a request that finished
            if resp.status < 500:
                raise UpstreamReply(resp.status, data, resp.headers.get("content-type", ""))
            raise _status_error("prefill", p.instance_id, resp.status, data)
        try:
            answer = from_json(data)
            kv = answer.get("kv_transfer_params")
            if not isinstance(kv, dict):
                raise KvParamsError("kv_transfer_params missing or not an object")
            care.hold_kv(DecodeRequestParams.from_dict(kv))
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
        head, tail = decode_body_parts(self.req.raw, self.req.body, self.transcript is not None)
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
            message = f"decode instance {name} failed before answering: {exc}"
            if self._restartable():
                raise _DecodeLost(name, Loss("lost", 502, message)) from None
            raise bad_gateway(message) from None
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
        if self.transcript is not None:
            self.transcript = Transcript(first)
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
        are relayed whole events at a time as they arrive (`_legs`). With `splice`, the first
        token's events go first and decode's are rewritten; with `continuation` (the first
        token, prefill's kv_transfer_params) decode is opened once the first token went out;
        with `splice` alone the first token ended the request (its whole stream is the
        splice's)."""
        self.streaming = True
        metrics = self.relay.metrics
        error: BaseException | None = None
        tally = _Tally()
        try:
            if splice is not None:
                tally.first_at = time.perf_counter()
                metrics.ttft.observe(tally.first_at - self.started)
                if continuation is None:
                    yield splice.ending()
                    metrics.e2e.observe(time.perf_counter() - self.started)
                    return
                tally.events = 1
                yield splice.opening()
                try:
                    self.resp = await self._open_continuation(
                        *continuation, splice.token_ids or self.transcript is not None
                    )
                except GatewayError as exc:
                    yield exc.sse_event()
                    return
            async for out in self._legs(splice, tally):
                yield out
            if not tally.ok:
                return
            self.care.succeeded()
            metrics.e2e.observe(time.perf_counter() - self.started)
            if tally.events > 2:  # ignore [DONE]; one event per token otherwise
                metrics.tpot.observe((tally.last_at - tally.first_at) / (tally.events - 2))
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._settle_stream(error)

    def _settle_stream(self, error: BaseException | None) -> None:
        """Settles the stream's attempt (`error`: what ended it) and lets its leg go."""
        outcome = self.care.settle(error)
        if self.resp is not None:
            if outcome is Outcome.SUCCESS:
                self.resp.release()
            else:
                self.resp.close()

    async def _legs(
        self, splice: Splice | None, tally: _Tally, loss: Loss | None = None
    ) -> AsyncGenerator[bytes, None]:
        """Decode's legs of the stream, relayed: `self.resp`'s events (rewritten by `splice`
        if given), and after a leg lost before its `[DONE]` another decode's continuing from
        the tokens sent (`_migrate`; a streamed n > 1's choices each on their own,
        `_fan_out`), within `--migration-limit`. A `loss` given first: the leg was lost
        already (a choice of n > 1 whose loss `_fan_out` counted). `tally.ok` tells whether
        the stream ended whole; else its last event was the one error event."""
        metrics = self.relay.metrics
        transcript = self.transcript
        resumed = counted = loss is not None
        done = failed = False
        idle_s = min(self.relay.config.stream_idle_timeout_s, self.timeout_s)
        while True:
            if loss is None:
                resp = self.resp
                assert resp is not None
                name = self.decode.instance_id
                carry = b""
                self.evicted = ""
                if transcript is not None:
                    self.relay.departures.add(name, self)
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
                            metrics.ttft.observe(tally.first_at - self.started)
                        if not tally.from_decode:
                            tally.from_decode = True
                            tracing.record_span("pdplane.first_byte", self.decode_answered_ns)
                        if transcript is not None:
                            at = out.find(_ERROR_EVENT)
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
                            if splice is None or not splice.token_ids:
                                out = transcript.strip(out)
                        tally.events += out.count(b"\n\n")
                        done = out.endswith(SSE_DONE)
                        # vLLM ends a failed request's stream with an error event, then [DONE].
                        failed = failed or _ERROR_EVENT in out
                        if out:
                            if splice is None:
                                out = usage_details.rewrite_events(
                                    out, self.cached, self.prefill is None
                                )
                            else:
                                out = splice.rewrite(out)
                            if transcript is not None and transcript.reads_text:
                                transcript.deliver(out)
                            yield out
                        if loss is not None:
                            break
                except (UpstreamTimeout, UpstreamUnreachable) as exc:
                    loss = self._decode_lost(name, exc, idle_s)
                finally:
                    await chunks.aclose()
                    if transcript is not None:
                        self.relay.departures.discard(name, self)
                if loss is None and not done:
                    loss = self._decode_lost(name, None, idle_s)
                if loss is None:
                    tally.ok = not failed
                    return
            if transcript is None or not transcript.resumable():
                yield loss.event or GatewayError(loss.status, loss.message).sse_event()
                return
            if transcript.finished and not loss.event:
                # The last token went out: the stream only misses its usage and [DONE].
                first = transcript.as_first_token()
                yield Splice(self.req, first, None, self.cached, transcript.tokens).closing()
                tally.ok = True
                return
            lost_at = time.perf_counter()
            try:
                if isinstance(transcript, Choices):
                    fan = self._fan_out(transcript, loss)
                else:
                    splice = await self._migrate(transcript, loss, counted)
            except GatewayError as exc:
                yield loss.event or exc.sse_event()
                return
            metrics.migration_seconds.observe(time.perf_counter() - lost_at)
            if isinstance(transcript, Choices):
                async for out in fan.events():
                    yield out
                tally.ok = fan.ok
                return
            resumed, counted, loss = True, False, None

    def _fan_out(self, choices: Choices, loss: Loss) -> FanOut:
        """A streamed n > 1 whose decode leg was lost (`loss`): the lost attempt is released
        failed and counted as one migration (however many choices it carried), and each
        unfinished choice continues on its own leg (`_choice_leg`), all at once. Raises
        GatewayError when `--migration-limit` or `--migration-timeout-s` is spent."""
        if self.resp is not None:
            self.resp.close()
        self.care.settle(RuntimeError(loss.message))
        self._count_migration(loss, self.decode.instance_id)
        legs = [self._choice_leg(i, t, loss) for i, t in choices.unfinished()]

        def ending() -> bytes:
            first = choices.as_first_token()
            return Splice(self.req, first, None, self.cached, choices.tokens).closing()

        return FanOut(legs, ending)

    def _choice_leg(self, index: int, transcript: Transcript, loss: Loss) -> Leg:
        """Choice `index` of a streamed n > 1 (`transcript`: its stream so far) continued as a
        stream of one choice: a copy of this request under its own id (`<id>-<index>`: its
        own Schedule and Release), sharing the migration budget, resumed at once."""
        child = copy.copy(self)
        child.id = f"{self.id}-{index}"
        child.headers = {**self.headers, "x-request-id": child.id}
        child.transcript = transcript
        child.excluded = list(self.excluded)
        child.choice = index
        child.resp = None
        child.evicted = ""

        abandoned: list[bool] = []

        async def events() -> AsyncGenerator[bytes, None]:
            tally = _Tally()
            error: BaseException | None = None
            try:
                async for out in child._legs(None, tally, loss):
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
                child._settle_stream(error)

        return Leg(index, events(), lambda: abandoned.append(True))

    def _decode_lost(self, name: str, exc: Exception | None, idle_s: float) -> Loss:
        """Why a stream's decode leg ended before its `[DONE]`: `exc` (connection lost,
        silent past `--stream-idle-timeout-s`; None: closed before `[DONE]`), or the reason
        its leg was closed (`evict`)."""
        if self.evicted == "drain":
            return Loss("drain", 502, f"decode instance {name} drained past its grace")
        if self.evicted:
            return Loss(self.evicted, 502, f"decode instance {name} left the registry")
        if isinstance(exc, UpstreamTimeout):
            return Loss("idle", 504, f"decode instance {name} sent nothing for {idle_s:g} s")
        if exc is None:
            return Loss("lost", 502, f"decode instance {name} ended the stream before [DONE]")
        return Loss("lost", 502, f"decode instance {name} failed mid-stream: {exc}")

    def evict(self, reason: str) -> None:
        """Closes the stream's decode leg because its instance left (`deregistered`) or
        drained past its grace (`drain`): the stream continues on another decode
        (`pdplane.gateway.departures`)."""
        self.evicted = reason
        if self.resp is not None:
            self.resp.close()

    def _count_migration(self, loss: Loss, instance_id: str) -> None:
        """One more resume of this request after `loss` of `instance_id`; raises GatewayError
        (the client's one error) when `--migration-limit` or `--migration-timeout-s` is
        spent."""
        config, metrics = self.relay.config, self.relay.metrics
        now = time.perf_counter()
        budget = self.budget
        if not budget.since:
            budget.since = now
        if budget.used >= config.migration_limit:
            metrics.migration_failures.labels("limit").inc()
            log.warning(
                "request %s: %s; not continued (--migration-limit %d spent)",
                self.id,
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

    async def _migrate(self, transcript: Transcript, loss: Loss, counted: bool = False) -> Splice:
        """Continues a stream whose decode leg was lost (`loss`) on another decode: the lost
        attempt is released failed; a new decision for the prompt plus the tokens sent
        (`transcript`), its prefill leg if it has one (the resumed prompt's KV), and the new
        decode leg on `/v1/completions` (`pdplane.gateway.bodies.resumed_body`). Returns the
        splice that continues the client's stream with its events (`self.resp`). Tries again
        on another decode when the new one fails too, within `--migration-limit` and
        `--migration-timeout-s`; raises GatewayError when either is spent, when no decode is
        left, or when the new leg is refused. `counted`: the loss was counted already (the
        shared decode of a streamed n > 1's choices, `_fan_out`)."""
        metrics, config = self.relay.metrics, self.relay.config
        lost = self.decode.instance_id
        tokenizer = self.tokenizer
        overlap = repeated = 0
        if tokenizer is not None and transcript.prompt_ids is not None:
            decode = partial(tokenizer.decode, skip_special_tokens=False)
            context, sent_ids = transcript.prompt_ids, transcript.sent
            if transcript.lookback is not None:
                # Resume before the text vLLM held back (or that may start a stop string).
                keep, overlap = stop_seam(
                    context, sent_ids, transcript.delivered, transcript.lookback, decode
                )
                if self.req.body.get("logprobs") not in (None, False):
                    repeated = len(sent_ids) - keep
            else:
                keep = whole_characters(context, sent_ids, decode)
            transcript.rewind(keep)
        prompt = transcript.resumed_prompt()
        sent = len(transcript.sent)
        cached = self.cached  # the client's prompt's, not the resumed prompt's
        while True:
            if self.resp is not None:
                self.resp.close()
            self.care.settle(RuntimeError(loss.message))  # Release failed, before Schedule
            if not counted:
                self._count_migration(loss, lost)
            counted = False
            self.excluded.append(lost)
            body = resumed_body(self.req, prompt, sent, self.choice)
            left = config.migration_timeout_s - (time.perf_counter() - self.budget.since)
            attributes = {
                "pdplane.lost_decode": lost,
                "pdplane.reason": loss.reason,
                "pdplane.tokens_sent": sent,
            }
            try:
                async with asyncio.timeout(max(left, 0.001)):
                    with tracing.span("pdplane.migration", attributes=attributes):
                        self.resp = await self._resume(body)
            except RetryElsewhere as failed:
                lost, loss = failed.instance_id, Loss("lost", 502, failed.error.message)
                continue
            except TimeoutError:
                self.care.settle(TimeoutError())
                metrics.migration_failures.labels("timeout").inc()
                raise gateway_timeout(
                    f"{loss.message}; not continued on another decode within "
                    f"--migration-timeout-s {config.migration_timeout_s:g}"
                ) from None
            except GatewayError as exc:
                metrics.migration_failures.labels("unavailable").inc()
                log.warning("request %s: %s; not continued: %s", self.id, loss.message, exc)
                raise GatewayError(
                    exc.status if exc.status < 500 else loss.status,
                    f"{loss.message}; not continued on another decode: {exc.message}",
                ) from None
            metrics.migration_recomputed.inc(len(prompt))
            prefill = self.prefill.instance_id if self.prefill is not None else "none"
            log.warning(
                "request %s: %s after %d tokens (%s); continued on decode %s (prefill %s), "
                "%d tokens recomputed",
                self.id,
                loss.message,
                sent,
                loss.reason,
                self.decode.instance_id,
                prefill,
                len(prompt),
            )
            self.cached = cached
            # completions' text_offset goes on from the client's (the leg counts from 0)
            offset = transcript.next_offset if transcript.offsets is not None else None
            seam = Seam(overlap, repeated, offset)
            return Splice(self.req, transcript.as_first_token(), None, cached, sent, seam)

    async def _resume(self, body: dict[str, Any]) -> UpstreamResponse:
        """The new legs of a resumed stream (`body`: `resumed_body`'s): Schedule, prefill's
        leg when the decision has one, decode's response headers. Raises RetryElsewhere
        (an instance unreachable: the next decode is tried), GatewayError."""
        try:
            await self._schedule(
                queue=True, prompt_tokens=len(body["prompt"]), max_tokens=body["max_tokens"] or 0
            )
            kv = None
            if self.prefill is not None:
                _, kv = await self._prefill_leg(COMPLETIONS, body)
            data = json.dumps(body, separators=(",", ":")).encode()
            if kv is not None:
                data = data[:-1] + b',"kv_transfer_params":' + kv + b"}"
            resp = await self._open_decode(data, COMPLETIONS)
            if resp.status < 400:
                return resp
            await self._refused_mid_stream(resp)
        except (RetryElsewhere, asyncio.CancelledError):
            # `_migrate` settles the attempt: with the failure (and tries the next decode),
            # its time budget spent, or the client gone.
            raise
        except BaseException as exc:
            self.care.settle(exc)
            raise

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
            await self._refused_mid_stream(resp)

    async def _refused_mid_stream(self, resp: UpstreamResponse) -> NoReturn:
        """Decode refused a leg of a stream under way (`resp`: its error status): prefill's
        KV is freed; raises GatewayError (decode's status and message for 4xx, 502 for 5xx),
        whose event ends the stream."""
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
        raise AssertionError("unreachable: _decode_error raises")

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


@dataclasses.dataclass(slots=True)
class _Tally:
    """A stream's progress, for its metrics: events relayed, the first and last one's
    time.perf_counter(), whether decode sent any; `ok`: it ended whole (with `[DONE]`)."""

    events: int = 0
    first_at: float = 0.0
    last_at: float = 0.0
    from_decode: bool = False
    ok: bool = False


class _DecodeLost(Exception):
    """A non-streamed request's decode was lost before its answer (`loss`): the request runs
    again on another pair, within `--migration-limit`."""

    def __init__(self, instance_id: str, loss: Loss) -> None:
        super().__init__(loss.message)
        self.instance_id = instance_id
        self.loss = loss
