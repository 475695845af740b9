"""The engines' preStop hook (deploy/helm/pdplane/files/drain_wait.py) against a real registry
and a simulated decode instance: it drains, then returns only once the streams that were
running have finished (none is cut), and it falls back to vLLM's /metrics without a registry."""

from __future__ import annotations

import importlib.util
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

import grpc
import httpx
import pytest

from pdplane.launch.ports import free_port_run
from pdplane.sim.testing import running_sims
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.fixtures import running_registry
from tests.integration.sim.helpers import wait_for

SCRIPT = Path(__file__).resolve().parents[3] / "deploy/helm/pdplane/files/drain_wait.py"
MODEL = "sim-model"
STREAMS = 3
TOKENS = 40
ITL_MS = 25  # each stream runs ~1 s


@pytest.fixture(scope="module")
def drain_wait() -> ModuleType:
    spec = importlib.util.spec_from_file_location("helm_drain_wait", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _instance(registry: str, instance_id: str) -> instance_pb2.Instance:
    with grpc.insecure_channel(registry) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        return stub.GetInstance(registry_pb2.GetInstanceRequest(instance_id=instance_id))


def _registered(registry: str, instance_id: str) -> bool:
    try:
        return _instance(registry, instance_id).load.total_kv_blocks > 0
    except grpc.RpcError:
        return False  # not registered yet


def _stream(url: str, done: list[tuple[float, int]]) -> None:
    body = {"model": MODEL, "prompt": "hello", "max_tokens": TOKENS, "stream": True}
    chunks = 0
    with (
        httpx.Client(timeout=30) as client,
        client.stream("POST", f"{url}/v1/completions", json=body) as resp,
    ):
        for line in resp.iter_lines():
            if line.startswith("data: {"):
                chunks += 1
    done.append((time.monotonic(), chunks))


def test_prestop_drains_then_waits_for_running_streams(
    drain_wait: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    with (
        running_registry(heartbeat_interval_ms=50) as registry,
        running_sims(["decode"], registry=registry, itl_ms=ITL_MS, model=MODEL) as sims,
    ):
        decode = sims[0]
        wait_for(lambda: _registered(registry, decode.instance_id), 10)
        done: list[tuple[float, int]] = []
        threads = [
            threading.Thread(target=_stream, args=(decode.url, done)) for _ in range(STREAMS)
        ]
        for t in threads:
            t.start()
        # The heartbeats show the streams running before the pod is told to stop.
        wait_for(lambda: _instance(registry, decode.instance_id).load.num_running == STREAMS, 10)
        for name, value in {
            "PDPLANE_INSTANCE_ID": decode.instance_id,
            "PDPLANE_REGISTRY": registry,
            "PDPLANE_DRAIN_SETTLE_S": "0.2",
            "PDPLANE_DRAIN_POLL_S": "0.05",
            "PDPLANE_DRAIN_TIMEOUT_S": "20",
        }.items():
            monkeypatch.setenv(name, value)
        assert drain_wait.main() == 0
        returned = time.monotonic()
        state = _instance(registry, decode.instance_id).state
        for t in threads:
            t.join(10)
    assert state == instance_pb2.INSTANCE_STATE_DRAINING
    # Every stream ran to its end, and before the hook let Kubernetes stop the instance.
    assert [chunks for _, chunks in done] == [TOKENS] * STREAMS
    assert max(finished for finished, _ in done) <= returned


def test_wait_gives_up_at_its_deadline_while_requests_run(drain_wait: ModuleType) -> None:
    with (
        running_registry(heartbeat_interval_ms=50) as registry,
        running_sims(["decode"], registry=registry, itl_ms=ITL_MS, model=MODEL) as sims,
    ):
        decode = sims[0]
        done: list[tuple[float, int]] = []
        wait_for(lambda: _registered(registry, decode.instance_id), 10)
        thread = threading.Thread(target=_stream, args=(decode.url, done))
        thread.start()
        wait_for(lambda: _instance(registry, decode.instance_id).load.num_running == 1, 10)
        start = time.monotonic()
        idle = drain_wait.wait_idle(
            decode.instance_id,
            registry,
            token=None,
            tls_ca=None,
            metrics_url=f"{decode.url}/metrics",
            timeout_s=0.3,
            settle_s=0.0,
            poll_s=0.05,
        )
        waited = time.monotonic() - start
        thread.join(10)
    assert not idle
    assert 0.3 <= waited < 0.3 + 5.0  # one poll (bounded RPC) past the deadline at most


def test_without_a_registry_it_reads_vllm_metrics(drain_wait: ModuleType) -> None:
    with running_sims(["decode"], itl_ms=ITL_MS, model=MODEL) as sims:
        decode = sims[0]
        metrics = f"{decode.url}/metrics"
        assert drain_wait.vllm_busy(metrics) == drain_wait.Busy(0, 0)
        done: list[tuple[float, int]] = []
        thread = threading.Thread(target=_stream, args=(decode.url, done))
        thread.start()
        wait_for(lambda: drain_wait.vllm_busy(metrics).requests == 1, 10)
        idle = drain_wait.wait_idle(
            decode.instance_id,
            f"127.0.0.1:{free_port_run()}",  # nothing listens there
            token=None,
            tls_ca=None,
            metrics_url=metrics,
            timeout_s=20,
            settle_s=0.0,
            poll_s=0.05,
        )
        finished = time.monotonic()
        thread.join(10)
    assert idle
    assert done and done[0][1] == TOKENS and done[0][0] <= finished
