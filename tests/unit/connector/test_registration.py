"""The facade registers its instance (role from kv_role) once its HTTP server is healthy, with
vLLM's real VllmConfig and the real registry on loopback; deregisters on shutdown."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from pdplane.core.grpc import util as grpc_util
from pdplane.launch.ports import free_port_run
from pdplane.models.tiny import build_tiny_model
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.fixtures import running_registry


class _Health:
    """GET /health: 503 until `ready` is set, then 200."""

    def __init__(self) -> None:
        self.ready = threading.Event()
        health = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.send_response(200 if health.ready.is_set() else 503)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


@pytest.fixture
def health() -> Iterator[_Health]:
    h = _Health()
    yield h
    h.close()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("models"))


def _vllm_config(model: Path, role: str, extra: dict[str, Any]) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    kv = {
        "kv_connector": "PdPlaneConnector",
        "kv_connector_module_path": "pdplane.connector",
        "kv_role": role,
        "kv_connector_extra_config": extra,
    }
    args = EngineArgs(
        model=str(model),
        served_model_name=["tiny"],
        max_model_len=1024,
        dtype="float32",
        enforce_eager=True,
        distributed_executor_backend="uni",
        kv_transfer_config=json.loads(json.dumps(kv)),
    )
    return args.create_engine_config()


def _listed(address: str) -> list[instance_pb2.Instance]:
    with grpc_util.channel(address) as ch:
        reply = registry_pb2_grpc.RegistryStub(ch).ListInstances(
            registry_pb2.ListInstancesRequest(), timeout=2
        )
    return list(reply.instances)


def _wait(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("kv_role", "role"),
    [
        ("kv_producer", instance_pb2.ROLE_PREFILL),
        ("kv_consumer", instance_pb2.ROLE_DECODE),
        ("kv_both", instance_pb2.ROLE_BOTH),
    ],
)
def test_registers_once_healthy_with_its_role_and_deregisters(
    kv_role: str, role: int, model_dir: Path, health: _Health
) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pdplane.connector import PdPlaneConnector

    with running_registry() as address:
        extra = {"registry": address, "url": health.url, "kv_port": free_port_run()}
        cfg = _vllm_config(model_dir, kv_role, extra)
        conn = PdPlaneConnector(cfg, KVConnectorRole.SCHEDULER, None)
        try:
            time.sleep(0.8)  # > one health poll: not registered while /health says 503
            assert _listed(address) == []
            health.ready.set()
            _wait(lambda: len(_listed(address)) == 1)
            (inst,) = _listed(address)
            spec = inst.spec
            assert spec.role == role and spec.model == "tiny" and spec.url == health.url
            assert spec.kv_endpoint == f"127.0.0.1:{extra['kv_port']}"
            assert spec.transport == instance_pb2.TRANSPORT_TCP and spec.max_model_len == 1024
            assert (spec.kv_layout.num_layers, spec.kv_layout.head_size) == (2, 32)
            assert spec.kv_layout.dtype == "float32" and "vllm" in spec.version
        finally:
            conn.shutdown()
        assert _listed(address) == []


@contextlib.contextmanager
def _registered_decode(model_dir: Path, health: _Health, port: int) -> Iterator[str]:
    """A kv_consumer connector registered (its /health answering 200); yields the registry."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from pdplane.connector import PdPlaneConnector

    with running_registry() as address:
        extra = {"registry": address, "url": health.url, "kv_port": port}
        conn = PdPlaneConnector(
            _vllm_config(model_dir, "kv_consumer", extra), KVConnectorRole.SCHEDULER, None
        )
        try:
            health.ready.set()
            _wait(lambda: len(_listed(address)) == 1)
            yield address
        finally:
            conn.shutdown()


def test_deregisters_when_its_http_server_is_gone(model_dir: Path, health: _Health) -> None:
    # An HTTP server gone while its engine (and this connector) runs on: the instance must
    # leave the registry within about a second, not heartbeat on until a restart or the lease.
    with _registered_decode(model_dir, health, free_port_run()) as address:
        health.close()  # nothing listens at the instance's URL any more
        closed = time.monotonic()
        _wait(lambda: _listed(address) == [], timeout=10.0)
        took = time.monotonic() - closed
        assert took < 1.5, f"deregistered {took:.2f} s after its HTTP server closed"


def test_a_slow_or_failing_health_answer_keeps_the_registration(
    model_dir: Path, health: _Health
) -> None:
    # 503 (or a late answer) means a busy or starting server, not a dead one.
    with _registered_decode(model_dir, health, free_port_run()) as address:
        health.ready.clear()  # /health now answers 503
        deadline = time.monotonic() + 2.0  # > 3 liveness probes
        while time.monotonic() < deadline:
            assert len(_listed(address)) == 1
            time.sleep(0.25)
