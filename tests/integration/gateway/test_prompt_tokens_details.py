"""`usage.prompt_tokens_details.cached_tokens` reports the fleet's prefix cache hit, as
`vllm serve --enable-prompt-tokens-details` reports one instance's: the prompt tokens prefill
did not compute, streamed and not, when the gateway's flag asks."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from tests.integration.gateway.conftest import MODEL, Stack

#: 48 sim tokens: two full 16-token blocks that a repeat finds in prefill's prefix cache.
_PROMPT = "the prefill instance keeps the prompt " * 8


def _usage(stack: Stack, body: dict[str, Any]) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": _PROMPT, "max_tokens": 4, **body}
    if not body.get("stream"):
        r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        return dict(r.json()["usage"])
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: {")]
    usages = [json.loads(e)["usage"] for e in events if json.loads(e).get("usage")]
    assert len(usages) == 1, events  # the include_usage chunk
    return dict(usages[0])


@pytest.fixture
def detailed(stack_factory: Callable[..., Stack]) -> Stack:
    stack = stack_factory(embedded=True, enable_prompt_tokens_details=True)
    stack.wait_ready(stack.sims(["prefill", "decode"], itl_ms=1))
    return stack


def test_usage_carries_prefill_s_prefix_cache_hit(detailed: Stack) -> None:
    cold = _usage(detailed, {})
    assert cold["prompt_tokens_details"] == {"cached_tokens": 0}  # nothing cached yet
    prompt = cold["prompt_tokens"]
    hit = (prompt - 1) // 16 * 16  # whole blocks, the last prompt token always computed
    assert hit >= 32
    assert _usage(detailed, {})["prompt_tokens_details"] == {"cached_tokens": hit}
    include = {"stream": True, "stream_options": {"include_usage": True}}
    # A stream whose first token comes from prefill (the gateway writes the usage chunk)...
    streamed = _usage(detailed, include)
    assert streamed["prompt_tokens_details"] == {"cached_tokens": hit}
    assert streamed["prompt_tokens"] == prompt
    # ...and one relayed from decode as it came (a seed keeps decode's first token).
    relayed = _usage(detailed, {**include, "seed": 7})
    assert relayed["prompt_tokens_details"] == {"cached_tokens": hit}


def test_without_the_flag_usage_is_relayed_as_the_instances_write_it(stack: Stack) -> None:
    stack.wait_ready(stack.sims(["prefill", "decode"], itl_ms=1))
    for _ in range(2):  # vLLM's usage without --enable-prompt-tokens-details: null details
        assert _usage(stack, {}).get("prompt_tokens_details") is None


def test_a_request_decode_prefills_alone_reports_decode_s_hit(detailed: Stack) -> None:
    """Decode holding all but a few prompt tokens computes the rest itself (no prefill leg):
    the usage then carries the hit that let it, decode's cached tokens (the sim, like a vLLM
    without the flag, reports none itself). Token ids: routed by prefix with no tokenizer."""
    prompt = [(7 * i) % 500 + 1 for i in range(48)]
    routed: list[tuple[str, dict[str, Any]]] = []
    for _ in range(4):
        r = httpx.post(
            f"{detailed.url}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
            headers={"X-Pdplane-Route": "1"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        routed.append((r.headers["x-pdplane-prefill"], r.json()["usage"]))
        if r.headers["x-pdplane-prefill"] == "none":
            held = int(r.headers["x-pdplane-decode"].split("cached_tokens=")[1])
            assert held == 48, r.headers  # the whole prompt: three 16-token blocks
            # As vLLM counts a hit: whole blocks, never the last token (computed for logits).
            assert r.json()["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
            return
    pytest.fail(f"no request was served by decode alone: {routed}")
