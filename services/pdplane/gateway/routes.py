"""HTTP routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics."""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdplane.gateway.asgi import DisconnectWatch, SSEResponse
from pdplane.gateway.errors import (
    GatewayError,
    UpstreamReply,
    bad_request,
    not_found,
    unauthorized,
    unavailable,
)
from pdplane.gateway.fleet import FleetView
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.relay import JsonReply, Relay
from pdplane.gateway.validation import CHAT, COMPLETIONS, Endpoint, parse_request

__all__ = ["build_router"]

_JSON = "application/json"
#: Longest accepted client X-Request-Id (characters); it travels in headers and KV params.
_MAX_REQUEST_ID = 256
#: Status recorded for requests whose client went away before an answer (nginx's convention).
_CLIENT_CLOSED = 499


def _json(data: object, status: int = 200) -> Response:
    return Response(json.dumps(data).encode(), status, media_type=_JSON)


def build_router(
    relay: Relay,
    fleet: Callable[[], FleetView],
    metrics: GatewayMetrics,
    api_keys: tuple[str, ...] = (),
) -> APIRouter:
    """The gateway's routes over `relay`; `fleet()` returns the current FleetView."""
    router = APIRouter()
    expected = tuple(f"Bearer {k}".encode() for k in api_keys)

    def authorize(request: Request) -> None:
        if not expected:
            return
        got = request.headers.get("authorization", "").encode()
        if not any(hmac.compare_digest(got, e) for e in expected):
            raise unauthorized()

    async def relay_endpoint(request: Request, endpoint: Endpoint) -> Response:
        started = time.perf_counter()
        request_id = request.headers.get("x-request-id") or f"pdp-{uuid.uuid4().hex}"
        if len(request_id) > _MAX_REQUEST_ID:
            request_id = f"pdp-{uuid.uuid4().hex}"
            body = bad_request(f"X-Request-Id longer than {_MAX_REQUEST_ID} characters").body()
            return Response(body, 400, headers={"x-request-id": request_id}, media_type=_JSON)
        headers = {"x-request-id": request_id}
        status = 500
        streaming = False
        watch: DisconnectWatch | None = None
        metrics.inflight.inc()

        def done() -> None:
            metrics.requests.labels(endpoint, str(status)).inc()
            metrics.inflight.dec()

        try:
            authorize(request)
            routing_key = request.headers.get("x-routing-key", "")
            req = parse_request(endpoint, await request.body(), routing_key)
            view = fleet()
            model = view.models.get(req.model)
            if model is None:
                if not view.ready:
                    raise unavailable("registry not reachable yet; cannot resolve the model")
                raise not_found(req.model)
            watch = DisconnectWatch(request.receive)
            answered, reply = await watch.run(
                relay.handle(req, request_id, started, model.max_model_len)
            )
            if not answered or reply is None:
                status = _CLIENT_CLOSED
                return Response(status_code=_CLIENT_CLOSED, headers=headers)
            if isinstance(reply, JsonReply):
                status = reply.status
                return Response(reply.body, status, headers=headers, media_type=reply.content_type)
            status, streaming = 200, True
            return SSEResponse(reply, watch, headers, done)
        except GatewayError as exc:
            status = exc.status
            return Response(exc.body(), status, headers=headers, media_type=_JSON)
        except UpstreamReply as exc:
            status = exc.status
            return Response(exc.body, status, headers=headers, media_type=exc.content_type or _JSON)
        finally:
            if not streaming:
                if watch is not None:
                    watch.close()
                done()

    @router.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        """OpenAI completions, relayed prefill -> decode (stream or not)."""
        return await relay_endpoint(request, COMPLETIONS)

    @router.post(CHAT)
    async def chat_completions(request: Request) -> Response:
        """OpenAI chat completions, relayed prefill -> decode (stream or not)."""
        return await relay_endpoint(request, CHAT)

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        """Models served by the registered instances, deduplicated (OpenAI list shape)."""
        try:
            authorize(request)
        except GatewayError as exc:
            return Response(exc.body(), exc.status, media_type=_JSON)
        return _json(fleet().models_list())

    @router.get("/health")
    async def health() -> Response:
        """200 when every served model has a usable prefill/decode pair, else 503 + reason."""
        healthy, body = fleet().health()
        return _json(body, 200 if healthy else 503)

    @router.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus text exposition of the gateway's metrics."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router
