"""The prefill -> decode relay of one request (no FastAPI here: plain asyncio + aiohttp).

Per request: Schedule -> prefill leg -> decode leg -> relay decode's answer -> Release.
`Relay.handle` returns a `JsonReply` (non-streaming answers and upstream errors, passed through
unchanged) or a `StreamReply` (SSE relayed event by event), or raises `GatewayError`.

Failure handling (before any byte reached the client an attempt may be retried on another pair,
at most `max_retries` times, excluding the instance that failed):
- instance unreachable (refused, reset, closed before answering) -> retry, else 502;
- instance silent for `upstream_timeout_s` -> 504 (no retry: it may still be computing);
- instance answers 4xx -> that status and body, unchanged; 5xx -> 502 naming the instance;
- prefill's answer without usable `kv_transfer_params` -> 502 naming the prefill instance;
- decode fails after streaming began -> one `data: {"error": ...}` event, then close;
- cancellation (client gone) -> upstream requests closed (vLLM aborts them), KV held by
  prefill freed through `KvTransfer.AbortTransfer`, Release with outcome "cancelled".
Whenever prefill answered but decode did not finish, prefill's KV is freed the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, Protocol

import aiohttp

from pdplane.core.kv_params import DecodeRequestParams, KvParamsError
from pdplane.gateway.bodies import decode_body, decode_body_parts, prefill_body
from pdplane.gateway.errors import (
    GatewayError,
    UpstreamReply,
    bad_gateway,
    bad_request,
    gateway_timeout,
    unavailable,
)
from pdplane.gateway.kv_abort import KvAborter
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.upstream import UpstreamClient, UpstreamTimeout, UpstreamUnreachable
from pdplane.gateway.validation import ClientRequest
from pdplane.scheduler.client import SchedulerError, SchedulerUnavailable
from pdplane.v1 import scheduler_pb2

__all__ = ["Dispatch", "JsonReply", "Relay", "RelayConfig", "SchedulerPort", "StreamReply"]

log = logging.getLogger(__name__)

Dispatch = Literal["sequential", "concurrent"]
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"content-type": "text/event-stream"}


class SchedulerPort(Protocol):
    """What the relay needs of the scheduler (`pdplane.scheduler.client.SchedulerClient`)."""

    async def schedule(
        self,
        request_id: str,
        model: str,
        prompt_tokens: int,
        max_tokens: int = 0,
        *,
        routing_key: str = "",
        exclude_instance_ids: Iterable[str] = (),
    ) -> scheduler_pb2.ScheduleResponse: ...

    async def release(self, request_id: str, outcome: str) -> bool: ...


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """Relay knobs (see `pdplane.gateway.settings.GatewaySettings` for their meaning)."""

    dispatch: Dispatch = "sequential"
    upstream_timeout_s: float = 300.0
    max_retries: int = 1


@dataclass(frozen=True, slots=True)
class JsonReply:
    """A complete answer: HTTP `status`, `body` bytes and their content type."""

    status: int
    body: bytes
    content_type: str = "application/json"


@dataclass(frozen=True, slots=True)
class StreamReply:
    """A streamed answer: iterate `chunks` (whole SSE events, bytes), then always `aclose()`.

    `aclose` also cleans up when `chunks` was never iterated (client gone before the first
    event): the upstream response is closed and the request released as cancelled.
    """

    chunks: AsyncGenerator[bytes, None]
    headers: dict[str, str]
    abandon: Callable[[], None]

    async def aclose(self) -> None:
        """Ends the stream (idempotent)."""
        await self.chunks.aclose()
        self.abandon()


class _Retry(Exception):
    """An attempt failed before anything reached the client; another pair may succeed."""

    def __init__(self, side: str, instance_id: str, error: GatewayError) -> None:
        super().__init__(error.message)
        self.side = side
        self.instance_id = instance_id
        self.error = error


class Relay:
    """Relays requests through scheduled (prefill, decode) pairs.

    Args:
        scheduler: Schedule/Release client.
        upstream: the pooled HTTP client to the instances.
        aborter: AbortTransfer client for KV held by prefill instances.
        metrics: where latencies, retries and cancellations are recorded.
        config: dispatch mode, timeouts, retries.
    """

    def __init__(
        self,
        scheduler: SchedulerPort,
        upstream: UpstreamClient,
        aborter: KvAborter,
        metrics: GatewayMetrics,
        config: RelayConfig,
    ) -> None:
        self.scheduler = scheduler
        self.upstream = upstream
        self.aborter = aborter
        self.metrics = metrics
        self.config = config
        self._background: set[asyncio.Task[Any]] = set()

    async def handle(
        self, req: ClientRequest, request_id: str, started: float, max_model_len: int
    ) -> JsonReply | StreamReply:
        """Relays `req` under `request_id`; `started` = arrival (time.perf_counter()).

        `max_model_len` (tokens) caps the lengths sent to Schedule so that a request too long
        for the model still reaches an instance, whose own 400 is the authoritative answer.
        Raises GatewayError (400/502/503/504); asyncio.CancelledError after cleaning up.
        """
        excluded: list[str] = []
        last: _Retry | None = None
        for _ in range(self.config.max_retries + 1):
            pair = await self._schedule(req, request_id, excluded, last, max_model_len)
            try:
                return await _Attempt(self, req, request_id, pair, started).run()
            except _Retry as retry:
                log.warning("request %s: %s; retrying on another pair", request_id, retry)
                self.metrics.retries.labels(retry.side).inc()
                excluded.append(retry.instance_id)
                last = retry
        assert last is not None
        raise last.error

    async def _schedule(
        self,
        req: ClientRequest,
        request_id: str,
        excluded: list[str],
        last: _Retry | None,
        max_model_len: int,
    ) -> scheduler_pb2.ScheduleResponse:
        prompt_tokens, max_tokens = req.prompt_tokens, req.max_tokens
        if max_model_len:
            prompt_tokens = min(prompt_tokens, max_model_len)
            max_tokens = min(max_tokens, max_model_len - prompt_tokens)
        try:
            return await self.scheduler.schedule(
                request_id,
                req.model,
                prompt_tokens,
                max_tokens,
                routing_key=req.routing_key,
                exclude_instance_ids=excluded,
            )
        except asyncio.CancelledError:
            # The scheduler may have counted the request before the client left; an unknown id
            # is harmless to Release.
            self.spawn(self.release(request_id, "cancelled"))
            raise
        except SchedulerUnavailable as exc:
            if last is not None:
                raise last.error from None  # no other pair: the failure is the answer
            raise unavailable(exc.reason) from None
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        except SchedulerError as exc:
            raise unavailable(f"scheduler error: {exc}") from None

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Runs `coro` in the background, keeping a reference until it ends."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def release(self, request_id: str, outcome: str) -> None:
        """Release(request_id, outcome); failures are logged (the scheduler's lease-free
        accounting must not fail the client's request)."""
        try:
            await self.scheduler.release(request_id, outcome)
        except Exception as exc:
            log.warning("Release(%s, %s) failed: %s", request_id, outcome, exc)

    async def abort_transfer(self, params: DecodeRequestParams, reason: str) -> None:
        """AbortTransfer on the prefill instance holding `params`' KV; logged, never raised."""
        freed = await self.aborter.abort(params.kv_endpoint, params.transfer_id, reason)
        self.metrics.kv_aborts.labels("freed" if freed else "not_freed").inc()

    async def drain(self, timeout_s: float = 5.0) -> None:
        """Waits (bounded) for background Release/AbortTransfer calls; used at shutdown."""
        if self._background:
            await asyncio.wait(set(self._background), timeout=timeout_s)


def _status_error(side: str, instance_id: str, status: int, body: bytes) -> GatewayError:
    excerpt = body[:300].decode(errors="replace")
    return bad_gateway(f"{side} instance {instance_id} answered {status}: {excerpt}")


class _Attempt:
    """One try of a request on one scheduled pair; owns the pair's Release."""

    def __init__(
        self,
        relay: Relay,
        req: ClientRequest,
        request_id: str,
        pair: scheduler_pb2.ScheduleResponse,
        started: float,
    ) -> None:
        self.relay = relay
        self.req = req
        self.request_id = request_id
        self.prefill = pair.prefill
        self.decode = pair.decode
        self.started = started
        self.params: DecodeRequestParams | None = None
        self.streaming = False  # set once the stream generator started (it then cleans up)
        self.headers = {"content-type": "application/json", "x-request-id": request_id}
        cfg = relay.config
        self.timeout_s = cfg.upstream_timeout_s

    async def run(self) -> JsonReply | StreamReply:
        outcome = "failed"
        handed_off = retrying = False
        resp: aiohttp.ClientResponse | None = None
        try:
            if self.relay.config.dispatch == "concurrent":
                resp = await self._concurrent_legs()
            else:
                kv = await self._prefill_leg()
                resp = await self._open_decode(decode_body(self.req.body, kv))
            if resp.status >= 400:
                await self._decode_error(resp)
            if not self.req.stream:
                body = await self._read_decode(resp)
                outcome = "success"
                self.relay.metrics.e2e.observe(time.perf_counter() - self.started)
                return JsonReply(200, body, resp.headers.get("content-type", "application/json"))
            handed_off = True
            return StreamReply(self._stream(resp), _SSE_HEADERS, partial(self._abandon, resp))
        except _Retry:
            retrying = True
            raise
        except asyncio.CancelledError:
            outcome = "cancelled"
            raise
        finally:
            if not handed_off:
                if resp is not None:
                    resp.close()
                if retrying:
                    # The retry reschedules the same request id: this Release must land first,
                    # or it would end the accounting of the new assignment.
                    self._free_kv("retrying on another pair")
                    await self.relay.release(self.request_id, outcome)
                else:
                    self._finish(outcome)

    def _finish(self, outcome: str) -> None:
        if outcome != "success" and self.params is not None:
            self.relay.spawn(self.relay.abort_transfer(self.params, outcome))
        if outcome == "cancelled":
            self.relay.metrics.cancellations.inc()
        self.relay.spawn(self.relay.release(self.request_id, outcome))

    # -- prefill -------------------------------------------------------------------------

    async def _prefill_leg(self) -> dict[str, Any]:
        """Sends the prefill leg; returns prefill's kv_transfer_params dict (as returned)."""
        t0 = time.perf_counter()
        p = self.prefill
        body = prefill_body(self.req.endpoint, self.req.body, self.request_id)
        try:
            resp = await self.relay.upstream.open(
                p.url + self.req.endpoint,
                body,
                self.headers,
                read_timeout_s=self.timeout_s,
                total_timeout_s=self.timeout_s,
            )
            data = await self.relay.upstream.read(resp)
        except UpstreamUnreachable as exc:
            err = _unreachable("prefill", p.instance_id, exc)
            raise _Retry("prefill", p.instance_id, err) from None
        except UpstreamTimeout:
            raise gateway_timeout(
                f"prefill instance {p.instance_id} did not answer within {self.timeout_s:g} s"
            ) from None
        self.relay.metrics.leg.labels("prefill").observe(time.perf_counter() - t0)
        if resp.status >= 400:
            if resp.status < 500:
                raise UpstreamReply(resp.status, data, resp.headers.get("content-type", ""))
            raise _status_error("prefill", p.instance_id, resp.status, data)
        return self._kv_params_of(data)

    def _kv_params_of(self, data: bytes) -> dict[str, Any]:
        try:
            kv = json.loads(data).get("kv_transfer_params")
            if not isinstance(kv, dict):
                raise KvParamsError("kv_transfer_params missing or not an object")
            self.params = DecodeRequestParams.from_dict(kv)
        except (ValueError, AttributeError) as exc:
            raise bad_gateway(
                f"prefill instance {self.prefill.instance_id} returned no usable "
                f"kv_transfer_params: {exc}"
            ) from None
        return kv

    # -- decode --------------------------------------------------------------------------

    async def _open_decode(self, body: bytes | AsyncIterator[bytes]) -> aiohttp.ClientResponse:
        t0 = time.perf_counter()
        d = self.decode
        try:
            resp = await self.relay.upstream.open(
                d.url + self.req.endpoint, body, self.headers, read_timeout_s=self.timeout_s
            )
        except UpstreamUnreachable as exc:
            self._free_kv("decode unreachable")
            err = _unreachable("decode", d.instance_id, exc)
            raise _Retry("decode", d.instance_id, err) from None
        except UpstreamTimeout:
            raise gateway_timeout(
                f"decode instance {d.instance_id} did not answer within {self.timeout_s:g} s"
            ) from None
        self.relay.metrics.leg.labels("decode").observe(time.perf_counter() - t0)
        return resp

    def _free_kv(self, reason: str) -> None:
        # Prefill holds the KV until decode pulls; decode will not, so free it now. Cleared so
        # that `_finish` does not abort a second time.
        if self.params is not None:
            self.relay.spawn(self.relay.abort_transfer(self.params, reason))
            self.params = None

    async def _decode_error(self, resp: aiohttp.ClientResponse) -> None:
        try:
            data = await self.relay.upstream.read(resp)
        except (UpstreamUnreachable, UpstreamTimeout):
            data = b""
        self._free_kv(f"decode answered {resp.status}")
        if resp.status < 500:
            raise UpstreamReply(resp.status, data, resp.headers.get("content-type", ""))
        raise _status_error("decode", self.decode.instance_id, resp.status, data)

    async def _read_decode(self, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await self.relay.upstream.read(resp)
        except UpstreamUnreachable as exc:
            raise bad_gateway(
                f"decode instance {self.decode.instance_id} failed before answering: {exc}"
            ) from None
        except UpstreamTimeout:
            raise gateway_timeout(
                f"decode instance {self.decode.instance_id} went silent for {self.timeout_s:g} s"
            ) from None

    async def _concurrent_legs(self) -> aiohttp.ClientResponse:
        """Opens the decode request while prefill runs: headers and the body without
        kv_transfer_params go out at once, the rest when prefill answers (chunked)."""
        head, tail = decode_body_parts(self.req.body)
        params: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

        async def body() -> AsyncIterator[bytes]:
            yield head
            yield await params + tail

        decode = asyncio.ensure_future(self._open_decode(body()))
        try:
            kv = await self._prefill_leg()
        except BaseException:
            decode.cancel()
            await asyncio.gather(decode, return_exceptions=True)
            raise
        params.set_result(json.dumps(kv, separators=(",", ":")).encode())
        return await decode

    # -- streaming -----------------------------------------------------------------------

    def _abandon(self, resp: aiohttp.ClientResponse) -> None:
        if not self.streaming:
            self.streaming = True
            resp.close()
            self._finish("cancelled")

    async def _stream(self, resp: aiohttp.ClientResponse) -> AsyncGenerator[bytes, None]:
        """Decode's SSE, relayed whole events at a time as they arrive; owns Release."""
        self.streaming = True
        metrics = self.relay.metrics
        outcome = "failed"
        carry = b""
        first = last = 0.0
        events = 0
        done = False
        try:
            try:
                async for chunk in resp.content.iter_any():
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
                    events += out.count(b"\n\n")
                    done = out.endswith(_DONE)
                    yield out
            except TimeoutError:
                yield gateway_timeout(
                    f"decode instance {self.decode.instance_id} went silent for "
                    f"{self.timeout_s:g} s"
                ).sse_event()
                return
            except aiohttp.ClientError as exc:
                yield bad_gateway(
                    f"decode instance {self.decode.instance_id} failed mid-stream: "
                    f"{exc or type(exc).__name__}"
                ).sse_event()
                return
            if not done:
                yield bad_gateway(
                    f"decode instance {self.decode.instance_id} ended the stream before [DONE]"
                ).sse_event()
                return
            outcome = "success"
            metrics.e2e.observe(time.perf_counter() - self.started)
            if events > 2:  # ignore [DONE]; one event per token otherwise
                metrics.tpot.observe((last - first) / (events - 2))
        except (asyncio.CancelledError, GeneratorExit):
            outcome = "cancelled"
            raise
        finally:
            if outcome == "success":
                resp.release()
            else:
                resp.close()
            self._finish(outcome)


def _unreachable(side: str, instance_id: str, exc: Exception) -> GatewayError:
    return bad_gateway(f"{side} instance {instance_id} unreachable: {exc}")
