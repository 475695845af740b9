"""Must show: upstream 4xx passed through, mid-stream failure, 503 naming the missing role,
unreachable instances retried on another pair."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from pdplane.sim.testing import RunningSims
from tests.integration.gateway.conftest import MODEL, Stack, wait_for

_TOO_LONG = {"model": MODEL, "prompt": "hello", "max_tokens": 5000}  # sims: max_model_len 4096


@pytest.mark.parametrize("stream", [False, True])
def test_decode_400_reaches_the_client_unchanged(
    pair: tuple[Stack, RunningSims], stream: bool
) -> None:
    stack, sims = pair
    r = httpx.post(f"{stack.url}/v1/completions", json={**_TOO_LONG, "stream": stream}, timeout=10)
    assert r.status_code == 400
    assert r.headers["content-type"].startswith("application/json")  # not an event stream
    error = r.json()["error"]
    assert error["code"] == 400 and "max_tokens" in error["message"]
    [decode] = sims[1].records()
    assert decode["status"] == 400
    # Decode refused before pulling: the gateway told prefill to free the KV it held.
    [prefill] = sims[0].records()
    transfer_id = prefill["kv"]["transfer_id"]
    wait_for(lambda: any(f["transfer_id"] == transfer_id for f in sims[0].freed_transfers()))
    assert sims[0].held_transfers() == []
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")


@pytest.mark.parametrize("embedded", [False, True], ids=["remote", "embedded"])
def test_decode_dying_mid_stream_gives_one_error_event_and_closes(
    stack_factory: Callable[..., Stack], embedded: bool
) -> None:
    # The only decode: the stream waits for one within --migration-timeout-s (a restart of it
    # would continue the stream), then one error event naming the lost decode and [DONE], as
    # vLLM ends a stream whose request failed.
    stack = stack_factory(embedded=embedded, migration_timeout_s=0.5)
    sims = stack.sims(["prefill", "decode"], itl_ms=1)
    stack.wait_ready(sims)
    sims[1].set_faults(fail_mode="drop", fail_after_tokens=2, fail_next=1)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 10, "stream": True}
    started = time.monotonic()
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        raw = r.read()  # returns: the gateway closed the stream
    assert time.monotonic() - started >= 0.5
    events = raw[:-2].split(b"\n\n")
    assert events[-1] == b"data: [DONE]" and raw.count(b"[DONE]") == 1
    errors = [e for e in events if b'"error"' in e]
    assert errors == [events[-2]]
    error = json.loads(events[-2][len(b"data: ") :])["error"]
    assert error["code"] == 504 and sims[1].instance_id in error["message"]
    assert "--migration-timeout-s 0.5" in error["message"]
    # the first token (prefill's, gateway.first_token), decode's two, the error event, [DONE]
    assert len(events) == 5
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")


@pytest.mark.parametrize("embedded", [False, True], ids=["remote", "embedded"])
def test_only_decode_registered_waits_then_503_naming_prefill_or_200_once_it_comes(
    stack_factory, embedded: bool, caplog: pytest.LogCaptureFixture
) -> None:  # type: ignore[no-untyped-def]
    # A model without a usable pair waits in the admission queue (--queue-timeout-s), then
    # gets 503 naming the missing side; a prefill registering meanwhile serves the request.
    stack: Stack = stack_factory(embedded=embedded, queue_timeout_s=0.5)
    decode = stack.sims(["decode"])
    wait_for(lambda: stack.health().json()["models"].get(MODEL) is not None)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
    with caplog.at_level(logging.WARNING, logger="pdplane.gateway.relay_endpoints"):
        started = time.monotonic()
        r = httpx.post(
            f"{stack.url}/v1/completions", json=body, headers={"X-Request-Id": "r503"}, timeout=10
        )
    assert r.status_code == 503 and time.monotonic() - started >= 0.5
    error = r.json()["error"]
    assert error["code"] == 503 and "prefill" in error["message"]
    assert "--queue-timeout-s 0.5" in error["message"]
    assert decode[0].records() == []
    # The refusal is in the gateway's log too, with the request id and the scheduler's reason
    # (an overloaded stack had answered 503s that no log of the stack showed).
    [logged] = [rec.getMessage() for rec in caplog.records if "r503" in rec.getMessage()]
    assert "503" in logged and error["message"] in logged

    patient: Stack = stack_factory(embedded=embedded, queue_timeout_s=30)
    patient.sims(["decode"])
    wait_for(lambda: patient.health().json()["models"].get(MODEL) is not None)
    answers: list[int] = []
    sender = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{patient.url}/v1/completions", json=body, timeout=30).status_code
        )
    )
    sender.start()
    time.sleep(0.5)  # it waits: no prefill yet
    assert not answers
    patient.sims(["prefill"])
    sender.join(30)
    assert answers == [200]


def test_unreachable_prefill_is_retried_on_another_pair(stack: Stack) -> None:
    sims = stack.sims(["prefill", "prefill", "decode"])
    stack.wait_ready(sims)
    sims[0].set_faults(fail_mode="drop", fail_next=100)
    sims[1].set_faults(fail_mode="drop", fail_next=100)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 3}
    # Whichever prefill the scheduler picks first drops the connection; the retry excludes it
    # and lands on the other one, which drops too: 502 after exactly one retry.
    r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 502
    assert "unreachable" in r.json()["error"]["message"]
    assert len(sims[0].records()) == len(sims[1].records()) == 1
    sims[1].set_faults(fail_next=0)
    r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10)
    assert r.status_code == 200, r.text
    metrics = httpx.get(f"{stack.url}/metrics").text
    assert 'pdplane_gateway_retries_total{side="prefill"}' in metrics
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")


@pytest.mark.parametrize("first_token", ["prefill", "decode"])
def test_decodes_error_event_before_done_is_released_failed(
    stack_factory: Callable[..., Stack], first_token: str
) -> None:
    # vLLM ends a stream whose request failed (here: decode's KV load) with an error event
    # and then [DONE]: the request failed all the same.
    stack = stack_factory(first_token=first_token)
    prefill = stack.sims(["prefill"], itl_ms=1, kv_hold_timeout_s=0.05)
    decode = stack.sims(
        ["decode"], itl_ms=1, transfer_latency_ms=400, kv_load_failure_policy="fail"
    )
    stack.wait_ready(prefill)
    stack.wait_ready(decode)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        events = [e for e in r.read().split(b"\n\n") if e]
    assert b"KV load failed" in events[-2] and events[-1] == b"data: [DONE]"
    assert decode[0].records()[0]["kv"]["result"].startswith("failed")
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")
    wait_for(lambda: stack.releases() == {"failed": 1.0}, what="released failed")
