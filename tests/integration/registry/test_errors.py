"""Every refusal has its status code and a message naming the field; auth and TLS."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import pytest

from pdplane.core.grpc import util as grpc_util
from pdplane.registry.client import RegistrationClient
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.fixtures import make_spec, running_registry
from tests.unit.registry.bad_specs import BAD_SPECS

Code = grpc.StatusCode


def _refused(call: Any, request: Any, **kw: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as info:
        call(request, timeout=5, **kw)
    return info.value


@pytest.mark.parametrize(("field", "overrides"), BAD_SPECS)
def test_register_invalid_spec(
    stub: registry_pb2_grpc.RegistryStub, field: str, overrides: dict[str, Any]
) -> None:
    err = _refused(stub.Register, registry_pb2.RegisterRequest(spec=make_spec(**overrides)))
    assert err.code() == Code.INVALID_ARGUMENT
    assert err.details().startswith(f"{field}: ")


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (registry_pb2.RegisterRequest(), "spec"),
        (
            registry_pb2.RegisterRequest(spec=make_spec(), lease_ttl_ms=4_000_000_000),
            "lease_ttl_ms",
        ),
        (registry_pb2.RegisterRequest(spec=make_spec(), request_id="r" * 31), "request_id"),
        (registry_pb2.RegisterRequest(spec=make_spec(), request_id="r" * 129), "request_id"),
    ],
)
def test_register_invalid_request(
    stub: registry_pb2_grpc.RegistryStub, request_: registry_pb2.RegisterRequest, field: str
) -> None:
    err = _refused(stub.Register, request_)
    assert err.code() == Code.INVALID_ARGUMENT
    assert err.details().startswith(f"{field}: ")


def test_heartbeat_and_deregister_refusals(stub: registry_pb2_grpc.RegistryStub) -> None:
    lease = stub.Register(registry_pb2.RegisterRequest(spec=make_spec("p0"))).lease_id
    hb = registry_pb2.HeartbeatRequest
    cases = [
        (stub.Heartbeat, hb(lease_id=lease), Code.INVALID_ARGUMENT, "instance_id"),
        (stub.Heartbeat, hb(instance_id="p0"), Code.INVALID_ARGUMENT, "lease_id"),
        (
            stub.Heartbeat,
            hb(instance_id="p0", lease_id=lease, load=instance_pb2.LoadReport(kv_cache_usage=2)),
            Code.INVALID_ARGUMENT,
            "load.kv_cache_usage",
        ),
        (stub.Heartbeat, hb(instance_id="p0", lease_id="stale"), Code.NOT_FOUND, "lease_id"),
        (stub.Heartbeat, hb(instance_id="ghost", lease_id=lease), Code.NOT_FOUND, "instance_id"),
        (
            stub.Deregister,
            registry_pb2.DeregisterRequest(instance_id="p0", lease_id="stale"),
            Code.NOT_FOUND,
            "lease_id",
        ),
        (
            stub.GetInstance,
            registry_pb2.GetInstanceRequest(instance_id="ghost"),
            Code.NOT_FOUND,
            "instance_id",
        ),
        (
            stub.ListInstances,
            registry_pb2.ListInstancesRequest(role=instance_pb2.Role.ValueType(42)),
            Code.INVALID_ARGUMENT,
            "role",
        ),
    ]
    for call, request, code, field in cases:
        err = _refused(call, request)
        assert (err.code(), err.details().split(":")[0]) == (code, field), request
    # None of the refusals touched the live lease.
    assert stub.Heartbeat(hb(instance_id="p0", lease_id=lease)).lease_ttl_ms == 1000


def test_duplicate_id_with_other_spec(stub: registry_pb2_grpc.RegistryStub) -> None:
    first = stub.Register(registry_pb2.RegisterRequest(spec=make_spec("p0")))
    err = _refused(stub.Register, registry_pb2.RegisterRequest(spec=make_spec("p0", model="x")))
    assert err.code() == Code.ALREADY_EXISTS
    assert err.details().startswith("spec.instance_id: ")
    # The identical spec with the live lease id (the holder's proof) replaces the lease.
    again = stub.Register(
        registry_pb2.RegisterRequest(spec=make_spec("p0"), lease_id=first.lease_id)
    )
    assert again.lease_id != first.lease_id


def test_token_required_when_configured() -> None:
    with running_registry(token="s3cret") as addr, grpc_util.channel(addr) as chan:
        stub = registry_pb2_grpc.RegistryStub(chan)
        request = registry_pb2.ListInstancesRequest()
        assert _refused(stub.ListInstances, request).code() == Code.UNAUTHENTICATED
        wrong = grpc_util.token_metadata("nope")
        assert _refused(stub.ListInstances, request, metadata=wrong).code() == (
            Code.UNAUTHENTICATED
        )
        stub.ListInstances(request, timeout=5, metadata=grpc_util.token_metadata("s3cret"))

        client = RegistrationClient(addr, make_spec("p0"), token="s3cret")
        client.start()
        try:
            assert client.wait_registered(5)
        finally:
            client.stop()
        refused = RegistrationClient(addr, make_spec("p1"))
        refused.start()
        try:
            assert not refused.wait_registered(1)
            assert refused.last_error.startswith("UNAUTHENTICATED")
        finally:
            refused.stop()


def test_tls(tls_files: tuple[Path, Path]) -> None:
    cert, key = tls_files
    with running_registry(tls_cert=str(cert), tls_key=str(key)) as addr:
        client = RegistrationClient(addr, make_spec("p0"), tls_ca=str(cert))
        client.start()
        try:
            assert client.wait_registered(5)
        finally:
            client.stop()
        with grpc_util.channel(addr) as plain:  # no TLS: cannot talk to a TLS registry
            stub = registry_pb2_grpc.RegistryStub(plain)
            err = _refused(stub.ListInstances, registry_pb2.ListInstancesRequest())
            assert err.code() == Code.UNAVAILABLE


def test_unauthenticated_watch_leaves_registry_responsive() -> None:
    # A refused WatchInstances once blocked the asyncio registry's event loop for good: every
    # later call timed out, leases expired and SIGTERM no longer stopped it.
    good = grpc_util.token_metadata("s3cret")
    with running_registry(token="s3cret") as addr, grpc_util.channel(addr) as chan:
        stub = registry_pb2_grpc.RegistryStub(chan)
        lease = stub.Register(
            registry_pb2.RegisterRequest(spec=make_spec("p0")), timeout=5, metadata=good
        ).lease_id
        for metadata in ((), grpc_util.token_metadata("nope")):
            watch = stub.WatchInstances(
                registry_pb2.WatchInstancesRequest(), timeout=5, metadata=metadata
            )
            with pytest.raises(grpc.RpcError) as err:
                next(iter(watch))
            assert err.value.code() == Code.UNAUTHENTICATED
        listed = stub.ListInstances(registry_pb2.ListInstancesRequest(), timeout=2, metadata=good)
        assert [i.spec.instance_id for i in listed.instances] == ["p0"]
        beat = registry_pb2.HeartbeatRequest(instance_id="p0", lease_id=lease)
        assert stub.Heartbeat(beat, timeout=2, metadata=good).lease_ttl_ms > 0
