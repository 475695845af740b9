"""A real request moving KV between two real vLLM CPU instances through PdPlaneConnector.

Every test uses a fresh prompt (vLLM's prefix cache would otherwise answer before the
connector is asked). The registry restart test runs last in this module: it briefly empties
the registry the other tests read load reports from.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
import torch

from pdplane.connector.holds import HoldTable
from pdplane.connector.kv_cache import KvCacheView
from pdplane.connector.server import KvTransferServicer, start_kv_server
from pdplane.connector.transports.base import Peer, PullRequest
from pdplane.connector.transports.tcp import TcpTransport
from pdplane.core import grpc_util
from pdplane.core.kv_params import DecodeRequestParams, PrefillRequestParams
from pdplane.core.layout import fingerprint
from pdplane.launch.process import wait_until
from pdplane.launch.vllm_cpu import VllmCpuInstance
from pdplane.v1 import instance_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc
from tests.e2e.conftest import PULL_TIMEOUT_S, TRANSFER_TIMEOUT_S, RegistryHandle, VllmPair
from tests.e2e.connector.helpers import complete, fresh_prompt, log_lines, metric, text

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

EXTERNAL = {"source": "external_kv_transfer"}


@dataclass
class Roundtrip:
    prompt: list[int]
    params: dict[str, Any]  # what prefill returned
    decode_text: str
    reference_text: str
    external_tokens: float  # decode's external_kv_transfer prompt tokens for this request
    pull_ms: float


def _prefill(pair: VllmPair, prompt: list[int], request_id: str) -> dict[str, Any]:
    response = complete(
        pair.prefill_url,
        prompt,
        max_tokens=1,
        kv_transfer_params=PrefillRequestParams(request_id).to_dict(),
    )
    params = response["kv_transfer_params"]
    assert params and params["do_remote_prefill"] is True, response
    return dict(params)


def _layout(registry: RegistryHandle, instance_id: str) -> instance_pb2.KvLayout:
    inst = registry.get(instance_id)
    assert inst is not None, f"{instance_id} not registered"
    return inst.spec.kv_layout


def _free_blocks(registry: RegistryHandle, instance_id: str) -> int:
    inst = registry.get(instance_id)
    assert inst is not None, f"{instance_id} not registered"
    return int(inst.load.free_kv_blocks)


def _wait_free_blocks(reg: RegistryHandle, instance_id: str, want: int, timeout: float) -> None:
    wait_until(
        lambda: _free_blocks(reg, instance_id) == want,
        timeout,
        interval_s=0.1,
        what=f"{instance_id} free KV blocks == {want}",
    )


def _idle_free_blocks(reg: RegistryHandle, instance_id: str, timeout: float = 5.0) -> int:
    """Waits until every KV block of the instance is free again (vLLM keeps one null block;
    prefix-cached blocks count as free) and returns that count. The load report lags up to a
    heartbeat (1 s), so a baseline read right after another request could be stale."""

    def idle() -> bool:
        inst = reg.get(instance_id)
        return bool(
            inst is not None
            and inst.load.total_kv_blocks > 0
            and inst.load.free_kv_blocks == inst.load.total_kv_blocks - 1
        )

    wait_until(idle, timeout, interval_s=0.1, what=f"{instance_id} idle with all blocks free")
    inst = reg.get(instance_id)
    assert inst is not None
    return int(inst.load.free_kv_blocks)


def _pull_status(endpoint: str, transfer_id: str, layout: instance_pb2.KvLayout) -> grpc.StatusCode:
    with grpc_util.channel(endpoint) as ch:
        stub = kv_transfer_pb2_grpc.KvTransferStub(ch)
        call = stub.PullBlocks(
            kv_transfer_pb2.PullBlocksRequest(transfer_id=transfer_id, expected_layout=layout),
            timeout=5.0,
        )
        try:
            for _ in call:
                pass
        except grpc.RpcError as exc:
            return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


@pytest.fixture(scope="module")
def roundtrip(vllm_pair: VllmPair, vllm_reference: VllmCpuInstance) -> Roundtrip:
    """One 512-token prompt: prefill (remote decode) -> decode (with prefill's params)."""
    prompt = fresh_prompt(seed=1)
    reference = text(complete(vllm_reference.url, prompt))
    before = metric(vllm_pair.decode_url, "vllm:prompt_tokens_by_source_total", **EXTERNAL)
    params = _prefill(vllm_pair, prompt, "e2e-roundtrip")
    decoded = text(complete(vllm_pair.decode_url, prompt, kv_transfer_params=params))
    after = metric(vllm_pair.decode_url, "vllm:prompt_tokens_by_source_total", **EXTERNAL)
    tid = params["pdplane_transfer_id"]
    pulled = log_lines(vllm_pair.decode_log, f"transfer {tid}: pulled")
    assert pulled, f"decode logged no pull of {tid}"
    pull_ms = float(re.findall(r"in ([0-9.]+) ms", pulled[-1])[0])
    return Roundtrip(prompt, params, decoded, reference, after - before, pull_ms)


def test_instances_listed_with_roles_by_pdplane_ls(
    vllm_pair: VllmPair, registry_address: str, registry: RegistryHandle
) -> None:
    _idle_free_blocks(registry, vllm_pair.prefill_id)  # a heartbeat carried the load report
    out = subprocess.run(
        [sys.executable, "-m", "pdplane.cli.main", "ls", "--json", "--registry", registry_address],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    listed = {i["id"]: i for i in json.loads(out)}
    assert listed[vllm_pair.prefill_id]["role"] == "prefill"
    assert listed[vllm_pair.decode_id]["role"] == "decode"
    assert listed[vllm_pair.prefill_id]["kv_endpoint"] == vllm_pair.prefill_kv_endpoint
    assert listed[vllm_pair.decode_id]["url"] == vllm_pair.decode_url
    assert listed[vllm_pair.prefill_id]["kv_layout"] == listed[vllm_pair.decode_id]["kv_layout"]
    assert listed[vllm_pair.prefill_id]["load"]["total_kv_blocks"] == 64


def test_decode_with_pulled_kv_matches_single_instance(
    roundtrip: Roundtrip, record_property: Any
) -> None:
    assert roundtrip.params["pdplane_num_tokens"] == 512
    assert len(roundtrip.params["remote_block_ids"]) == 4  # 512 tokens / 128 per block
    assert roundtrip.decode_text == roundtrip.reference_text
    record_property("pull_ms_512_tokens", roundtrip.pull_ms)


def test_decode_reports_prompt_tokens_as_loaded_externally(roundtrip: Roundtrip) -> None:
    # vLLM recomputes the last prompt token to sample the next one; the rest came from prefill.
    assert roundtrip.external_tokens >= 511


def test_transfer_key_on_prefill_equals_key_on_decode(
    roundtrip: Roundtrip, vllm_pair: VllmPair
) -> None:
    tid = roundtrip.params["pdplane_transfer_id"]
    assert tid.startswith("e2e-roundtrip.")  # derived from the gateway's request id
    held = re.findall(r"transfer (\S+): holding", "\n".join(log_lines(vllm_pair.prefill_log, tid)))
    pulled = re.findall(r"transfer (\S+): pulled", "\n".join(log_lines(vllm_pair.decode_log, tid)))
    completed = log_lines(vllm_pair.prefill_log, f"transfer {tid} completed")
    assert held == [tid]
    assert pulled == [tid]
    assert completed, "prefill never saw decode's CompleteTransfer"


def test_pull_time_for_512_token_prompts(vllm_pair: VllmPair, record_property: Any) -> None:
    # Measurement (printed and recorded): decode's pull of a 512-token prompt's KV (4 blocks,
    # 2 layers, 512 KiB) over loopback, as logged by decode's connector.
    times = []
    for i in range(10):
        prompt = fresh_prompt(seed=100 + i)
        params = _prefill(vllm_pair, prompt, f"e2e-timing-{i}")
        complete(vllm_pair.decode_url, prompt, max_tokens=2, kv_transfer_params=params)
        tid = params["pdplane_transfer_id"]
        (line,) = log_lines(vllm_pair.decode_log, f"transfer {tid}: pulled")
        times.append(float(re.findall(r"in ([0-9.]+) ms", line)[0]))
    times.sort()
    record_property("pull_ms_p50", times[len(times) // 2])
    record_property("pull_ms_max", times[-1])
    print(f"pull of 512 tokens: p50 {times[len(times) // 2]:.1f} ms, max {times[-1]:.1f} ms")
    assert times[-1] < PULL_TIMEOUT_S * 1000


@dataclass
class _Relay:
    """A KvTransfer server of the test's own holding a copy of a real prefill's blocks."""

    server: grpc.Server
    params: dict[str, Any]


def _relay(
    pair: VllmPair, params: dict[str, Any], layout: instance_pb2.KvLayout, corrupt: bool
) -> _Relay:
    dp = DecodeRequestParams.from_dict(params)
    n = len(dp.block_ids)
    block_nbytes = 2 * layout.num_kv_heads * layout.block_size * layout.head_size * 4  # float32
    cache = {f"layer{i}": torch.zeros(n, block_nbytes, dtype=torch.uint8) for i in range(2)}
    transport = TcpTransport()
    transport.bind(KvCacheView(cache))
    with grpc_util.channel(dp.kv_endpoint) as ch:
        stub = kv_transfer_pb2_grpc.KvTransferStub(ch)
        got = transport.pull(
            Peer(dp.kv_endpoint, stub),
            PullRequest(dp.transfer_id, range(n), range(n), layout, deadline=time.monotonic() + 10),
        )
        assert got == 2 * n * block_nbytes
        stub.CompleteTransfer(
            kv_transfer_pb2.CompleteTransferRequest(transfer_id=dp.transfer_id, success=True),
            timeout=5,
        )
    if corrupt:
        gen = torch.Generator().manual_seed(0)
        for t in cache.values():
            floats = t.view(torch.float32)
            floats.copy_(torch.randn(floats.shape, generator=gen))
    holds = HoldTable()
    relay_tid = f"{dp.request_id}.relay"
    holds.add("relay", relay_tid, list(range(n)), 60.0)
    server, port = start_kv_server(KvTransferServicer(holds, transport, layout), "127.0.0.1:0")
    relayed = DecodeRequestParams(
        request_id=dp.request_id,
        transfer_id=relay_tid,
        engine_id="relay",
        kv_endpoint=f"127.0.0.1:{port}",
        block_ids=list(range(n)),
        num_tokens=dp.num_tokens,
        kv_layout=dp.kv_layout,
        transport=dp.transport,
        tp_size=dp.tp_size,
    )
    return _Relay(server, relayed.to_dict())


@pytest.mark.parametrize("corrupt", [False, True], ids=["intact", "corrupted"])
def test_corrupting_transferred_bytes_changes_output(
    corrupt: bool,
    vllm_pair: VllmPair,
    vllm_reference: VllmCpuInstance,
    registry: RegistryHandle,
) -> None:
    # The KV goes prefill -> this test -> decode; only the bytes in the middle differ between
    # the two cases, so a changed output proves decode really uses the pulled KV.
    prompt = fresh_prompt(seed=10 + int(corrupt))
    reference = text(complete(vllm_reference.url, prompt))
    params = _prefill(vllm_pair, prompt, f"e2e-relay-{corrupt}")
    relay = _relay(vllm_pair, params, _layout(registry, vllm_pair.decode_id), corrupt)
    try:
        decoded = text(complete(vllm_pair.decode_url, prompt, kv_transfer_params=relay.params))
    finally:
        relay.server.stop(0).wait(5)
    if corrupt:
        assert decoded != reference
    else:
        assert decoded == reference


def test_dead_prefill_recomputes_within_timeout_and_leaks_no_blocks(
    vllm_pair: VllmPair,
    vllm_reference: VllmCpuInstance,
    registry: RegistryHandle,
    free_port: Any,
) -> None:
    prompt = fresh_prompt(seed=20)
    reference = text(complete(vllm_reference.url, prompt))
    layout = _layout(registry, vllm_pair.decode_id)
    baseline = _idle_free_blocks(registry, vllm_pair.decode_id)
    dead = DecodeRequestParams(
        request_id="e2e-dead",
        transfer_id="e2e-dead.0000",
        engine_id="gone",
        kv_endpoint=f"127.0.0.1:{free_port()}",  # nothing listens here
        block_ids=[1, 2, 3, 4],
        num_tokens=len(prompt),
        kv_layout=fingerprint(layout),
    )
    start = time.monotonic()
    decoded = text(complete(vllm_pair.decode_url, prompt, kv_transfer_params=dead.to_dict()))
    elapsed = time.monotonic() - start
    print(f"dead prefill: decode answered by recompute in {elapsed:.2f} s")
    assert decoded == reference  # kv_load_failure_policy=recompute
    assert elapsed < PULL_TIMEOUT_S + 5
    assert log_lines(vllm_pair.decode_log, "transfer e2e-dead.0000: pull failed")
    _wait_free_blocks(registry, vllm_pair.decode_id, baseline, timeout=5.0)


def test_unpulled_transfer_is_freed_after_timeout(
    vllm_pair: VllmPair, registry: RegistryHandle
) -> None:
    layout = _layout(registry, vllm_pair.prefill_id)
    baseline = _idle_free_blocks(registry, vllm_pair.prefill_id)
    params = _prefill(vllm_pair, fresh_prompt(seed=30), "e2e-unpulled")
    held_at = time.monotonic()
    _wait_free_blocks(registry, vllm_pair.prefill_id, baseline - 4, timeout=3.0)
    _wait_free_blocks(registry, vllm_pair.prefill_id, baseline, timeout=TRANSFER_TIMEOUT_S + 4)
    assert time.monotonic() - held_at >= TRANSFER_TIMEOUT_S - 1.5  # not freed early
    tid = params["pdplane_transfer_id"]
    assert _pull_status(vllm_pair.prefill_kv_endpoint, tid, layout) == grpc.StatusCode.NOT_FOUND


def test_abort_frees_held_blocks_at_once(vllm_pair: VllmPair, registry: RegistryHandle) -> None:
    layout = _layout(registry, vllm_pair.prefill_id)
    baseline = _idle_free_blocks(registry, vllm_pair.prefill_id)
    params = _prefill(vllm_pair, fresh_prompt(seed=40), "e2e-abort")
    tid = params["pdplane_transfer_id"]
    with grpc_util.channel(vllm_pair.prefill_kv_endpoint) as ch:
        reply = kv_transfer_pb2_grpc.KvTransferStub(ch).AbortTransfer(
            kv_transfer_pb2.AbortTransferRequest(transfer_id=tid, reason="client disconnected"),
            timeout=5,
        )
    assert reply.freed
    aborted_at = time.monotonic()
    _wait_free_blocks(registry, vllm_pair.prefill_id, baseline, timeout=3.0)
    assert time.monotonic() - aborted_at < TRANSFER_TIMEOUT_S / 2
    assert _pull_status(vllm_pair.prefill_kv_endpoint, tid, layout) == grpc.StatusCode.NOT_FOUND


def test_concurrent_transfers_are_all_correct_and_leak_no_blocks(
    vllm_pair: VllmPair, vllm_reference: VllmCpuInstance, registry: RegistryHandle
) -> None:
    prompts = [fresh_prompt(seed=200 + i, num_tokens=300 + 20 * i) for i in range(6)]
    expected = [text(complete(vllm_reference.url, p)) for p in prompts]
    base_p = _idle_free_blocks(registry, vllm_pair.prefill_id)
    base_d = _idle_free_blocks(registry, vllm_pair.decode_id)

    def one(i: int) -> str:
        params = _prefill(vllm_pair, prompts[i], f"e2e-concurrent-{i}")
        return text(complete(vllm_pair.decode_url, prompts[i], kv_transfer_params=params))

    with ThreadPoolExecutor(len(prompts)) as pool:
        got = list(pool.map(one, range(len(prompts))))
    assert got == expected
    for i in range(len(prompts)):
        assert log_lines(vllm_pair.decode_log, f"transfer e2e-concurrent-{i}.")
    _wait_free_blocks(registry, vllm_pair.prefill_id, base_p, timeout=5.0)
    _wait_free_blocks(registry, vllm_pair.decode_id, base_d, timeout=5.0)


def test_chat_prefill_then_streamed_decode_matches_reference(
    vllm_pair: VllmPair, vllm_reference: VllmCpuInstance
) -> None:
    words = ["red", "river", "quick", "forest", "gamma", "lease", "block", "token", "pull", "hold"]
    rng = random.Random(7)
    content = " ".join(rng.choice(words) for _ in range(300))
    messages = [{"role": "user", "content": content}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 10, "temperature": 0.0}
    expected = httpx.post(f"{vllm_reference.url}/v1/chat/completions", json=body, timeout=60)
    expected.raise_for_status()
    prefill = httpx.post(
        f"{vllm_pair.prefill_url}/v1/chat/completions",
        json={
            **body,
            "max_tokens": 1,
            "kv_transfer_params": PrefillRequestParams("e2e-chat").to_dict(),
        },
        timeout=60,
    )
    prefill.raise_for_status()
    params = prefill.json()["kv_transfer_params"]
    streamed = []
    with httpx.stream(
        "POST",
        f"{vllm_pair.decode_url}/v1/chat/completions",
        json={**body, "stream": True, "kv_transfer_params": params},
        timeout=60,
    ) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    streamed.append(choice["delta"].get("content") or "")
    assert "".join(streamed) == expected.json()["choices"][0]["message"]["content"]
    tid = params["pdplane_transfer_id"]
    assert log_lines(vllm_pair.decode_log, f"transfer {tid}: pulled")


class _HungPrefill(KvTransferServicer):
    """Accepts PullBlocks and never sends a byte."""

    def PullBlocks(self, request: Any, context: Any) -> Any:
        while context.is_active():
            time.sleep(0.02)
        yield from ()


def test_client_leaving_during_a_hung_pull_leaks_no_decode_blocks(
    vllm_pair: VllmPair, vllm_reference: VllmCpuInstance, registry: RegistryHandle
) -> None:
    layout = _layout(registry, vllm_pair.decode_id)
    server, port = start_kv_server(_HungPrefill(HoldTable(), TcpTransport(), layout), "127.0.0.1:0")
    prompt = fresh_prompt(seed=50)
    hung = DecodeRequestParams(
        request_id="e2e-hung",
        transfer_id="e2e-hung.0000",
        engine_id="hung",
        kv_endpoint=f"127.0.0.1:{port}",
        block_ids=[1, 2, 3, 4],
        num_tokens=len(prompt),
        kv_layout=fingerprint(layout),
    )
    baseline = _idle_free_blocks(registry, vllm_pair.decode_id)
    try:
        with pytest.raises(httpx.TimeoutException):  # the client gives up and disconnects
            complete(vllm_pair.decode_url, prompt, kv_transfer_params=hung.to_dict(), timeout=2.0)
        # vLLM aborted the request but keeps its blocks until the connector reports the load
        # finished; the connector does so at its pull timeout.
        _wait_free_blocks(registry, vllm_pair.decode_id, baseline, timeout=PULL_TIMEOUT_S + 5)
    finally:
        server.stop(0).wait(5)
    assert log_lines(vllm_pair.decode_log, "transfer e2e-hung.0000: pull failed")
    other = fresh_prompt(seed=51, num_tokens=64)  # the engine is alive and serving
    assert text(complete(vllm_pair.decode_url, other)) == text(complete(vllm_reference.url, other))


def test_registry_restart_relists_both_within_2s(
    vllm_pair: VllmPair, registry: RegistryHandle
) -> None:
    wanted = {vllm_pair.prefill_id, vllm_pair.decode_id}
    assert wanted <= {i.spec.instance_id for i in registry.list()}
    registry.restart()
    restarted = time.monotonic()
    wait_until(
        lambda: wanted <= {i.spec.instance_id for i in registry.list()},
        5.0,
        interval_s=0.05,
        what="both instances listed again",
    )
    relisted = time.monotonic() - restarted
    print(f"registry restart: both instances listed again after {relisted:.2f} s")
    assert relisted <= 2.0
