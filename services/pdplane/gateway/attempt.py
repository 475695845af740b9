"""One try of a request on one scheduled (prefill, decode) pair: both legs and the stream.

A decision without prefill (conditional disaggregation: decode holds all but a few prompt
tokens) has one leg: the client's original request goes to decode as it came, without
`kv_transfer_params`, and decode computes the rest of the prompt itself.

See `pdplane.gateway.relay` for the failure semantics. What the attempt leaves behind (its
Release, the KV its prefill holds, background calls) is its `Aftercare`, which decides the
outcome; the attempt only reports what happened and settles it wherever it ends.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

from pdplane.core import tracing
from pdplane.core.kv_params import DecodeRequestParams, KvParamsError
from pdplane.gateway import usage_details
from pdplane.gateway.aftercare import Aftercare
from pdplane.gateway.bodies import decode_body, decode_body_parts, prefill_body
from pdplane.gateway.config import RelayConfig
from pdplane.gateway.errors import GatewayError, UpstreamReply, bad_gateway, gateway_timeout
from pdplane.gateway.first_token import FirstToken, Splice, applies
from pdplane.gateway.first_token import decode_body as first_token_decode_body
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.prompt_ids import Tokenizers
from pdplane.gateway.replies import SSE_DONE, JsonReply, RetryElsewhere, StreamReply
from pdplane.gateway.upstream import (
    UpstreamClient,
    UpstreamResponse,
    UpstreamTimeout,
    UpstreamUnreachable,
)
from pdplane.gateway.validation import COMPLETIONS, ClientRequest
from pdplane.scheduler import Decision, InstanceRef, Outcome

__all__ = ["Attempt", "Legs", "TakeOver"]

_SSE_HEADERS = {"content-type": "text/event-stream"}
#: How an upstream error event starts (vLLM: `data: {"error": {...}}`, spaced or not).
_ERROR_EVENT = b'data: {"error"'


def _status_error(side: str, instance_id: str, status: int, body: bytes) -> GatewayError:
    excerpt = body[:300].decode(errors="replace")
    return bad_gateway(f"{side} instance {instance_id} answered {status}: {excerpt}")


#: Another decode for a stream whose decode could not be reached after the first token went
#: out, within the request's retries: (its after-care, its decision), or None when no try is
#: left. Raises GatewayError (no other decode: the failure is the answer) or CancelledError.
TakeOver = Callable[[RetryElsewhere], Awaitable[tuple[Aftercare, Decision] | None]]


@dataclass(frozen=True, slots=True)
class Legs:
    """What the legs of every attempt share: the pooled upstream client, metrics, the relay's
    knobs, and the headers of every leg but `x-request-id`."""

    upstream: UpstreamClient
    metrics: GatewayMetrics
    config: RelayConfig
    headers: dict[str, str]
    tokenizers: Tokenizers | None = None

    @classmethod
    def of(
        cls,
        upstream: UpstreamClient,
        metrics: GatewayMetrics,
        config: RelayConfig,
        tokenizers: Tokenizers | None = None,
    ) -> Legs:
        """Legs for `config` (an `upstream_api_key` is sent as a bearer token on every leg);
        `tokenizers`: the served models' (the first token from prefill asks them whether a
        token without text ends inside a character, and rebuilds that character's text)."""
        headers = {"content-type": "application/json"}
        if config.upstream_api_key:
            headers["authorization"] = f"Bearer {config.upstream_api_key}"
        return cls(upstream, metrics, config, headers, tokenizers)


class Attempt:
    """One try of a request on one scheduled pair; `care` is its after-care, `max_model_len`
    the model's context length (tokens; 0 = unknown), `take_over` where another decode comes
    from once the first token from prefill went out (None: none is asked for)."""

    def __init__(
        self,
        legs: Legs,
        care: Aftercare,
        req: ClientRequest,
        decision: Decision,
        started: float,
        max_model_len: int = 0,
        take_over: TakeOver | None = None,
    ) -> None:
        self.upstream = legs.upstream
        self.legs_tokenizers = legs.tokenizers
        self.metrics = legs.metrics
        self.dispatch = legs.config.dispatch
        self.timeout_s = legs.config.upstream_timeout_s
        self.idle_timeout_s = min(legs.config.stream_idle_timeout_s, self.timeout_s)
        self.care = care
        self.req = req
        self.request_id = care.request_id
        self.prefill = decision.prefill
        self.decode = decision.decode
        self.started = started
        self.max_model_len = max_model_len  # the model's (tokens; 0 = unknown)
        self.take_over = take_over
        self.streaming = False  # set once the stream generator started (it then settles)
        self.decode_answered_ns = 0  # time.time_ns() at decode's response headers
        self.prefilled_at = 0.0  # time.perf_counter() at prefill's answer (its first token)
        self.details = legs.config.prompt_tokens_details  # usage reports the fleet's cache hit
        self.cached: int | None = None  # prefill's prefix cache hit, when `details` asks
        self.headers = {**legs.headers, "x-request-id": self.request_id}
        # The first token from prefill (`pdplane.gateway.first_token`): sequential dispatch
        # only, as decode's prompt then holds it. More tokens asked than the model holds take
        # the usual path: decode, asked one less, would serve max_model_len + 1 and name the
        # wrong number when it refuses.
        self.first_token = (
            legs.config.first_token == "prefill"
            and self.prefill is not None
            and self.dispatch == "sequential"
            and not (max_model_len and req.max_tokens > max_model_len)
            and applies(req)
        )

    async def run(self) -> JsonReply | StreamReply:
        """Both legs; the answer, or a stream that settles the attempt when it ends. Raises
        RetryElsewhere, GatewayError, UpstreamReply, or CancelledError (all settled)."""
        error: BaseException | None = None
        handed_off = False
        resp: UpstreamResponse | None = None
        splice: Splice | None = None
        first_from_decode = False
        try:
            if self.prefill is None:
                resp = await self._open_decode(self.req.raw)
            elif self.dispatch == "concurrent":
                resp = await self._concurrent_legs()
            else:
                answer, kv = await self._prefill_leg()
                first = FirstToken.of(self.req.endpoint, answer) if self.first_token else None
                splice = self._splice(first) if first is not None else None
                # Counted where the attempt hands its answer back, once per request: an
                # attempt that raises (a retry on another pair) counts nothing.
                first_from_decode = self.first_token and splice is None
                if first is not None and splice is not None:
                    # The first token goes out now; decode is opened after it (`_stream`).
                    self.metrics.first_from_prefill.inc()
                    handed_off = True
                    if first.ends_request(self.req, self.max_model_len):
                        return self._ended_at_prefill(splice)
                    stream = self._stream(None, splice, (first, kv))
                    return StreamReply(stream, _SSE_HEADERS, self._abandon_before_start)
                else:
                    resp = await self._open_decode(decode_body(self.req.raw, self.req.body, kv))
            if resp.status >= 400:
                await self._decode_error(resp)
            if not self.req.stream:
                body = await self._read_decode(resp)
                self.care.succeeded()
                if self.prefilled_at:  # prefill computed the first token (vLLM counts it then)
                    self.metrics.ttft.observe(self.prefilled_at - self.started)
                body = usage_details.rewrite_json(body, self.cached)
                self.metrics.e2e.observe(time.perf_counter() - self.started)
                return JsonReply(200, body, resp.headers.get("content-type", "application/json"))
            handed_off = True
            if first_from_decode:
                self.metrics.first_from_decode.inc()
            stream = self._stream(resp, splice)
            return StreamReply(stream, _SSE_HEADERS, partial(self._abandon, resp))
        except BaseException as exc:
            error = exc
            raise
        finally:
            if not handed_off:
                if resp is not None:
                    resp.close()
                self.care.settle(error)

    # -- prefill -------------------------------------------------------------------------

    async def _prefill_leg(self) -> tuple[dict[str, Any], bytes]:
        """Sends the prefill leg; returns prefill's answer (parsed) and its
        kv_transfer_params (JSON bytes, as returned)."""
        t0 = time.perf_counter()
        p = self.prefill
        assert p is not None, "a prefill leg without a prefill instance"
        d = self.decode
        body = prefill_body(
            self.req.endpoint,
            self.req.body,
            self.request_id,
            d.instance_id,
            d.kv_endpoint,
            token_ids=self.first_token,
        )
        with tracing.span("pdplane.prefill_leg"), self._leg_errors("prefill", p):
            resp = await self.upstream.open(
                p.url + self.req.endpoint,
                body,
                tracing.inject_headers(self.headers),
                read_timeout_s=self.timeout_s,
                total_timeout_s=self.timeout_s,
            )
            data = await self.upstream.read(resp)
        self.prefilled_at = time.perf_counter()
        self.metrics.prefill_leg.observe(self.prefilled_at - t0)
        if resp.status >= 400:
            if resp.status < 500:
                raise UpstreamReply(resp.status, data, resp.headers.get("content-type", ""))
            raise _status_error("prefill", p.instance_id, resp.status, data)
        return self._kv_params_of(data)

    def _splice(self, first: FirstToken) -> Splice | None:
        """The client's stream from prefill's `first` on; None when decode cannot continue it
        (`FirstToken.continuable`: the usual path). Only a first token without text asks the
        tokenizer: whether it ends inside a character, which `Splice` then rebuilds with the
        client's detokenizer settings (special tokens skipped unless the client keeps them)."""
        kept = client = None
        if not first.text:
            kept = self._decode_text()
            skip = self.req.body.get("skip_special_tokens") is not False
            client = self._decode_text(skip) if kept is not None else None
        if not first.continuable(kept, client):
            return None
        decode = client if first.inside_character(kept) else None
        return Splice(self.req, first, decode, self.cached)

    def _decode_text(self, skip_special_tokens: bool = False) -> Callable[[list[int]], str] | None:
        """The model's ids -> text (special tokens kept unless `skip_special_tokens`), when
        the gateway has its tokenizer."""
        tokenizers = self.legs_tokenizers
        tokenizer = tokenizers.get(self.req.model) if tokenizers is not None else None
        if tokenizer is None:
            return None
        return partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)

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

    def _kv_params_of(self, data: bytes) -> tuple[dict[str, Any], bytes]:
        try:
            answer = json.loads(data)
            if self.details:
                self.cached = usage_details.cached_tokens_of(answer)
            kv = answer.get("kv_transfer_params")
            if not isinstance(kv, dict):
                raise KvParamsError("kv_transfer_params missing or not an object")
            self.care.hold_kv(DecodeRequestParams.from_dict(kv))
            tracing.stamp_kv_params(kv)
        except (ValueError, AttributeError) as exc:
            p = self.prefill.instance_id if self.prefill is not None else "?"
            raise bad_gateway(
                f"prefill instance {p} returned no usable kv_transfer_params: {exc}"
            ) from None
        return answer, json.dumps(kv, separators=(",", ":")).encode()

    # -- decode --------------------------------------------------------------------------

    async def _open_decode(
        self, body: bytes | AsyncIterator[bytes], endpoint: str = ""
    ) -> UpstreamResponse:
        """Opens the decode leg on `endpoint` (default: the client's) with `body`."""
        t0 = time.perf_counter()
        d = self.decode
        with tracing.span("pdplane.decode_leg"), self._leg_errors("decode", d):
            resp = await self.upstream.open(
                d.url + (endpoint or self.req.endpoint),
                body,
                tracing.inject_headers(self.headers),
                read_timeout_s=self.timeout_s,
            )
        self.metrics.decode_leg.observe(time.perf_counter() - t0)
        self.decode_answered_ns = time.time_ns()
        return resp

    async def _decode_error(self, resp: UpstreamResponse) -> None:
        try:
            data = await self.upstream.read(resp)
        except (UpstreamUnreachable, UpstreamTimeout):
            data = b""
        self.care.free_kv(f"decode answered {resp.status}")
        if resp.status < 500:
            raise UpstreamReply(resp.status, data, resp.headers.get("content-type", ""))
        raise _status_error("decode", self.decode.instance_id, resp.status, data)

    async def _read_decode(self, resp: UpstreamResponse) -> bytes:
        try:
            return await self.upstream.read(resp)
        except UpstreamUnreachable as exc:
            raise bad_gateway(
                f"decode instance {self.decode.instance_id} failed before answering: {exc}"
            ) from None
        except UpstreamTimeout:
            raise gateway_timeout(
                f"decode instance {self.decode.instance_id} went silent for {self.timeout_s:g} s"
            ) from None

    async def _concurrent_legs(self) -> UpstreamResponse:
        """Opens the decode request while prefill runs: headers and the body without
        kv_transfer_params go out at once, the rest when prefill answers (chunked)."""
        head, tail = decode_body_parts(self.req.raw, self.req.body)
        params: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def body() -> AsyncIterator[bytes]:
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

    # -- streaming -----------------------------------------------------------------------

    def _abandon(self, resp: UpstreamResponse) -> None:
        # The reply was closed before its stream started (the client left first), so the
        # stream's own `finally` never runs: settle here, as a closed stream would.
        if not self.streaming:
            self.streaming = True
            resp.close()
            self.care.settle(GeneratorExit())

    def _ended_at_prefill(self, splice: Splice) -> StreamReply:
        """The whole stream from prefill's answer (its token ended the request): decode is not
        asked, prefill's KV is freed."""
        self.care.free_kv("the request ended at its first token")
        self.care.succeeded()

        async def events() -> AsyncGenerator[bytes, None]:
            self.streaming = True
            error: BaseException | None = None
            try:
                self.metrics.ttft.observe(time.perf_counter() - self.started)
                yield splice.ending()
                self.metrics.e2e.observe(time.perf_counter() - self.started)
            except BaseException as exc:
                error = exc
                raise
            finally:
                self.care.settle(error)

        return StreamReply(events(), _SSE_HEADERS, self._abandon_before_start)

    def _abandon_before_start(self) -> None:
        if not self.streaming:
            self.streaming = True
            self.care.settle(GeneratorExit())

    async def _stream(
        self,
        resp: UpstreamResponse | None,
        splice: Splice | None = None,
        continuation: tuple[FirstToken, bytes] | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """Decode's SSE, relayed whole events at a time as they arrive; settles the attempt.
        With `splice`, the first token's events go first and decode's are rewritten; with
        `continuation` (the first token, prefill's kv_transfer_params; `resp` None) decode is
        opened once the first token went out (`_open_continuation`)."""
        self.streaming = True
        metrics = self.metrics
        error: BaseException | None = None
        carry = b""
        first = last = 0.0
        events = 0
        done = from_decode = failed = False
        try:
            if splice is not None:
                first = time.perf_counter()
                metrics.ttft.observe(first - self.started)
                events = 1
                yield splice.opening()
            if resp is None:
                assert continuation is not None, "no decode response and nothing to open"
                try:
                    resp = await self._open_continuation(
                        *continuation, token_ids=splice is not None and splice.token_ids
                    )
                except GatewayError as exc:
                    yield exc.sse_event()
                    return
            try:
                async for chunk in resp.chunks(self.idle_timeout_s):
                    data = carry + chunk if carry else chunk
                    cut = data.rfind(b"\n\n") + 2
                    if cut == 1:  # no complete event yet
                        carry = data
                        continue
                    out, carry = data[:cut], data[cut:]
                    last = time.perf_counter()
                    if not events:
                        first = last
                        metrics.ttft.observe(first - self.started)
                    if not from_decode:
                        from_decode = True
                        tracing.record_span("pdplane.first_byte", self.decode_answered_ns)
                    events += out.count(b"\n\n")
                    done = out.endswith(SSE_DONE)
                    # vLLM ends a failed request's stream with an error event, then [DONE].
                    failed = failed or _ERROR_EVENT in out
                    if splice is None:
                        yield usage_details.rewrite_events(out, self.cached)
                    else:
                        yield splice.rewrite(out)
            except UpstreamTimeout:
                yield gateway_timeout(
                    f"decode instance {self.decode.instance_id} sent nothing for "
                    f"{self.idle_timeout_s:g} s"
                ).sse_event()
                return
            except UpstreamUnreachable as exc:
                yield bad_gateway(
                    f"decode instance {self.decode.instance_id} failed mid-stream: {exc}"
                ).sse_event()
                return
            if not done:
                yield bad_gateway(
                    f"decode instance {self.decode.instance_id} ended the stream before [DONE]"
                ).sse_event()
                return
            if failed:
                return
            self.care.succeeded()
            metrics.e2e.observe(time.perf_counter() - self.started)
            if events > 2:  # ignore [DONE]; one event per token otherwise
                metrics.tpot.observe((last - first) / (events - 2))
        except BaseException as exc:
            error = exc
            raise
        finally:
            outcome = self.care.settle(error)
            if resp is not None:
                if outcome is Outcome.SUCCESS:
                    resp.release()
                else:
                    resp.close()

    async def _open_continuation(
        self, first: FirstToken, kv: bytes, token_ids: bool = False
    ) -> UpstreamResponse:
        """Decode's leg of a stream whose first token (prefill's) reached the client: decode
        continues from prefill's prompt ids + `first`, loading prefill's KV (`kv`: its
        kv_transfer_params, JSON bytes).

        A decode that cannot be reached is replaced, within the request's retries
        (`take_over`), by another that computes the whole prompt itself: the attempt is
        released as failed and prefill's KV freed, as for any retry, and the client's stream
        goes on. Anything else before decode's first byte (a timeout, an error status) is the
        answer: raises GatewayError, whose event ends the stream (the status and decode's
        message for 4xx, 502 for 5xx, 504 for silence). `token_ids`: decode streams its
        tokens' ids (`Splice.token_ids`).
        """
        body = first_token_decode_body(self.req, first, kv, token_ids)
        while True:
            try:
                resp = await self._open_decode(body, COMPLETIONS)
            except RetryElsewhere as failed:
                if self.take_over is None:
                    raise failed.error from None
                self.care.settle(failed)  # Release first, so the next Schedule excludes it
                taken = await self.take_over(failed)
                if taken is None:
                    raise failed.error from None
                self.care, decision = taken
                self.decode = decision.decode
                body = first_token_decode_body(self.req, first, None, token_ids)
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
