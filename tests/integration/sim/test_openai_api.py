"""The sim speaks vLLM's OpenAI API: shapes, SSE framing, errors, faults, disconnects, metrics."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from aiohttp import web
from aiohttp.client_exceptions import ClientConnectionResetError
from prometheus_client.parser import text_string_to_metric_families

from pdplane.sim.testing import running_sims
from tests.integration.sim.helpers import wait_for

CHAT = {"model": "sim-model", "messages": [{"role": "user", "content": "Hello there"}]}


def _events(raw: str) -> list[str]:
    assert raw.endswith("\n\n")
    frames = raw[:-2].split("\n\n")
    assert all(f.startswith("data: ") for f in frames)
    return [f[len("data: ") :] for f in frames]


def test_completion_non_stream_shape_and_determinism() -> None:
    with running_sims(["both", "both"]) as sims:
        body = {"model": "sim-model", "prompt": "The capital of France is", "max_tokens": 8}
        a = httpx.post(sims.urls[0] + "/v1/completions", json=body).json()
        b = httpx.post(sims.urls[1] + "/v1/completions", json=body).json()
        assert a["object"] == "text_completion" and a["id"].startswith("cmpl-")
        assert a["choices"][0]["text"] == b["choices"][0]["text"]  # same prompt + seed
        assert a["choices"][0]["finish_reason"] == "length"
        assert a["usage"] == {
            "prompt_tokens": 5,
            "total_tokens": 13,
            "completion_tokens": 8,
            "prompt_tokens_details": None,
        }
        assert a["kv_transfer_params"] is None
        record = sims[0].records()[0]
        assert record["body"] == body and record["status"] == 200 and record["finished"]


def test_chat_stream_framing_and_usage() -> None:
    with running_sims("both", itl_ms=1) as sims:
        body = {**CHAT, "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", sims.urls[0] + "/v1/chat/completions", json=body) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            events = _events(r.read().decode())
        assert events[-1] == "[DONE]"
        chunks = [json.loads(e) for e in events[:-1]]
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert [c["choices"][0]["finish_reason"] for c in chunks[1:5]] == [None] * 3 + ["length"]
        assert chunks[5]["choices"] == [] and chunks[5]["usage"]["completion_tokens"] == 4
        text = "".join(c["choices"][0]["delta"]["content"] for c in chunks[1:5])
        whole = httpx.post(sims.urls[0] + "/v1/chat/completions", json={**CHAT, "max_tokens": 4})
        assert whole.json()["choices"][0]["message"]["content"] == text


def test_errors_are_openai_json() -> None:
    with running_sims("decode", max_model_len=32) as sims:
        url = sims.urls[0]
        r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 33})
        assert r.status_code == 400
        assert r.json()["error"]["type"] == "BadRequestError"
        r = httpx.post(url + "/v1/completions", content=b"{not json")
        assert r.status_code == 400 and "error" in r.json()
        r = httpx.post(url + "/v1/chat/completions", json={**CHAT, "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        # vLLM's SamplingParams: several choices need sampling (temperature under 1e-5 is greedy).
        for path, body in [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", CHAT)]:
            greedy = {**body, "max_tokens": 2, "n": 2, "temperature": 0}
            r = httpx.post(url + path, json=greedy)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["message"] == "n must be 1 when using greedy sampling, got 2."
            r = httpx.post(url + path, json={**greedy, "temperature": 0.7})
            assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_models_health_and_vllm_metric_names() -> None:
    with running_sims("prefill") as sims:
        url = sims.urls[0]
        assert httpx.get(url + "/health").status_code == 200
        assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == "sim-model"
        httpx.post(url + "/v1/completions", json={"prompt": "a b c", "max_tokens": 2})
        text = httpx.get(url + "/metrics").text
        for name in (
            "vllm:num_requests_running",
            "vllm:num_requests_waiting",
            "vllm:kv_cache_usage_perc",
            "vllm:external_prefix_cache_hits_total",
            "vllm:time_to_first_token_seconds_bucket",
        ):
            assert name + "{" in text, name
        assert 'vllm:prompt_tokens_total{engine="0",model_name="sim-model"} 3.0' in text


def test_injected_http500_then_recovery() -> None:
    with running_sims("both") as sims:
        sims[0].set_faults(fail_next=1, fail_mode="http500")
        r = httpx.post(sims.urls[0] + "/v1/chat/completions", json={**CHAT, "max_tokens": 2})
        assert r.status_code == 500 and r.json()["error"]["code"] == 500
        assert httpx.post(sims.urls[0] + "/v1/chat/completions", json=CHAT).status_code == 200
        assert [r["fault"] for r in sims[0].records()] == ["http500", None]


def test_drop_mid_stream_cuts_the_connection() -> None:
    with running_sims("both") as sims:
        r = httpx.post(
            sims.urls[0] + "/sim/faults",
            json={"fail_next": 1, "fail_mode": "drop", "fail_after_tokens": 2},
        )
        assert r.json()["fail_next"] == 1
        body = {**CHAT, "max_tokens": 10, "stream": True}
        received = b""
        with (
            pytest.raises(httpx.HTTPError),
            httpx.stream("POST", sims.urls[0] + "/v1/chat/completions", json=body) as r,
        ):
            for chunk in r.iter_bytes():
                received += chunk
        assert received.count(b"data: ") == 3  # the role chunk and two tokens
        assert b"[DONE]" not in received
        assert sims[0].records()[0]["fault"] == "drop"


def test_stall_holds_until_the_client_leaves_and_is_recorded_cancelled() -> None:
    with running_sims("both") as sims:
        sims[0].set_faults(fail_next=1, fail_mode="stall", fail_after_tokens=1)
        body = {**CHAT, "max_tokens": 10, "stream": True}
        with pytest.raises(httpx.ReadTimeout):  # noqa: SIM117
            with httpx.stream(
                "POST",
                sims.urls[0] + "/v1/chat/completions",
                json=body,
                timeout=httpx.Timeout(5.0, read=0.3),
            ) as r:
                for _ in r.iter_bytes():
                    pass
        record = wait_for(lambda: [x for x in sims[0].records() if x["finished"]])[0]
        assert record["cancelled"] and record["tokens_sent"] == 1
        state = httpx.get(sims.urls[0] + "/sim/state").json()
        assert state["load"]["num_running"] == 0
        assert state["load"]["free_kv_blocks"] == state["load"]["total_kv_blocks"]


def test_client_disconnect_mid_stream_is_recorded() -> None:
    with running_sims("decode", itl_ms=20) as sims:
        body = {**CHAT, "max_tokens": 200, "stream": True}
        with httpx.stream("POST", sims.urls[0] + "/v1/chat/completions", json=body) as r:
            next(r.iter_bytes())
        record = wait_for(lambda: [x for x in sims[0].records() if x["finished"]])[0]
        assert record["cancelled"] and record["tokens_sent"] < 200


def test_client_gone_before_the_stream_headers_is_recorded_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # aiohttp cancels the handler of a client that left, but a handler that resumed first
    # finds it at its next write: here the stream's headers (the race CI once lost).
    async def gone(self: web.StreamResponse, request: web.BaseRequest) -> None:
        raise ClientConnectionResetError("Cannot write to closing transport")

    with running_sims("decode") as sims:
        monkeypatch.setattr(web.StreamResponse, "prepare", gone)
        body = {**CHAT, "max_tokens": 5, "stream": True}
        with pytest.raises(httpx.HTTPError):
            httpx.post(sims.urls[0] + "/v1/chat/completions", json=body, timeout=2)
        monkeypatch.undo()
        record = wait_for(lambda: [x for x in sims[0].records() if x["finished"]])[0]
        assert record["cancelled"] and record["tokens_sent"] == 0
        state = httpx.get(sims.urls[0] + "/sim/state").json()
        assert state["load"]["num_running"] == 0 and state["load"]["num_waiting"] == 0


async def test_queued_request_counts_as_waiting_until_a_slot_frees() -> None:
    with running_sims("decode", max_num_seqs=1, itl_ms=20) as sims:
        url = sims.urls[0]
        body = {**CHAT, "max_tokens": 50, "stream": True}
        async with httpx.AsyncClient(timeout=10.0) as client:
            async with client.stream("POST", url + "/v1/chat/completions", json=body) as first:
                chunks = first.aiter_bytes()  # keep a reference: a dropped one closes
                await anext(chunks)
                second = asyncio.create_task(
                    client.post(url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2})
                )
                deadline = time.monotonic() + 5
                while True:
                    load = (await client.get(url + "/sim/state")).json()["load"]
                    if load["num_waiting"] == 1:
                        break
                    assert time.monotonic() < deadline, load
                    await asyncio.sleep(0.01)
                assert load["num_running"] == 1
                assert not second.done()
            # Leaving the first stream cancels it, which frees the slot for the second.
            assert (await asyncio.wait_for(second, 5)).status_code == 200


@pytest.mark.parametrize(
    "content",
    [
        [{"type": "text", "text": 5}],
        [{"type": "text", "text": ["a"]}],
        [{"type": "text"}],
        ["not a part"],
        7,
    ],
)
def test_malformed_chat_content_is_400_like_vllm(content: object) -> None:
    with running_sims("decode") as sims:
        body = {**CHAT, "messages": [{"role": "user", "content": content}]}
        r = httpx.post(sims.urls[0] + "/v1/chat/completions", json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "BadRequestError"


@pytest.mark.parametrize(
    ("path", "raw"),
    [
        # deep nesting: json's RecursionError was a 500
        ("/v1/chat/completions", b"[" * 100_000),
        # a token id outside uint32 raised inside the engine loop: every later request hung
        ("/v1/completions", json.dumps({"model": "sim-model", "prompt": [1, 2**40]}).encode()),
        # past aiohttp's 1 MiB default body: vLLM (uvicorn) reads it and refuses the length
        ("/v1/completions", json.dumps({"prompt": "a " * 1_000_000, "max_tokens": 2}).encode()),
    ],
)
def test_hostile_body_is_400_and_the_sim_keeps_serving(path: str, raw: bytes) -> None:
    with running_sims("both") as sims:
        headers = {"content-type": "application/json"}
        r = httpx.post(sims.urls[0] + path, content=raw, headers=headers, timeout=10)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["type"] == "BadRequestError"
        ok = httpx.post(sims.urls[0] + "/v1/chat/completions", json=CHAT, timeout=10)
        assert ok.status_code == 200, ok.text


def _engine_idle(url: str) -> bool:
    families = text_string_to_metric_families(httpx.get(url + "/metrics").text)
    running = {
        s.value
        for f in families
        for s in f.samples
        if s.name in ("vllm:num_requests_running", "vllm:num_requests_waiting")
    }
    return running == {0.0}


def test_a_slow_reader_gets_every_token_and_the_finish_reason() -> None:
    # vLLM keeps what its engine produced until the client reads it: the engine may finish
    # long before a slow client has read the stream, which must still end whole.
    with running_sims("both") as sims:
        url = urlsplit(sims.urls[0])
        body = {
            **CHAT,
            "n": 8,
            "max_tokens": 300,
            "ignore_eos": True,
            "stream": True,
            "logprobs": True,
            "top_logprobs": 20,
        }
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window
        sock.settimeout(30)
        sock.connect((url.hostname, url.port))
        conn = http.client.HTTPConnection(url.hostname or "", url.port)
        conn.sock = sock
        conn.request(
            "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        reply = conn.getresponse()
        # The engine finishes every choice while the stream waits on this client's window.
        wait_for(lambda: _engine_idle(sims.urls[0]), timeout=30)
        events = _events(reply.read().decode())
        conn.close()
    assert events[-1] == "[DONE]"
    tokens = [0] * 8
    finished = [None] * 8
    for event in events[:-1]:
        for choice in json.loads(event)["choices"]:
            tokens[choice["index"]] += choice["delta"].get("content") is not None and bool(
                choice["logprobs"]
            )
            finished[choice["index"]] = finished[choice["index"]] or choice["finish_reason"]
    assert tokens == [300] * 8
    assert finished == ["length"] * 8
