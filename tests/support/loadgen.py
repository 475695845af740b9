"""Closed-loop asyncio load generator: N concurrent streaming chat requests, zero think time.

Each finished request is checked: HTTP 200, SSE framing, exactly `max_tokens` token chunks and
the final `data: [DONE]`. Latency is end to end (request sent -> [DONE] read), TTFT is request
sent -> first token chunk read (ms).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import json
import time
from dataclasses import dataclass, field

import aiohttp
import httpx

from tests.support.stats import percentile

__all__ = ["LoadResult", "percentile", "run_load"]

_WORDS = (
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
)


@dataclass
class LoadResult:
    """One measured window: counts, throughput and latency samples (ms)."""

    concurrency: int
    duration_s: float
    ok: int = 0
    errors: int = 0
    latencies_ms: list[float] = field(default_factory=list)
    ttfts_ms: list[float] = field(default_factory=list)
    first_error: str = ""
    #: slowest request seen, measured or not (sizes the next window) (ms).
    max_latency_ms: float = 0.0

    @property
    def rps(self) -> float:
        return self.ok / self.duration_s if self.duration_s else 0.0

    def p(self, q: float) -> float:
        return percentile(self.latencies_ms, q)


def _body(model: str, seq: int, max_tokens: int, prompt_words: int) -> bytes:
    words = " ".join(_WORDS[(seq + i) % len(_WORDS)] for i in range(prompt_words))
    return json.dumps(
        {
            "model": model,
            "messages": [{"role": "user", "content": f"request {seq}: {words}"}],
            "max_tokens": max_tokens,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    ).encode()


def _token_chunks(data: bytes) -> int:
    """Non-empty chat content deltas in `data` (compact or spaced JSON)."""
    compact = data.count(b'"delta":{"content"') - data.count(b'"delta":{"content":""')
    spaced = data.count(b'"delta": {"content"') - data.count(b'"delta": {"content": ""')
    return compact + spaced


async def _one(
    session: aiohttp.ClientSession, url: str, body: bytes, max_tokens: int
) -> tuple[float, float]:
    """Sends one request; returns (ttft_ms, latency_ms). Raises ValueError on a bad reply."""
    start = time.perf_counter()
    ttft = 0.0
    buf = bytearray()
    async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
        if r.status != 200:
            raise ValueError(f"HTTP {r.status}: {(await r.read())[:200]!r}")
        async for chunk in r.content.iter_any():
            if not ttft and _token_chunks(chunk):
                ttft = time.perf_counter() - start
            buf += chunk
    end = time.perf_counter()
    if not buf.endswith(b"data: [DONE]\n\n"):
        raise ValueError(f"stream did not end with [DONE]: {bytes(buf[-80:])!r}")
    if (at := buf.find(b'data: {"error"')) >= 0:  # then [DONE], as vLLM ends a failed request
        raise ValueError(f"error event: {bytes(buf[at : at + 200])!r}")
    tokens = _token_chunks(bytes(buf))
    if tokens != max_tokens:
        raise ValueError(f"{tokens} token chunks, expected {max_tokens}")
    return (ttft or end - start) * 1000, (end - start) * 1000


async def run_load(
    url: str,
    *,
    concurrency: int,
    duration_s: float,
    warmup_s: float = 0.5,
    model: str = "sim-model",
    max_tokens: int = 16,
    prompt_words: int = 32,
    request_timeout_s: float = 60.0,
) -> LoadResult:
    """Drives `url` (…/v1/chat/completions) with `concurrency` streams for warmup + duration.

    Throughput counts requests that finish inside the measured window; latency samples come
    from requests that also started inside it.
    """
    seq = itertools.count()
    result = LoadResult(concurrency, duration_s)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    measure_from, stop_at = t0 + warmup_s, t0 + warmup_s + duration_s
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    timeout = aiohttp.ClientTimeout(total=request_timeout_s)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def worker() -> None:
            while (started := loop.time()) < stop_at:
                body = _body(model, next(seq), max_tokens, prompt_words)
                try:
                    ttft, latency = await _one(session, url, body, max_tokens)
                except (aiohttp.ClientError, ValueError, TimeoutError) as exc:
                    if measure_from <= loop.time() <= stop_at:
                        result.errors += 1
                        result.first_error = result.first_error or repr(exc)[:300]
                    continue
                ended = loop.time()
                result.max_latency_ms = max(result.max_latency_ms, latency)
                if measure_from <= ended <= stop_at:
                    result.ok += 1
                    if started >= measure_from:
                        result.latencies_ms.append(latency)
                        result.ttfts_ms.append(ttft)

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return result


async def completion_burst(
    url: str, body: dict[str, object], total: int, concurrency: int, timeout_s: float = 30.0
) -> collections.Counter[int]:
    """Sends `total` streamed requests `body` to `url`/v1/completions, `concurrency` at a time,
    and counts them by HTTP status: the status when the stream ended whole (`data: [DONE]`,
    no error event), minus the status when it did not (an error answer or event, or a
    truncated stream)."""
    statuses: collections.Counter[int] = collections.Counter()
    gate = asyncio.Semaphore(concurrency)

    async def one(client: httpx.AsyncClient) -> None:
        async with gate:
            async with client.stream("POST", url + "/v1/completions", json=body) as r:
                data = b"".join([chunk async for chunk in r.aiter_bytes()])
            done = data.endswith(b"data: [DONE]\n\n") and b'data: {"error"' not in data
            statuses[r.status_code if done else -r.status_code] += 1

    async with httpx.AsyncClient(timeout=timeout_s) as client:
        await asyncio.gather(*(one(client) for _ in range(total)))
    return statuses
