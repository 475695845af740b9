"""What the connector's end-to-end tests share: completions, metrics, log lines, load reports."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import grpc
import httpx

from pdplane.core.grpc import util as grpc_util
from pdplane.core.kv_params import PrefillRequestParams
from pdplane.launch.process import wait_until
from pdplane.v1 import instance_pb2, kv_transfer_pb2, kv_transfer_tcp_pb2_grpc
from tests.e2e.conftest import RegistryHandle, VllmPair

MODEL = "tiny"
#: Labels of vLLM's prompt-token counter for tokens whose KV came from another instance.
EXTERNAL = {"source": "external_kv_transfer"}
VOCAB = 2048


def fresh_prompt(seed: int, num_tokens: int = 512) -> list[int]:
    """A prompt of `num_tokens` token ids no other test uses (vLLM's prefix cache would answer
    a repeated prompt before the connector is asked). Ids avoid the special tokens (0..5)."""
    rng = random.Random(seed)
    return [rng.randrange(8, VOCAB) for _ in range(num_tokens)]


def complete(
    url: str,
    prompt: list[int],
    max_tokens: int = 12,
    kv_transfer_params: dict[str, Any] | None = None,
    timeout: float = 60.0,
) -> dict[str, Any]:
    """POST /v1/completions (greedy, non-streaming); raises for a non-200 answer."""
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    if kv_transfer_params is not None:
        body["kv_transfer_params"] = kv_transfer_params
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=timeout)
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


def text(response: dict[str, Any]) -> str:
    return str(response["choices"][0]["text"])


def metric(url: str, name: str, **labels: str) -> float:
    """Sum of the Prometheus samples `name` at `url`/metrics whose labels include `labels`."""
    body = httpx.get(f"{url}/metrics", timeout=10.0).text
    total = 0.0
    for line in body.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(r"^([a-zA-Z_:]+)(\{[^}]*\})?\s+(\S+)$", line)
        if not m or m.group(1) != name:
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(m.group(3))
    return total


def log_lines(path: Path, needle: str) -> list[str]:
    """Lines of a log file containing `needle`."""
    return [ln for ln in path.read_text(errors="replace").splitlines() if needle in ln]


def prefill(pair: VllmPair, prompt: list[int], request_id: str) -> dict[str, Any]:
    response = complete(
        pair.prefill_url,
        prompt,
        max_tokens=1,
        kv_transfer_params=PrefillRequestParams(request_id).to_dict(),
    )
    params = response["kv_transfer_params"]
    assert params and params["do_remote_prefill"] is True, response
    return dict(params)


def layout_of(registry: RegistryHandle, instance_id: str) -> instance_pb2.KvLayout:
    inst = registry.get(instance_id)
    assert inst is not None, f"{instance_id} not registered"
    return inst.spec.kv_layout


def free_blocks(registry: RegistryHandle, instance_id: str) -> int:
    inst = registry.get(instance_id)
    assert inst is not None, f"{instance_id} not registered"
    return int(inst.load.free_kv_blocks)


def wait_free_blocks(reg: RegistryHandle, instance_id: str, want: int, timeout: float) -> None:
    wait_until(
        lambda: free_blocks(reg, instance_id) == want,
        timeout,
        interval_s=0.1,
        what=f"{instance_id} free KV blocks == {want}",
    )


def idle_free_blocks(reg: RegistryHandle, instance_id: str, timeout: float = 5.0) -> int:
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


def pull_status(endpoint: str, transfer_id: str, layout: instance_pb2.KvLayout) -> grpc.StatusCode:
    with grpc_util.channel(endpoint) as ch:
        stub = kv_transfer_tcp_pb2_grpc.TcpKvTransferStub(ch)
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
