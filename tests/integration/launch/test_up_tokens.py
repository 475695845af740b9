"""`pdplane up`'s fleet is token-protected with nothing typed; `pdplane ls` and `pdplane drain`
work against it by reading the fleet's credentials file.

Uses the launch helpers `pdplane up` runs on (FleetSpec.from_settings with up's settings, the
credentials file, Fleet's real registry/scheduler/gateway processes) and a registered instance
standing in for vLLM.
"""

from __future__ import annotations

import dataclasses
import json
import stat
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from pdplane.cli import fleet_credentials
from pdplane.cli.up import UpSettings
from pdplane.core.grpc import util as grpc_util
from pdplane.launch.deployment import Fleet, FleetSpec
from pdplane.launch.ports import free_port_run
from pdplane.registry.client import RegistrationClient
from pdplane.sim.testing import running_sims
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.launch.cli import run_pdplane
from tests.integration.registry.fixtures import make_spec


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("PDPLANE_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("PDPLANE_TOKEN", "PDPLANE_ADMIN_TOKEN", "PDPLANE_REGISTRY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    return tmp_path / "cache"


@pytest.fixture
def fleet(
    cache_dir: Path, tmp_path: Path
) -> Iterator[tuple[Fleet, fleet_credentials.FleetCredentials]]:
    base = free_port_run(3)
    argv = ["--registry-port", str(base), "--scheduler-port", str(base + 1)]
    argv += ["--gateway-port", str(base + 2), "--log-dir", str(tmp_path / "logs")]
    settings = UpSettings.parse(argv)
    creds = fleet_credentials.generate(f"{settings.host}:{settings.registry_port}")
    spec = FleetSpec.from_settings(settings, token=creds.token, admin_token=creds.admin_token)
    running = Fleet(spec)
    # As `pdplane up` writes it: the scheduler and KV addresses take the shared token too.
    creds = dataclasses.replace(creds, services=running.service_addresses())
    fleet_credentials.write(creds)
    try:
        running.start_services(60)
        yield running, creds
    finally:
        running.stop()
        fleet_credentials.remove(creds)


def test_the_fleet_is_protected_and_its_tools_need_nothing_typed(
    fleet: tuple[Fleet, fleet_credentials.FleetCredentials], cache_dir: Path
) -> None:
    running, creds = fleet
    address = running.registry_address
    path = fleet_credentials.credentials_path()
    assert path.parent == cache_dir
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert fleet_credentials.for_registry(address) == creds

    with grpc_util.channel(address) as chan:
        stub = registry_pb2_grpc.RegistryStub(chan)
        with pytest.raises(grpc.RpcError) as err:
            stub.ListInstances(registry_pb2.ListInstancesRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    # The tokens travel in the children's environment, never their argv (which ps shows).
    for pid in running.service_pids():
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
        assert creds.token not in cmdline and creds.admin_token not in cmdline

    client = RegistrationClient(
        address, make_spec("decode-5", instance_pb2.ROLE_DECODE), token=creds.token
    )
    client.start()
    try:
        assert client.wait_registered(10)
        listed = run_pdplane("ls", "--registry", address, "--json")
        assert listed.returncode == 0, listed.stderr
        assert "decode-5" in listed.stdout
        drained = run_pdplane("drain", "decode-5", "--registry", address)
        assert drained.returncode == 0, drained.stderr
        assert drained.stdout.strip() == "decode-5: draining"
    finally:
        client.stop()


def test_tools_do_not_send_a_fleet_s_tokens_to_another_registry(
    fleet: tuple[Fleet, fleet_credentials.FleetCredentials],
) -> None:
    running, _ = fleet
    assert fleet_credentials.for_registry("127.0.0.1:1") is None
    assert fleet_credentials.for_registry(f"127.0.0.1:1,{running.registry_address}") is not None


def test_grpc_and_live_plan_need_nothing_typed(
    fleet: tuple[Fleet, fleet_credentials.FleetCredentials],
) -> None:
    # README's next steps after `pdplane up`, exactly as printed there (no token typed).
    address = fleet[0].registry_address
    called = run_pdplane("grpc", address, "pdplane.v1.Registry/ListInstances", "{}")
    assert called.returncode == 0, called.stderr
    assert "revision" in json.loads(called.stdout)
    planned = run_pdplane("plan", "--registry", address, "--window", "1s", "--interval-s", "0.2")
    assert planned.returncode == 0, planned.stderr
    # The window is waited out in silence otherwise: say what it is doing first.
    assert planned.stderr.splitlines()[0] == f"collecting 1s of load reports from {address}"


def test_plan_reads_a_token_file(
    fleet: tuple[Fleet, fleet_credentials.FleetCredentials], tmp_path: Path
) -> None:
    running, creds = fleet
    fleet_credentials.remove(creds)  # only the file given below may supply the token
    token_file = tmp_path / "token"
    token_file.write_text(creds.token + "\n")
    argv = ["plan", "--registry", running.registry_address, "--window", "0.5s"]
    refused = run_pdplane(*argv, "--interval-s", "0.2")
    assert refused.returncode == 1 and "UNAUTHENTICATED" in refused.stderr
    # Without the file, `pdplane ls` says how to give the token instead of only refusing.
    listed = run_pdplane("ls", "--registry", running.registry_address)
    assert listed.returncode == 1 and "UNAUTHENTICATED" in listed.stderr
    assert "pass --token or --token-file" in listed.stderr, listed.stderr
    assert creds.token not in listed.stderr
    planned = run_pdplane(*argv, "--interval-s", "0.2", "--token-file", str(token_file))
    assert planned.returncode == 0, planned.stderr


def test_grpc_reaches_the_scheduler_with_the_fleet_token(
    fleet: tuple[Fleet, fleet_credentials.FleetCredentials],
) -> None:
    # The shared token applies on every gRPC hop, not only at the registry.
    running, creds = fleet
    address = running.scheduler_address
    assert address in creds.services
    with grpc_util.channel(address) as chan, pytest.raises(grpc.RpcError) as err:
        chan.unary_unary("/pdplane.v1.Scheduler/ListKvStates")(b"", timeout=10)
    assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED  # auth is on
    called = run_pdplane("grpc", address, "pdplane.v1.Scheduler/ListKvStates", "{}")
    assert called.returncode == 0, called.stderr
    assert isinstance(json.loads(called.stdout), dict)


def test_grpc_sends_the_shared_token_only_to_the_fleet_s_own_services(
    fleet: tuple[Fleet, fleet_credentials.FleetCredentials],
) -> None:
    running, creds = fleet
    assert fleet_credentials.token_for(running.scheduler_address, None) == creds.token
    kv = f"{running.spec.host}:{running.spec.kv_base_port}"
    assert fleet_credentials.token_for(kv, None) == creds.token
    assert fleet_credentials.token_for("127.0.0.1:1", None) is None
    # The admin token is the registry's alone.
    assert fleet_credentials.token_for(running.scheduler_address, None, admin=True) is None
    admin = fleet_credentials.token_for(running.registry_address, None, admin=True)
    assert admin == creds.admin_token


def test_a_credentials_file_without_services_still_reaches_the_registry(
    fleet: tuple[Fleet, fleet_credentials.FleetCredentials], cache_dir: Path
) -> None:
    # A file written by an older version: registry and tokens only.
    running, creds = fleet
    for path in cache_dir.rglob("*.json"):  # the fleet's own file and the latest fleet's
        data = json.loads(path.read_text())
        if data.get("registry") == running.registry_address:
            del data["services"]
            path.write_text(json.dumps(data))
    assert fleet_credentials.token_for(running.registry_address, None) == creds.token
    assert fleet_credentials.token_for(running.scheduler_address, None) is None


def test_grpc_reaches_a_joined_instance_s_kv_server_with_the_fleet_token(
    fleet: tuple[Fleet, fleet_credentials.FleetCredentials],
) -> None:
    # An instance that joined after the file was written (as `pdplane vllm` does): its
    # KvTransfer endpoint is known from the registry only.
    running, creds = fleet
    with running_sims(
        ["decode"],
        registry=running.registry_address,
        registry_token=creds.token,
        kv_token=creds.token,
    ) as sims:
        endpoint = sims[0].kv_endpoint
        assert endpoint not in creds.services
        _wait_registered(running.registry_address, creds.token, endpoint)
        body = '{"transfer_id": "no-such-transfer"}'
        called = run_pdplane("grpc", endpoint, "pdplane.v1.KvTransfer/AbortTransfer", body)
        assert "UNAUTHENTICATED" not in called.stderr, called.stderr
        assert called.returncode == 0, called.stderr
    # A server the registry does not list gets no token, even one that would accept it.
    with running_sims(["decode"], kv_token=creds.token) as stranger:
        body = '{"transfer_id": "no-such-transfer"}'
        endpoint = stranger[0].kv_endpoint
        called = run_pdplane("grpc", endpoint, "pdplane.v1.KvTransfer/AbortTransfer", body)
        assert called.returncode == 1 and "UNAUTHENTICATED" in called.stderr, called.stderr


def _wait_registered(registry: str, token: str, kv_endpoint: str, timeout_s: float = 10) -> None:
    """Blocks until the registry lists an instance at `kv_endpoint` (a watch, no polling)."""
    request = registry_pb2.WatchInstancesRequest()
    with grpc_util.channel(registry) as chan:
        stub = registry_pb2_grpc.RegistryStub(chan)
        metadata = grpc_util.token_metadata(token)
        for event in stub.WatchInstances(request, timeout=timeout_s, metadata=metadata):
            if any(i.spec.kv_endpoint == kv_endpoint for i in _instances(event)):
                return
    raise AssertionError(f"{kv_endpoint} never registered")


def _instances(event: registry_pb2.WatchEvent) -> list[instance_pb2.Instance]:
    if event.type == registry_pb2.WatchEvent.SNAPSHOT:
        return list(event.instances)
    added = (registry_pb2.WatchEvent.ADDED, registry_pb2.WatchEvent.UPDATED)
    return [event.instance] if event.type in added else []
