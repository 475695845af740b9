"""Must show (the ordering behind it): a quiet tenant beside a tenant that floods the in-flight
budget gets its first tokens about as fast as alone with `--flow-policy fair`, and far later with
`fifo`. Real registry, gateway (scheduler embedded) and sims on loopback.

The case that decides it is a burst of the quiet tenant past its share of the budget (two
active tenants: half of it) while the flood keeps the budget full: it must not wait for the
flood's completions. Times are only compared with each other (alone < beside with fair <
beside with FIFO), never with constants; that nothing of the quiet tenant waited at the gateway
is read from the gateway's own count of requests admitted at once.
"""

from __future__ import annotations

import random
import statistics
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.gateway.conftest import MODEL, Stack, wait_for

_TENANTS = """
keys:
  - {key: sk-quiet, tenant: quiet}
  - {key: sk-noisy, tenant: noisy}
"""
#: A request weighs prompt + max_tokens = 256 tokens = 16 KV blocks of 16 (decode's KV holds
#: exactly what the gateway counts: no block is shared or half used).
_PROMPT, _MAX_TOKENS = 196, 60
#: Decode's KV cache: 128 blocks = 2048 tokens = 8 requests; --inflight-budget 0.5 = 4.
_KV_BLOCKS = 128
#: The quiet tenant's burst: twice its share of the budget (2 requests), its share of the KV.
_BURST = 4
_FLOOD = 16
#: Admitted without waiting: the flow wait histogram's first bucket (an immediate admission
#: observes 0 s).
_AT_ONCE = (
    f'pdplane_gateway_flow_wait_seconds_bucket{{le="0.005",model="{MODEL}",priority="0",'
    'tenant="quiet"}'
)


def _stream(url: str, key: str, out: list[float], i: int) -> None:
    """One streamed completion; `out[i]` = seconds to the first token's event."""
    body = {
        "model": MODEL,
        "prompt": [random.randrange(100, 20000) for _ in range(_PROMPT)],  # no prefix hit
        "max_tokens": _MAX_TOKENS,
        "stream": True,
    }
    started = time.perf_counter()
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if out[i] < 0 and '"text"' in line:
                out[i] = time.perf_counter() - started
            if line == "data: [DONE]":
                break
    assert out[i] >= 0


def _burst(url: str, key: str, n: int) -> tuple[list[float], list[threading.Thread]]:
    """`n` requests of `key` at once; returns their TTFTs (filled as they arrive) and threads."""
    ttfts = [-1.0] * n
    threads = [threading.Thread(target=_stream, args=(url, key, ttfts, i)) for i in range(n)]
    for t in threads:
        t.start()
    return ttfts, threads


def _quiet_at_once(stack: Stack) -> float:
    for line in httpx.get(f"{stack.url}/metrics", timeout=5).text.splitlines():
        if line.startswith(_AT_ONCE):
            return float(line.split()[1])
    return 0.0


def _start(stack_factory, tenants: Path, policy: str) -> Stack:  # type: ignore[no-untyped-def]
    stack: Stack = stack_factory(
        embedded=True,
        tenants=str(tenants),
        flow_policy=policy,
        inflight_budget=0.5,
        queue_timeout_s=30,
    )
    # Prefill: a prompt in ~50 ms; decode: 59 steps of 20 ms after the first token.
    length = {"max_model_len": _KV_BLOCKS * 16, "block_size": 16}
    prefill = stack.sims(["prefill", "prefill"], ttft_per_token_ms=0.25, itl_ms=1, **length)
    decode = stack.sims(["decode"], itl_ms=20, kv_blocks=_KV_BLOCKS, **length)
    stack.wait_ready(prefill)
    stack.wait_ready(decode)
    budget = f'pdplane_gateway_flow_budget_tokens{{model="{MODEL}"}} 1024.0'
    wait_for(lambda: budget in httpx.get(f"{stack.url}/metrics", timeout=5).text, 10, budget)
    return stack


def _beside_flood(stack: Stack) -> list[float]:
    """The quiet tenant's burst once the noisy tenant's flood fills the budget and queues."""
    flow = stack.app.state.flow
    _, flood = _burst(stack.url, "sk-noisy", _FLOOD)
    wait_for(lambda: flow.queued(MODEL) >= _FLOOD - 4 - 1, 10, "the flood to queue")
    quiet, threads = _burst(stack.url, "sk-quiet", _BURST)
    for t in [*threads, *flood]:
        t.join(60)
    return quiet


@pytest.mark.timeout(180)
def test_a_quiet_tenant_beside_a_flood_fair_near_alone_fifo_far_worse(
    stack_factory, tmp_path: Path
) -> None:  # type: ignore[no-untyped-def]
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(_TENANTS)
    fair = _start(stack_factory, tenants, "fair")
    alone, threads = _burst(fair.url, "sk-quiet", _BURST)
    for t in threads:
        t.join(60)
    before = _quiet_at_once(fair)
    beside = _beside_flood(fair)
    # Fair: every request of the burst admitted at once (past its share of the budget, within
    # its share of the KV cache), none behind the flood's completions.
    assert _quiet_at_once(fair) - before == _BURST
    fifo = _start(stack_factory, tenants, "fifo")
    behind = _beside_flood(fifo)
    a, f, q = (statistics.median(x) for x in (alone, beside, behind))
    # FIFO waits behind the flood's queue (12 requests, 4 at a time: about three of its
    # requests' decode times).
    assert a < q and f < q and max(beside) < min(behind)
    # Fair: even its slowest request stays within an eighth of FIFO's wait of its alone value,
    # i.e. well under one flood completion (waiting for one was the failure).
    assert max(beside) - a < (q - a) / 8, (alone, beside, behind)
