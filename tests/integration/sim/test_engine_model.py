"""The engine model behind the HTTP API: queueing, the prefix cache's metrics, push buffers."""

from __future__ import annotations

import asyncio
import re

import httpx

from pdplane.core.kv_params import DecodeRequestParams, PrefillRequestParams
from pdplane.sim.config import SimConfig
from pdplane.sim.profiles import CostModel
from pdplane.sim.testing import running_sims

MODEL = "sim-model"


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


async def test_prompts_queue_behind_each_other_in_the_token_budget() -> None:
    # 10 ms per step + 0.02 ms per prompt token, 512-token budget: a 2000-token prompt needs
    # 4 steps (512 + 512 + 512 + 464), and a second one sent at the same time gets only the
    # 48 tokens left in the first's last step, so its first token comes 4 steps later.
    cost = CostModel(step_ms=10.0, prefill_token_ms=0.02)
    with running_sims("both", cost=cost, max_num_batched_tokens=512, block_size=16) as sims:
        url = sims.urls[0] + "/v1/completions"
        prompts = [" ".join(f"w{i}x{j}" for j in range(2000)) for i in range(2)]

        async def ttft(client: httpx.AsyncClient, prompt: str) -> float:
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
            r = await client.post(url, json=body)
            assert r.status_code == 200
            return loop.time() - t0

        async with httpx.AsyncClient(timeout=30) as client:
            first, second = await asyncio.gather(*(ttft(client, p) for p in prompts))
        # A busy machine only makes steps last longer, so a lower bound on one latency
        # holds: the earlier answer needs 4 steps of >= 20 ms.
        assert min(first, second) >= 4 * 0.02
        # The queueing itself is read from the engine's own step numbers, not from the
        # difference of two client latencies (either answer can be delivered late).
        # Whenever the second arrives, it can only use what the first leaves of the budget:
        # 1952 more tokens at <= 512 a step after the first's last step.
        early, late = sorted(sims[0].records(), key=lambda r: r["first_token_step"])
        assert early["first_token_step"] - early["queued_step"] >= 4
        assert late["first_token_step"] - early["first_token_step"] >= 4
        stats = httpx.get(sims.urls[0] + "/sim/stats").json()
        assert stats["steps"] >= 8 and stats["computed_tokens"] == 4000


async def test_a_burst_waits_its_turns_on_the_api_servers_fifo() -> None:
    # 40 ms per request on the API server's one FIFO, 1 ms steps: of 4 requests sent at once
    # the k-th to get its first token cannot have it before k turns.
    cost = CostModel(step_ms=1.0, serial_request_ms=40.0)
    with running_sims("both", cost=cost) as sims:
        url = sims.urls[0] + "/v1/completions"
        loop = asyncio.get_running_loop()

        async def first_token_at(client: httpx.AsyncClient, i: int) -> float:
            body = {"model": MODEL, "prompt": f"burst {i}", "max_tokens": 1}
            r = await client.post(url, json=body)
            assert r.status_code == 200
            return loop.time() - t0

        async with httpx.AsyncClient(timeout=30) as client:
            t0 = loop.time()
            done = sorted(await asyncio.gather(*(first_token_at(client, i) for i in range(4))))
        # Lower bounds only (a busy machine makes everything later).
        for k, t in enumerate(done, start=1):
            assert t >= k * 0.040


def test_a_repeated_prompt_shows_in_vllms_prefix_cache_counters() -> None:
    with running_sims("both", block_size=4) as sims:
        url = sims.urls[0]
        body = {
            "model": MODEL,
            "prompt": "one two three four five six seven eight nine",
            "max_tokens": 2,
        }
        for _ in range(2):
            assert httpx.post(url + "/v1/completions", json=body).status_code == 200
        text = httpx.get(url + "/metrics").text
        assert _metric(text, "vllm:prefix_cache_queries_total") == 18
        assert _metric(text, "vllm:prefix_cache_hits_total") == 8  # 2 full blocks of 4
        assert _metric(text, "vllm:num_preemptions_total") == 0
        assert _metric(text, "vllm:request_success_total") == 2


def _prefill(url: str, rid: str, decode: str, decode_kv: str, words: int) -> dict:
    body = {
        "model": MODEL,
        "prompt": " ".join(f"{rid}x{i}" for i in range(words)),
        "max_tokens": 1,
        "kv_transfer_params": PrefillRequestParams(rid, decode, decode_kv).to_dict(),
    }
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return {"prompt": body["prompt"], "kv": r.json()["kv_transfer_params"]}


def _decode(url: str, leg: dict) -> None:
    body = {
        "model": MODEL,
        "prompt": leg["prompt"],
        "max_tokens": 3,
        "kv_transfer_params": leg["kv"],
    }
    r = httpx.post(url + "/v1/completions", json=body)
    assert r.status_code == 200, r.text


def test_push_fills_the_receive_buffer_and_an_overflow_recomputes_like_the_seed() -> None:
    # tiny layout, 16-token blocks: 16 KiB per block; 64 words = 4 blocks = 64 KiB per push.
    push = {"kv_mode": "push", "block_size": 16}
    configs = [
        SimConfig(role="prefill", **push),
        SimConfig(role="decode", push_buffer_bytes=100_000, push_overflow="recompute", **push),
        SimConfig(role="decode", push_buffer_bytes=100_000, push_overflow="pull", **push),
    ]
    with running_sims(configs=configs) as sims:
        p, seed_like, pdplane_like = sims
        for tag, d in (("s", seed_like), ("p", pdplane_like)):
            first = _prefill(p.url, tag + "a", d.instance_id, d.kv_endpoint, 64)
            second = _prefill(p.url, tag + "b", d.instance_id, d.kv_endpoint, 64)
            assert DecodeRequestParams.from_dict(second["kv"]).pushed
            state = httpx.get(d.url + "/sim/state").json()["load"]
            assert int(state["recv_buffer_headroom_bytes"]) == 100_000 - 65_536
            _decode(d.url, first)
            _decode(d.url, second)
        seed_stats = httpx.get(seed_like.url + "/sim/stats").json()
        assert seed_stats["push_received"] == 1 and seed_stats["push_overflow_recomputes"] == 1
        assert seed_stats["recomputed_prompts"] == 1
        pd_stats = httpx.get(pdplane_like.url + "/sim/stats").json()
        assert pd_stats["push_received"] == 1 and pd_stats["push_refused"] == 1
        assert pd_stats["push_overflow_recomputes"] == 0 and pd_stats["recomputed_prompts"] == 0
        assert p.held_transfers() == []  # every transfer completed (pushed, pulled or not)
        reasons = sorted(t["reason"] for t in p.freed_transfers())
        assert reasons == ["completed"] * 3 + ["failed"]  # the recomputed one gave up its KV
