"""Hostile client input: 400 with an OpenAI error body, never a 500, and bounded work."""

from __future__ import annotations

import json

import httpx
import pytest

from pdplane.gateway.errors import GatewayError
from pdplane.gateway.json_guard import VALUE_SLACK
from pdplane.gateway.testing import running_gateway
from pdplane.gateway.validation import CHAT, COMPLETIONS, parse_request
from tests.unit.gateway.conftest import MODEL, VIEW, FakeScheduler

_PART = b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "x\\ud83d"}]}]}'
_NESTED = b'{"model": "m", "prompt": "x", "extra": ' + b"[" * 5000 + b"]" * 5000 + b"}"


@pytest.mark.parametrize(
    ("endpoint", "raw", "fragment"),
    [
        (COMPLETIONS, b'{"model": "m", "prompt": "a\\ud800b"}', "surrogate"),
        (COMPLETIONS, b'{"model": "m", "prompt": "a\xed\xa0\x80b"}', "UTF-8"),
        (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "surrogate"),
        (CHAT, _PART, "surrogate"),
        (COMPLETIONS, _NESTED, "nested"),
        (COMPLETIONS, b"[" * 100_000, "nested"),
    ],
)
def test_bad_text_and_deep_nesting_are_400(endpoint: str, raw: bytes, fragment: str) -> None:
    with pytest.raises(GatewayError) as info:
        parse_request(endpoint, raw)  # type: ignore[arg-type]
    assert info.value.status == 400
    assert fragment in info.value.message


def test_surrogate_pairs_and_escaped_backslashes_are_fine() -> None:
    # An emoji as a JSON surrogate pair, and a literal backslash-u that only looks like one.
    raw = b'{"model": "m", "prompt": "smile \\ud83d\\ude00 and \\\\ud800"}'
    assert parse_request(COMPLETIONS, raw).body["prompt"] == "smile \U0001f600 and \\ud800"


def test_token_id_lists_far_over_the_model_length_are_refused_before_parsing() -> None:
    too_many = 4096 + VALUE_SLACK + 10
    raw = json.dumps({"model": "m", "prompt": [7] * too_many}).encode()
    with pytest.raises(GatewayError) as info:
        parse_request(COMPLETIONS, raw, max_model_len=4096)
    assert info.value.status == 400
    assert "4096" in info.value.message
    # Commas inside strings do not count: a long text prompt is left to the instance.
    text = json.dumps({"model": "m", "prompt": 'a, \\" ' * too_many}).encode()
    assert parse_request(COMPLETIONS, text, max_model_len=4096).prompt_tokens > 4096


@pytest.mark.parametrize(
    ("prompt", "ok"),
    [
        ([1, 2, 3], True),
        ([0], True),  # one token id (found by the fuzzer: a 500)
        ([2**32 - 1], True),
        ([2**32], False),  # past uint32 (found by the fuzzer: a 500 in prefix hashing)
        ([[1, 2**40]], False),
        ([[1, 2, 3]], True),
        (["abc"], True),
        ([1, True], False),
        ([1, 2.0], False),
        ([1, "a"], False),
        ([[1], 2], False),
        ([[1, -2]], False),
        ([{}], False),
        (5, False),
    ],
)
def test_prompt_shapes(prompt: object, ok: bool) -> None:
    raw = json.dumps({"model": "m", "prompt": prompt}).encode()
    if ok:
        parse_request(COMPLETIONS, raw)
        return
    with pytest.raises(GatewayError) as info:
        parse_request(COMPLETIONS, raw)
    assert (info.value.status, info.value.param) == (400, "prompt")


_JSON = {"content-type": "application/json"}


async def test_hostile_bodies_over_http_are_400_json() -> None:
    sched = FakeScheduler([])
    bodies = [
        b'{"model": "%s", "prompt": "\\ud800"}' % MODEL.encode(),
        b'{"model": "%s", "prompt": "\xed\xa0\x80"}' % MODEL.encode(),
        b"[" * 2000 + b"]" * 2000,
        b'{"model": "%s", "prompt": ' % MODEL.encode() + b"[" * 990 + b"]" * 990 + b"}",
    ]
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW) as url:
        async with httpx.AsyncClient(timeout=10) as client:
            for body in bodies:
                r = await client.post(f"{url}/v1/completions", content=body, headers=_JSON)
                assert r.status_code == 400, (body[:40], r.text)
                assert r.json()["error"]["code"] == 400
    assert sched.log == []


async def test_a_second_conflicting_authorization_header_is_refused() -> None:
    sched = FakeScheduler([])
    body = {"model": MODEL, "prompt": "x"}
    with running_gateway(scheduler_port=sched, fleet=lambda: VIEW, api_key="k1") as url:
        async with httpx.AsyncClient(timeout=10) as client:
            for path in ("/v1/completions", "/v1/models"):
                headers = [("authorization", "Bearer k1"), ("authorization", "Bearer other")]
                r = await client.request(
                    "POST" if path != "/v1/models" else "GET",
                    f"{url}{path}",
                    json=body if path != "/v1/models" else None,
                    headers=headers,
                )
                assert r.status_code == 401, (path, r.text)
    assert sched.log == []
