"""On real vLLM 0.32 CPU: with `--enable-prompt-tokens-details` the gateway's usage reports
prefill's prefix cache hit (vLLM's `remote_prefill_cached_tokens`, returned with the prefill
leg's kv_transfer_params through the pdplane connector), streamed and not."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdplane.gateway.testing import running_gateway
from pdplane.launch.process import http_ok, wait_until
from tests.e2e.conftest import MODEL_NAME, VllmPair
from tests.e2e.stack.conftest import fresh_text
from tests.integration.scheduler.fixtures import running_scheduler

pytestmark = pytest.mark.vllm

_BLOCK = 128  # the CPU KV cache block size (tokens)


@pytest.fixture
def detailed_url(registry_address: str, vllm_pair: VllmPair) -> Iterator[str]:
    with (
        running_scheduler(registry_address) as scheduler,
        running_gateway(scheduler, registry_address, enable_prompt_tokens_details=True) as url,
    ):
        wait_until(lambda: http_ok(f"{url}/health"), 60.0, what="gateway /health 200")
        yield url


def _usage(url: str, body: dict[str, Any]) -> dict[str, Any]:
    if not body.get("stream"):
        r = httpx.post(f"{url}/v1/completions", json=body, timeout=120.0)
        assert r.status_code == 200, r.text
        return dict(r.json()["usage"])
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120.0) as r:
        assert r.status_code == 200, r.read()
        chunks = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: {")]
    usages = [c["usage"] for c in chunks if c.get("usage")]
    assert len(usages) == 1, chunks
    return dict(usages[0])


def test_usage_reports_prefill_s_prefix_cache_hit(detailed_url: str) -> None:
    # Twice a fresh text: over one KV cache block whatever the run's prompt counter reached
    # (its words grow with it: three copies passed 1,024 tokens late in a run).
    text = fresh_text("usage")
    body = {"model": MODEL_NAME, "prompt": f"{text} {text}", "max_tokens": 4}
    cold = _usage(detailed_url, body)
    assert cold["prompt_tokens_details"] == {"cached_tokens": 0}, cold
    hit = (cold["prompt_tokens"] - 1) // _BLOCK * _BLOCK  # whole blocks; never the last token
    assert hit >= _BLOCK, cold
    warm = _usage(detailed_url, body)
    assert warm["prompt_tokens_details"] == {"cached_tokens": hit}, warm
    streamed = _usage(
        detailed_url, {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    assert streamed["prompt_tokens_details"] == {"cached_tokens": hit}, streamed
