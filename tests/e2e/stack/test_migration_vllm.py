"""Request migration on real vLLM CPU, 1P2D: a greedy 200-token stream whose decode is
SIGKILLed after ~50 tokens continues on the other decode. The client gets one stream (no
error event, one [DONE]) of 200 tokens whose text is one plain instance's greedy answer; the
text after the seam is that instance's answer to the prompt plus the tokens sent before it
(as token ids); usage counts every token once; prefill's KV is freed.

The session's pair (prefill-0, decode-0) plus one more decode started here, the victim: the
gateway (embedded scheduler, decodes taken in turn) is steered onto it with a probe request.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdplane.gateway.testing import running_gateway
from pdplane.launch.ports import free_port_run
from pdplane.launch.process import http_ok, wait_until
from pdplane.launch.vllm_cpu import VllmCpuInstance, VllmCpuOptions
from tests.e2e.conftest import (
    MODEL_NAME,
    PULL_TIMEOUT_S,
    START_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    RegistryHandle,
    VllmPair,
)
from tests.e2e.connector.helpers import idle_free_blocks, metric
from tests.e2e.stack.conftest import fresh_text

pytestmark = pytest.mark.vllm

MAX_TOKENS = 200
KILL_AT = 50
VICTIM = "decode-victim"


@pytest.fixture
def victim(
    tiny_model: Path, registry: RegistryHandle, vllm_pair: VllmPair, tmp_path: Path
) -> Iterator[VllmCpuInstance]:
    """A second decode (kv_consumer) registered beside the session's pair."""
    inst = VllmCpuInstance(
        VllmCpuOptions(
            model=tiny_model,
            port=free_port_run(),
            served_model_name=MODEL_NAME,
            role="kv_consumer",
            kv_port=free_port_run(),
            instance_id=VICTIM,
            omp_threads_bind="1",
            registry=registry.address,
            transfer_timeout_s=TRANSFER_TIMEOUT_S,
            pull_timeout_s=PULL_TIMEOUT_S,
            kv_load_failure_policy="recompute",
        ),
        tmp_path / "victim.log",
    )
    inst.process.die_with_parent = True
    inst.start()
    try:
        inst.wait_healthy(START_TIMEOUT_S)
        wait_until(lambda: registry.get(VICTIM) is not None, 30.0, what="the victim registered")
        yield inst
    finally:
        inst.stop(grace_s=2.0)
        # Gone from the registry (lease lapsed) before later tests schedule.
        wait_until(lambda: registry.get(VICTIM) is None, 30.0, what="the victim's lease gone")


def _sigkill(inst: VllmCpuInstance) -> None:
    pid = inst.process.pid
    assert pid is not None
    os.killpg(os.getpgid(pid), signal.SIGKILL)  # API server and engine core, as an OOM kill


def _complete(url: str, body: dict[str, Any]) -> dict[str, Any]:
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()  # type: ignore[no-any-return]


def test_a_decode_sigkilled_mid_stream_the_stream_continues_on_the_other(
    registry: RegistryHandle,
    vllm_pair: VllmPair,
    vllm_reference: VllmCpuInstance,
    victim: VllmCpuInstance,
    whole_tokens: list[int],
) -> None:
    prompt = fresh_text("migration")
    sampling = {
        "model": MODEL_NAME,
        "temperature": 0,
        "ignore_eos": True,
        # Tokens with text of their own: the seam never falls inside a character (the
        # seam's token count below is then the tokens the client has).
        "allowed_token_ids": whole_tokens,
    }
    # One plain instance's greedy answer, with its ids.
    ref = _complete(
        vllm_reference.url,
        {**sampling, "prompt": prompt, "max_tokens": MAX_TOKENS, "return_token_ids": True},
    )["choices"][0]
    ref_ids, ref_prompt = ref["token_ids"], ref["prompt_token_ids"]
    assert len(ref_ids) == MAX_TOKENS

    with running_gateway(
        "embedded",
        registry.address,
        decode_policy="round_robin",
        stream_idle_timeout_s=30.0,
    ) as url:
        wait_until(lambda: http_ok(f"{url}/health"), 60.0, what="gateway /health 200")
        # Decodes in turn: after a probe on decode-0 the next stream goes to the victim.
        for _ in range(4):
            probe = {**sampling, "prompt": fresh_text("probe"), "max_tokens": 2, "stream": True}
            with httpx.stream(
                "POST",
                f"{url}/v1/completions",
                json=probe,
                headers={"X-Pdplane-Route": "1"},
                timeout=120,
            ) as r:
                r.read()
                went = r.headers.get("x-pdplane-decode", "")
            if went.startswith(vllm_pair.decode_id):
                break
        else:
            pytest.fail("the probes never went to decode-0")

        body = {
            **sampling,
            "prompt": prompt,
            "max_tokens": MAX_TOKENS,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        events: list[dict[str, Any]] = []
        raw_done: list[bool] = []
        tokens = 0
        killed = threading.Event()
        with httpx.stream(
            "POST",
            f"{url}/v1/completions",
            json=body,
            headers={"X-Pdplane-Route": "1"},
            timeout=300,
        ) as r:
            assert r.status_code == 200
            assert r.headers.get("x-pdplane-decode", "").startswith(VICTIM), r.headers
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    raw_done.append(True)
                    continue
                event = json.loads(line[6:])
                events.append(event)
                tokens += len(event.get("choices") or ())
                if tokens >= KILL_AT and not killed.is_set():
                    _sigkill(victim)
                    killed.set()
        recomputed = metric(url, "pdplane_gateway_migration_recomputed_tokens_total")
        migrations = metric(url, "pdplane_gateway_migrations_total", reason="lost")

    assert killed.is_set()
    assert raw_done == [True]
    assert not [e for e in events if "error" in e], events[-3:]
    text = "".join(c["text"] for e in events for c in e.get("choices") or ())
    assert text == ref["text"]
    usage = events[-1]["usage"]
    assert usage["completion_tokens"] == MAX_TOKENS, usage
    assert usage["prompt_tokens"] == len(ref_prompt), usage
    assert migrations == 1
    # The seam: the resumed leg's prompt was the prompt plus the tokens sent before it.
    sent = int(recomputed) - len(ref_prompt)
    assert KILL_AT <= sent < MAX_TOKENS, sent
    after = _complete(
        vllm_reference.url,
        {**sampling, "prompt": ref_prompt + ref_ids[:sent], "max_tokens": MAX_TOKENS - sent},
    )["choices"][0]["text"]
    assert after and text.endswith(after)
    print(f"seam after {sent} of {MAX_TOKENS} tokens; {len(after)} characters after it")
    # Prefill's KV: nothing held once the stream ended (every block free again).
    idle_free_blocks(registry, vllm_pair.prefill_id, timeout=15.0)
