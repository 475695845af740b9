"""`pdplane grpc`, the README's grpcurl stand-in: lists services and calls methods by
reflection against a running registry."""

from __future__ import annotations

import json
import subprocess
import sys

from pdplane.registry.server import RegistryServer


def _grpc(*args: str) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdplane.cli.main", "grpc", *args]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60)


def test_list_and_call_by_reflection(registry: RegistryServer) -> None:
    listed = _grpc(registry.address, "list")
    assert listed.returncode == 0, listed.stderr
    assert {"pdplane.v1.Registry", "grpc.health.v1.Health"} <= set(listed.stdout.split())
    health = _grpc(registry.address, "grpc.health.v1.Health/Check", "{}")
    assert health.returncode == 0, health.stderr
    assert json.loads(health.stdout) == {"status": "SERVING"}
    instances = _grpc(registry.address, "pdplane.v1.Registry/ListInstances", "--timeout-s", "5")
    assert instances.returncode == 0, instances.stderr
    assert "revision" in json.loads(instances.stdout)


def test_a_bad_method_is_a_clear_error(registry: RegistryServer) -> None:
    result = _grpc(registry.address, "pdplane.v1.Registry/NoSuchMethod", "{}")
    assert result.returncode == 2 and "NoSuchMethod" in result.stderr


def test_list_of_a_service_lists_its_methods_as_grpcurl_does(registry: RegistryServer) -> None:
    listed = _grpc(registry.address, "list", "grpc.health.v1.Health")
    assert listed.returncode == 0, listed.stderr
    methods = listed.stdout.split()
    assert {"grpc.health.v1.Health.Check", "grpc.health.v1.Health.Watch"} <= set(methods)
    assert all(m.startswith("grpc.health.v1.Health.") for m in methods), methods
    methods = _grpc(registry.address, "list", "pdplane.v1.Registry").stdout.split()
    assert {"pdplane.v1.Registry.Register", "pdplane.v1.Registry.ListInstances"} <= set(methods)
    # grpcurl's dotted form calls too, as it does there.
    health = _grpc(registry.address, "grpc.health.v1.Health.Check", "{}")
    assert health.returncode == 0 and json.loads(health.stdout) == {"status": "SERVING"}
    unknown = _grpc(registry.address, "list", "pdplane.v1.NoSuchService")
    assert unknown.returncode == 2 and "NoSuchService" in unknown.stderr
