"""A decode that cannot be reached after the first token from prefill went out: what is left
behind in every case. Another decode takes over (or the stream ends with one error event);
either way prefill's KV is freed, the scheduler's in-flight count returns to 0, each attempt
is released once with its outcome, and nothing else is held.

The dead decode is registered by hand (its lease kept alive) with addresses nobody listens on:
an instance that died before its lease ran out.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from pdplane.core import tracing
from pdplane.launch.ports import free_port_run
from pdplane.registry.client import RegistrationClient
from pdplane.sim.profiles import CostModel
from pdplane.sim.testing import RunningSims, expected_text
from pdplane.v1 import instance_pb2
from tests.integration.gateway.conftest import MODEL, Stack, wait_for
from tests.integration.gateway.helpers import FIRST_TOKEN_PROMPT as PROMPT
from tests.integration.gateway.helpers import (
    SHORT_BODY,
    client_stream,
    hold_decode,
    metric,
    open_request,
    sse_text,
    timed_events,
)
from tests.support.otlp import OtlpReceiver

DEAD = "a-dead-decode"


@contextlib.contextmanager
def _dead_decode(
    stack: Stack,
    like: RunningSims,
    kv_alive: bool = False,
    instance_id: str = DEAD,
) -> Iterator[None]:
    """A registered decode whose HTTP port (and KV endpoint, unless `kv_alive`: then the first
    sim's) refuses connections; the spec is otherwise `like[0]`'s, so it pairs with the sims."""
    dead = instance_pb2.InstanceSpec()
    dead.CopyFrom(like[0].instance.spec())
    dead.instance_id, dead.role = instance_id, instance_pb2.ROLE_DECODE
    dead.url = f"http://127.0.0.1:{free_port_run()}"
    if not kv_alive:
        dead.kv_endpoint = f"127.0.0.1:{free_port_run()}"
    client = RegistrationClient(stack.registry, dead, instance_pb2.LoadReport)
    client.start()
    try:
        assert client.wait_registered(5.0), client.last_error
        wait_for(
            lambda: instance_id in {c.instance_id for c in stack.service.view.candidates(MODEL)},
            what="the scheduler to see the dead decode",
        )
        yield
    finally:
        client.stop()


def _nothing_held(stack: Stack, prefill: RunningSims) -> None:
    wait_for(lambda: prefill[0].held_transfers() == [], what="prefill's KV freed")
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")
    wait_for(lambda: stack.background_tasks() == 0, what="no AbortTransfer still running")
    wait_for(lambda: stack.upstream_in_use() == 0, what="no upstream connection in use")


@pytest.mark.parametrize("embedded", [False, True], ids=["remote", "embedded"])
def test_no_other_decode_ends_the_stream_with_one_error_event(
    stack_factory: Callable[..., Stack], embedded: bool
) -> None:
    stack = stack_factory(embedded=embedded)
    prefill = stack.sims(["prefill"], itl_ms=1)
    with _dead_decode(stack, prefill):
        stack.wait_ready(prefill)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}
        _, events = timed_events(stack.url, body)
        assert len(events) == 3 and events[2] == b"data: [DONE]", events
        assert sse_text(events[:1]) == expected_text(PROMPT, 0, 1)
        error = json.loads(events[1][6:])["error"]
        assert error["code"] == 502 and DEAD in error["message"], error
        _nothing_held(stack, prefill)
        wait_for(lambda: stack.releases() == {"failed": 1.0}, what="released failed, once")
        (held,) = prefill[0].records()
        freed = [f["transfer_id"] for f in prefill[0].freed_transfers()]
        assert freed == [held["kv"]["transfer_id"]]


def _until_the_dead_one_is_picked(
    stack: Stack, decode: RunningSims, max_tokens: int = 5
) -> tuple[str, list[bytes], int]:
    """Sends streams until one was scheduled on the dead decode (decode is chosen by load,
    ties in turn); returns its prompt, its events and how many streams went before it."""
    for i in range(8):
        prompt = f"{PROMPT} {i}"
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
        before = metric(stack, 'pdplane_gateway_retries_total{side="decode"}')
        _, events = timed_events(stack.url, body)
        if metric(stack, 'pdplane_gateway_retries_total{side="decode"}') > before:
            return prompt, events, i
        assert sse_text(events) == expected_text(prompt, 0, max_tokens)
    pytest.fail("the dead decode was never chosen")
    raise AssertionError  # unreachable: for the type checker


def test_max_retries_0_ends_the_stream_and_frees_the_kv(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(max_retries=0)
    sims = stack.sims(["prefill", "decode"], itl_ms=1)
    with _dead_decode(stack, sims):
        stack.wait_ready(sims)
        for i in range(8):
            prompt = f"{PROMPT} {i}"
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "stream": True}
            _, events = timed_events(stack.url, body)
            if b'"error"' in events[-2]:
                break
        else:
            pytest.fail("the dead decode was never chosen")
        assert len(events) == 3 and sse_text(events[:1]) == expected_text(prompt, 0, 1)
        assert events[2] == b"data: [DONE]"
        error = json.loads(events[1][6:])["error"]
        assert error["code"] == 502 and DEAD in error["message"], error
        _nothing_held(stack, sims)
        expected = {"failed": 1.0, "success": float(i)} if i else {"failed": 1.0}
        wait_for(lambda: stack.releases() == expected, what="one failed, the rest succeeded")
        # no take-over was tried: decode saw no request without KV
        assert all("kv_transfer_params" in r["body"] for r in sims[1].records())
        assert metric(stack, 'pdplane_gateway_retries_total{side="decode"}') == 0


@pytest.mark.parametrize("kv_mode", ["pull", "push"])
@pytest.mark.parametrize("embedded", [False, True], ids=["remote", "embedded"])
def test_a_take_over_counts_once_and_leaves_nothing(
    stack_factory: Callable[..., Stack], embedded: bool, kv_mode: str
) -> None:
    stack = stack_factory(embedded=embedded)
    sims = stack.sims(["prefill", "decode"], itl_ms=1, kv_mode=kv_mode)
    with _dead_decode(stack, sims):
        stack.wait_ready(sims)
        prompt, events, before = _until_the_dead_one_is_picked(stack, sims)
        assert sse_text(events) == expected_text(prompt, 0, 5) and events[-1] == b"data: [DONE]"
        _nothing_held(stack, sims)
        wait_for(
            lambda: stack.releases() == {"failed": 1.0, "success": before + 1.0},
            what="one failed attempt, every request a success",
        )
        assert metric(stack, 'pdplane_gateway_retries_total{side="decode"}') == 1
        requests = before + 1
        assert metric(stack, "pdplane_gateway_ttft_seconds_count") == requests
        assert metric(stack, 'pdplane_gateway_first_tokens_total{source="prefill"}') == requests
        assert metric(stack, "pdplane_gateway_inflight_requests") == 0
        if kv_mode == "push":
            buffer = sims[1].instance.state.push_buffer
            assert buffer is not None and buffer.used_bytes == 0


def test_sixty_four_streams_with_one_of_two_decodes_dead(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    sims = stack.sims(["prefill", "decode"], itl_ms=1)
    with _dead_decode(stack, sims):
        stack.wait_ready(sims)

        async def one(client: httpx.AsyncClient, i: int) -> tuple[str, list[bytes]]:
            prompt = f"{PROMPT} number {i}"
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 6, "stream": True}
            async with client.stream("POST", f"{stack.url}/v1/completions", json=body) as r:
                assert r.status_code == 200
                events = [e for e in (await r.aread()).split(b"\n\n") if e]
            return prompt, events

        async def burst() -> list[tuple[str, list[bytes]]]:
            limits = httpx.Limits(max_connections=64)
            async with httpx.AsyncClient(timeout=60, limits=limits) as client:
                return await asyncio.gather(*(one(client, i) for i in range(64)))

        for prompt, events in asyncio.run(burst()):
            assert events[-1] == b"data: [DONE]", events
            assert sse_text(events) == expected_text(prompt, 0, 6)
        _nothing_held(stack, sims)
        taken = metric(stack, 'pdplane_gateway_retries_total{side="decode"}')
        assert taken > 0  # the dead decode was chosen, and replaced
        wait_for(lambda: stack.releases() == {"failed": taken, "success": 64.0})
        assert metric(stack, "pdplane_gateway_ttft_seconds_count") == 64
        assert metric(stack, "pdplane_gateway_inflight_requests") == 0


def _full_fleet(stack: Stack) -> tuple[contextlib.ExitStack, RunningSims]:
    """A prefill, a decode of 8 KV blocks (of 128 tokens) held by a long stream, and the dead
    decode (no load report: room unknown, so a short request is scheduled on it); closing the
    exit stack ends the long stream."""
    sims = stack.sims(
        ["prefill", "decode"], kv_blocks=8, block_size=128, itl_ms=50, max_model_len=1024
    )
    exits = contextlib.ExitStack()
    exits.enter_context(_dead_decode(stack, sims))
    stack.wait_ready(sims)
    wait_for(
        lambda: all(
            c.total_kv_blocks > 0
            for c in stack.service.view.candidates(MODEL)
            if c.instance_id != DEAD
        ),
        what="the first load reports",
    )
    holder = hold_decode(stack)
    exits.callback(holder.close)
    return exits, sims


def _first_event(sock: socket.socket) -> bytes:
    """Reads `sock`'s response until its first complete SSE event; returns what was read."""
    buf = b""
    while b"data: " not in buf or not buf.split(b"data: ", 1)[1].count(b"\n\n"):
        chunk = sock.recv(65536)
        assert chunk, f"connection closed early: {buf!r}"
        buf += chunk
    return buf


def test_a_take_over_waits_for_room_when_every_other_decode_is_full(
    stack_factory: Callable[..., Stack],
) -> None:
    # The dead decode is the only one with room; the live one is full: the take-over's
    # Schedule is refused for room, as a new request's would be, and waits for it.
    stack = stack_factory(queue_timeout_s=30, inflight_budget=0)  # the KV-room queue
    exits, sims = _full_fleet(stack)
    with exits:
        sock = open_request(stack.url, "/v1/completions", SHORT_BODY)
        buf = _first_event(sock)
        assert b" 200 OK" in buf.split(b"\r\n", 1)[0] and b'"error"' not in buf, buf
        wait_for(lambda: metric(stack, "pdplane_gateway_queued_requests") == 1, what="queued")
        exits.close()  # the long stream leaves: room for the take-over
        while not buf.endswith(b"data: [DONE]\n\n") and b"\r\n0\r\n" not in buf:
            chunk = sock.recv(65536)
            assert chunk, f"connection closed early: {buf!r}"
            buf += chunk
        sock.close()
    assert b'"error"' not in buf, buf
    body = buf.split(b"\r\n\r\n", 1)[1]
    events = [line for line in body.split(b"\n") if line.startswith(b"data: ")]
    assert sse_text(events) == expected_text(SHORT_BODY["prompt"], 0, 16)
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")
    assert metric(stack, "pdplane_gateway_queued_requests") == 0
    assert sims[0].held_transfers() == []
    assert stack.releases().get("success") == 1  # the short stream's take-over


def test_a_take_over_whose_room_never_comes_ends_with_a_503_event(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory(queue_timeout_s=0.5, inflight_budget=0)  # the KV-room queue
    exits, sims = _full_fleet(stack)
    with exits:
        body = {**SHORT_BODY, "prompt": SHORT_BODY["prompt"] + "short"}
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as r:
            assert r.status_code == 200
            events = [e for e in r.read().split(b"\n\n") if e]
        assert len(events) == 3 and events[2] == b"data: [DONE]", events
        assert sse_text(events[:1]) == expected_text(body["prompt"], 0, 1)
        error = json.loads(events[1][6:])["error"]
        assert error["code"] == 503 and "--queue-timeout-s 0.5" in error["message"], error
        assert metric(stack, 'pdplane_gateway_queue_refusals_total{reason="timeout"}') == 1
        assert sims[0].held_transfers() == []
        assert stack.scheduler_inflight() == 1  # the long stream only
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")


@pytest.mark.parametrize("embedded", [False, True], ids=["remote", "embedded"])
def test_a_client_leaving_while_the_take_over_waits_leaves_nothing(
    stack_factory: Callable[..., Stack], embedded: bool
) -> None:
    stack = stack_factory(queue_timeout_s=30, embedded=embedded, inflight_budget=0)
    exits, sims = _full_fleet(stack)
    with exits:
        sock = open_request(stack.url, "/v1/completions", SHORT_BODY)
        _first_event(sock)
        wait_for(lambda: metric(stack, "pdplane_gateway_queued_requests") == 1, what="queued")
        sock.close()
        wait_for(lambda: metric(stack, "pdplane_gateway_queued_requests") == 0, what="left")
        assert stack.scheduler_inflight() == 1  # the long stream only
        # its first attempt failed (the long stream's may have too), its take-over cancelled
        wait_for(lambda: stack.releases().get("cancelled") == 1, what="released cancelled")
        assert stack.releases().get("failed") in (1, 2), stack.releases()
        assert metric(stack, "pdplane_gateway_cancellations_total") == 1
        assert sims[0].held_transfers() == []
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")
    assert metric(stack, "pdplane_gateway_inflight_requests") == 0


def test_both_decode_legs_of_a_take_over_are_children_of_the_request(
    receiver: OtlpReceiver,
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    prefill = stack.sims(["prefill"], itl_ms=1)
    with _dead_decode(stack, prefill):
        decode = stack.sims(["decode"], itl_ms=1)
        stack.wait_ready(prefill)
        stack.wait_ready(decode)
        prompt, events, before = _until_the_dead_one_is_picked(stack, decode)
        assert sse_text(events) == expected_text(prompt, 0, 5)
    tracing.shutdown()  # flushes the batch
    legs = before + 2  # one decode leg per request, and the one that failed

    def complete(spans: list[Any]) -> bool:
        names = [s.name for s in spans]
        return names.count("pdplane.decode_leg") >= legs and (
            names.count("pdplane.request") >= before + 1
        )

    spans = receiver.wait_for(complete)
    roots = {s.span_id: s for s in spans if s.name == "pdplane.request"}
    for s in spans:
        if s.name in ("pdplane.decode_leg", "pdplane.first_byte", "pdplane.schedule"):
            root = roots[s.parent_id]  # a child of its request's span
            assert root.start_ns <= s.start_ns <= s.end_ns <= root.end_ns, s.name
    # the stream that was taken over: two Schedules, two decode legs (the first failed)
    taken = max(roots.values(), key=lambda r: r.end_ns)
    children = [s.name for s in spans if s.parent_id == taken.span_id]
    assert children.count("pdplane.schedule") == 2 and children.count("pdplane.decode_leg") == 2


@pytest.mark.parametrize("embedded", [False, True], ids=["remote", "embedded"])
def test_a_client_leaving_while_the_take_over_opens_leaves_nothing(
    stack_factory: Callable[..., Stack], embedded: bool
) -> None:
    # The decode that takes over is 2 s from answering; the client leaves meanwhile.
    stack = stack_factory(embedded=embedded)
    prefill = stack.sims(["prefill"], itl_ms=1)
    with _dead_decode(stack, prefill):
        decode = stack.sims(["decode"], cost=CostModel(step_ms=1.0, request_ms=2000.0))
        stack.wait_ready(prefill)
        stack.wait_ready(decode)
        for i in range(8):
            body = {"model": MODEL, "prompt": f"{PROMPT} {i}", "max_tokens": 5, "stream": True}
            with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as r:
                lines = r.iter_lines()  # kept: a dropped iterator closes the response
                assert next(lines).startswith("data: {")  # the first token, prefill's
                wait_for(lambda n=i: len(decode[0].records()) > n, what="decode asked")
                if "kv_transfer_params" not in decode[0].records()[-1]["body"]:
                    assert stack.upstream_in_use() == 1  # the take-over's, opening
                    break  # the client leaves now
                r.read()
        else:
            pytest.fail("the dead decode was never chosen")
        wait_for(lambda: decode[0].records()[-1]["cancelled"], what="decode's request cancelled")
        _nothing_held(stack, prefill)
        expected = {"failed": 1.0, "cancelled": 1.0, **({"success": float(i)} if i else {})}
        wait_for(lambda: stack.releases() == expected, what="released failed, then cancelled")
        assert metric(stack, "pdplane_gateway_cancellations_total") == 1
        assert metric(stack, "pdplane_gateway_inflight_requests") == 0


def test_a_chat_stream_taken_over_has_the_usual_paths_text_and_usage(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    sims = stack.sims(["prefill", "decode"], itl_ms=1)
    path = "/v1/chat/completions"
    with _dead_decode(stack, sims):
        stack.wait_ready(sims)
        for i in range(8):
            body = {"model": MODEL, "messages": [{"role": "user", "content": f"{PROMPT} {i}"}],
                    "max_tokens": 6, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
            before = metric(stack, 'pdplane_gateway_retries_total{side="decode"}')
            taken_over = client_stream(stack.url, path, body)
            if metric(stack, 'pdplane_gateway_retries_total{side="decode"}') > before:
                break
        else:
            pytest.fail("the dead decode was never chosen")
    wait_for(
        lambda: DEAD not in {c.instance_id for c in stack.service.view.candidates(MODEL)},
        what="the dead decode gone",
    )
    # the same request on the live pair, decode loading prefill's KV
    assert client_stream(stack.url, path, body) == taken_over
    assert taken_over[1]["completion_tokens"] == 6
    _nothing_held(stack, sims)


def test_a_take_over_with_the_scheduler_gone_ends_the_stream_and_frees_the_kv(
    stack_factory: Callable[..., Stack],
) -> None:
    # The scheduler process stops while prefill computes (500 ms): the take-over's Schedule
    # cannot be answered. The stream ends with one error event, at once, prefill's KV freed.
    stack = stack_factory()
    prefill = stack.sims(["prefill"], cost=CostModel(step_ms=1.0, request_ms=500.0))
    with _dead_decode(stack, prefill):
        stack.wait_ready(prefill)
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}
        with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as r:
            wait_for(lambda: prefill[0].records() != [], what="prefill asked")
            assert stack.scheduler is not None
            stack.scheduler.stop(grace=0)
            events = [e for e in r.read().split(b"\n\n") if e]
        assert len(events) == 3 and events[2] == b"data: [DONE]", events
        assert sse_text(events[:1]) == expected_text(PROMPT, 0, 1)
        error = json.loads(events[1][6:])["error"]
        assert error["code"] in (502, 503), error
        wait_for(lambda: prefill[0].held_transfers() == [], what="prefill's KV freed")
        assert metric(stack, "pdplane_gateway_inflight_requests") == 0


def test_two_dead_decodes_are_taken_over_in_turn_within_the_retries(
    stack_factory: Callable[..., Stack],
) -> None:
    # --max-retries 2, two dead decodes and a live one: whichever dead one is picked first,
    # a stream whose take-over picks the other dead one too is taken over again, each failed
    # attempt released once, and the stream still completes.
    stack = stack_factory(max_retries=2)
    sims = stack.sims(["prefill", "decode"], itl_ms=1)
    with (
        _dead_decode(stack, sims),
        _dead_decode(stack, sims, instance_id="another-dead-decode"),
    ):
        stack.wait_ready(sims)
        for i in range(12):
            prompt = f"{PROMPT} {i}"
            _, events = timed_events(stack.url, {**_BODY5, "prompt": prompt})
            assert sse_text(events) == expected_text(prompt, 0, 5) and events[-1] == b"data: [DONE]"
        _nothing_held(stack, sims)
        retries = metric(stack, 'pdplane_gateway_retries_total{side="decode"}')
        assert retries > 0
        wait_for(lambda: stack.releases() == {"failed": retries, "success": 12.0})
        taken = [r for r in sims[1].records() if "kv_transfer_params" not in r["body"]]
        # some stream was taken over twice (one take-over request per stream reached decode)
        assert 0 < len(taken) < retries, (len(taken), retries)


_BODY5 = {"model": MODEL, "max_tokens": 5, "stream": True}
