"""Through the gateway, real prefill -> decode with the KV pulled by the connector gives exactly
the text one plain vLLM instance gives (greedy), for every endpoint, streamed or not, and the
OpenAI Python client works unchanged."""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from pdplane.launch.vllm_cpu import VllmCpuInstance
from tests.e2e.conftest import MODEL_NAME, VllmPair
from tests.e2e.connector.helpers import EXTERNAL, metric
from tests.e2e.stack.conftest import fresh_text

pytestmark = pytest.mark.vllm

MAX_TOKENS = 16


def _external_tokens(pair: VllmPair) -> float:
    return metric(pair.decode_url, "vllm:prompt_tokens_by_source_total", **EXTERNAL)


def _post(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}{path}", json=body, timeout=120.0)
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def _stream_text(url: str, path: str, body: dict[str, Any]) -> tuple[str, list[str]]:
    """Joins the streamed deltas; returns (text, raw data payloads)."""
    pieces: list[str] = []
    payloads: list[str] = []
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=120.0) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            payloads.append(payload)
            if payload == "[DONE]":
                continue
            for choice in json.loads(payload)["choices"]:
                pieces.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return "".join(pieces), payloads


def _completion_body(prompt: str) -> dict[str, Any]:
    return {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}


def _chat_body(prompt: str) -> dict[str, Any]:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
    }


def test_completions_match_single_instance_and_kv_is_loaded_externally(
    gateway_url: str, vllm_pair: VllmPair, vllm_reference: VllmCpuInstance
) -> None:
    body = _completion_body(fresh_text("cmpl"))
    expected = _post(vllm_reference.url, "/v1/completions", body)["choices"][0]["text"]
    before = _external_tokens(vllm_pair)
    got = _post(gateway_url, "/v1/completions", body)
    assert got["choices"][0]["text"] == expected
    assert _external_tokens(vllm_pair) - before > 0
    assert got["usage"]["completion_tokens"] == MAX_TOKENS


def test_streamed_completions_match_single_instance(
    gateway_url: str, vllm_pair: VllmPair, vllm_reference: VllmCpuInstance
) -> None:
    body = _completion_body(fresh_text("scmpl"))
    expected = _post(vllm_reference.url, "/v1/completions", body)["choices"][0]["text"]
    before = _external_tokens(vllm_pair)
    text, payloads = _stream_text(gateway_url, "/v1/completions", body)
    assert text == expected
    assert payloads.count("[DONE]") == 1 and payloads[-1] == "[DONE]"
    assert _external_tokens(vllm_pair) - before > 0


def test_chat_matches_single_instance(
    gateway_url: str, vllm_pair: VllmPair, vllm_reference: VllmCpuInstance
) -> None:
    body = _chat_body(fresh_text("chat"))
    expected = _post(vllm_reference.url, "/v1/chat/completions", body)
    before = _external_tokens(vllm_pair)
    got = _post(gateway_url, "/v1/chat/completions", body)
    assert got["choices"][0]["message"]["content"] == expected["choices"][0]["message"]["content"]
    assert got["usage"]["prompt_tokens"] == expected["usage"]["prompt_tokens"]
    assert _external_tokens(vllm_pair) - before > 0


def test_streamed_chat_matches_single_instance(
    gateway_url: str, vllm_pair: VllmPair, vllm_reference: VllmCpuInstance
) -> None:
    body = _chat_body(fresh_text("schat"))
    expected = _post(vllm_reference.url, "/v1/chat/completions", body)
    before = _external_tokens(vllm_pair)
    text, payloads = _stream_text(gateway_url, "/v1/chat/completions", body)
    assert text == expected["choices"][0]["message"]["content"]
    assert payloads.count("[DONE]") == 1
    assert _external_tokens(vllm_pair) - before > 0


def test_openai_client_works_unchanged(gateway_url: str, vllm_reference: VllmCpuInstance) -> None:
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)
    reference = openai.OpenAI(base_url=f"{vllm_reference.url}/v1", api_key="x", max_retries=0)

    assert [m.id for m in client.models.list().data] == [MODEL_NAME]

    prompt = fresh_text("oai")
    args: dict[str, Any] = {"model": MODEL_NAME, "max_tokens": MAX_TOKENS, "temperature": 0}
    cmpl = client.completions.create(prompt=prompt, **args)
    assert (
        cmpl.choices[0].text == reference.completions.create(prompt=prompt, **args).choices[0].text
    )

    messages: Any = [{"role": "user", "content": fresh_text("oaichat")}]
    chat = client.chat.completions.create(messages=messages, **args)
    expected = reference.chat.completions.create(messages=messages, **args)
    assert chat.choices[0].message.content == expected.choices[0].message.content

    messages = [{"role": "user", "content": fresh_text("oaistream")}]
    stream = client.chat.completions.create(
        messages=messages, stream=True, stream_options={"include_usage": True}, **args
    )
    chunks = list(stream)
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    expected = reference.chat.completions.create(messages=messages, **args)
    assert streamed == expected.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == MAX_TOKENS


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"model": MODEL_NAME, "prompt": ""}),
        ("/v1/completions", {"model": MODEL_NAME}),
        ("/v1/chat/completions", {"model": MODEL_NAME, "messages": []}),
    ],
)
def test_empty_prompts_are_refused_with_vllm_s_own_answer(
    gateway_url: str, vllm_reference: VllmCpuInstance, path: str, body: dict[str, Any]
) -> None:
    ours = httpx.post(f"{gateway_url}{path}", json=body, timeout=60)
    theirs = httpx.post(f"{vllm_reference.url}{path}", json=body, timeout=60)
    assert (ours.status_code, ours.json()) == (theirs.status_code, theirs.json())


def test_a_request_without_model_is_served_like_vllm_serve(
    gateway_url: str, vllm_reference: VllmCpuInstance
) -> None:
    body = _completion_body(fresh_text("nomodel"))
    del body["model"]
    ours = _post(gateway_url, "/v1/completions", body)
    theirs = _post(vllm_reference.url, "/v1/completions", body)
    assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]


def test_read_only_routes_answer_as_an_instance_does(
    gateway_url: str, vllm_reference: VllmCpuInstance
) -> None:
    text = {"model": MODEL_NAME, "prompt": "The prefill instance", "add_special_tokens": False}
    tokens = _post(gateway_url, "/tokenize", text)
    assert tokens == _post(vllm_reference.url, "/tokenize", text)
    detok = {"model": MODEL_NAME, "tokens": tokens["tokens"]}
    assert _post(gateway_url, "/detokenize", detok) == _post(
        vllm_reference.url, "/detokenize", detok
    )
    version = httpx.get(f"{gateway_url}/version", timeout=10).json()
    assert version == httpx.get(f"{vllm_reference.url}/version", timeout=10).json()
    (ours,) = httpx.get(f"{gateway_url}/v1/models", timeout=10).json()["data"]
    (theirs,) = httpx.get(f"{vllm_reference.url}/v1/models", timeout=10).json()["data"]
    assert ours["id"] == theirs["id"] == MODEL_NAME
    assert (
        ours["root"] == theirs["root"]
    )  # the model's path: `vllm bench serve` loads its tokenizer
