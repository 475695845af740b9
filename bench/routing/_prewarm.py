"""Warm prefix caches before a routing point: every decode instance computes every tenant's
system prompt once, and the router's prefix index (when it has one) learns of it.

A fresh fleet starts with empty caches, so a shared-prefix point's first minutes are a
transient: each tenant's first request, and later one copy of its prefix per decode instance
(kv_aware balances decodes by their predicted step time, so a prefix spreads to the decodes
too), pull the whole system prompt. When those one-off pulls land depends on the machine's
speed: on a loaded machine more of them fall after the warmup fraction and inflate the measured
KV per request. Prewarmed, the point measures the steady state, where every decode already
holds every prefix and pulls only each prompt's uncached rest.

Waits on observable state only: each prewarm request's answer (the sim caches the prompt's
blocks when it computes them), then the router's `pdplane_scheduler_kv_index_blocks` equal to
the cached blocks the sims report (`GET /fleet/stats`), bounded by a deadline.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import aiohttp

from bench.routing.workloads import Workload
from tests.support.routing_stats import metric_sums

__all__ = ["INDEX_BLOCKS_METRIC", "prewarm_decodes"]

#: The embedded scheduler's (instance, block) entry count in its prefix index.
INDEX_BLOCKS_METRIC = "pdplane_scheduler_kv_index_blocks"
_POLL_S = 0.05


async def prewarm_decodes(
    http: aiohttp.ClientSession,
    work: Workload,
    decode_urls: Sequence[str],
    control: str,
    *,
    model: str = "sim-model",
    metrics_url: str = "",
    timeout_s: float = 60.0,
) -> dict[str, Any]:
    """Sends each tenant's first request of `work` (max_tokens 1, not streamed) straight to
    every decode instance in `decode_urls` (one decode's requests in turn, the decodes at
    once), then, with `metrics_url` (a gateway's /metrics), waits until the router's prefix
    index holds as many (instance, block) entries as the sims' caches (`control` + /fleet/stats).

    Returns {"prewarm_requests", "prewarm_cached_blocks"}. Raises RuntimeError when a request
    is not answered 200 or the index does not match within `timeout_s` seconds.
    """
    firsts: dict[str, list[dict[str, str]]] = {}
    for turn in work.turns:
        if turn.tenant and turn.turn == 0:
            firsts.setdefault(turn.tenant, turn.messages)
    timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def warm(url: str) -> None:
        for messages in firsts.values():
            body = {"model": model, "messages": messages, "max_tokens": 1}
            async with http.post(url + "/v1/chat/completions", json=body, timeout=timeout) as r:
                if r.status != 200:
                    text = (await r.read())[:200].decode(errors="replace")
                    raise RuntimeError(f"prewarm of {url} answered {r.status}: {text}")
                await r.read()

    await asyncio.gather(*(warm(u) for u in decode_urls))
    cached = await _sims_cached_blocks(http, control)
    if metrics_url:
        deadline = time.monotonic() + timeout_s
        indexed = -1.0
        while indexed != cached:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"prefix index holds {indexed:.0f} blocks, the sims {cached}, "
                    f"{timeout_s} s after the prewarm"
                )
            await asyncio.sleep(_POLL_S)
            indexed = await _index_blocks(http, metrics_url)
    return {"prewarm_requests": len(firsts) * len(decode_urls), "prewarm_cached_blocks": cached}


async def _sims_cached_blocks(http: aiohttp.ClientSession, control: str) -> int:
    async with http.get(control + "/fleet/stats") as r:
        stats = await r.json()
    return sum(int(x["stats"]["cached_blocks"]) for x in stats["instances"])


async def _index_blocks(http: aiohttp.ClientSession, metrics_url: str) -> float:
    async with http.get(metrics_url) as r:
        return metric_sums(await r.text()).get(INDEX_BLOCKS_METRIC, -1.0)
