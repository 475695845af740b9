"""vLLM's read-only routes through the gateway, answered by an instance of the model.

Clients of `vllm serve` call more than the two generation endpoints: `vllm bench serve` aligns
its prompts with `POST /tokenize` and `POST /detokenize` and, without `--model`, takes the model
and its tokenizer path from `GET /v1/models` (`root`); people ask `GET /version`. These answers
depend only on the model, so any SERVING instance of it gives them: the gateway forwards the
request (the body unchanged; the model from its `model` field, the default model when absent)
and relays status and body. `GET /v1/models` keeps the fleet's list (one entry per model, with
its largest `max_model_len`) and takes each entry's vLLM details (`root`, `permission`, ...)
from an instance of that model; an instance that does not answer leaves the registry's entry.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
from collections.abc import Callable
from typing import Any

from pdplane.gateway.errors import GatewayError, bad_gateway, gateway_timeout, not_found
from pdplane.gateway.fleet_view import FleetView
from pdplane.gateway.upstream import UpstreamClient, UpstreamTimeout, UpstreamUnreachable

__all__ = ["InstanceAnswer", "Passthrough"]

log = logging.getLogger(__name__)

#: Instances tried per request before 502 (a second one when the first is unreachable).
_ATTEMPTS = 2


class InstanceAnswer:
    """An instance's answer, relayed as is: status, body bytes and content type."""

    __slots__ = ("body", "content_type", "status")

    def __init__(self, status: int, body: bytes, content_type: str) -> None:
        self.status = status
        self.body = body
        self.content_type = content_type


class Passthrough:
    """Forwards read-only vLLM routes to an instance (see the module docstring).

    Args:
        fleet: returns the current FleetView (instance URLs per model).
        upstream: the gateway's pooled HTTP client.
        upstream_api_key: bearer token for the instances (vLLM started with `--api-key`).
        timeout_s: bound on one forwarded request (s).
    """

    def __init__(
        self,
        fleet: Callable[[], FleetView],
        upstream: UpstreamClient,
        upstream_api_key: str | None = None,
        timeout_s: float = 30.0,
    ) -> None:
        self._fleet = fleet
        self._upstream = upstream
        self._headers = {"content-type": "application/json"}
        if upstream_api_key:
            self._headers["authorization"] = f"Bearer {upstream_api_key}"
        self._timeout_s = timeout_s
        self._turn = itertools.count()
        self._roots: dict[str, str] = {}  # root path -> served model name, from `models()`

    def _urls(self, model: str | None) -> tuple[str, ...]:
        view = self._fleet()
        if model:
            state = view.models.get(model)
            if state is None:
                raise not_found(model)
            return state.urls
        return tuple(url for state in view.models.values() for url in state.urls)

    async def forward(
        self, method: str, path: str, body: bytes = b"", model: str | None = None
    ) -> InstanceAnswer:
        """`method path` (with `body` for POST) answered by an instance of `model` (default:
        the body's `model` field; any instance when neither names one).

        Raises:
            GatewayError: 404 for an unknown model, 503 when no instance serves it, 502 when
                none could be reached, 504 when the instance is silent past the timeout.
        """
        if model is None and body:
            model = _model_of(body)
            served = self._roots.get(model) if model else None
            if served is not None and model not in self._fleet().models:
                body, model = _with_model(body, served), served
        urls = self._urls(model)
        if not urls:
            raise GatewayError(503, f"no instance is serving {model or 'any model'}")
        first = next(self._turn)
        failures: list[str] = []
        for attempt in range(min(_ATTEMPTS, len(urls))):
            url = urls[(first + attempt) % len(urls)]
            try:
                resp = await self._upstream.open(
                    f"{url}{path}",
                    body,
                    self._headers,
                    read_timeout_s=self._timeout_s,
                    total_timeout_s=self._timeout_s,
                    method=method,
                )
                data = await self._upstream.read(resp)
            except UpstreamUnreachable as exc:
                failures.append(str(exc))
                continue
            except UpstreamTimeout as exc:
                raise gateway_timeout(str(exc)) from None
            content_type = resp.headers.get("content-type", "application/json")
            return InstanceAnswer(resp.status, data, content_type)
        raise bad_gateway(f"{path}: no instance reachable ({'; '.join(failures)})")

    async def models(self) -> dict[str, Any]:
        """The `GET /v1/models` body: the fleet's models with each one's vLLM details."""
        listing = self._fleet().models_list()
        entries = await asyncio.gather(*(self._details(m) for m in listing["data"]))
        return {**listing, "data": list(entries)}

    async def _details(self, entry: dict[str, Any]) -> dict[str, Any]:
        try:
            answer = await self.forward("GET", "/v1/models", model=entry["id"])
            if answer.status == 200:
                for model in json.loads(answer.body).get("data", []):
                    if model.get("id") == entry["id"]:
                        if isinstance(model.get("root"), str) and model["root"] != entry["id"]:
                            self._roots[model["root"]] = entry["id"]
                        return {**model, "max_model_len": entry["max_model_len"]}
        except (GatewayError, ValueError, AttributeError) as exc:
            log.info("no vLLM details for model %s: %s", entry["id"], exc)
        return entry


def _model_of(body: bytes) -> str | None:
    try:
        data = json.loads(body)
    except ValueError:
        return None  # the instance answers vLLM's own 400
    model = data.get("model") if isinstance(data, dict) else None
    return model if isinstance(model, str) and model else None


def _with_model(body: bytes, model: str) -> bytes:
    data = json.loads(body)  # parsed once already by `_model_of`: valid JSON object
    data["model"] = model
    return json.dumps(data, separators=(",", ":")).encode()
