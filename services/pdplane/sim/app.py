"""The aiohttp application of one sim: OpenAI routes, probes, metrics and `/sim/*` debug routes.

Debug routes (tests and benchmarks read them; documented in docs/sim.md):
- `GET /sim/requests`: `{"requests": [RequestRecord...]}`, oldest first; `DELETE` clears.
- `GET /sim/transfers`: `{"held": [...], "freed": [...]}` (prefill side KV lifecycle).
- `GET /sim/faults` / `POST /sim/faults`: read / change fault injection at run time.
- `GET /sim/state`: instance id, role, URLs and the current load report.
- `GET /sim/stats`: the engine's counters (`pdplane.sim.stats.EngineStats`, modelled seconds),
  push-buffer counters and the wall clock, for benchmarks that diff two reads.
"""

from __future__ import annotations

import ipaddress
import json
import time
from typing import Any

from aiohttp import web
from google.protobuf.json_format import MessageToDict

from pdplane.sim.generation import CompletionRoutes, error_response
from pdplane.sim.protocol import SimApiError
from pdplane.sim.state import SimState

#: Largest request body a sim reads (bytes): what the gateway passes on.
_MAX_BODY = 64 * 1024 * 1024

__all__ = ["build_app"]

_VERSION = "0.32.0"


def control_guard(open_control: bool) -> Any:
    """aiohttp middleware: `/sim/*` (fault injection, transfers, records: no auth) answers 403
    unless the client is on loopback or `open_control` is set; other routes pass."""

    @web.middleware
    async def guard(request: web.Request, handler: Any) -> web.StreamResponse:
        if open_control or not request.path.startswith("/sim/"):
            return await handler(request)
        try:
            loopback = ipaddress.ip_address(request.remote or "").is_loopback
        except ValueError:
            loopback = False
        if not loopback:
            return web.json_response(
                {"error": "/sim/* answers loopback clients only (--open-control to change)"},
                status=403,
            )
        return await handler(request)

    return guard


def build_app(state: SimState) -> web.Application:
    """The routes of one sim over `state` (no server is started here)."""
    # vLLM (uvicorn) reads a body of any size and refuses a prompt by its length; aiohttp's
    # 1 MiB default answered 413 in plain text. The gateway passes on at most 64 MiB.
    app = web.Application(
        middlewares=[control_guard(state.config.open_control)], client_max_size=_MAX_BODY
    )
    completion = CompletionRoutes(state)
    model = state.config.model
    created = int(time.time())

    async def models(_request: web.Request) -> web.Response:
        card = {
            "id": model,
            "object": "model",
            "created": created,
            "owned_by": "vllm",
            "root": state.config.model_root or model,
            "parent": None,
            "max_model_len": state.config.max_model_len,
            "permission": [],
        }
        return web.json_response({"object": "list", "data": [card]})

    async def health(_request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def version(_request: web.Request) -> web.Response:
        return web.json_response({"version": _VERSION})

    async def metrics(_request: web.Request) -> web.Response:
        return web.Response(
            body=state.metrics.exposition(),
            headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"},
        )

    async def tokenize(request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except json.JSONDecodeError:
            return error_response(SimApiError(400, "request body is not valid JSON"))
        text = body.get("prompt") if isinstance(body, dict) else None
        messages = body.get("messages") if isinstance(body, dict) else None
        assert state.tokenizer is not None
        if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
            ids = state.tokenizer.encode_chat(messages)
        elif isinstance(text, str):
            ids = state.tokenizer.encode(text)
        else:
            return error_response(SimApiError(400, "prompt must be a string", param="prompt"))
        return web.json_response(
            {
                "count": len(ids),
                "max_model_len": state.config.max_model_len,
                "tokens": ids,
                "token_strs": None,
            }
        )

    async def reset_prefix_cache(_request: web.Request) -> web.Response:
        state.core.pool.reset()
        return web.Response(status=200)

    async def stats(_request: web.Request) -> web.Response:
        return web.json_response(state.stats_snapshot())

    async def get_requests(_request: web.Request) -> web.Response:
        return web.json_response({"requests": [r.to_dict() for r in state.recorder.records()]})

    async def clear_requests(_request: web.Request) -> web.Response:
        state.recorder.clear()
        return web.json_response({"cleared": True})

    async def transfers(_request: web.Request) -> web.Response:
        table = state.transfers
        return web.json_response(
            {"held": [t.to_dict() for t in table.held.values()], "freed": list(table.freed)}
        )

    async def get_faults(_request: web.Request) -> web.Response:
        return web.json_response(state.faults.to_dict())

    async def set_faults(request: web.Request) -> web.Response:
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise ValueError("body must be a JSON object")
            state.faults.update(body)
        except (json.JSONDecodeError, ValueError) as exc:
            return error_response(SimApiError(400, str(exc)))
        return web.json_response(state.faults.to_dict())

    async def sim_state(_request: web.Request) -> web.Response:
        return web.json_response(
            {
                "instance_id": state.instance_id,
                "role": state.config.role,
                "url": state.url,
                "kv_endpoint": state.kv_endpoint,
                "model": model,
                "kv_layout": state.layout_fingerprint,
                "load": MessageToDict(
                    state.load_report(),
                    preserving_proto_field_name=True,
                    always_print_fields_with_no_presence=True,
                ),
            }
        )

    app.router.add_post("/v1/completions", completion.completions)
    app.router.add_post("/v1/chat/completions", completion.chat)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/health", health)
    app.router.add_get("/version", version)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_get("/sim/requests", get_requests)
    app.router.add_delete("/sim/requests", clear_requests)
    app.router.add_get("/sim/transfers", transfers)
    app.router.add_get("/sim/faults", get_faults)
    app.router.add_post("/sim/faults", set_faults)
    app.router.add_get("/sim/state", sim_state)
    app.router.add_get("/sim/stats", stats)
    app.router.add_post("/reset_prefix_cache", reset_prefix_cache)
    return app
