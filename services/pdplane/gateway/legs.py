"""The legs of an attempt: the prefill call, decode's request, and what their failures become.

- `prefill_leg`: prefill's answer and the `kv_transfer_params` it holds the KV under;
- `open_decode`: decode's request, up to its response headers (the body is read or relayed
  by the caller);
- `open_concurrently` (`--dispatch concurrent`): decode's request opened while prefill runs,
  the `kv_transfer_params` only prefill can issue sent when it answers;
- `decode_error`, `refused_mid_stream`: decode refused the request (before or during a
  stream under way);
- `leg_errors`: an instance that cannot be reached is `RetryElsewhere` (another pair may
  answer; a non-streamed request's decode lost after taking it is `DecodeLost`), one that is
  silent past `--upstream-timeout-s` is a 504 (no retry: it may still be computing).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncGenerator, Iterator
from contextlib import contextmanager
from typing import Any, NoReturn

from pydantic_core import from_json

from pdplane.core import tracing
from pdplane.core.kv_params import DecodeRequestParams, KvParamsError, make_transfer_id
from pdplane.gateway import usage_details
from pdplane.gateway.bodies import decode_body_parts, prefill_body
from pdplane.gateway.errors import GatewayError, UpstreamReply, bad_gateway, gateway_timeout
from pdplane.gateway.migration import Loss
from pdplane.gateway.replies import RetryElsewhere
from pdplane.gateway.request import DecodeLost, Request, status_error
from pdplane.gateway.upstream import UpstreamResponse, UpstreamTimeout, UpstreamUnreachable
from pdplane.scheduler import InstanceRef

__all__ = [
    "decode_error",
    "leg_errors",
    "open_concurrently",
    "open_decode",
    "prefill_leg",
    "refused_mid_stream",
]


@contextmanager
def leg_errors(r: Request, side: str, ref: InstanceRef) -> Iterator[None]:
    """Unreachable -> RetryElsewhere (the retry frees prefill's KV); silent -> 504."""
    try:
        yield
    except UpstreamUnreachable as exc:
        if exc.accepted and side == "decode" and not r.req.stream:
            # A non-streamed request's decode died while computing it: run it again, unless
            # --migration-limit 0 says never.
            message = f"decode instance {ref.instance_id} failed before answering: {exc}"
            if r.restartable():
                raise DecodeLost(ref.instance_id, Loss("lost", 502, message)) from None
            raise bad_gateway(f"{message}; {_NOT_AGAIN}") from None
        err = bad_gateway(f"{side} instance {ref.instance_id} unreachable: {exc}")
        raise RetryElsewhere(side, ref.instance_id, err) from None
    except UpstreamTimeout:
        raise gateway_timeout(
            f"{side} instance {ref.instance_id} did not answer within {r.timeout_s:g} s"
        ) from None


async def prefill_leg(
    r: Request, endpoint: str = "", client_body: dict[str, Any] | None = None
) -> tuple[dict[str, Any], bytes]:
    """The prefill leg: prefill's answer (parsed) and its kv_transfer_params (JSON bytes,
    as returned); prefill then holds the prompt's KV for decode (`care.hold_kv`).
    `endpoint`, `client_body`: a resumed stream's (default the client's).

    From the moment the call goes out until its answer is read, the attempt's after-care
    knows the transfer id prefill is to hold the KV under (`care.expect_kv`): an attempt that
    gives the call up (cancelled: the client left, a time budget ran out, another choice of
    the stream failed; or timed out) frees it by that id, whether prefill was still computing
    (vLLM aborts it when the connection closes; the abort then finds nothing, and ends the
    hold if it comes later) or had finished and holds the KV.

    Raises UpstreamReply (prefill's 4xx), GatewayError (502: its 5xx or no usable
    kv_transfer_params; 504), RetryElsewhere (unreachable).
    """
    t0 = time.perf_counter()
    p, d, care = r.prefill, r.decode, r.care
    assert p is not None, "a prefill leg without a prefill instance"
    endpoint = endpoint or r.req.endpoint
    transfer_id = make_transfer_id(r.id)
    body = prefill_body(
        endpoint,  # type: ignore[arg-type]
        r.req.body if client_body is None else client_body,
        r.id,
        d.instance_id,
        d.kv_endpoint,
        # a resumed prompt's prefill too: its answer continues the stream's own
        token_ids=r.first_token or client_body is not None,
        transfer_id=transfer_id,
    )
    upstream = r.relay.upstream
    care.expect_kv(p.kv_endpoint, transfer_id)
    with tracing.span("pdplane.prefill_leg"), leg_errors(r, "prefill", p):
        try:
            resp = await upstream.open(
                p.url + endpoint,
                body,
                tracing.inject_headers(r.headers),
                read_timeout_s=r.timeout_s,
                total_timeout_s=r.timeout_s,
            )
        except UpstreamUnreachable as exc:
            if not exc.accepted:  # refused or reset on the way in: prefill never ran it
                care.nothing_held()
            raise
        data = await upstream.read(resp)
    r.prefilled_at = time.perf_counter()
    r.relay.metrics.prefill_leg.observe(r.prefilled_at - t0)
    if resp.status >= 400:
        care.nothing_held()  # vLLM holds KV only for a request that finished
        if resp.status < 500:
            kind = resp.headers.get("content-type", "")
            raise UpstreamReply(resp.status, data, kind, f"prefill instance {p.instance_id}")
        raise status_error("prefill", p.instance_id, resp.status, data)
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
    if r.relay.config.prompt_tokens_details:
        r.cached = usage_details.cached_tokens_of(answer)
    tracing.stamp_kv_params(kv)
    return answer, json.dumps(kv, separators=(",", ":")).encode()


async def open_decode(r: Request, body: Any, endpoint: str = "") -> UpstreamResponse:
    """Opens the decode leg on `endpoint` (default: the client's) with `body` (bytes, or an
    async iterator of them sent chunked); returns once decode's headers arrived. Raises as
    `leg_errors`."""
    t0 = time.perf_counter()
    d = r.decode
    with tracing.span("pdplane.decode_leg"), leg_errors(r, "decode", d):
        opening = asyncio.ensure_future(
            r.relay.upstream.open(
                d.url + (endpoint or r.req.endpoint),
                body,
                tracing.inject_headers(r.headers),
                read_timeout_s=r.timeout_s,
            )
        )
        resp = await _unless_decode_leaves(r, opening)
    r.relay.metrics.decode_leg.observe(time.perf_counter() - t0)
    r.decode_answered_ns = time.time_ns()
    return resp


_NOT_AGAIN = "not run again on another decode: --migration-limit 0"


class _Opening:
    """A decode request awaiting its response headers (a non-streamed one: the whole
    generation), closed if its decode leaves the registry or drains past its grace."""

    def __init__(self, opening: asyncio.Future[UpstreamResponse]) -> None:
        self.opening = opening
        self.reason = ""

    def evict(self, reason: str) -> None:
        self.reason = reason
        self.opening.cancel()


async def _unless_decode_leaves(
    r: Request, opening: asyncio.Future[UpstreamResponse]
) -> UpstreamResponse:
    """`opening`'s response. A non-streamed request whose decode leaves meanwhile (lease
    expired: a frozen process keeps its connection open and silent; drained past
    `--drain-grace-s`) is DecodeLost (the relay runs it again on another pair) or, with
    `--migration-limit 0`, a 502 at once: never a wait for `--upstream-timeout-s`. (A
    stream's headers come at once; its leg is watched while it is relayed.)"""
    if r.req.stream:
        return await opening
    name = r.decode.instance_id
    leaving = _Opening(opening)
    r.relay.departures.add(name, leaving)
    try:
        return await opening
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if not leaving.reason or (task is not None and task.cancelling()):
            raise  # cancelled from outside (the client left), not by a departure
        message = (
            f"decode instance {name} drained past its grace before answering"
            if leaving.reason == "drain"
            else f"decode instance {name} left the registry before answering"
        )
        if not r.restartable():
            raise bad_gateway(f"{message}; {_NOT_AGAIN}") from None
        raise DecodeLost(name, Loss(leaving.reason, 502, message)) from None
    finally:
        r.relay.departures.discard(name, leaving)


async def open_concurrently(r: Request) -> UpstreamResponse:
    """Opens the decode request while prefill runs: headers and the body without
    kv_transfer_params go out at once, the rest when prefill answers (chunked). A prefill
    leg that fails cancels decode's request before it is whole (decode never runs it)."""
    head, tail = decode_body_parts(r.req.raw, r.req.body, r.transcript is not None)
    params: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()

    async def body() -> AsyncGenerator[bytes, None]:
        yield head
        yield await params + tail

    decode = asyncio.ensure_future(open_decode(r, body()))
    try:
        _, kv = await prefill_leg(r)
    except BaseException:
        decode.cancel()
        await asyncio.gather(decode, return_exceptions=True)
        raise
    params.set_result(kv)
    return await decode


async def decode_error(r: Request, resp: UpstreamResponse) -> NoReturn:
    """Decode refused the request (`resp`: its error status): prefill's KV is freed now;
    raises its 4xx as it came (UpstreamReply) or a 502 naming it."""
    try:
        data = await r.relay.upstream.read(resp)
    except (UpstreamUnreachable, UpstreamTimeout):
        data = b""
    r.care.free_kv(f"decode answered {resp.status}")
    if resp.status < 500:
        source = f"decode instance {r.decode.instance_id}"
        raise UpstreamReply(resp.status, data, resp.headers.get("content-type", ""), source)
    raise status_error("decode", r.decode.instance_id, resp.status, data)


async def refused_mid_stream(r: Request, resp: UpstreamResponse) -> NoReturn:
    """Decode refused a leg of a stream under way (`resp`: its error status): prefill's KV is
    freed; raises GatewayError (decode's status and message for 4xx, 502 for 5xx), whose
    event ends the stream."""
    try:
        await decode_error(r, resp)
    except UpstreamReply as reply:
        excerpt = reply.body[:300].decode(errors="replace")
        raise GatewayError(
            reply.status,
            f"decode instance {r.decode.instance_id} answered {reply.status}: {excerpt}",
        ) from None
    finally:
        resp.close()
