"""Relay failure handling against scripted fakes (scheduler and instances)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable

import httpx
import pytest
from aiohttp import web

from pdplane.gateway.testing import running_gateway
from pdplane.launch.ports import free_port_run
from pdplane.scheduler import Decision, RequestFeatures, SchedulerBusy, SchedulerUnavailable
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


async def _post(url: str, body: dict[str, object], **kw: object) -> httpx.Response:
    async with httpx.AsyncClient(timeout=10) as client:
        return await client.post(f"{url}/v1/completions", json=body, **kw)  # type: ignore[arg-type]


async def _silent(request: web.Request) -> web.StreamResponse:
    await request.read()
    await asyncio.sleep(30)
    raise AssertionError("unreachable")


async def test_prefill_without_kv_params_is_502_naming_prefill(serve: Serve) -> None:
    async def bare(request: web.Request) -> web.StreamResponse:
        return web.json_response({"choices": []})

    sched = FakeScheduler([(await serve(bare), await serve(sse_decode))])
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW) as url:
        r = await _post(url, BODY)
    assert r.status_code == 502
    assert (
        "prefill instance p returned no usable kv_transfer_params" in r.json()["error"]["message"]
    )
    assert sched.log[-1] == ("release", "failed")


async def test_prefill_4xx_passes_through_and_5xx_is_502(serve: Serve) -> None:
    error = b'{"error": {"message": "prompt too long", "type": "BadRequestError", "code": 400}}'

    async def refuse(request: web.Request) -> web.StreamResponse:
        return web.Response(body=error, status=400, content_type="application/json")

    async def crash(request: web.Request) -> web.StreamResponse:
        return web.Response(text="boom", status=500)

    decode = await serve(sse_decode)
    sched = FakeScheduler([(await serve(refuse), decode), (await serve(crash), decode)])
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW) as url:
        r = await _post(url, BODY)
        assert (r.status_code, r.content) == (400, error)
        r = await _post(url, BODY)
        assert r.status_code == 502
        assert r.json()["error"]["message"] == "prefill instance p answered 500: boom"


@pytest.mark.parametrize("leg", ["prefill", "decode"])
async def test_a_4xx_that_is_not_json_becomes_an_openai_error_naming_the_instance(
    serve: Serve, leg: str
) -> None:
    # A proxy or an engine's framework in front of the instance may answer 4xx in plain text
    # or HTML: the client still gets an OpenAI-style JSON error, with that status.
    async def refuse(request: web.Request) -> web.StreamResponse:
        await request.read()
        return web.Response(text="413 Request Entity Too Large", status=413)

    prefill = await serve(refuse if leg == "prefill" else good_prefill)
    decode = await serve(refuse if leg == "decode" else sse_decode)
    sched = FakeScheduler([(prefill, decode)])
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW) as url:
        r = await _post(url, BODY)
    assert r.status_code == 413
    assert r.headers["content-type"] == "application/json"
    error = r.json()["error"]
    name = "p" if leg == "prefill" else "d"
    assert error["message"] == f"{leg} instance {name} answered 413: 413 Request Entity Too Large"
    assert error["code"] == 413


async def test_silent_prefill_is_504(serve: Serve) -> None:
    sched = FakeScheduler([(await serve(_silent), await serve(sse_decode))])
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW, upstream_timeout_s=0.3) as url:
        r = await _post(url, BODY)
    assert r.status_code == 504
    assert "prefill instance p did not answer within 0.3 s" in r.json()["error"]["message"]
    assert sched.log[-1] == ("release", "failed")


@pytest.mark.parametrize("ending", ["stall", "no_done"])
async def test_stream_ending_badly_gives_one_error_event(serve: Serve, ending: str) -> None:
    async def bad_stream(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choi')  # partial event
        if ending == "stall":
            await asyncio.sleep(30)
        return resp

    sched = FakeScheduler([(await serve(good_prefill), await serve(bad_stream))])
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW, upstream_timeout_s=0.3) as url:
        r = await _post(url, {**BODY, "stream": True})
    events = r.content[:-2].split(b"\n\n")
    assert events[0] == b'data: {"choices":[{"text":"a"}]}'  # the partial event is not relayed
    assert len(events) == 3 and events[2] == b"data: [DONE]"  # as vLLM ends a failed request
    error = json.loads(events[1][len(b"data: ") :])["error"]
    assert error["code"] == (504 if ending == "stall" else 502)
    assert sched.log[-1] == ("release", "failed")


async def test_unreachable_decode_retries_on_another_pair_after_releasing(serve: Serve) -> None:
    prefill, decode = await serve(good_prefill), await serve(sse_decode)
    dead = f"http://127.0.0.1:{free_port_run()}"
    sched = FakeScheduler([(prefill, dead), (prefill, decode)])
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW) as url:
        r = await _post(url, {**BODY, "stream": True})
        for _ in range(100):  # the success Release runs in the background
            if sched.log[-1][0] == "release":
                break
            await asyncio.sleep(0.01)
    assert r.status_code == 200 and r.content.endswith(b"data: [DONE]\n\n")
    assert sched.log == [
        ("schedule", []),
        ("release", "failed"),  # before the retry reuses the request id
        ("schedule", ["d"]),
        ("release", "success"),
    ]


async def test_no_retry_left_is_502_and_max_retries_zero_does_not_retry(serve: Serve) -> None:
    dead = f"http://127.0.0.1:{free_port_run()}"
    sched = FakeScheduler([(dead, dead), SchedulerUnavailable("no prefill instance: excluded")])
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW) as url:
        r = await _post(url, BODY)
    assert r.status_code == 502  # the failure, not the scheduler's "nothing left"
    assert "prefill instance p unreachable" in r.json()["error"]["message"]

    sched = FakeScheduler([(dead, dead)])
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW, max_retries=0) as url:
        r = await _post(url, BODY)
    assert r.status_code == 502
    assert [e for e in sched.log if e[0] == "schedule"] == [("schedule", [])]


async def test_scheduler_errors_map_to_503_and_400() -> None:
    sched = FakeScheduler(
        [SchedulerUnavailable("no prefill instance for model 'm'"), ValueError("bad length")]
    )
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW) as url:
        r = await _post(url, BODY)
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "no prefill instance for model 'm'"
        r = await _post(url, BODY)
        assert r.status_code == 400


async def test_api_key_guards_v1_but_not_health(serve: Serve) -> None:
    sched = FakeScheduler([(await serve(good_prefill), await serve(sse_decode))])
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW, api_key="k1,k2") as url:
        r = await _post(url, BODY)
        assert r.status_code == 401 and r.json()["error"]["type"] == "AuthenticationError"
        r = await _post(url, BODY, headers={"Authorization": "Bearer nope"})
        assert r.status_code == 401
        async with httpx.AsyncClient() as client:
            assert (await client.get(f"{url}/v1/models")).status_code == 401
            assert (await client.get(f"{url}/health")).status_code == 200
        r = await _post(url, {**BODY, "stream": True}, headers={"Authorization": "Bearer k2"})
        assert r.status_code == 200
    assert sched.log[0] == ("schedule", [])  # only the authorized request was scheduled


async def _leave_and_wait_for_the_release(url: str, sched: FakeScheduler) -> None:
    """Posts a completion, gives up waiting for the answer after 0.3 s (connecting may take
    longer on a busy machine), then waits (bounded, 10 s) until the gateway released it as
    cancelled."""
    with pytest.raises(httpx.ReadTimeout):
        async with httpx.AsyncClient(timeout=httpx.Timeout(10, read=0.3)) as client:
            await client.post(f"{url}/v1/completions", json=BODY)
    for _ in range(1000):
        if sched.log[-1] == ("release", "cancelled"):
            return
        await asyncio.sleep(0.01)


async def test_client_leaving_during_schedule_still_releases(serve: Serve) -> None:
    sched = FakeScheduler([(await serve(good_prefill), await serve(sse_decode))], delay_s=5)
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW) as url:
        await _leave_and_wait_for_the_release(url, sched)
    assert sched.log == [("schedule", []), ("release", "cancelled")]


class _BusyThenSlow(FakeScheduler):
    """Refuses the first Schedule for capacity; the queue head's next one takes 5 s (a
    decision the scheduler may count before the client leaves)."""

    async def schedule(self, features: RequestFeatures) -> Decision:
        if len(self.log) == 1:
            self.delay_s = 5
        return await super().schedule(features)


async def test_client_leaving_while_its_queued_schedule_is_asked_still_releases(
    serve: Serve,
) -> None:
    pair = (await serve(good_prefill), await serve(sse_decode))
    sched = _BusyThenSlow([SchedulerBusy("no KV room"), pair])
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW, queue_timeout_s=30) as url:
        await _leave_and_wait_for_the_release(url, sched)
    assert sched.log == [("schedule", []), ("schedule", []), ("release", "cancelled")]


async def test_unknown_paths_methods_and_huge_request_ids_get_openai_errors() -> None:
    sched = FakeScheduler([])
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW) as url:
        async with httpx.AsyncClient() as client:
            r = await client.get(f"{url}/v1/completions")
            assert r.status_code == 405
            assert r.json()["error"] == {
                "message": "Method Not Allowed",
                "type": "MethodNotAllowedError",
                "param": None,
                "code": 405,
            }
            r = await client.post(f"{url}/v1/nothing", json=BODY)
            assert r.status_code == 404 and r.json()["error"]["code"] == 404
        r = await _post(url, BODY, headers={"X-Request-Id": "x" * 257})
        assert r.status_code == 400 and "X-Request-Id" in r.json()["error"]["message"]
    assert sched.log == []


async def test_upstream_api_key_reaches_both_legs(serve: Serve) -> None:
    seen: list[str | None] = []

    def recording(handler: Handler) -> Handler:
        async def wrapped(request: web.Request) -> web.StreamResponse:
            seen.append(request.headers.get("Authorization"))
            return await handler(request)

        return wrapped

    prefill, decode = await serve(recording(good_prefill)), await serve(recording(sse_decode))
    sched = FakeScheduler([(prefill, decode)])
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW, upstream_api_key="up") as url:
        r = await _post(url, {**BODY, "stream": True})
    assert r.status_code == 200
    assert seen == ["Bearer up", "Bearer up"]


async def test_a_stream_silent_past_the_idle_timeout_ends_in_one_error_event(
    serve: Serve,
) -> None:
    # --upstream-timeout-s stays long (300 s by default); decode's silence between chunks is
    # bounded on its own by --stream-idle-timeout-s.
    async def stalled(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices":[{"text":"a"}]}\n\n')
        await asyncio.sleep(60)
        return resp

    sched = FakeScheduler([(await serve(good_prefill), await serve(stalled))])
    with running_gateway(
        scheduler_port=sched, fleet=lambda: VIEW, upstream_timeout_s=60, stream_idle_timeout_s=0.3
    ) as url:
        r = await _post(url, {**BODY, "stream": True})
        for _ in range(100):  # the Release runs in the background
            if sched.log[-1][0] == "release":
                break
            await asyncio.sleep(0.01)
    events = r.content[:-2].split(b"\n\n")
    assert events[0] == b'data: {"choices":[{"text":"a"}]}'
    error = json.loads(events[1][len(b"data: ") :])["error"]
    assert (len(events), error["code"], events[2]) == (3, 504, b"data: [DONE]")
    assert "sent nothing for 0.3 s" in error["message"]
    assert sched.log[-1] == ("release", "failed")


async def test_health_says_scheduler_unreachable() -> None:
    address = f"127.0.0.1:{free_port_run()}"  # nothing listens there
    with running_gateway(scheduler=address, fleet=lambda: VIEW) as url:
        async with httpx.AsyncClient() as client:
            deadline = time.monotonic() + 5.0
            while (r := await client.get(f"{url}/health")).status_code == 200:
                assert time.monotonic() < deadline, "/health never noticed the scheduler gone"
                await asyncio.sleep(0.05)
            assert r.status_code == 503
            assert r.json()["reason"] == f"scheduler unreachable at {address}"
            assert (await client.get(f"{url}/ping")).status_code == 503


async def test_the_scheduler_is_told_which_requests_take_their_first_token_from_prefill(
    serve: Serve,
) -> None:
    class Recording(FakeScheduler):
        def __init__(self, pairs: list[tuple[str, str]]) -> None:
            super().__init__(pairs)
            self.features: list[RequestFeatures] = []

        async def schedule(self, features: RequestFeatures) -> Decision:
            self.features.append(features)
            return await super().schedule(features)

    pair = (await serve(good_prefill), await serve(sse_decode))
    sched = Recording([pair, pair])
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW) as url:
        await _post(url, {**BODY, "stream": True})  # streamed: the first token from prefill
        await _post(url, BODY)  # not streamed: the usual path
    assert [f.first_token_from_prefill for f in sched.features] == [True, False]
