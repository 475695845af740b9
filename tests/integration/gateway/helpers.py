"""What several gateway integration tests share: raw-socket requests, admission bodies, stream
readers and the gateway's metrics (fixtures are in conftest.py)."""

from __future__ import annotations

import json
import socket
import time
from typing import Any
from urllib.parse import urlsplit

import httpx

from tests.integration.gateway.conftest import MODEL, Stack

#: A prompt whose first token the sims compute (first-token tests).
FIRST_TOKEN_PROMPT = "The prefill instance computes the first token"

#: 401 prompt + 16 output tokens (estimated 516 without a tokenizer): 4-5 blocks of 128.
SHORT_BODY = {"model": MODEL, "prompt": "word " * 400, "max_tokens": 16, "stream": True}
#: 701 prompt + 199 output tokens, streamed at 50 ms a token (~10 s): its prompt alone holds 6
#: blocks of 128 (what decode's load reports show), 7 once decoded.
LONG_BODY = {"model": MODEL, "prompt": "word " * 700, "max_tokens": 199, "stream": True}


def open_request(
    url: str, path: str, body: dict[str, object], request_id: str = ""
) -> socket.socket:
    """Sends one POST over a fresh connection and returns the socket (response unread), so
    that "going away" is exactly a closed TCP connection."""
    parts = urlsplit(url)
    sock = socket.create_connection((parts.hostname, parts.port), timeout=10)
    data = json.dumps(body).encode()
    extra = f"X-Request-Id: {request_id}\r\n" if request_id else ""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {parts.netloc}\r\nContent-Type: application/json\r\n"
        f"{extra}Content-Length: {len(data)}\r\n\r\n"
    )
    sock.sendall(head.encode() + data)
    return sock


def hold_decode(stack: Stack) -> socket.socket:
    """A long request (`LONG_BODY`) that holds 6-7 of the decode's 8 blocks; returns its socket
    once it streams."""
    sock = open_request(stack.url, "/v1/completions", LONG_BODY)
    buf = b""
    while b"data: " not in buf:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed early: {buf!r}"
        buf += chunk
    return sock


def client_stream(url: str, path: str, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(the joined text, the last usage) of one streamed request on `path`; fails on an
    error event or a missing `[DONE]`."""
    text: list[str] = []
    usage: dict[str, Any] = {}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        events = [e for e in r.read().split(b"\n\n") if e]
    assert events[-1] == b"data: [DONE]"
    for event in events[:-1]:
        chunk = httpx.Response(200, content=event[6:]).json()
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            text.append(
                choice["delta"].get("content") or "" if "delta" in choice else choice["text"]
            )
        usage = chunk.get("usage") or usage
    return "".join(text), usage


def timed_events(url: str, body: dict[str, Any]) -> tuple[list[float], list[bytes]]:
    """(arrival time of each event, s since the request; the events as `data: ...` lines) of
    one stream on /v1/completions."""
    stamps: list[float] = []
    events: list[bytes] = []
    start = time.perf_counter()
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                stamps.append(time.perf_counter() - start)
                events.append(line.encode())
    return stamps, events


def sse_text(events: list[bytes]) -> str:
    """The joined completion text of `data: ...` lines (as `timed_events` gives them); fails
    on an error event."""
    chunks = [json.loads(e[6:]) for e in events if e.startswith(b"data: {")]
    assert all("error" not in c for c in chunks), chunks
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def metric(stack: Stack, line_start: str) -> float:
    """The value of the gateway's /metrics sample whose line starts with `line_start` (name
    and labels), 0.0 when there is none yet."""
    for line in httpx.get(f"{stack.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(line_start + " "):
            return float(line.split()[1])
    return 0.0
