"""`pdplane up --store etcd`: a local etcd starts first and the registry runs on it (the
services alone here; the vLLM fleet on top is what the end-to-end tests run)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from pdplane.launch.deployment import Fleet, FleetSpec
from pdplane.launch.ports import free_port_run
from pdplane.launch.process import http_ok
from pdplane.registry.client import RegistrationClient
from tests.integration.registry.fixtures import make_spec


def test_up_store_etcd_starts_etcd_and_a_registry_on_it(
    tmp_path: Path, registry_store: str
) -> None:
    if registry_store != "etcd":
        pytest.skip("etcd store only")
    # Every port the fleet checks, its vLLM and KV ports included, from one free run below
    # the ephemeral range: the defaults (8100, 8200) may be held by another fleet on the host
    # (busy_ports() then failed the test under load).
    port = free_port_run(9)
    spec = FleetSpec(
        registry_port=port,
        scheduler_port=port + 1,
        gateway_port=port + 2,
        store="etcd",
        etcd_port=port + 3,  # its peer port is etcd_port + 1
        vllm_base_port=port + 5,
        kv_base_port=port + 7,
        log_dir=tmp_path / "logs",
    )
    fleet = Fleet(spec)
    assert fleet.busy_ports() == []
    try:
        fleet._start_services(time.monotonic() + 60)
        assert http_ok(f"http://127.0.0.1:{port + 3}/health")
        client = RegistrationClient(fleet.registry_address, make_spec("p0"))
        client.start()
        try:
            assert client.wait_registered(10)
        finally:
            client.stop()
        registry_log = (tmp_path / "logs" / "registry.log").read_text()
        assert f"127.0.0.1:{port + 3}" in registry_log  # the etcd store's start-up line
        assert (tmp_path / "logs" / "etcd-data").is_dir()
        assert {what for _, what in fleet.busy_ports()} >= {"etcd client", "registry"}
    finally:
        fleet.stop()
