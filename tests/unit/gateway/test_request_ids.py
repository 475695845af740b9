"""X-Request-Id: kept when given and sane, generated otherwise, refused when unusable."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import httpx

from pdplane.gateway.testing import running_gateway
from pdplane.scheduler import Decision, Outcome, RequestFeatures
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


class _RecordingScheduler(FakeScheduler):
    """Also records the request ids of Schedule and Release."""

    def __init__(self, pairs: list[tuple[str, str]]) -> None:
        super().__init__(pairs)
        self.scheduled: list[str] = []
        self.released: list[str] = []

    async def schedule(self, features: RequestFeatures) -> Decision:
        self.scheduled.append(features.request_id)
        return await super().schedule(features)

    def release_nowait(self, request_id: str, outcome: Outcome) -> None:
        self.released.append(request_id)
        super().release_nowait(request_id, outcome)


async def test_a_repeated_client_id_is_still_counted_once_per_request(serve: Serve) -> None:
    pair = (await serve(good_prefill), await serve(sse_decode))
    sched = _RecordingScheduler([pair] * 10)
    stream = {**BODY, "stream": True}
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW) as url:
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            answers = await asyncio.gather(
                *(
                    client.post("/v1/completions", json=stream, headers={"X-Request-Id": "same"})
                    for _ in range(10)
                )
            )
    assert [(r.status_code, r.headers["x-request-id"]) for r in answers] == [(200, "same")] * 10
    # In-flight identity is the gateway's: ten distinct ids scheduled, each released once.
    assert len(set(sched.scheduled)) == 10, sched.scheduled
    assert all(rid.startswith("same-pdp-") for rid in sched.scheduled)
    assert sorted(sched.released) == sorted(sched.scheduled)
