"""Must show: a full fleet queues requests as `vllm serve` does instead of answering 503 at once.

A decode whose KV cache holds 5 requests gets 16 at a time: every request completes (the
ones without room wait for it, in the flow control's in-flight budget by default, else in the
admission queue for KV room). A request whose room never comes gets 503 after
`--queue-timeout-s`, naming the KV room and the wait; one past `--max-queued-requests` gets
503 at once; a client that leaves while queued leaves nothing behind in the scheduler.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from tests.integration.gateway.conftest import MODEL, Stack, wait_for
from tests.integration.gateway.helpers import SHORT_BODY, hold_decode, open_request
from tests.support.loadgen import completion_burst


def _metric(stack: Stack, name: str) -> float:
    for line in httpx.get(f"{stack.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise AssertionError(f"{name} not exported")


def _reported(stack: Stack) -> bool:
    """Whether every instance's load report reached the scheduler (the KV guard needs it)."""
    return all(c.total_kv_blocks > 0 for c in stack.service.view.candidates(MODEL))


def _small_fleet(stack: Stack) -> None:
    # 8 blocks: the long request (6-7) leaves no room for a short one (4).
    sims = stack.sims(
        ["prefill", "decode"], kv_blocks=8, block_size=128, itl_ms=50, max_model_len=1024
    )
    stack.wait_ready(sims)
    wait_for(lambda: _reported(stack), 5.0, "the first load reports")


@pytest.mark.parametrize("budget", [1.0, 0.0], ids=["flow-budget", "kv-room-queue"])
def test_sixteen_at_a_time_on_a_five_request_decode_all_complete(  # type: ignore[no-untyped-def]
    stack_factory, budget: float
) -> None:
    # With the in-flight budget (the default) requests wait for their turn at the gateway;
    # without it (--inflight-budget 0) the scheduler's KV-room refusals make them wait.
    stack: Stack = stack_factory(embedded=True, inflight_budget=budget)
    sims = stack.sims(
        ["prefill", "decode"], kv_blocks=20, block_size=128, itl_ms=10, max_model_len=1024
    )
    stack.wait_ready(sims)
    wait_for(lambda: _reported(stack), 5.0, "the first load reports")
    statuses = asyncio.run(completion_burst(stack.url, SHORT_BODY, 48, 16))
    assert statuses == {200: 48}
    if budget:
        waits = _metric(
            stack,
            'pdplane_gateway_flow_wait_seconds_bucket{le="0.005",model="sim-model",priority="0",'
            'tenant="default"}',
        )
        assert waits < 48  # some waited for their turn
        assert _metric(stack, 'pdplane_gateway_flow_inflight_tokens{model="sim-model"}') == 0
    else:
        assert _metric(stack, "pdplane_gateway_queue_wait_seconds_count") > 0  # some waited
    assert _metric(stack, "pdplane_gateway_queued_requests") == 0
    wait_for(lambda: stack.scheduler_inflight() == 0, 2.0, "scheduler in-flight count 0")


@pytest.mark.parametrize(
    ("mode", "stream"),
    [("stream", True), ("unary", True), ("embedded", True), ("stream", False), ("embedded", False)],
)
def test_room_that_never_comes_is_a_503_after_the_queue_timeout(  # type: ignore[no-untyped-def]
    stack_factory, mode: str, stream: bool
) -> None:
    stack: Stack = stack_factory(
        queue_timeout_s=0.5,
        schedule_stream=mode == "stream",
        embedded=mode == "embedded",
        inflight_budget=0,  # the scheduler's KV-room refusal, not the gateway's budget
    )
    _small_fleet(stack)
    holder = hold_decode(stack)
    try:
        started = time.monotonic()
        body = {**SHORT_BODY, "stream": stream}
        r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10)
        waited = time.monotonic() - started
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert "no KV room for 516 tokens" in message
        assert "waited" in message and "--queue-timeout-s 0.5" in message
        assert waited >= 0.5
        assert _metric(stack, 'pdplane_gateway_queue_refusals_total{reason="timeout"}') == 1
    finally:
        holder.close()
    wait_for(lambda: stack.scheduler_inflight() == 0, 2.0, "scheduler in-flight count 0")


@pytest.mark.parametrize("embedded", [False, True], ids=["remote", "embedded"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_a_client_leaving_the_queue_leaves_nothing_behind(  # type: ignore[no-untyped-def]
    stack_factory, embedded: bool, stream: bool
) -> None:
    stack: Stack = stack_factory(embedded=embedded, inflight_budget=0)
    _small_fleet(stack)
    holder = hold_decode(stack)
    queued = open_request(stack.url, "/v1/completions", {**SHORT_BODY, "stream": stream})
    wait_for(lambda: _metric(stack, "pdplane_gateway_queued_requests") == 1, 5.0, "1 queued")
    queued.close()
    wait_for(lambda: _metric(stack, "pdplane_gateway_queued_requests") == 0, 2.0, "0 queued")
    assert stack.scheduler_inflight() == 1  # the holder only: the leaver was never scheduled
    holder.close()
    wait_for(lambda: stack.scheduler_inflight() == 0, 2.0, "scheduler in-flight count 0")
    # Room has come: a late Schedule of the leaver would be counted now.
    r = httpx.post(f"{stack.url}/v1/completions", json=SHORT_BODY, timeout=10)
    assert r.status_code == 200
    wait_for(lambda: stack.scheduler_inflight() == 0, 2.0, "scheduler in-flight count 0")
    assert _metric(stack, "pdplane_gateway_inflight_requests") == 0


def test_a_request_past_the_queue_cap_gets_503_at_once(stack_factory) -> None:  # type: ignore[no-untyped-def]
    stack: Stack = stack_factory(max_queued_requests=1, embedded=True, inflight_budget=0)
    _small_fleet(stack)
    holder = hold_decode(stack)
    queued = open_request(stack.url, "/v1/completions", SHORT_BODY)
    try:
        wait_for(lambda: _metric(stack, "pdplane_gateway_queued_requests") == 1, 5.0, "queued")
        r = httpx.post(f"{stack.url}/v1/completions", json=SHORT_BODY, timeout=10)
        assert r.status_code == 503
        message = r.json()["error"]["message"]
        assert "no KV room" in message and "not queued: 1 requests already wait" in message
        assert _metric(stack, 'pdplane_gateway_queue_refusals_total{reason="queue_full"}') == 1
    finally:
        queued.close()
        holder.close()
    wait_for(lambda: stack.scheduler_inflight() == 0, 2.0, "scheduler in-flight count 0")


def test_a_request_for_n_choices_takes_n_answers_of_the_budget(stack: Stack) -> None:
    # vLLM holds the prompt once (shared by the choices) and each choice's answer: a request
    # for 3 choices of 100 tokens needs 3 x 100 answer tokens of KV, not 100.
    sims = stack.sims(["prefill", "decode"], itl_ms=200, max_model_len=1024)
    stack.wait_ready(sims)
    body = {"model": MODEL, "prompt": [7] * 20, "max_tokens": 100, "n": 3, "stream": True}
    sock = open_request(stack.url, "/v1/completions", body)
    try:
        buf = b""
        while b"data: " not in buf:  # admitted and streaming
            chunk = sock.recv(65536)
            assert chunk, f"connection closed early: {buf!r}"
            buf += chunk
        tokens = _metric(stack, f'pdplane_gateway_flow_inflight_tokens{{model="{MODEL}"}}')
        assert tokens == 20 + 3 * 100
    finally:
        sock.close()
