"""`pdplane drain ID`: the instance turns DRAINING and stays so while it heartbeats."""

from __future__ import annotations

import subprocess
import sys

from pdplane.core.grpc import util as grpc_util
from pdplane.registry.client import RegistrationClient
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.conftest import wait_until
from tests.integration.registry.fixtures import make_spec, running_registry


def _drain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pdplane.cli.main", "drain", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def _state(address: str, instance_id: str) -> int | None:
    with grpc_util.channel(address) as ch:
        reply = registry_pb2_grpc.RegistryStub(ch).ListInstances(
            registry_pb2.ListInstancesRequest(), timeout=5
        )
    return next((i.state for i in reply.instances if i.spec.instance_id == instance_id), None)


def test_drain_an_instance_by_id() -> None:
    with running_registry() as address:
        client = RegistrationClient(address, make_spec("decode-9", instance_pb2.ROLE_DECODE))
        client.start()
        try:
            assert client.wait_registered(10)
            out = _drain("--registry", address, "decode-9")  # the id may come after flags
            assert out.returncode == 0, out.stderr
            assert out.stdout.strip() == "decode-9: draining"
            assert _state(address, "decode-9") == instance_pb2.INSTANCE_STATE_DRAINING
            assert wait_until(lambda: client.state == instance_pb2.INSTANCE_STATE_DRAINING, 5)
            assert _state(address, "decode-9") == instance_pb2.INSTANCE_STATE_DRAINING
        finally:
            client.stop()


def test_drain_needs_the_admin_token_when_the_registry_has_one() -> None:
    with running_registry(token="t", admin_token="a") as address:
        client = RegistrationClient(
            address, make_spec("decode-3", instance_pb2.ROLE_DECODE), token="t"
        )
        client.start()
        try:
            assert client.wait_registered(10)
            refused = _drain("decode-3", "--registry", address, "--admin-token", "t")
            assert refused.returncode == 1
            assert "PERMISSION_DENIED" in refused.stderr
            done = _drain("decode-3", "--registry", address, "--admin-token", "a")
            assert done.returncode == 0, done.stderr
            assert wait_until(lambda: client.state == instance_pb2.INSTANCE_STATE_DRAINING, 5)
        finally:
            client.stop()


def test_drain_of_an_unknown_instance_fails_with_the_registry_s_reason() -> None:
    with running_registry() as address:
        out = _drain("nobody", "--registry", address)
    assert out.returncode == 1
    assert "NOT_FOUND" in out.stderr
