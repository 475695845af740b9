"""The first token from prefill, on real vLLM CPU: a streamed request through the gateway gives
the events one plain vLLM instance streams (greedy: same text, token by token, same usage), its
first token is prefill's (decode generates one token less and loads prefill's KV), and requests
that would sample differently when split take the usual path."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdplane.launch.vllm_cpu import VllmCpuInstance
from tests.e2e.conftest import MODEL_NAME, VllmPair
from tests.e2e.connector.helpers import EXTERNAL, metric
from tests.e2e.stack.conftest import fresh_text

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
_VOLATILE = ("id", "created", "system_fingerprint")


def _events(url: str, path: str, body: dict[str, Any]) -> list[Any]:
    """The streamed events, parsed, without the fields that differ per response."""
    out: list[Any] = []
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120.0) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            payload = line.removeprefix("data: ")
            if payload == "[DONE]":
                out.append(payload)
                continue
            event = json.loads(payload)
            for key in _VOLATILE:
                event.pop(key, None)
            out.append(event)
    return out


def _text(events: list[Any]) -> str:
    out = []
    for e in events:
        for c in e["choices"] if isinstance(e, dict) else ():
            out.append(c["text"] if "text" in c else c["delta"].get("content", ""))
    return "".join(out)


def _shape(event: Any) -> str:
    """The event with its text blanked: which fields it has, with which values."""
    if isinstance(event, dict):
        for c in event.get("choices", ()):
            if "text" in c:
                c["text"] = ""
            elif "content" in c.get("delta", {}):
                c["delta"]["content"] = ""
    return json.dumps(event, sort_keys=True)


def _assert_same_stream(got: list[Any], expected: list[Any]) -> None:
    """Same text, same final usage, same kinds of events. (vLLM's API server merges the
    tokens of several engine steps into one chunk when it runs behind, so the number of
    chunks is not compared.)"""
    assert _text(got) == _text(expected)
    assert got[-2:] == expected[-2:]  # the usage event (or the finishing one), [DONE]
    assert {_shape(e) for e in got} == {_shape(e) for e in expected}
    assert _shape(got[0]) == _shape(expected[0])


def _generated(pair: VllmPair) -> tuple[float, float]:
    name = "vllm:generation_tokens_total"
    return metric(pair.prefill_url, name), metric(pair.decode_url, name)


def _body(path: str, tag: str, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL_NAME,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
        **extra,
    }
    if path == "/v1/chat/completions":
        body["messages"] = [{"role": "user", "content": fresh_text(tag)}]
    else:
        body["prompt"] = fresh_text(tag)
    return body


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_events_match_one_instance_and_the_first_token_is_prefills(
    gateway_url: str,
    vllm_pair: VllmPair,
    vllm_reference: VllmCpuInstance,
    whole_tokens: list[int],
    path: str,
) -> None:
    body = _body(path, "first" + path[-5:], allowed_token_ids=whole_tokens)
    expected = _events(vllm_reference.url, path, body)
    prefill0, decode0 = _generated(vllm_pair)
    loaded0 = metric(vllm_pair.decode_url, "vllm:prompt_tokens_by_source_total", **EXTERNAL)
    got = _events(gateway_url, path, body)
    _assert_same_stream(got, expected)
    prefill1, decode1 = _generated(vllm_pair)
    assert (prefill1 - prefill0, decode1 - decode0) == (1, MAX_TOKENS - 1)
    loaded = metric(vllm_pair.decode_url, "vllm:prompt_tokens_by_source_total", **EXTERNAL)
    assert loaded - loaded0 > 0  # decode loaded prefill's KV, it did not recompute the prompt


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_prompt_ending_with_a_replacement_character_still_takes_prefills_first_token(
    gateway_url: str,
    vllm_pair: VllmPair,
    vllm_reference: VllmCpuInstance,
    whole_tokens: list[int],
    path: str,
) -> None:
    # Prompts made of random token ids (`vllm bench serve`'s random dataset) often end with
    # U+FFFD; vLLM's detokenizer then writes the prompt's pending text with the first token.
    body = _body(path, "fffd" + path[-5:], allowed_token_ids=whole_tokens)
    if path == "/v1/chat/completions":
        body["messages"][0]["content"] += " \ufffd\ufffd\ufffd"
    else:
        body["prompt"] += " \ufffd\ufffd\ufffd"
    expected = _events(vllm_reference.url, path, body)
    prefill0, decode0 = _generated(vllm_pair)
    _assert_same_stream(_events(gateway_url, path, body), expected)
    prefill1, decode1 = _generated(vllm_pair)
    assert (prefill1 - prefill0, decode1 - decode0) == (1, MAX_TOKENS - 1)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_one_token_is_answered_by_prefill_alone(
    gateway_url: str,
    vllm_pair: VllmPair,
    vllm_reference: VllmCpuInstance,
    whole_tokens: list[int],
    path: str,
) -> None:
    body = _body(path, "one" + path[-5:], max_tokens=1, allowed_token_ids=whole_tokens)
    expected = _events(vllm_reference.url, path, body)
    prefill0, decode0 = _generated(vllm_pair)
    _assert_same_stream(_events(gateway_url, path, body), expected)
    assert _generated(vllm_pair) == (prefill0 + 1, decode0)


def test_a_seeded_request_takes_the_usual_path(
    gateway_url: str, vllm_pair: VllmPair, vllm_reference: VllmCpuInstance
) -> None:
    path = "/v1/completions"
    body = _body(path, "seeded", temperature=1.0, seed=7)
    expected = _events(vllm_reference.url, path, body)
    prefill0, decode0 = _generated(vllm_pair)
    # the seed's tokens, as one instance samples them
    _assert_same_stream(_events(gateway_url, path, body), expected)
    assert _generated(vllm_pair) == (prefill0 + 1, decode0 + MAX_TOKENS)


def _text_and_usage(events: list[Any]) -> tuple[str, Any, Any]:
    """The text, the last usage and the finish reason of a stream."""
    usage = reason = None
    for e in events:
        if isinstance(e, dict):
            usage = e.get("usage") or usage
            for c in e["choices"]:
                reason = c.get("finish_reason") or reason
    return _text(events), usage, reason


_CHAT = "/v1/chat/completions"
_COMPLETIONS = "/v1/completions"


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (_COMPLETIONS, {"max_tokens": None, "stream_options": None}),  # vLLM's default of 16
        (_COMPLETIONS, {"skip_special_tokens": False, "spaces_between_special_tokens": False}),
        (_COMPLETIONS, {"ignore_eos": False, "max_tokens": 40}),
        (_CHAT, {"stream_options": {"include_usage": True, "continuous_usage_stats": True}}),
        (_CHAT, {"skip_special_tokens": False, "add_generation_prompt": False}),
        (_CHAT, {"max_tokens": 9, "max_completion_tokens": 5}),
        (_CHAT, {"stream_options": {"include_usage": False}, "ignore_eos": False}),
    ],
    ids=[
        "completions-default-max-tokens",
        "completions-special-tokens",
        "completions-eos",
        "chat-continuous-usage",
        "chat-special-tokens-no-generation-prompt",
        "chat-max-completion-tokens-wins",
        "chat-no-usage-eos",
    ],
)
def test_odd_requests_give_one_instances_text_and_usage(
    gateway_url: str, vllm_reference: VllmCpuInstance, path: str, extra: dict[str, Any]
) -> None:
    body = _body(path, "odd" + str(len(extra)) + path[-5:])
    for key, value in extra.items():
        if value is None:
            body.pop(key)
        else:
            body[key] = value
    if path == _CHAT:
        body["messages"][0]["content"] += " été 😀"  # non-ASCII, a character of 4 bytes
    else:
        body["prompt"] += " été 😀"
    expected = _events(vllm_reference.url, path, body)
    got = _events(gateway_url, path, body)
    assert _text_and_usage(got) == _text_and_usage(expected)
    assert got[-1] == expected[-1] == "[DONE]"


def test_a_prompt_one_token_short_of_the_model_length_gets_one_token(
    gateway_url: str,
    vllm_pair: VllmPair,
    vllm_reference: VllmCpuInstance,
    whole_tokens: list[int],
) -> None:
    # vLLM clamps max_tokens to the one token left; decode would refuse prefill's prompt plus
    # the first token (the model's whole length, 1024 here).
    prompt = [5 + (i * 7919) % 2000 for i in range(1023)]
    body = {
        **_body(_COMPLETIONS, "long", max_tokens=5, allowed_token_ids=whole_tokens),
        "prompt": prompt,
    }
    expected = _events(vllm_reference.url, _COMPLETIONS, body)
    prefill0, decode0 = _generated(vllm_pair)
    got = _events(gateway_url, _COMPLETIONS, body)
    assert _text_and_usage(got) == _text_and_usage(expected)
    assert _text_and_usage(got)[1]["completion_tokens"] == 1
    assert _generated(vllm_pair) == (prefill0 + 1, decode0)


@pytest.fixture(scope="module")
def tokenizer_gateway_url(registry_address: str, vllm_pair: VllmPair, tiny_model: Path) -> Any:
    """A gateway with the model's tokenizer (as `pdplane up` starts it): it can tell a first
    token without text that ends inside a character from one that decodes to nothing."""
    from pdplane.gateway.testing import running_gateway
    from pdplane.launch.process import http_ok, wait_until
    from tests.integration.scheduler.fixtures import running_scheduler

    with (
        running_scheduler(registry_address) as scheduler,
        running_gateway(scheduler, registry_address, tokenizer=str(tiny_model)) as url,
    ):
        wait_until(lambda: http_ok(f"{url}/health"), 60.0, what="gateway /health 200")
        yield url


def _token_sets(tiny_model: Path) -> tuple[list[int], list[int]]:
    """(ids past the tokenizer's vocabulary: the model's is padded, they decode to nothing;
    byte tokens that are part of a character)."""
    import json as json_

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    vocab = json_.loads((tiny_model / "config.json").read_text())["vocab_size"]
    partial = [i for i in range(len(tok)) if "\ufffd" in tok.decode([i])]
    return list(range(len(tok), vocab)), partial


def test_with_the_tokenizer_a_first_token_without_text_is_continued(
    tokenizer_gateway_url: str,
    vllm_pair: VllmPair,
    vllm_reference: VllmCpuInstance,
    tiny_model: Path,
) -> None:
    path = "/v1/completions"
    padded, partial = _token_sets(tiny_model)
    assert padded and partial
    # every token past the vocabulary: the first one has no text, and is not a character's part
    body = _body(path, "padded", allowed_token_ids=padded)
    expected = _events(vllm_reference.url, path, body)
    before = _generated(vllm_pair)
    _assert_same_stream(_events(tokenizer_gateway_url, path, body), expected)
    after = _generated(vllm_pair)
    assert (after[0] - before[0], after[1] - before[1]) == (1, MAX_TOKENS - 1)  # prefill's token
    # byte tokens only: the first ends inside a character (or is an invalid byte: text ""
    # too); its text and that of the bytes after it are rebuilt from decode's token ids
    body = _body(path, "partial", allowed_token_ids=partial, max_tokens=MAX_TOKENS)
    expected = _events(vllm_reference.url, path, body)
    before = _generated(vllm_pair)
    _assert_same_stream(_events(tokenizer_gateway_url, path, body), expected)
    after = _generated(vllm_pair)
    assert (after[0] - before[0], after[1] - before[1]) == (1, MAX_TOKENS - 1)


def _inside_character(url: str, path: str, tiny_model: Path) -> dict[str, Any]:
    """A body whose greedy first token ends inside a UTF-8 character, asked of the plain
    instance: the tiny model's random weights pick a byte token for about one random prompt
    in four."""
    import random

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    words = [i for i in range(len(tok)) if tok.decode([i]).strip().isalpha()]
    for i in range(60):
        body = _body(path, "held")
        text = tok.decode(random.Random(i).choices(words, k=100))
        if path == _CHAT:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        probe = {**body, "max_tokens": 1, "stream": False, "return_token_ids": True}
        probe.pop("stream_options")
        answer = httpx.post(f"{url}{path}", json=probe, timeout=60.0).json()
        choice = answer["choices"][0]
        prompt = answer.get("prompt_token_ids") or choice["prompt_token_ids"]
        if tok.decode([*prompt[-8:], *choice["token_ids"]]).endswith("\ufffd"):
            return body
    raise AssertionError("no prompt of 60 starts with a token inside a character")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_first_token_inside_a_character_is_prefills_and_the_text_is_one_instances(
    tokenizer_gateway_url: str,
    vllm_pair: VllmPair,
    vllm_reference: VllmCpuInstance,
    tiny_model: Path,
    path: str,
) -> None:
    body = _inside_character(vllm_reference.url, path, tiny_model)
    expected = _events(vllm_reference.url, path, body)
    prefill0, decode0 = _generated(vllm_pair)
    sources0 = metric(tokenizer_gateway_url, "pdplane_gateway_first_tokens_total", source="prefill")
    got = _events(tokenizer_gateway_url, path, body)
    _assert_same_stream(got, expected)
    first = got[1] if path == _CHAT else got[0]  # chat: after the role chunk
    assert _text([first]) == ""  # vLLM streams the held token with no text
    prefill1, decode1 = _generated(vllm_pair)
    assert (prefill1 - prefill0, decode1 - decode0) == (1, MAX_TOKENS - 1)
    sources = metric(tokenizer_gateway_url, "pdplane_gateway_first_tokens_total", source="prefill")
    assert sources - sources0 == 1
