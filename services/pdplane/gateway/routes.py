"""FastAPI routes besides the relay endpoints: /v1/models, /health, /metrics."""

from __future__ import annotations

import json
from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdplane.gateway.auth import ApiKeys
from pdplane.gateway.errors import unauthorized
from pdplane.gateway.fleet import FleetView
from pdplane.gateway.metrics import GatewayMetrics

__all__ = ["build_router"]

_JSON = "application/json"


def _json(data: object, status: int = 200) -> Response:
    return Response(json.dumps(data).encode(), status, media_type=_JSON)


def build_router(
    fleet: Callable[[], FleetView], metrics: GatewayMetrics, api_keys: ApiKeys
) -> APIRouter:
    """The gateway's read-only routes; `fleet()` returns the current FleetView."""
    router = APIRouter()

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        """Models served by the registered instances, deduplicated (OpenAI list shape)."""
        if not api_keys.allows(request.headers.get("authorization", "").encode("latin-1")):
            exc = unauthorized()
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
