"""The relay endpoints, POST /v1/completions and /v1/chat/completions, as a lean ASGI layer.

They are the gateway's hot path, so they are served here in front of FastAPI's routing and
dependency machinery (which costs a measurable share of a request's CPU); every other path
goes on to the FastAPI app.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import os
import time
from collections.abc import Callable

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
from pdplane.gateway.fleet import FleetView
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.prompt_ids import Tokenizers, TokenizerSet, exact_prompt_async
from pdplane.gateway.relay import Relay
from pdplane.gateway.replies import JsonReply
from pdplane.gateway.route_note import ROUTE_HEADER, RouteNote
from pdplane.gateway.routes import RELAY_PATHS
from pdplane.gateway.validation import ClientRequest, Endpoint, parse_request

__all__ = ["RelayEndpoints"]

log = logging.getLogger(__name__)

_JSON = "application/json"
#: Longest accepted client X-Request-Id (characters); it travels in headers and KV params.
_MAX_REQUEST_ID = 256
#: Largest accepted request body (bytes).
_MAX_BODY = 64 * 1024 * 1024
#: Status recorded for requests whose client went away before an answer (nginx's convention).
_CLIENT_CLOSED = 499


#: Generated request ids: "pdp-<64-bit random per process>-<counter>", unique across gateways
#: sharing a scheduler (as uuid4 would be) for a fraction of uuid4's cost per request.
_ID_PREFIX = f"pdp-{os.urandom(8).hex()}-"
_id_counter = itertools.count(1)


class _ClientGone(Exception):
    """The client disconnected while its body was being read."""


async def _read_body(receive: Receive, timeout_s: float) -> bytes:
    """The request body; GatewayError 408 when it takes longer than `timeout_s` (s)."""
    try:
        async with asyncio.timeout(timeout_s):
            return await _receive_body(receive)
    except TimeoutError:
        raise GatewayError(408, f"request body not received within {timeout_s:g} s") from None


async def _receive_body(receive: Receive) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > _MAX_BODY:
            raise GatewayError(413, f"request body larger than {_MAX_BODY} bytes")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _headers(scope: Scope) -> tuple[bytes | None, str, str, bool]:
    """(authorization, x-request-id, x-routing-key, whether x-pdplane-route asks for the
    routing headers) from the raw ASGI headers."""
    auth, request_id, routing_key, show_route = None, "", "", False
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
    return auth, request_id, routing_key, show_route


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
        api_keys: accepted bearer tokens.
        body_timeout_s: longest read of one request body (s); then 408.
        tokenizers: the models' tokenizers (exact prompt ids and prefix hashes); none = the
            estimated prompt lengths of `pdplane.gateway.tokens`.
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
        auth, request_id, routing_key, show_route = _headers(scope)
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
        metrics.inflight.inc()

        def done() -> None:
            metrics.answered(endpoint, status)
            metrics.inflight.dec()
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
            if not self.api_keys.allows(auth):
                raise unauthorized()
            view = self.fleet()
            req = parse_request(
                endpoint,
                await _read_body(receive, self.body_timeout_s),
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
            watch = DisconnectWatch(receive)
            answered, reply = await watch.run(
                self.relay.handle(req, request_id, started, model.max_model_len, note)
            )
            if not answered or reply is None:
                status = _CLIENT_CLOSED
                return Response(status_code=_CLIENT_CLOSED, headers=headers)
            if show_route:
                headers.update(note.headers())
            if isinstance(reply, JsonReply):
                status = reply.status
                return Response(reply.body, status, headers=headers, media_type=reply.content_type)
            status, streaming = 200, True
            return SSEResponse(reply, watch, headers, done)
        except _ClientGone:
            status = _CLIENT_CLOSED
            return Response(status_code=_CLIENT_CLOSED, headers=headers)
        except GatewayError as exc:
            status = exc.status
            if status >= 500:
                # The gateway's own refusals (no pair, instance failed or silent): the client
                # gets the error body, the operator this line (per-status counts are in
                # pdplane_gateway_requests_total).
                log.warning("request %s: %d %s", request_id, status, exc.message)
            return Response(exc.body(), status, headers=headers, media_type=_JSON)
        except UpstreamReply as exc:
            status = exc.status
            return Response(exc.body, status, headers=headers, media_type=exc.content_type or _JSON)
        finally:
            if not streaming:
                if watch is not None:
                    watch.close()
                done()
