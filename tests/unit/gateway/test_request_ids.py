"""X-Request-Id: kept when given and sane, generated otherwise, refused when unusable."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx

from pdplane.gateway.testing import running_gateway
from tests.unit.gateway.conftest import (
    MODEL,
    VIEW,
    FakeScheduler,
    Handler,
    good_prefill,
    sse_decode,
)

Serve = Callable[[Handler], Awaitable[str]]
BODY = {"model": MODEL, "prompt": "hi", "max_tokens": 3}


async def test_request_ids(serve: Serve) -> None:
    pair = (await serve(good_prefill), await serve(sse_decode))
    sched = FakeScheduler([pair, pair, pair, pair])
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            kept = await client.post("/v1/completions", json=BODY, headers={"X-Request-Id": "r-1"})
            assert (kept.status_code, kept.headers["x-request-id"]) == (200, "r-1")
            first = (await client.post("/v1/completions", json=BODY)).headers["x-request-id"]
            second = (await client.post("/v1/completions", json=BODY)).headers["x-request-id"]
            assert first.startswith("pdp-") and second.startswith("pdp-") and first != second
            long = await client.post(
                "/v1/completions", json=BODY, headers={"X-Request-Id": "x" * 257}
            )
            assert long.status_code == 400 and "longer than 256" in long.text
            tab = await client.post("/v1/completions", json=BODY, headers={"X-Request-Id": "a\tb"})
            assert tab.status_code == 400 and "control characters" in tab.text
    assert [entry for entry in sched.log if entry[0] == "schedule"] == [("schedule", [])] * 3
