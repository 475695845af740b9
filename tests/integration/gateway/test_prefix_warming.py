"""Prefix warming through the whole path: a prefix many requests read is copied onto the idle
prefill that lacks it, by a request the gateway sends (scheduler remote and embedded).

Two prefill and one decode sims, kv_aware with the shipped warming rule (8 reads in 10 s per
holder); token-id prompts, so the gateway knows the ids with no tokenizer. After 9 requests
over one shared prefix of 4,096 tokens the second prefill holds it too (its KV events say so), the
gateway counted one warm sent, and every client request was answered.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx
from prometheus_client.parser import text_string_to_metric_families

from pdplane.core.prefix_hash import block_hashes
from pdplane.scheduler.warming import WARM_MIN_TOKENS, WARM_REQUESTS_PER_HOLDER
from tests.integration.gateway.conftest import MODEL, Stack, wait_for

BS = 16  # the sims' KV cache block size
# Long enough that computing it again costs more than the holder's predicted queue ever is
# here (the holder keeps every request).
SHARED = [(i * 7919) % 1900 + 10 for i in range(4 * WARM_MIN_TOKENS)]
# Each request's own part is longer than --local-prefill-max-tokens (2048), so the decode that
# holds the shared prefix after the first transfer never computes a prompt itself: every
# request has a prefill leg, the only kind of decision that warms.
OWN = 2100


def _warms(stack: Stack, result: str) -> float:
    text = httpx.get(f"{stack.url}/metrics", timeout=5).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if (
                sample.name == "pdplane_gateway_prefix_warms_total"
                and sample.labels.get("result") == result
            ):
                return float(sample.value)
    return 0.0


def _holds(stack: Stack, ids: list[int], instance: str) -> bool:
    hashes = block_hashes(ids, BS)
    return stack.kv_index().index.match(hashes, instances=[instance]).get(instance, 0) >= len(
        hashes
    )


def test_a_prefix_every_request_reads_is_copied_to_the_idle_prefill(stack: Stack) -> None:
    sims = stack.sims(["prefill", "prefill", "decode"], itl_ms=1, max_model_len=8192)
    stack.wait_ready(sims)
    prefills = [h.instance_id for h in sims.handles if h.role == "prefill"]
    holders: list[str] = []
    # The first request computes the prefix (no read of a held prefix); the next 8 read it.
    for n in range(WARM_REQUESTS_PER_HOLDER + 1):
        prompt = SHARED + [2000 + (n * OWN + k) % 5000 for k in range(OWN)]
        r = httpx.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 4},
            headers={"X-Pdplane-Route": "1"},
            timeout=30,
        )
        assert r.status_code == 200, r.text
        holders.append(r.headers["x-pdplane-prefill"].partition(";")[0])
        if n == 0:  # the next requests are routed on the first one's blocks
            wait_for(lambda: _holds(stack, SHARED, holders[0]), 10, "the first holder's blocks")
    assert set(holders) == {holders[0]}, holders  # kv_aware keeps the prefix on its holder
    (other,) = set(prefills) - {holders[0]}
    wait_for(lambda: _warms(stack, "sent") == 1, 10, "one prefix warm sent")
    wait_for(lambda: _holds(stack, SHARED, other), 10, "the idle prefill to hold the prefix")
    assert _warms(stack, "failed") == 0 and _warms(stack, "dropped") == 0


def test_no_warm_below_the_rule(stack_factory: Callable[..., Stack]) -> None:
    stack = stack_factory()
    sims = stack.sims(["prefill", "prefill", "decode"], itl_ms=1)
    stack.wait_ready(sims)
    short = SHARED[: WARM_MIN_TOKENS - BS]  # shorter than --kv-warm-min-tokens
    for n in range(2 * WARM_REQUESTS_PER_HOLDER):
        r = httpx.post(
            f"{stack.url}/v1/completions",
            json={"model": MODEL, "prompt": short + [900 + n] * OWN, "max_tokens": 2},
            timeout=30,
        )
        assert r.status_code == 200, r.text
    assert _warms(stack, "sent") == _warms(stack, "failed") == _warms(stack, "dropped") == 0
