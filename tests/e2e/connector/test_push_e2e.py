"""Push mode between two real vLLM CPU instances: prefill pushes the prompt's KV layer by layer
during its forward into decode's bounded receive buffer; decode takes it from there.

The pair is this module's own (`"mode": "push"` on both sides), registered in the session's
registry. Decode's receive buffer holds 600 KiB: a 512-token prompt's KV (4 blocks x 2 layers
x 64 KiB = 512 KiB) fits, a 900-token prompt's (1 MiB) does not, so that one is refused and
pulled. Every test uses a fresh prompt (vLLM's prefix cache would answer a repeat).
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdplane.core.kv_params import PrefillRequestParams
from pdplane.launch.ports import free_port_run
from pdplane.launch.process import wait_until
from pdplane.launch.vllm_cpu import VllmCpuInstance, VllmCpuOptions
from tests.e2e.conftest import (
    MODEL_NAME,
    PULL_TIMEOUT_S,
    START_TIMEOUT_S,
    TRANSFER_TIMEOUT_S,
    RegistryHandle,
    VllmPair,
)
from tests.e2e.connector.helpers import (
    EXTERNAL,
    complete,
    fresh_prompt,
    idle_free_blocks,
    log_lines,
    metric,
    prefill,
    text,
    wait_free_blocks,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]

PUSH_BUFFER_BYTES = 600 * 1024
PREFILL_ID, DECODE_ID = "push-prefill-0", "push-decode-0"


@pytest.fixture(scope="module")
def push_pair(
    tiny_model: Path, registry: RegistryHandle, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmPair]:
    logs = tmp_path_factory.mktemp("vllm-push-logs")
    connector: dict[str, Any] = {
        "registry": registry.address,
        "transfer_timeout_s": TRANSFER_TIMEOUT_S,
        "pull_timeout_s": PULL_TIMEOUT_S,
        "kv_load_failure_policy": "recompute",
        "connector_extra": {"mode": "push", "push_buffer_bytes": PUSH_BUFFER_BYTES},
    }

    def instance(role: str, instance_id: str, core: str) -> VllmCpuInstance:
        options = VllmCpuOptions(
            model=tiny_model,
            port=free_port_run(),
            served_model_name=MODEL_NAME,
            role=role,  # type: ignore[arg-type]
            kv_port=free_port_run(),
            instance_id=instance_id,
            omp_threads_bind=core,
            **connector,
        )
        return VllmCpuInstance(options, logs / f"{instance_id}.log")

    pair = VllmPair(
        instance("kv_producer", PREFILL_ID, "0"),
        instance("kv_consumer", DECODE_ID, "1"),
        PREFILL_ID,
        DECODE_ID,
    )
    try:
        pair.prefill.start()
        pair.decode.start()
        pair.prefill.wait_healthy(START_TIMEOUT_S)
        pair.decode.wait_healthy(START_TIMEOUT_S)
        wait_until(
            lambda: {PREFILL_ID, DECODE_ID} <= {i.spec.instance_id for i in registry.list()},
            30.0,
            what="the push pair in the registry",
        )
        yield pair
    finally:
        pair.prefill.stop()
        pair.decode.stop()


def push_prefill(pair: VllmPair, prompt: list[int], request_id: str) -> dict[str, Any]:
    """The prefill leg as the gateway sends it: with the scheduled decode as push target."""
    params = PrefillRequestParams(request_id, pair.decode_id, pair.decode_kv_endpoint)
    response = complete(pair.prefill_url, prompt, max_tokens=1, kv_transfer_params=params.to_dict())
    out = response["kv_transfer_params"]
    assert out and out["do_remote_prefill"] is True, response
    return dict(out)


def _ms(line: str) -> float:
    return float(re.findall(r"in ([0-9.]+) ms", line)[0])


@dataclass
class PushRoundtrip:
    params: dict[str, Any]
    decode_text: str
    reference_text: str
    external_tokens: float


@pytest.fixture(scope="module")
def pushed(push_pair: VllmPair, vllm_reference: VllmCpuInstance) -> PushRoundtrip:
    prompt = fresh_prompt(seed=501)
    reference = text(complete(vllm_reference.url, prompt))
    before = metric(push_pair.decode_url, "vllm:prompt_tokens_by_source_total", **EXTERNAL)
    params = push_prefill(push_pair, prompt, "e2e-push")
    decoded = text(complete(push_pair.decode_url, prompt, kv_transfer_params=params))
    after = metric(push_pair.decode_url, "vllm:prompt_tokens_by_source_total", **EXTERNAL)
    return PushRoundtrip(params, decoded, reference, after - before)


def test_pushed_kv_gives_the_single_instance_text(pushed: PushRoundtrip) -> None:
    assert pushed.params["pdplane_pushed"] is True
    assert pushed.params["pdplane_num_tokens"] == 512
    assert pushed.decode_text == pushed.reference_text


def test_decode_reports_pushed_prompt_tokens_as_external(pushed: PushRoundtrip) -> None:
    # vLLM recomputes the last prompt token to sample the next one; the rest came by push.
    assert pushed.external_tokens >= 511


def test_kv_came_by_push_not_pull(pushed: PushRoundtrip, push_pair: VllmPair) -> None:
    tid = pushed.params["pdplane_transfer_id"]
    assert log_lines(push_pair.prefill_log, f"transfer {tid}: pushed ")
    assert log_lines(push_pair.decode_log, f"transfer {tid}: took pushed 4 blocks")
    assert not log_lines(push_pair.decode_log, f"transfer {tid}: pulled")
    assert log_lines(push_pair.prefill_log, f"transfer {tid} completed")


def test_decode_heartbeats_report_its_receive_buffer(
    pushed: PushRoundtrip, registry: RegistryHandle
) -> None:
    # The worker's buffer reaches the load report through vLLM's connector stats (every engine
    # step), so the scheduler's decode guard can tell a full buffer from a free one.
    def reported() -> bool:
        inst = registry.get(DECODE_ID)
        return inst is not None and inst.load.recv_buffer_capacity_bytes == PUSH_BUFFER_BYTES

    wait_until(reported, 10.0, interval_s=0.1, what="the receive buffer in the load report")
    load = registry.get(DECODE_ID).load  # type: ignore[union-attr]
    assert load.kv_block_bytes == 2 * 64 * 1024  # 2 layers x 64 KiB per block
    assert load.recv_buffer_headroom_bytes == PUSH_BUFFER_BYTES  # the push was taken: all free


def test_full_receive_buffer_falls_back_to_pull_and_matches(
    push_pair: VllmPair, vllm_reference: VllmCpuInstance, registry: RegistryHandle
) -> None:
    prompt = fresh_prompt(seed=502, num_tokens=900)  # 8 blocks: 1 MiB > the 600 KiB buffer
    reference = text(complete(vllm_reference.url, prompt))
    base_p = idle_free_blocks(registry, PREFILL_ID)
    base_d = idle_free_blocks(registry, DECODE_ID)
    params = push_prefill(push_pair, prompt, "e2e-push-full")
    decoded = text(complete(push_pair.decode_url, prompt, kv_transfer_params=params))
    assert decoded == reference
    tid = params["pdplane_transfer_id"]
    refused = log_lines(push_pair.prefill_log, f"transfer {tid}: push not delivered")
    assert refused and "RESOURCE_EXHAUSTED" in refused[0]
    assert log_lines(push_pair.decode_log, f"transfer {tid}: pulled 8 blocks")
    assert not log_lines(push_pair.decode_log, f"transfer {tid}: took pushed")
    wait_free_blocks(registry, PREFILL_ID, base_p, timeout=5.0)
    wait_free_blocks(registry, DECODE_ID, base_d, timeout=5.0)


def test_push_leaks_no_blocks_on_either_side(
    push_pair: VllmPair, vllm_reference: VllmCpuInstance, registry: RegistryHandle
) -> None:
    base_p = idle_free_blocks(registry, PREFILL_ID)
    base_d = idle_free_blocks(registry, DECODE_ID)
    for i in range(3):
        prompt = fresh_prompt(seed=510 + i, num_tokens=256 + 64 * i)
        params = push_prefill(push_pair, prompt, f"e2e-push-leak-{i}")
        got = text(complete(push_pair.decode_url, prompt, kv_transfer_params=params))
        assert got == text(complete(vllm_reference.url, prompt))
        assert log_lines(push_pair.decode_log, f"transfer {params['pdplane_transfer_id']}: took")
    wait_free_blocks(registry, PREFILL_ID, base_p, timeout=5.0)
    wait_free_blocks(registry, DECODE_ID, base_d, timeout=5.0)


def _load_line(pair: VllmPair, tid_prefix: str) -> str:
    """Decode's log line saying how the KV of the transfer starting `tid_prefix` came."""
    lines = [
        ln
        for ln in log_lines(pair.decode_log, f"transfer {tid_prefix}")
        if ": took pushed " in ln or ": pulled " in ln
    ]
    assert len(lines) == 1, lines
    return lines[0]


def _ttft_ms(pair: VllmPair, prompt: list[int], params_of: Any) -> float:
    t0 = time.perf_counter()
    params = params_of(prompt)
    complete(pair.decode_url, prompt, max_tokens=1, kv_transfer_params=params)
    return (time.perf_counter() - t0) * 1000


def test_ttft_push_vs_pull_for_512_token_prompts(
    push_pair: VllmPair, vllm_pair: VllmPair, record_property: Any
) -> None:
    # Measurement (printed and recorded): TTFT of a 512-token prompt through a direct
    # prefill -> decode call (prefill leg + decode leg with one output token), push pair vs
    # the session's pull pair, interleaved so both see the same machine load.
    push_ms, pull_ms, took_ms, pulled_ms = [], [], [], []
    for i in range(8):
        p1, p2 = fresh_prompt(seed=600 + i), fresh_prompt(seed=700 + i)
        push_ms.append(
            _ttft_ms(push_pair, p1, lambda p, i=i: push_prefill(push_pair, p, f"e2e-ttft-push-{i}"))
        )
        pull_ms.append(
            _ttft_ms(vllm_pair, p2, lambda p, i=i: prefill(vllm_pair, p, f"e2e-ttft-pull-{i}"))
        )
        took = _load_line(push_pair, f"e2e-ttft-push-{i}.")
        assert ": took pushed " in took, took  # every push landed and was used
        took_ms.append(_ms(took))
        pulled_ms.append(_ms(_load_line(vllm_pair, f"e2e-ttft-pull-{i}.")))
    result = {
        "ttft_push_ms_p50": statistics.median(push_ms),
        "ttft_pull_ms_p50": statistics.median(pull_ms),
        "load_push_ms_p50": statistics.median(took_ms),
        "load_pull_ms_p50": statistics.median(pulled_ms),
    }
    for key, value in result.items():
        record_property(key, value)
    print("512-token prompt, direct P->D:", {k: round(v, 1) for k, v in result.items()})
