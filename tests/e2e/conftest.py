"""Session fixtures with REAL vLLM CPU instances (started once per test run).

* `tiny_model`: path of the locally built tiny Llama (cached across runs under
  `$PDPLANE_MODEL_CACHE`, default `~/.cache/pdplane/models`).
* `registry` / `registry_address`: an in-process pdplane registry on a fixed free port
  (`registry.restart()` stops it and starts a fresh, empty one on the same port).
* `vllm_pair`: one kv_producer (prefill) and one kv_consumer (decode) with the pdplane
  connector, registered in that registry (ids "prefill-0" / "decode-0").
* `vllm_reference`: one plain vLLM instance (no connector), same flags: the expected greedy text.

The three instances start together on first use (~60 s on 2 cores, ~4 GB) and stop at the end
of the session, process groups and all.

Pair settings other tests may rely on: TCP transport; prefill frees an unpulled transfer after
`TRANSFER_TIMEOUT_S` (short, so the timeout test runs in seconds; a gateway relays P -> D in
milliseconds); decode gives up a pull after `PULL_TIMEOUT_S` and then RECOMPUTES
(`kv_load_failure_policy: recompute`); vLLM's prefix cache is on, so use a fresh prompt per
test when a transfer must happen.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from pdplane.core.grpc import util as grpc_util
from pdplane.launch.ports import free_port_run
from pdplane.launch.process import wait_until
from pdplane.launch.vllm_cpu import VllmCpuInstance, VllmCpuOptions
from pdplane.registry.server import RegistryServer
from pdplane.registry.settings import RegistrySettings
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc

MODEL_NAME = "tiny"
TRANSFER_TIMEOUT_S = 8.0
PULL_TIMEOUT_S = 10.0
START_TIMEOUT_S = 300.0


class RegistryHandle:
    """An in-process registry on a fixed port that a test can restart."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.address = f"127.0.0.1:{port}"
        self._server: RegistryServer | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        settings = RegistrySettings.model_validate({"host": "127.0.0.1", "port": self.port})
        with self._lock:
            self._server = RegistryServer(settings)
            self._server.start()

    def stop(self) -> None:
        with self._lock:
            if self._server is not None:
                self._server.stop(grace=0.2)
                self._server = None

    def restart(self) -> None:
        """Stops the registry (losing every lease) and starts an empty one on the same port."""
        self.stop()
        self.start()

    def list(self) -> list[instance_pb2.Instance]:
        """ListInstances (all roles)."""
        with grpc_util.channel(self.address) as ch:
            reply = registry_pb2_grpc.RegistryStub(ch).ListInstances(
                registry_pb2.ListInstancesRequest(), timeout=2.0
            )
        return list(reply.instances)

    def get(self, instance_id: str) -> instance_pb2.Instance | None:
        return next((i for i in self.list() if i.spec.instance_id == instance_id), None)


@dataclass
class VllmPair:
    """The kv_producer + kv_consumer pair of the session."""

    prefill: VllmCpuInstance
    decode: VllmCpuInstance
    prefill_id: str
    decode_id: str

    @property
    def prefill_url(self) -> str:
        return self.prefill.url

    @property
    def decode_url(self) -> str:
        return self.decode.url

    @property
    def prefill_kv_endpoint(self) -> str:
        assert self.prefill.kv_endpoint is not None
        return self.prefill.kv_endpoint

    @property
    def decode_kv_endpoint(self) -> str:
        assert self.decode.kv_endpoint is not None
        return self.decode.kv_endpoint

    @property
    def prefill_log(self) -> Path:
        return self.prefill.log_path

    @property
    def decode_log(self) -> Path:
        return self.decode.log_path


@dataclass
class _Fleet:
    pair: VllmPair
    reference: VllmCpuInstance


@pytest.fixture(scope="session")
def registry() -> Iterator[RegistryHandle]:
    handle = RegistryHandle(free_port_run())
    handle.start()
    yield handle
    handle.stop()


@pytest.fixture(scope="session")
def registry_address(registry: RegistryHandle) -> str:
    """host:port of the session's registry."""
    return registry.address


@pytest.fixture(scope="session")
def _vllm_fleet(
    tiny_model: Path, registry: RegistryHandle, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[_Fleet]:
    logs = tmp_path_factory.mktemp("vllm-logs")

    def options(**kw: object) -> VllmCpuOptions:
        return VllmCpuOptions(
            model=tiny_model,
            port=free_port_run(),
            served_model_name=MODEL_NAME,
            **kw,  # type: ignore[arg-type]
        )

    connector = {
        "registry": registry.address,
        "transfer_timeout_s": TRANSFER_TIMEOUT_S,
        "pull_timeout_s": PULL_TIMEOUT_S,
        "kv_load_failure_policy": "recompute",
    }
    prefill = VllmCpuInstance(
        options(
            role="kv_producer",
            kv_port=free_port_run(),
            instance_id="prefill-0",
            omp_threads_bind="0",
            **connector,
        ),
        logs / "prefill.log",
    )
    decode = VllmCpuInstance(
        options(
            role="kv_consumer",
            kv_port=free_port_run(),
            instance_id="decode-0",
            omp_threads_bind="1",
            **connector,
        ),
        logs / "decode.log",
    )
    reference = VllmCpuInstance(options(omp_threads_bind="1"), logs / "reference.log")
    instances = [prefill, decode, reference]
    try:
        for inst in instances:
            # A killed test run must not leave engines behind (the fixture runs on the main
            # thread, which lives as long as the session).
            inst.process.die_with_parent = True
            inst.start()
        for inst in instances:
            inst.wait_healthy(START_TIMEOUT_S)
        wait_until(
            lambda: {"prefill-0", "decode-0"} <= {i.spec.instance_id for i in registry.list()},
            30.0,
            what="prefill-0 and decode-0 in the registry",
        )
        yield _Fleet(VllmPair(prefill, decode, "prefill-0", "decode-0"), reference)
    finally:
        for inst in instances:
            inst.stop()


@pytest.fixture(scope="session")
def vllm_pair(_vllm_fleet: _Fleet) -> VllmPair:
    """kv_producer + kv_consumer with the pdplane connector, registered (see module doc)."""
    return _vllm_fleet.pair


@pytest.fixture(scope="session")
def vllm_reference(_vllm_fleet: _Fleet) -> VllmCpuInstance:
    """A plain vLLM instance with the pair's flags (no connector): the expected output."""
    return _vllm_fleet.reference
