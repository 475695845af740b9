"""A decision without prefill: the client's original request goes straight to decode."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest
from aiohttp import web

from pdplane.gateway.testing import running_gateway
from tests.unit.gateway.conftest import MODEL, VIEW, FakeScheduler, Handler

Serve = Callable[[Handler], Awaitable[str]]


@pytest.mark.parametrize("dispatch", ["sequential", "concurrent"])
@pytest.mark.parametrize("stream", [False, True])
async def test_no_prefill_sends_the_original_request_to_decode_only(
    serve: Serve, dispatch: str, stream: bool
) -> None:
    seen: list[bytes] = []

    async def decode(request: web.Request) -> web.StreamResponse:
        seen.append(await request.read())
        if not stream:
            return web.json_response({"choices": [{"text": "local"}]})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"text":"local"}]}\n\ndata: [DONE]\n\n')
        return resp

    sched = FakeScheduler([("", await serve(decode))])
    body: dict[str, Any] = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 3, "stream": stream}
    raw = json.dumps(body).encode()
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW, dispatch=dispatch) as url:
        async with httpx.AsyncClient(timeout=10) as client:
            r = await client.post(
                f"{url}/v1/completions", content=raw, headers={"content-type": "application/json"}
            )
    assert r.status_code == 200
    assert "local" in r.text
    if stream:
        # a stream's decode also streams its token ids: what continuing it on another decode
        # needs, should this one be lost (docs/migration.md)
        raw = raw[:-1] + b',"return_token_ids":true}'
    assert seen == [raw]  # byte for byte otherwise: no kv_transfer_params, nothing rewritten
    assert sched.log[-1] == ("release", "success")
