"""Every route of the gateway, declared here.

- The relay endpoints, POST /v1/completions and /v1/chat/completions (`RELAY_PATHS`), are the
  hot path: the ASGI front (`pdplane.gateway.relay_endpoints`) answers them before FastAPI's routing
  and dependency machinery, which costs a measurable share of a request's CPU. FastAPI routes
  of the same paths only document their bodies in /openapi.json (the models `parse_request`
  validates against), so clients and schema-driven fuzzers see the real shapes; FastAPI never
  reaches them.
- FastAPI serves the rest: /v1/models, /health, /ping, /metrics, and vLLM's read-only routes
  answered by an instance (/tokenize, /detokenize, /version).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pdplane.core.server_id import server_id
from pdplane.gateway.auth import CONFLICT, ApiKeys
from pdplane.gateway.errors import GatewayError, unauthorized
from pdplane.gateway.fleet_tokenizers import RoutingState
from pdplane.gateway.fleet_view import FleetView
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.gateway.passthrough import Passthrough
from pdplane.gateway.request_body import CLIENT_CLOSED, ClientGone, read_body
from pdplane.gateway.validation import CHAT, COMPLETIONS, REQUEST_SCHEMAS, Endpoint

__all__ = ["RELAY_PATHS", "build_router"]

_JSON = "application/json"

#: The relay endpoints by path, answered by `pdplane.gateway.relay_endpoints` in front of FastAPI.
RELAY_PATHS: dict[str, Endpoint] = {COMPLETIONS: COMPLETIONS, CHAT: CHAT}

_RELAY_ANSWERS: dict[int | str, dict[str, Any]] = {
    200: {"description": "the decode instance's answer (JSON, or SSE when `stream` is true)"},
    400: {"description": "invalid body (OpenAI error shape)"},
    401: {"description": "missing or invalid API key"},
    404: {"description": "unknown model"},
    503: {"description": "no usable prefill/decode pair"},
}


def _relay_schema_routes(router: APIRouter) -> None:
    """Routes that only document the relay endpoints' request bodies (see module docstring)."""
    for path, model in REQUEST_SCHEMAS.items():

        async def relay(body: Any) -> Response:
            raise AssertionError("relay endpoints are served by pdplane.gateway.relay_endpoints")

        # A pydantic model parameter is FastAPI's JSON body.
        relay.__annotations__["body"] = model
        router.add_api_route(
            path, relay, methods=["POST"], responses=_RELAY_ANSWERS, name=path.rsplit("/", 1)[-1]
        )


def _json(data: object, status: int = 200) -> Response:
    return Response(json.dumps(data).encode(), status, media_type=_JSON)


def build_router(
    fleet: Callable[[], FleetView],
    metrics: GatewayMetrics,
    api_keys: ApiKeys,
    passthrough: Passthrough,
    routing: Callable[[], Mapping[str, RoutingState]] = dict,
    scheduler_problem: Callable[[], str | None] = lambda: None,
    body_timeout_s: float = 60.0,
) -> APIRouter:
    """The gateway's FastAPI routes (the relay endpoints' only for /openapi.json);
    `fleet()` returns the current FleetView, `routing()` each model's routing state (added to
    its /health entry), and `scheduler_problem()` (e.g. "scheduler unreachable at ...", else
    None) makes /health 503. Bodies passed on (/tokenize, /detokenize) are read within
    `body_timeout_s` (s) and `request_body.MAX_BODY` bytes, as the relay endpoints'."""
    router = APIRouter()
    _relay_schema_routes(router)

    def refused(request: Request) -> Response | None:
        values = request.headers.getlist("authorization")
        if len(values) > 1:
            got: bytes | None = CONFLICT
        else:
            got = values[0].encode("latin-1") if values else None
        if api_keys.allows(got):
            return None
        exc = unauthorized()
        return Response(exc.body(), exc.status, media_type=_JSON)

    async def forward(method: str, path: str, body: bytes = b"") -> Response:
        try:
            answer = await passthrough.forward(method, path, body)
        except GatewayError as exc:
            return Response(exc.body(), exc.status, media_type=_JSON)
        return Response(answer.body, answer.status, media_type=answer.content_type)

    async def forward_body(request: Request, path: str) -> Response:
        try:
            body = await read_body(request.receive, body_timeout_s)
        except GatewayError as exc:
            return Response(exc.body(), exc.status, media_type=_JSON)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)  # nobody to send it to
        return await forward("POST", path, body)

    def checked_health(model: str | None = None) -> tuple[bool, dict[str, object]]:
        healthy, body = fleet().health(model)
        states = routing()
        models = body.get("models")
        if isinstance(models, dict):
            for name, entry in models.items():
                state = states.get(name)
                if state is not None:
                    entry.update(state.as_json())
        problem = scheduler_problem()
        if problem is None:
            return healthy, body
        reason = "; ".join(r for r in (problem, body.get("reason")) if r)
        return False, {**body, "status": "unavailable", "reason": reason}

    @router.get("/v1/models")
    async def models(request: Request) -> Response:
        """Models served by the registered instances, deduplicated (OpenAI list shape), each
        with vLLM's details (`root`, `permission`, ...) from one of its instances."""
        return refused(request) or _json(await passthrough.models())

    @router.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        """vLLM's /tokenize, answered by an instance of the body's model."""
        return refused(request) or await forward_body(request, "/tokenize")

    @router.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        """vLLM's /detokenize, answered by an instance of the body's model."""
        return refused(request) or await forward_body(request, "/detokenize")

    @router.get("/version")
    async def version() -> Response:
        """vLLM's /version, of one instance."""
        return await forward("GET", "/version")

    @router.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's /ping: an empty 200 exactly when /health is 200, else 503."""
        healthy, _ = checked_health()
        return Response(status_code=200 if healthy else 503)

    @router.get("/health")
    async def health(model: str | None = None) -> Response:
        """200 when at least one served model has a usable prefill/decode pair (`status`
        "degraded" when another has none), else 503 + reason; `?model=NAME`: 200 exactly
        when that model has one (per-model readiness). Each model's entry says how it is
        routed (`routing`: precise or load, with `routing_reason`). `server_id` says which
        gateway process answered (`pdplane.core.server_id`)."""
        healthy, body = checked_health(model)
        return _json({**body, "server_id": server_id()}, 200 if healthy else 503)

    @router.get("/metrics")
    async def prometheus() -> Response:
        """Prometheus text exposition of the gateway's metrics."""
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return router
