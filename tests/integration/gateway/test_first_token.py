"""The first token from prefill through the gateway, with sims: it reaches the client before
decode loaded the KV, decode continues from it, a request that would sample differently takes
the usual path, and a request that ends at its first token never reaches decode."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from pdplane.launch.ports import free_port_run
from pdplane.registry.client import RegistrationClient
from pdplane.sim.profiles import CostModel
from pdplane.sim.testing import expected_text
from pdplane.sim.tokens import WordTokenizer
from pdplane.v1 import instance_pb2
from tests.integration.gateway.conftest import MODEL, Stack, wait_for
from tests.integration.gateway.helpers import FIRST_TOKEN_PROMPT as PROMPT
from tests.integration.gateway.helpers import client_stream, sse_text, timed_events


def _stream(url: str, body: dict[str, Any]) -> tuple[list[float], str]:
    """(arrival time of each token event, s since the request, the joined text) of one
    stream."""
    stamps, events = timed_events(url, body)
    stamps = [t for t, e in zip(stamps, events, strict=True) if e != b"data: [DONE]"]
    return stamps, sse_text(events)


@pytest.mark.parametrize("embedded", [False, True], ids=["remote", "embedded"])
def test_the_first_token_arrives_before_decode_loaded_the_kv(
    stack_factory: Callable[..., Stack], embedded: bool
) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}
    ttft: dict[str, float] = {}
    for mode in ("prefill", "decode"):
        stack = stack_factory(embedded=embedded, first_token=mode)
        # a pull takes 300 ms: the transfer dominates everything else on the decode side
        sims = stack.sims(["prefill", "decode"], itl_ms=1, transfer_latency_ms=300)
        stack.wait_ready(sims)
        stamps, text = _stream(stack.url, body)
        assert text == expected_text(PROMPT, 0, 5)  # the same answer either way
        assert len(stamps) == 5
        ttft[mode] = stamps[0]
        if mode == "prefill":
            # the transfer sits between the first and the second token
            assert stamps[1] - stamps[0] > stamps[0]
            (decode,) = sims[1].records()
            assert decode["body"]["prompt"][:-1] == WordTokenizer().encode(PROMPT)
            assert decode["body"]["max_tokens"] == 4
        wait_for(lambda s=stack: s.scheduler_inflight() == 0, what="in-flight count back to 0")
        assert sims[0].held_transfers() == []
        stack.close()
    assert ttft["prefill"] < ttft["decode"]


def test_a_seeded_request_takes_the_usual_path(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory()
    sims = stack.sims(["prefill", "decode"], itl_ms=1)
    stack.wait_ready(sims)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True, "seed": 5}
    _, text = _stream(stack.url, body)
    assert text == expected_text(PROMPT, 5, 4)
    (decode,) = sims[1].records()
    assert decode["body"]["prompt"] == PROMPT and decode["body"]["max_tokens"] == 4
    (prefill,) = sims[0].records()
    assert "return_token_ids" not in prefill["body"]


def test_one_token_asked_is_answered_by_prefill_and_its_kv_freed(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    sims = stack.sims(["prefill", "decode"], itl_ms=1)
    stack.wait_ready(sims)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [e for e in r.read().split(b"\n\n") if e]
    chunks = [httpx.Response(200, content=e[6:]).json() for e in events[:-1]]
    assert events[-1] == b"data: [DONE]"
    assert chunks[0]["choices"][0]["text"] == expected_text(PROMPT, 0, 1)
    assert chunks[0]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 1
    assert sims[1].records() == []  # decode never asked
    wait_for(lambda: sims[0].held_transfers() == [], what="prefill's KV freed")
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")


@pytest.mark.parametrize("max_tokens", [None, 5], ids=["no-limit", "clamped"])
def test_a_prompt_one_token_short_of_the_model_length_ends_at_prefill(
    stack_factory: Callable[..., Stack], max_tokens: int | None
) -> None:
    # One instance answers one token ("length"): vLLM clamps max_tokens to the room left.
    # Decode's prompt would be prefill's plus the first token, the model's whole length,
    # which vLLM refuses: the request must end with prefill's token instead.
    stack = stack_factory()
    sims = stack.sims(["prefill", "decode"], itl_ms=1, max_model_len=16)
    stack.wait_ready(sims)
    prompt = " ".join(f"w{i}" for i in range(15))
    assert len(WordTokenizer().encode(prompt)) == 15
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        events = [e for e in r.read().split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    chunks = [httpx.Response(200, content=e[6:]).json() for e in events[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == expected_text(prompt, 0, 1)
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 15, "total_tokens": 16,
                                   "completion_tokens": 1}  # fmt: skip
    assert sims[1].records() == []  # decode never asked
    wait_for(lambda: sims[0].held_transfers() == [], what="prefill's KV freed")
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")


@pytest.mark.parametrize("kv_mode", ["pull", "push"])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_text_and_usage_are_those_of_the_usual_path(
    stack_factory: Callable[..., Stack], kv_mode: str, path: str
) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "stream": True,
                            "stream_options": {"include_usage": True}}  # fmt: skip
    if path == "/v1/completions":
        body["prompt"] = PROMPT + " \u00e9t\u00e9 \U0001f600"
    else:
        body["messages"] = [{"role": "user", "content": PROMPT + " \U0001f600"}]
    seen = {}
    for mode in ("prefill", "decode"):
        stack = stack_factory(first_token=mode)
        sims = stack.sims(["prefill", "decode"], itl_ms=1, kv_mode=kv_mode)
        stack.wait_ready(sims)
        seen[mode] = client_stream(stack.url, path, body)
        (decode,) = sims[1].records()
        assert decode["path"] == ("/v1/completions" if mode == "prefill" else path)
        wait_for(lambda s=stack: s.scheduler_inflight() == 0, what="in-flight count back to 0")
        wait_for(lambda p=sims[0]: p.held_transfers() == [], what="prefill's KV freed")
        if kv_mode == "push":
            (prefill,) = sims[0].records()
            assert prefill["kv"].get("pushed")
        stack.close()
    assert seen["prefill"] == seen["decode"]
    assert seen["prefill"][1]["completion_tokens"] == 6


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_max_tokens_over_the_model_length_gets_decodes_own_400(
    stack_factory: Callable[..., Stack], path: str
) -> None:
    # One token less for decode must not turn a refused request into a served one, nor make
    # the refusal name a number the client did not send.
    stack = stack_factory()
    sims = stack.sims(["prefill", "decode"], itl_ms=1, max_model_len=64)
    stack.wait_ready(sims)
    name = "max_tokens" if path == "/v1/completions" else "max_completion_tokens"
    body: dict[str, Any] = {"model": MODEL, name: 65, "stream": True}
    if path == "/v1/completions":
        body["prompt"] = PROMPT
    else:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    r = httpx.post(f"{stack.url}{path}", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert f"{name}=65 cannot be greater than max_model_len=64" in r.json()["error"]["message"]
    wait_for(lambda: sims[0].held_transfers() == [], what="prefill's KV freed")
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")


@pytest.mark.parametrize("embedded", [False, True], ids=["remote", "embedded"])
def test_the_first_token_does_not_wait_for_decodes_answer(
    stack_factory: Callable[..., Stack], embedded: bool
) -> None:
    # Decode's API server takes 500 ms before the request is in its engine (and its stream's
    # headers go out): the first token, prefill's, must not wait for them.
    stack = stack_factory(embedded=embedded)
    prefill = stack.sims(["prefill"], itl_ms=1)
    decode = stack.sims(["decode"], cost=CostModel(step_ms=1.0, request_ms=500.0))
    stack.wait_ready(prefill)
    stack.wait_ready(decode)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "stream": True}
    stamps, events = timed_events(stack.url, body)
    assert sse_text(events) == expected_text(PROMPT, 0, 4) and events[-1] == b"data: [DONE]"
    # the second token comes from decode, >= 500 ms after its request; the first before it
    assert stamps[1] - stamps[0] > 0.4
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")
    assert prefill[0].held_transfers() == []


def test_an_unreachable_decode_is_replaced_after_the_first_token(
    stack_factory: Callable[..., Stack],
) -> None:
    # A decode that is registered but refuses connections (it died; its lease has not run
    # out): the first token already reached the client, so another decode takes over,
    # computing the whole prompt itself, and the stream goes on as one instance's would.
    stack = stack_factory()
    sims = stack.sims(["prefill", "decode"], itl_ms=1)
    stack.wait_ready(sims)
    dead = instance_pb2.InstanceSpec()
    dead.CopyFrom(sims[1].instance.spec())
    dead.instance_id, dead.url = "a-dead-decode", f"http://127.0.0.1:{free_port_run()}"
    client = RegistrationClient(stack.registry, dead, instance_pb2.LoadReport)
    client.start()
    try:
        assert client.wait_registered(5.0), client.last_error
        wait_for(
            lambda: (
                "a-dead-decode" in {c.instance_id for c in stack.service.view.candidates(MODEL)}
            ),
            what="the scheduler to see the dead decode",
        )
        # decode is chosen by load, ties in turn: within a few requests the dead one is picked
        for i in range(6):
            prompt = f"{PROMPT} {i}"
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 5, "stream": True}
            _, events = timed_events(stack.url, body)
            assert sse_text(events) == expected_text(prompt, 0, 5)
            assert events[-1] == b"data: [DONE]"
            takeovers = [r for r in sims[1].records() if "kv_transfer_params" not in r["body"]]
            if takeovers:
                break
        else:
            pytest.fail("the dead decode was never chosen")
        (taken,) = takeovers
        prompt_ids = WordTokenizer().encode(prompt)
        assert taken["body"]["prompt"][:-1] == prompt_ids and taken["body"]["max_tokens"] == 4
        # prefill's KV of that request was freed, not left for a pull that never comes
        (held,) = [r for r in sims[0].records() if r["body"]["prompt"] == prompt]
        transfer_id = held["kv"]["transfer_id"]
        wait_for(lambda: any(f["transfer_id"] == transfer_id for f in sims[0].freed_transfers()))
        wait_for(lambda: sims[0].held_transfers() == [], what="prefill's KV freed")
        wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")
        metrics = httpx.get(f"{stack.url}/metrics").text
        assert 'pdplane_gateway_retries_total{side="decode"} 1.0' in metrics
        releases = stack.releases()
        assert releases["failed"] == 1 and releases["success"] == i + 1
    finally:
        client.stop()


def test_a_decode_error_after_the_first_token_ends_the_stream_with_it(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    sims = stack.sims(["prefill", "decode"], itl_ms=1)
    stack.wait_ready(sims)
    sims[1].set_faults(fail_mode="http500", fail_next=1)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}
    _, events = timed_events(stack.url, body)
    assert len(events) == 3 and events[-1] == b"data: [DONE]"  # as vLLM ends a failed request
    assert sse_text(events[:1]) == expected_text(PROMPT, 0, 1)
    error = json.loads(events[1][6:])["error"]
    assert error["code"] == 502 and sims[1].instance_id in error["message"]
    assert "500" in error["message"]
    wait_for(lambda: sims[0].held_transfers() == [], what="prefill's KV freed")
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")
    wait_for(lambda: stack.releases() == {"failed": 1.0}, what="released failed")


def test_a_client_leaving_before_decode_answered_frees_everything(
    stack_factory: Callable[..., Stack],
) -> None:
    stack = stack_factory()
    prefill = stack.sims(["prefill"], itl_ms=1)
    decode = stack.sims(["decode"], cost=CostModel(step_ms=1.0, request_ms=2000.0))
    stack.wait_ready(prefill)
    stack.wait_ready(decode)
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 5, "stream": True}
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the response
        assert next(lines).startswith("data: {")  # the first token
        # decode was asked (it is 2 s from answering); then the client leaves
        wait_for(lambda: decode[0].records() != [], what="decode asked")
    wait_for(lambda: prefill[0].held_transfers() == [], what="prefill's KV freed")
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")
    wait_for(lambda: stack.releases() == {"cancelled": 1.0}, what="released cancelled")
    wait_for(lambda: decode[0].records()[0]["cancelled"], what="decode's request cancelled")
