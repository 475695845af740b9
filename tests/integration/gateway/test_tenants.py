"""Must show: a key over its tokens/min gets 429 with a correct Retry-After and succeeds after
it; the tenants file reloaded under load loses no request. Real registry, scheduler, gateway
and sims on loopback."""

from __future__ import annotations

import math
import os
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.integration.gateway.conftest import MODEL, Stack, wait_for

_FILE = """
tenants:
  chat: {{weight: 2}}
keys:
  - {{key: sk-chat, tenant: chat}}
  - {{key: sk-small, tenant: small, tokens_per_min: {tpm}}}
{extra}
"""


def _write(path: Path, tpm: int = 600, extra: str = "") -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(_FILE.format(tpm=tpm, extra=extra))
    os.replace(tmp, path)  # as a ConfigMap update: the new file appears whole


def _post(stack: Stack, key: str, max_tokens: int = 20) -> httpx.Response:
    body = {"model": MODEL, "prompt": "one two three four", "max_tokens": max_tokens}
    return httpx.post(
        f"{stack.url}/v1/completions",
        json=body,
        headers={"Authorization": f"Bearer {key}"},
        timeout=30,
    )


@pytest.fixture
def tenants_file(tmp_path: Path) -> Path:
    path = tmp_path / "tenants.yaml"
    _write(path)
    return path


def test_a_key_over_its_tokens_per_minute_gets_429_then_succeeds_after_retry_after(
    stack_factory, tenants_file: Path
) -> None:  # type: ignore[no-untyped-def]
    # 600 tokens/min = 10 tokens/s; a request weighs its prompt (5 estimated) + max_tokens.
    stack: Stack = stack_factory(embedded=True, tenants=str(tenants_file))
    stack.wait_ready(stack.sims(["prefill", "decode"], itl_ms=1))
    assert _post(stack, "nope").status_code == 401
    first = _post(stack, "sk-small", max_tokens=400)
    assert first.status_code == 200
    used = first.json()["usage"]["total_tokens"]  # the charge was corrected to this
    # What is left of 600 after `used`, refilled at 10/s: a request of 400 + prompt waits.
    r = _post(stack, "sk-small", max_tokens=400)
    assert r.status_code == 429
    err = r.json()["error"]
    assert err["type"] == "tokens" and err["code"] == "rate_limit_exceeded"
    assert "tokens per min (TPM): Limit 600" in err["message"]
    retry_after = int(r.headers["retry-after"])
    prompt = first.json()["usage"]["prompt_tokens"]
    cost = 400 + max(prompt, 1)
    expected = math.ceil((cost - (600 - used)) / 10)  # tokens missing / refill rate
    assert expected - 2 <= retry_after <= expected + 1
    assert _post(stack, "sk-chat").status_code == 200  # another key is not limited
    time.sleep(retry_after)
    assert _post(stack, "sk-small", max_tokens=400).status_code == 200
    metrics = httpx.get(f"{stack.url}/metrics", timeout=5).text
    assert 'pdplane_gateway_rate_limited_total{limit="tokens",tenant="small"} 1.0' in metrics


def test_reloading_the_tenants_file_under_load_loses_no_request(
    stack_factory, tenants_file: Path
) -> None:  # type: ignore[no-untyped-def]
    stack: Stack = stack_factory(embedded=True, tenants=str(tenants_file), tenants_reload_s=0.05)
    stack.wait_ready(stack.sims(["prefill", "decode"], itl_ms=1))
    statuses: list[int] = []
    stop = threading.Event()

    def load() -> None:
        with httpx.Client(timeout=30) as client:
            while not stop.is_set():
                body = {"model": MODEL, "prompt": "a b c", "max_tokens": 4, "stream": True}
                r = client.post(
                    f"{stack.url}/v1/completions",
                    json=body,
                    headers={"Authorization": "Bearer sk-chat"},
                )
                ok = r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
                statuses.append(r.status_code if ok else -1)

    workers = [threading.Thread(target=load) for _ in range(4)]
    for w in workers:
        w.start()
    try:
        for i in range(20):
            _write(tenants_file, tpm=600 + i, extra=f"  - {{key: sk-new-{i}, tenant: t{i}}}")
            wait_for(
                lambda i=i: _post(stack, f"sk-new-{i}", max_tokens=1).status_code == 200,
                5,
                f"reload {i}",
            )
            time.sleep(0.05)
        # A key removed by a reload is refused at once; the others keep working.
        _write(tenants_file)
        wait_for(lambda: _post(stack, "sk-new-19", max_tokens=1).status_code == 401, 5, "removal")
    finally:
        stop.set()
        for w in workers:
            w.join(30)
    assert len(statuses) >= 50
    assert set(statuses) == {200}, {s: statuses.count(s) for s in set(statuses)}
    metrics = httpx.get(f"{stack.url}/metrics", timeout=5).text
    reloads = [
        line
        for line in metrics.splitlines()
        if line.startswith('pdplane_gateway_tenants_reloads_total{result="ok"}')
    ]
    assert reloads and float(reloads[0].split()[1]) >= 21


def test_the_budget_gauge_is_exported_before_the_first_request(stack_factory) -> None:  # type: ignore[no-untyped-def]
    # One decode of 1000 blocks x 16 tokens, --inflight-budget 0.5: 8000 tokens, from the
    # first scrape on (the budget follows the decode instances' KV cache, not the traffic).
    stack: Stack = stack_factory(embedded=True, inflight_budget=0.5)
    stack.wait_ready(stack.sims(["prefill", "decode"], kv_blocks=1000, block_size=16))
    line = f'pdplane_gateway_flow_budget_tokens{{model="{MODEL}"}} 8000.0'
    wait_for(lambda: line in httpx.get(f"{stack.url}/metrics", timeout=5).text, 5, line)
