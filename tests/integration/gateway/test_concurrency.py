"""Must show: 200 concurrent streaming requests, nothing lost or mixed up."""

from __future__ import annotations

import asyncio
import json

import aiohttp

from pdplane.sim.testing import RunningSims, expected_text
from pdplane.sim.tokens import WordTokenizer
from tests.integration.gateway.conftest import MODEL, Stack, wait_for

N = 200


async def _one(session: aiohttp.ClientSession, url: str, i: int) -> tuple[str, str, bytes]:
    prompt = f"request number {i}"
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8 + i % 5,
            "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {"X-Request-Id": f"conc-{i}"}
    async with session.post(f"{url}/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200, await r.text()
        return r.headers["x-request-id"], prompt, await r.read()


async def test_200_concurrent_streams_each_get_their_own_answer(
    pair: tuple[Stack, RunningSims],
) -> None:
    stack, sims = pair
    connector = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        results = await asyncio.gather(*(_one(session, stack.url, i) for i in range(N)))

    for i, (request_id, prompt, raw) in enumerate(results):
        assert request_id == f"conc-{i}"
        events = raw[:-2].split(b"\n\n")
        assert events[-1] == b"data: [DONE]" and raw.count(b"[DONE]") == 1
        chunks = [json.loads(e[len(b"data: ") :]) for e in events[:-1]]
        n = 8 + i % 5
        assert chunks[-1]["usage"]["completion_tokens"] == n
        text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
        assert text == expected_text(prompt, 0, n), i
        assert len({c["id"] for c in chunks}) == 1

    # Upstream ids are the gateway's "<client id>-pdp-...". Decode got the client's prompt as
    # prefill's token ids plus the first token, which prefill streamed (gateway.first_token).
    by_id = {r["request_id"].split("-pdp-")[0]: r for r in sims[1].records()}
    assert len(by_id) == N
    tok = WordTokenizer()
    for i in range(N):
        ids = tok.encode(f"request number {i}")
        assert by_id[f"conc-{i}"]["body"]["prompt"][:-1] == ids
    assert sims[0].held_transfers() == []
    wait_for(lambda: stack.scheduler_inflight() == 0, what="in-flight count back to 0")
