"""Per-instance authority: a rogue cannot register without the token, an instance changes only
its own lease (nor takes one by re-registering a copied spec), lease ids are never listed, an
operator's admin token drains anyone.

Runs on both stores (the registry suite's autouse fixture).
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from pdplane.core.grpc import util as grpc_util
from pdplane.registry.client import RegistrationClient
from pdplane.registry.registration import _HELD_RETRY_S
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.conftest import WatchRecorder, wait_until
from tests.integration.registry.fixtures import make_spec, running_registry

TOKEN = "instance-secret"
ADMIN = "admin-secret"
_Event = registry_pb2.WatchEvent


@pytest.fixture
def address() -> Iterator[str]:
    with running_registry(token=TOKEN, admin_token=ADMIN) as addr:
        yield addr


@pytest.fixture
def stub(address: str) -> Iterator[registry_pb2_grpc.RegistryStub]:
    with grpc_util.channel(address) as chan:
        yield registry_pb2_grpc.RegistryStub(chan)


def _as(token: str | None) -> tuple[tuple[str, str], ...]:
    return grpc_util.token_metadata(token)


def _register(stub: registry_pb2_grpc.RegistryStub, name: str) -> str:
    spec = make_spec(name, instance_pb2.ROLE_DECODE)
    reply = stub.Register(registry_pb2.RegisterRequest(spec=spec), metadata=_as(TOKEN), timeout=5)
    return str(reply.lease_id)


def _code(call: object) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()  # type: ignore[operator]
    return err.value.code()


def test_without_the_token_a_rogue_cannot_register(stub: registry_pb2_grpc.RegistryStub) -> None:
    request = registry_pb2.RegisterRequest(spec=make_spec("rogue", instance_pb2.ROLE_DECODE))
    for token in (None, "guess"):
        code = _code(lambda t=token: stub.Register(request, metadata=_as(t), timeout=5))
        assert code == grpc.StatusCode.UNAUTHENTICATED
    listed = stub.ListInstances(registry_pb2.ListInstancesRequest(), metadata=_as(TOKEN))
    assert list(listed.instances) == []


def test_lease_ids_are_never_listed(address: str, stub: registry_pb2_grpc.RegistryStub) -> None:
    lease = _register(stub, "decode-1")
    assert lease
    listed = stub.ListInstances(registry_pb2.ListInstancesRequest(), metadata=_as(TOKEN))
    got = stub.GetInstance(
        registry_pb2.GetInstanceRequest(instance_id="decode-1"), metadata=_as(TOKEN)
    )
    assert [i.lease_id for i in listed.instances] == [""]
    assert got.lease_id == ""
    watch = WatchRecorder(address, token=TOKEN)
    try:
        assert wait_until(lambda: watch.of_type(_Event.SNAPSHOT), 5)
        _register(stub, "decode-2")
        assert wait_until(lambda: watch.of_type(_Event.ADDED), 5)
        snapshot = watch.of_type(_Event.SNAPSHOT)[0]
        added = watch.of_type(_Event.ADDED)[0]
        assert [i.lease_id for i in snapshot.instances] == [""]
        assert added.instance.spec.instance_id == "decode-2"
        assert added.instance.lease_id == ""
    finally:
        watch.close()


def test_an_instance_cannot_drain_or_deregister_another(
    stub: registry_pb2_grpc.RegistryStub,
) -> None:
    _register(stub, "victim")
    _register(stub, "rogue")
    for drain in (True, False):
        # Without the victim's lease id (never listed) the shared token does not suffice ...
        no_lease = registry_pb2.DeregisterRequest(instance_id="victim", drain=drain)
        code = _code(lambda r=no_lease: stub.Deregister(r, metadata=_as(TOKEN), timeout=5))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        # ... nor does the rogue's own lease id.
        wrong = registry_pb2.DeregisterRequest(instance_id="victim", lease_id="0" * 16, drain=drain)
        code = _code(lambda r=wrong: stub.Deregister(r, metadata=_as(TOKEN), timeout=5))
        assert code == grpc.StatusCode.NOT_FOUND
    get = registry_pb2.GetInstanceRequest(instance_id="victim")
    victim = stub.GetInstance(get, metadata=_as(TOKEN))
    assert victim.state == instance_pb2.INSTANCE_STATE_SERVING


def test_an_instance_changes_its_own_lease(stub: registry_pb2_grpc.RegistryStub) -> None:
    lease = _register(stub, "self")
    beat = registry_pb2.HeartbeatRequest(instance_id="self", lease_id=lease)
    assert stub.Heartbeat(beat, metadata=_as(TOKEN), timeout=5).lease_ttl_ms > 0
    drain = registry_pb2.DeregisterRequest(instance_id="self", lease_id=lease, drain=True)
    reply = stub.Deregister(drain, metadata=_as(TOKEN), timeout=5)
    assert reply.state == instance_pb2.INSTANCE_STATE_DRAINING


def test_the_admin_token_drains_and_deregisters_any_instance(
    stub: registry_pb2_grpc.RegistryStub,
) -> None:
    _register(stub, "decode-7")
    drain = registry_pb2.DeregisterRequest(instance_id="decode-7", drain=True)
    assert stub.Deregister(drain, metadata=_as(ADMIN), timeout=5).state == (
        instance_pb2.INSTANCE_STATE_DRAINING
    )
    remove = registry_pb2.DeregisterRequest(instance_id="decode-7")
    stub.Deregister(remove, metadata=_as(ADMIN), timeout=5)
    listed = stub.ListInstances(registry_pb2.ListInstancesRequest(), metadata=_as(ADMIN))
    assert list(listed.instances) == []
    unknown = registry_pb2.DeregisterRequest(instance_id="nobody", drain=True)
    code = _code(lambda: stub.Deregister(unknown, metadata=_as(ADMIN), timeout=5))
    assert code == grpc.StatusCode.NOT_FOUND


def test_a_second_conflicting_authorization_header_is_refused(
    stub: registry_pb2_grpc.RegistryStub,
) -> None:
    request = registry_pb2.ListInstancesRequest()
    both = (("authorization", f"Bearer {TOKEN}"), ("authorization", "Bearer other"))
    assert _code(lambda: stub.ListInstances(request, metadata=both, timeout=5)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )
    admin_too = (("authorization", f"Bearer {TOKEN}"), ("authorization", f"Bearer {ADMIN}"))
    drain = registry_pb2.DeregisterRequest(instance_id="x", drain=True)
    assert _code(lambda: stub.Deregister(drain, metadata=admin_too, timeout=5)) == (
        grpc.StatusCode.UNAUTHENTICATED
    )


def _beat(stub: registry_pb2_grpc.RegistryStub, name: str, lease: str) -> int:
    request = registry_pb2.HeartbeatRequest(instance_id=name, lease_id=lease)
    return int(stub.Heartbeat(request, metadata=_as(TOKEN), timeout=5).lease_ttl_ms)


def test_a_live_lease_is_not_taken_by_re_registering_a_copied_spec(
    stub: registry_pb2_grpc.RegistryStub,
) -> None:
    lease = _register(stub, "decode-1")
    # The rogue copies the spec from List (no lease id there) and re-registers it.
    listed = stub.ListInstances(registry_pb2.ListInstancesRequest(), metadata=_as(TOKEN))
    copied = registry_pb2.RegisterRequest(spec=listed.instances[0].spec)
    for guess in ("", "0123456789abcdef"):
        copied.lease_id = guess
        code = _code(lambda: stub.Register(copied, metadata=_as(TOKEN), timeout=5))
        assert code == grpc.StatusCode.ALREADY_EXISTS
    assert _beat(stub, "decode-1", lease) > 0  # the holder keeps its lease

    # The holder itself (its lease id as proof) and an operator (admin token) may replace it.
    copied.lease_id = lease
    again = stub.Register(copied, metadata=_as(TOKEN), timeout=5).lease_id
    assert again and again != lease
    assert _code(lambda: _beat(stub, "decode-1", lease)) == grpc.StatusCode.NOT_FOUND
    copied.lease_id = ""
    by_admin = stub.Register(copied, metadata=_as(ADMIN), timeout=5).lease_id
    assert by_admin not in ("", again)
    assert _beat(stub, "decode-1", by_admin) > 0


def test_a_restarted_instance_registers_again_by_itself_once_its_lease_expired(
    address: str, stub: registry_pb2_grpc.RegistryStub
) -> None:
    # A crashed process: registered with a 1 s lease and never heard of again.
    spec = make_spec("decode-1", instance_pb2.ROLE_DECODE)
    old = registry_pb2.RegisterRequest(spec=spec, lease_ttl_ms=1000)
    stub.Register(old, metadata=_as(TOKEN), timeout=5)
    # Its restart (same id, same spec, no lease id) is refused while the old lease holds
    # the id and retried every _HELD_RETRY_S: back within a few retries of the expiry (each
    # retry also pays its own RPC, and on etcd the delete must reach the view first).
    client = RegistrationClient(address, spec, token=TOKEN)
    client.start()
    try:
        assert client.wait_registered(timeout=1.0 + 3 * _HELD_RETRY_S + 0.5), client.last_error
        assert _beat(stub, "decode-1", client.lease_id) > 0
    finally:
        client.stop()
