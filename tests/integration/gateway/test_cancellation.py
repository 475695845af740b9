"""Must show: a client that goes away cancels both legs within 1 s and leaves nothing in flight.

Clients here are raw sockets so that "going away" is exactly a closed TCP connection.
"""

from __future__ import annotations

import socket
import time

import pytest

from pdplane.sim.testing import RunningSims
from tests.integration.gateway.conftest import MODEL, Stack, wait_for
from tests.integration.gateway.helpers import open_request


def _read_until(sock: socket.socket, needle: bytes, count: int) -> bytes:
    buf = b""
    while buf.count(needle) < count:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed early: {buf!r}"
        buf += chunk
    return buf


def _cancelled(sims: RunningSims, index: int) -> bool:
    records = sims[index].records()
    return bool(records) and records[-1]["cancelled"]


def _assert_cleaned_up(stack: Stack) -> None:
    wait_for(lambda: stack.scheduler_inflight() == 0, 2.0, "scheduler in-flight count 0")
    wait_for(
        lambda: "pdplane_gateway_cancellations_total 1.0" in _metrics(stack),
        2.0,
        "the cancellation to be counted",
    )
    assert "pdplane_gateway_inflight_requests 0.0" in _metrics(stack)


def _metrics(stack: Stack) -> str:
    import httpx

    return httpx.get(f"{stack.url}/metrics", timeout=5).text


def test_disconnect_mid_stream_cancels_decode(stack: Stack) -> None:
    sims = stack.sims(["prefill", "decode"], itl_ms=50)
    stack.wait_ready(sims)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 400, "stream": True}
    sock = open_request(stack.url, "/v1/completions", body)
    _read_until(sock, b"data: ", 2)
    assert stack.scheduler_inflight() == 1
    sock.close()
    closed = time.monotonic()
    wait_for(lambda: _cancelled(sims, 1), 1.0, "decode to see its request cancelled")
    assert time.monotonic() - closed < 1.0
    # Prefill's part ended normally: it answered, and decode pulled (completed) its KV.
    [prefill] = sims[0].records()
    assert prefill["finished"] and not prefill["cancelled"]
    assert sims[0].held_transfers() == []
    _assert_cleaned_up(stack)


@pytest.mark.parametrize("dispatch", ["sequential", "concurrent"])
def test_disconnect_during_prefill_cancels_prefill(stack_factory, dispatch: str) -> None:  # type: ignore[no-untyped-def]
    stack = stack_factory(dispatch=dispatch)
    sims = stack.sims(["prefill", "decode"], ttft_per_token_ms=200)  # "hello" -> >= 200 ms
    stack.wait_ready(sims)
    body = {"model": MODEL, "prompt": "hello " * 20, "max_tokens": 5, "stream": True}
    sock = open_request(stack.url, "/v1/completions", body)
    wait_for(lambda: len(sims[0].records()) == 1, 2.0, "prefill to receive the request")
    sock.close()
    wait_for(lambda: _cancelled(sims, 0), 1.0, "prefill to see its request cancelled")
    # Decode never got a complete request (concurrent dispatch had only sent part of it).
    assert sims[1].records() == []
    _assert_cleaned_up(stack)


def test_disconnect_while_decode_pulls_frees_prefill_kv(stack: Stack) -> None:
    sims = stack.sims(["prefill", "decode"], kv_transfer_ms_per_token=500)
    stack.wait_ready(sims)
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "stream": True}
    sock = open_request(stack.url, "/v1/completions", body)
    wait_for(lambda: len(sims[1].records()) == 1, 2.0, "decode to receive the request")
    [prefill] = sims[0].records()
    transfer_id = prefill["kv"]["transfer_id"]
    assert sims[0].held_transfers() == [transfer_id]
    sock.close()
    wait_for(lambda: _cancelled(sims, 1), 1.0, "decode to see its request cancelled")
    wait_for(lambda: sims[0].held_transfers() == [], 1.0, "prefill to free the KV")
    [freed] = sims[0].freed_transfers()
    assert freed["transfer_id"] == transfer_id
    assert freed["reason"].startswith("aborted")
    _assert_cleaned_up(stack)


@pytest.mark.parametrize(
    ("dispatch", "stream"),
    [("sequential", True), ("concurrent", True), ("sequential", False)],
    ids=["sequential", "concurrent", "not-streamed"],
)
def test_a_client_leaving_after_prefill_finished_frees_its_kv(
    stack_factory,  # type: ignore[no-untyped-def]
    dispatch: str,
    stream: bool,
) -> None:
    # Prefill finished (it holds the KV for decode) but its answer has not reached the
    # gateway when the client leaves: vLLM aborts nothing then (the request is over), so only
    # the gateway can free the KV, by the transfer id it gave prefill.
    stack = stack_factory(dispatch=dispatch)
    sims = stack.sims(["prefill", "decode"])
    stack.wait_ready(sims)
    sims[0].set_faults(fail_request_prefix="late-", fail_mode="stall")  # held, no answer
    body = {"model": MODEL, "prompt": "hello", "max_tokens": 5, "stream": stream}
    sock = open_request(stack.url, "/v1/completions", body, "late-1")
    wait_for(lambda: len(sims[0].held_transfers()) == 1, 2.0, "prefill to hold the KV")
    [held] = sims[0].held_transfers()
    sock.close()
    wait_for(lambda: sims[0].held_transfers() == [], 2.0, "the gateway to free prefill's KV")
    [freed] = sims[0].freed_transfers()
    assert freed["transfer_id"] == held and freed["reason"] == "aborted: cancelled"
    assert sims[1].records() == [] or sims[1].records()[0]["cancelled"]
    _assert_cleaned_up(stack)
    wait_for(lambda: stack.background_tasks() == 0, 2.0, "no AbortTransfer still running")
