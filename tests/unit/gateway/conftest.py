"""In-process fakes for the relay's unit tests: a scripted scheduler and tiny HTTP instances."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any

import pytest
from aiohttp import web

from pdplane.core.kv_params import DecodeRequestParams, PrefillRequestParams
from pdplane.gateway.fleet_view import FleetView, ModelState
from pdplane.gateway.validation import CHAT, Endpoint, parse_request
from pdplane.scheduler import Decision, Outcome, RequestFeatures
from pdplane.v1 import scheduler_pb2

MODEL = "m"
VIEW = FleetView(models={MODEL: ModelState(1, 1, True, 4096, 0)}, ready=True)

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class FakeScheduler:
    """Answers Schedule with scripted pairs (or raises), records every call in `log`.

    A pair's prefill URL "" is a decision without prefill (decode computes the prompt)."""

    def __init__(self, pairs: Iterable[tuple[str, str] | Exception], delay_s: float = 0) -> None:
        self.pairs = list(pairs)
        self.delay_s = delay_s
        self.log: list[tuple[str, Any]] = []

    async def schedule(self, features: RequestFeatures) -> Decision:
        self.log.append(("schedule", sorted(features.exclude_instance_ids)))
        await asyncio.sleep(self.delay_s)
        nxt = self.pairs.pop(0)
        if isinstance(nxt, Exception):
            raise nxt
        p, d = nxt
        return Decision(
            prefill=(
                scheduler_pb2.InstanceRef(instance_id="p", url=p, kv_endpoint="127.0.0.1:1")
                if p
                else None
            ),
            decode=scheduler_pb2.InstanceRef(instance_id="d", url=d),
        )

    async def release(self, request_id: str, outcome: Outcome) -> bool:
        self.release_nowait(request_id, outcome)
        return True

    def release_nowait(self, request_id: str, outcome: Outcome) -> None:
        self.log.append(("release", str(outcome)))

    def problem(self) -> str | None:
        return None

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def kv_answer(request_id: str) -> dict[str, Any]:
    """A prefill answer carrying valid kv_transfer_params."""
    params = DecodeRequestParams(request_id, "t1", "p", "127.0.0.1:1", [0], 3, "L1", "tcp", 1)
    return {"choices": [{"text": "x"}], "kv_transfer_params": params.to_dict()}


async def good_prefill(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    rid = PrefillRequestParams.from_dict(body["kv_transfer_params"]).request_id
    return web.json_response(kv_answer(rid))


async def sse_decode(request: web.Request) -> web.StreamResponse:
    await request.read()
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(3):
        await resp.write(b'data: {"choices":[{"text":"t%d"}]}\n\n' % i)
    await resp.write(b"data: [DONE]\n\n")
    return resp


@pytest.fixture
async def serve() -> AsyncIterator[Callable[[Handler], Awaitable[str]]]:
    """Starts a tiny HTTP instance answering both OpenAI paths with `handler`; returns its URL."""
    runners: list[web.AppRunner] = []

    async def start(handler: Handler) -> str:
        app = web.Application()
        app.router.add_post("/v1/completions", handler)
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app, shutdown_timeout=0.1)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        return f"http://127.0.0.1:{port}"

    yield start
    await asyncio.gather(*(r.cleanup() for r in runners))


def parsed(endpoint: Endpoint, **body: Any) -> Any:
    """A streamed request to model "m" on `endpoint` (prompt or chat message "hi"), with
    `body`'s fields over those, as `parse_request` gives it."""
    base: dict[str, Any] = {"model": "m", "stream": True}
    if endpoint == CHAT:
        base["messages"] = [{"role": "user", "content": "hi"}]
    else:
        base["prompt"] = "hi"
    return parse_request(endpoint, json.dumps({**base, **body}).encode())
