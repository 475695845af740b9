"""Must show: SSE framing, the usage chunk, a single [DONE], nothing of prefill's output."""

from __future__ import annotations

import json

import httpx

from pdplane.sim.testing import RunningSims, expected_text
from tests.integration.gateway.conftest import MODEL, Stack


def _events(raw: bytes) -> list[bytes]:
    """Splits an SSE body on blank lines; asserts nothing trails the last event."""
    assert raw.endswith(b"\n\n"), raw[-80:]
    return raw[:-2].split(b"\n\n")


def test_stream_with_include_usage(pair: tuple[Stack, RunningSims]) -> None:
    stack, sims = pair
    body = {"model": MODEL, "prompt": "The KV cache", "max_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    with httpx.stream("POST", f"{stack.url}/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        assert r.headers["content-type"] == "text/event-stream"
        raw = r.read()

    events = _events(raw)
    assert all(e.startswith(b"data: ") and b"\n" not in e for e in events)
    assert events.count(b"data: [DONE]") == 1 and events[-1] == b"data: [DONE]"
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    usage, content = chunks[-1], chunks[:-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 6
    assert all("usage" not in c or c["usage"] is None for c in content)
    # Nothing of prefill's answer: one completion id, exactly the 6 decode tokens, and the
    # text is decode's deterministic output for this prompt.
    assert len({c["id"] for c in chunks}) == 1
    assert len(content) == 6
    assert "".join(c["choices"][0]["text"] for c in content) == expected_text("The KV cache", 0, 6)
    assert len(sims[0].records()) == len(sims[1].records()) == 1
    assert sims[1].records()[0]["request_id"] == r.headers["x-request-id"]


def test_chat_stream_without_usage_has_no_usage_chunk(pair: tuple[Stack, RunningSims]) -> None:
    stack, _ = pair
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
            "max_completion_tokens": 4, "stream": True}  # fmt: skip
    with httpx.stream("POST", f"{stack.url}/v1/chat/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
        events = _events(r.read())
    assert events[-1] == b"data: [DONE]" and events.count(b"data: [DONE]") == 1
    chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
    assert all(c["choices"] for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
