"""Failures around a transfer with real vLLM CPU instances: corrupted bytes, a dead or hung
prefill, an unpulled or aborted transfer. Each must end in bounded time and leak no block.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
import torch

from pdplane.connector.holds import HoldTable
from pdplane.connector.kv_cache import KvCacheView
from pdplane.connector.server import HoldAccess, KvServer, start_kv_server, worker_services
from pdplane.connector.transports.base import Peer, PullRequest, ServiceBinding
from pdplane.connector.transports.tcp import TcpTransport
from pdplane.core.grpc import util as grpc_util
from pdplane.core.instance.layout import fingerprint
from pdplane.core.kv_params import DecodeRequestParams
from pdplane.launch.ports import free_port_run
from pdplane.launch.vllm_cpu import VllmCpuInstance
from pdplane.v1 import instance_pb2, kv_transfer_pb2, kv_transfer_pb2_grpc, kv_transfer_tcp_pb2_grpc
from tests.e2e.conftest import PULL_TIMEOUT_S, TRANSFER_TIMEOUT_S, RegistryHandle, VllmPair
from tests.e2e.connector.helpers import (
    complete,
    fresh_prompt,
    idle_free_blocks,
    layout_of,
    log_lines,
    prefill,
    pull_status,
    text,
    wait_free_blocks,
)

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


@dataclass
class _Relay:
    """A KvTransfer server of the test's own holding a copy of a real prefill's blocks."""

    server: KvServer
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
            Peer(dp.kv_endpoint, ch),
            PullRequest(dp.transfer_id, range(n), range(n), layout, deadline=time.monotonic() + 10),
        )
        assert got.nbytes == 2 * n * block_nbytes
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
    server = start_kv_server(worker_services(transport, HoldAccess(holds, layout)), "127.0.0.1:0")
    port = server.port
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
    params = prefill(vllm_pair, prompt, f"e2e-relay-{corrupt}")
    relay = _relay(vllm_pair, params, layout_of(registry, vllm_pair.decode_id), corrupt)
    try:
        decoded = text(complete(vllm_pair.decode_url, prompt, kv_transfer_params=relay.params))
    finally:
        relay.server.stop(0)
    if corrupt:
        assert decoded != reference
    else:
        assert decoded == reference


def test_dead_prefill_recomputes_within_timeout_and_leaks_no_blocks(
    vllm_pair: VllmPair,
    vllm_reference: VllmCpuInstance,
    registry: RegistryHandle,
) -> None:
    prompt = fresh_prompt(seed=20)
    reference = text(complete(vllm_reference.url, prompt))
    layout = layout_of(registry, vllm_pair.decode_id)
    baseline = idle_free_blocks(registry, vllm_pair.decode_id)
    dead = DecodeRequestParams(
        request_id="e2e-dead",
        transfer_id="e2e-dead.0000",
        engine_id="gone",
        kv_endpoint=f"127.0.0.1:{free_port_run()}",  # nothing listens here
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
    wait_free_blocks(registry, vllm_pair.decode_id, baseline, timeout=5.0)


def test_unpulled_transfer_is_freed_after_timeout(
    vllm_pair: VllmPair, registry: RegistryHandle
) -> None:
    layout = layout_of(registry, vllm_pair.prefill_id)
    baseline = idle_free_blocks(registry, vllm_pair.prefill_id)
    params = prefill(vllm_pair, fresh_prompt(seed=30), "e2e-unpulled")
    held_at = time.monotonic()
    wait_free_blocks(registry, vllm_pair.prefill_id, baseline - 4, timeout=3.0)
    wait_free_blocks(registry, vllm_pair.prefill_id, baseline, timeout=TRANSFER_TIMEOUT_S + 4)
    assert time.monotonic() - held_at >= TRANSFER_TIMEOUT_S - 1.5  # not freed early
    tid = params["pdplane_transfer_id"]
    assert pull_status(vllm_pair.prefill_kv_endpoint, tid, layout) == grpc.StatusCode.NOT_FOUND


def test_abort_frees_held_blocks_at_once(vllm_pair: VllmPair, registry: RegistryHandle) -> None:
    layout = layout_of(registry, vllm_pair.prefill_id)
    baseline = idle_free_blocks(registry, vllm_pair.prefill_id)
    params = prefill(vllm_pair, fresh_prompt(seed=40), "e2e-abort")
    tid = params["pdplane_transfer_id"]
    with grpc_util.channel(vllm_pair.prefill_kv_endpoint) as ch:
        reply = kv_transfer_pb2_grpc.KvTransferStub(ch).AbortTransfer(
            kv_transfer_pb2.AbortTransferRequest(transfer_id=tid, reason="client disconnected"),
            timeout=5,
        )
    # reply.freed is False when the abort overtook the engine's hold, which then ends on arrival.
    del reply
    aborted_at = time.monotonic()
    wait_free_blocks(registry, vllm_pair.prefill_id, baseline, timeout=3.0)
    assert time.monotonic() - aborted_at < TRANSFER_TIMEOUT_S / 2
    assert pull_status(vllm_pair.prefill_kv_endpoint, tid, layout) == grpc.StatusCode.NOT_FOUND


class _HungPrefill(kv_transfer_tcp_pb2_grpc.TcpKvTransferServicer):
    """Accepts PullBlocks and never sends a byte."""

    def PullBlocks(self, request: Any, context: Any) -> Any:
        while context.is_active():
            time.sleep(0.02)
        yield from ()


def test_client_leaving_during_a_hung_pull_leaks_no_decode_blocks(
    vllm_pair: VllmPair, vllm_reference: VllmCpuInstance, registry: RegistryHandle
) -> None:
    layout = layout_of(registry, vllm_pair.decode_id)
    hung = ServiceBinding(
        "pdplane.v1.TcpKvTransfer",
        lambda s: kv_transfer_tcp_pb2_grpc.add_TcpKvTransferServicer_to_server(_HungPrefill(), s),
    )
    server = start_kv_server([hung], "127.0.0.1:0")
    port = server.port
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
    baseline = idle_free_blocks(registry, vllm_pair.decode_id)
    try:
        with pytest.raises(httpx.TimeoutException):  # the client gives up and disconnects
            complete(vllm_pair.decode_url, prompt, kv_transfer_params=hung.to_dict(), timeout=2.0)
        # vLLM aborted the request but keeps its blocks until the connector reports the load
        # finished; the connector does so at its pull timeout.
        wait_free_blocks(registry, vllm_pair.decode_id, baseline, timeout=PULL_TIMEOUT_S + 5)
    finally:
        server.stop(0)
    assert log_lines(vllm_pair.decode_log, "transfer e2e-hung.0000: pull failed")
    other = fresh_prompt(seed=51, num_tokens=64)  # the engine is alive and serving
    assert text(complete(vllm_pair.decode_url, other)) == text(complete(vllm_reference.url, other))
