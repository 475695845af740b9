"""The relay endpoints' request bodies in /openapi.json.

POST /v1/completions and /v1/chat/completions are answered by the ASGI layer in front of
FastAPI (`pdplane.gateway.endpoints`), so FastAPI never routes them. These routes exist only so
that FastAPI's schema documents their bodies (the models `parse_request` validates against):
clients and schema-driven fuzzers see the real shapes, and the hot path is unchanged.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import Response

from pdplane.gateway.validation import REQUEST_SCHEMAS

__all__ = ["schema_router"]

_ANSWERS: dict[int | str, dict[str, Any]] = {
    200: {"description": "the decode instance's answer (JSON, or SSE when `stream` is true)"},
    400: {"description": "invalid body (OpenAI error shape)"},
    401: {"description": "missing or invalid API key"},
    404: {"description": "unknown model"},
    503: {"description": "no usable prefill/decode pair"},
}


def _never_routed() -> Response:
    # The ASGI layer answers these paths before FastAPI's router is reached.
    raise AssertionError("relay endpoints are served by pdplane.gateway.endpoints")


def schema_router() -> APIRouter:
    """Routes that only document the relay endpoints' request bodies (see module docstring)."""
    router = APIRouter()
    for path, model in REQUEST_SCHEMAS.items():

        async def relay(body: Any) -> Response:
            return _never_routed()

        # A pydantic model parameter is FastAPI's JSON body.
        relay.__annotations__["body"] = model
        router.add_api_route(
            path, relay, methods=["POST"], responses=_ANSWERS, name=path.rsplit("/", 1)[-1]
        )
    return router
