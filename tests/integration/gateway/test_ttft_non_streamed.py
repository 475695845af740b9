"""TTFT counts every request, as vLLM's own histogram does: a non-streamed request's first
token is the one prefill computes, so its TTFT is arrival -> prefill's answer (a streamed one's:
arrival -> the first event relayed)."""

from __future__ import annotations

import httpx

from tests.integration.gateway.conftest import MODEL, Stack


def _metrics(stack: Stack) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{stack.url}/metrics", timeout=5).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def test_a_non_streamed_request_counts_its_ttft_at_prefill_s_answer(stack: Stack) -> None:
    # Decode takes >= 10 x 40 ms after prefill answered: TTFT must not include that.
    sims = stack.sims(["prefill", "decode"], itl_ms=40)
    stack.wait_ready(sims)
    before = _metrics(stack)
    body = {"model": MODEL, "prompt": "hello there", "max_tokens": 10, "ignore_eos": True}
    r = httpx.post(f"{stack.url}/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    after = _metrics(stack)

    def grew(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert grew("pdplane_gateway_ttft_seconds_count") == 1
    ttft = grew("pdplane_gateway_ttft_seconds_sum")
    prefill_leg = grew('pdplane_gateway_leg_latency_seconds_sum{leg="prefill"}')
    e2e = grew("pdplane_gateway_e2e_latency_seconds_sum")
    # arrival -> prefill's answer: at least the prefill leg, well before the whole answer.
    assert prefill_leg <= ttft < e2e, (prefill_leg, ttft, e2e)
    assert e2e - ttft >= 9 * 0.040, (ttft, e2e)  # decode's steps after the first token
