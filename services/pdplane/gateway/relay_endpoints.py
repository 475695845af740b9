"""The relay endpoints, POST /v1/completions and /v1/chat/completions, as a lean ASGI layer.

They are the gateway's hot path, so they are served here in front of FastAPI's routing and
dependency machinery (which costs a measurable share of a request's CPU); every other path
goes on to the FastAPI app.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import os
import time
from collections.abc import AsyncGenerator, Callable

from pydantic_core import from_json
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from pdplane.core import tracing
from pdplane.gateway.asgi import DisconnectWatch, SSEResponse
from pdplane.gateway.auth import CONFLICT, ApiKeys
from pdplane.gateway.errors import (
    GatewayError,
    UpstreamReply,
    bad_request,
    error_body,
    not_found,
    unauthorized,
    unavailable,
)
from pdplane.gateway.fleet_view import FleetView
from pdplane.gateway.flow import FlowControl, FlowTicket
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.prompt_ids import Tokenizers, TokenizerSet, exact_prompt_async
from pdplane.gateway.ratelimit import RateLimiter
from pdplane.gateway.relay import Relay
from pdplane.gateway.replies import JsonReply, StreamReply
from pdplane.gateway.request_body import CLIENT_CLOSED, ClientGone, read_body
from pdplane.gateway.route_note import ROUTE_HEADER, RouteNote
from pdplane.gateway.routes import RELAY_PATHS
from pdplane.gateway.tenants import ANONYMOUS, Identity
from pdplane.gateway.validation import ClientRequest, Endpoint, parse_request

__all__ = ["RelayEndpoints"]

log = logging.getLogger(__name__)

_JSON = "application/json"
#: Longest accepted client X-Request-Id (characters); it travels in headers and KV params.
_MAX_REQUEST_ID = 256


#: Generated request ids: "pdp-<64-bit random per process>-<counter>", unique across gateways
#: sharing a scheduler (as uuid4 would be) for a fraction of uuid4's cost per request.
_ID_PREFIX = f"pdp-{os.urandom(8).hex()}-"
_id_counter = itertools.count(1)


def _headers(scope: Scope, tenant_header: bytes) -> tuple[bytes | None, str, str, bool, str]:
    """(authorization, x-request-id, x-routing-key, whether x-pdplane-route asks for the
    routing headers, the tenant header's value) from the raw ASGI headers."""
    auth, request_id, routing_key, show_route, tenant = None, "", "", False, ""
    for key, value in scope["headers"]:
        if key == b"authorization":
            # Two Authorization headers are refused (`ApiKeys.allows(CONFLICT)`), whatever
            # their values: proxies and servers disagree on which one counts.
            auth = value if auth is None else CONFLICT
        elif key == b"x-request-id":
            request_id = value.decode("latin-1")
        elif key == b"x-routing-key":
            routing_key = value.decode("latin-1")
        elif key == ROUTE_HEADER:
            show_route = value.strip().lower() in (b"1", b"true")
        elif key == tenant_header:
            tenant = value.decode("latin-1").strip()[:128]
    return auth, request_id, routing_key, show_route, tenant


def _client_traceparent(scope: Scope) -> str | None:
    for key, value in scope["headers"]:
        if key == b"traceparent":
            return str(value.decode("latin-1"))
    return None


def _with_default_model(req: ClientRequest, view: FleetView) -> ClientRequest:
    """`req` for the fleet's only model, as `vllm serve` serves its model to a request that
    names none. Raises GatewayError: 503 without any model yet, 400 when there are several."""
    if not view.ready:
        raise unavailable("registry not reachable yet; cannot resolve the model")
    names = sorted(view.models)
    if not names:
        raise unavailable("no instances registered")
    if len(names) > 1:
        raise bad_request(
            f"'model' is required: this gateway serves {len(names)} models ({', '.join(names)})",
            "model",
        )
    return dataclasses.replace(req, model=names[0])


class RelayEndpoints:
    """ASGI middleware serving the relay endpoints; everything else goes to `app`.

    Args:
        app: the FastAPI app (other routes, lifespan).
        relay: the prefill -> decode relay.
        fleet: returns the current FleetView (model lookup: 404 for an unknown model).
        metrics: request counters, in-flight gauge.
        api_keys: accepted bearer tokens and who they speak for (tenants).
        flow: the in-flight budget and its fair queue (`pdplane.gateway.flow`).
        limiter: the keys' rate limits (`pdplane.gateway.ratelimit`).
        body_timeout_s: longest read of one request body (s); then 408.
        tokenizers: the models' tokenizers (exact prompt ids and prefix hashes); none = the
            estimated prompt lengths of `pdplane.gateway.prompt_length`.
        access_log: write one line per request to `pdplane.gateway.access`
            (`pdplane.gateway.route_note`).
    """

    def __init__(
        self,
        app: ASGIApp,
        relay: Relay,
        fleet: Callable[[], FleetView],
        metrics: GatewayMetrics,
        api_keys: ApiKeys,
        flow: FlowControl,
        limiter: RateLimiter,
        body_timeout_s: float = 60.0,
        tokenizers: Tokenizers | None = None,
        access_log: bool = False,
    ) -> None:
        self.access_log = access_log
        self.app = app
        self.relay = relay
        self.fleet = fleet
        self.metrics = metrics
        self.api_keys = api_keys
        self.flow = flow
        self.limiter = limiter
        self.body_timeout_s = body_timeout_s
        self.tokenizers: Tokenizers = tokenizers or TokenizerSet({})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        endpoint = RELAY_PATHS.get(scope["path"]) if scope["type"] == "http" else None
        if endpoint is None:
            await self.app(scope, receive, send)
            return
        if scope["method"] != "POST":
            body = error_body(405, "Method Not Allowed")
            response = Response(body, 405, headers={"allow": "POST"}, media_type=_JSON)
            await response(scope, receive, send)
            return
        # The request's root span: until the last byte of the answer (streams included).
        parent = _client_traceparent(scope) if tracing.enabled() else None
        with tracing.span("pdplane.request", parent=parent, server=True):
            response = await self._relay(endpoint, scope, receive)
            await response(scope, receive, send)

    async def _relay(self, endpoint: Endpoint, scope: Scope, receive: Receive) -> Response:
        started = time.perf_counter()
        metrics = self.metrics
        auth, request_id, routing_key, show_route, named = _headers(
            scope, self.api_keys.book.header
        )
        error: GatewayError | None = None
        if len(request_id) > _MAX_REQUEST_ID:
            request_id = ""
            error = bad_request(f"X-Request-Id longer than {_MAX_REQUEST_ID} characters")
        elif not request_id.isprintable():
            # It is sent upstream as a header: no control characters.
            request_id = ""
            error = bad_request("X-Request-Id must not contain control characters")
        # The client's id is echoed to it; Schedule/Release, the KV transfer and the legs use
        # one the gateway makes unique: ten concurrent requests reusing one client id counted
        # as one in flight (and nine Releases came back unknown).
        generated = f"{_ID_PREFIX}{next(_id_counter):x}"
        headers = {"x-request-id": request_id or generated}
        request_id = f"{request_id}-{generated}" if request_id else generated
        status = 500
        streaming = False
        watch: DisconnectWatch | None = None
        note = RouteNote()
        model_name = ""
        turn = _Turn()
        metrics.inflight.inc()

        def done() -> None:
            metrics.answered(endpoint, status)
            metrics.inflight.dec()
            turn.end(self.flow, self.limiter, status)
            if self.access_log:
                client = scope.get("client")
                note.log_line(
                    client[0] if client else "-",
                    "POST",
                    endpoint,
                    status,
                    request_id,
                    model_name,
                    (time.perf_counter() - started) * 1000.0,
                )

        try:
            if error is not None:
                raise error
            who = self.api_keys.identify(auth, named)
            if who is None:
                raise unauthorized()
            view = self.fleet()
            req = parse_request(
                endpoint,
                await read_body(receive, self.body_timeout_s),
                routing_key,
                max_model_len=view.longest_model_len(),
            )
            if not req.model:
                req = _with_default_model(req, view)
            model = view.models.get(req.model)
            if model is None:
                if not view.ready:
                    raise unavailable("registry not reachable yet; cannot resolve the model")
                raise not_found(req.model)
            model_name = req.model
            req = await exact_prompt_async(
                self.tokenizers.get(req.model), req, model.max_model_len, model.block_sizes
            )
            note.prompt_tokens, note.exact = req.prompt_tokens, bool(req.prefix_hashes)
            if req.prefix_hashes:
                metrics.exact_prompts.inc()
            else:
                metrics.estimated_prompts.inc()
            turn.charge(self.limiter, who, req, model.max_model_len)
            watch = DisconnectWatch(receive)
            answered, reply = await watch.run(
                self._in_turn(turn, req, request_id, started, model.max_model_len, note)
            )
            if not answered or reply is None:
                status = CLIENT_CLOSED
                return Response(status_code=CLIENT_CLOSED, headers=headers)
            if show_route:
                headers.update(note.headers())
            if isinstance(reply, JsonReply):
                status = reply.status
                turn.answered(reply)
                return Response(reply.body, status, headers=headers, media_type=reply.content_type)
            status, streaming = 200, True
            return SSEResponse(turn.counted(reply), watch, headers, done)
        except ClientGone:
            status = CLIENT_CLOSED
            return Response(status_code=CLIENT_CLOSED, headers=headers)
        except GatewayError as exc:
            status = exc.status
            if status >= 500:
                # The gateway's own refusals (no pair, instance failed or silent): the client
                # gets the error body, the operator this line (per-status counts are in
                # pdplane_gateway_requests_total).
                log.warning("request %s: %d %s", request_id, status, exc.message)
            return Response(
                exc.body(), status, headers={**headers, **exc.headers}, media_type=_JSON
            )
        except UpstreamReply as exc:
            status = exc.status
            body, kind = exc.client_body()
            return Response(body, status, headers=headers, media_type=kind)
        finally:
            if not streaming:
                if watch is not None:
                    watch.close()
                done()

    async def _in_turn(
        self,
        turn: _Turn,
        req: ClientRequest,
        request_id: str,
        started: float,
        max_model_len: int,
        note: RouteNote,
    ) -> JsonReply | StreamReply:
        """Waits for the request's turn in its model's in-flight budget, then relays it."""
        who = turn.who
        priority = who.priority_of(req.priority)
        turn.ticket = await self.flow.admit(req.model, who.tenant, priority, turn.cost, who.weight)
        return await self.relay.handle(req, request_id, started, max_model_len, note)


class _Turn:
    """One request's place in flow control and its rate-limit charge, ended once (`end`).

    Its weight (`cost`, tokens) is its KV need: prompt + max_tokens per choice (`n`; the
    choices share the prompt's KV), max_tokens being the rest of the model length when the
    client set none (vLLM's default)."""

    __slots__ = ("charged", "completion", "cost", "prompt", "ticket", "who")

    def __init__(self) -> None:
        self.who: Identity = ANONYMOUS
        self.cost = 0
        self.prompt = 0
        self.charged = 0
        self.completion = 0  # completion tokens seen (events of a stream, or usage)
        self.ticket: FlowTicket | None = None

    def charge(
        self, limiter: RateLimiter, who: Identity, req: ClientRequest, max_model_len: int
    ) -> None:
        """Takes the request from its key's rate limits (GatewayError 429 when over)."""
        self.who = who
        new = req.max_tokens or max(0, max_model_len - req.prompt_tokens)
        choices = max(1, req.body.get("n") or 1)  # n: a validated int or absent (vLLM refuses < 1)
        self.prompt = req.prompt_tokens
        self.cost = max(1, req.prompt_tokens + choices * new)
        limiter.take(who, self.cost)
        self.charged = self.cost if who.tokens_per_min else 0
        self.completion = 0

    def answered(self, reply: JsonReply) -> None:
        """Reads the completion tokens of a JSON answer (only for a key with a token limit)."""
        if not self.charged or reply.status != 200:
            return
        try:
            usage = from_json(reply.body).get("usage") or {}
            self.completion = int(usage.get("completion_tokens") or 0)
        except (ValueError, AttributeError, TypeError):
            self.completion = 0

    def counted(self, reply: StreamReply) -> StreamReply:
        """`reply`, counting its token events when the key has a token limit."""
        if not self.charged:
            return reply
        return StreamReply(self._count(reply.chunks), reply.headers, reply.abandon)

    async def _count(self, chunks: AsyncGenerator[bytes, None]) -> AsyncGenerator[bytes, None]:
        try:
            async for chunk in chunks:
                # One event per token (vLLM, n=1; every choice's tokens for n>1); [DONE] is not.
                self.completion += chunk.count(b"data: ") - chunk.count(b"data: [DONE]")
                yield chunk
        finally:
            await chunks.aclose()

    def end(self, flow: FlowControl, limiter: RateLimiter, status: int) -> None:
        """The answer ended with `status`: the turn's tokens leave the budget, and the tokens
        the request did not use go back to its key (all of them when it failed)."""
        if self.ticket is not None:
            flow.release(self.ticket)
            self.ticket = None
        if self.charged:
            used = self.prompt + self.completion if status == 200 else 0
            limiter.settle(self.who, self.charged, used)
            self.charged = 0
