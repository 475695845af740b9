"""A Register whose answer is lost (the client's deadline passed after the registry had
granted the lease) is retried into that same lease: the instance is not locked out until its
own first lease expires, and watchers see it added once."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
import pytest

from pdplane.core.grpc import util as grpc_util
from pdplane.registry import registration
from pdplane.registry.client import RegistrationClient
from pdplane.registry.server import RegistryServer
from pdplane.registry.store import LeaseGrant
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.conftest import WatchRecorder, wait_until
from tests.integration.registry.fixtures import make_spec, running_registry_server

Ev = registry_pb2.WatchEvent
#: The client's RPC deadline in this test (s), and how late the registry answers the first
#: Register (s): past the deadline, so the client never sees its first grant.
DEADLINE_S = 0.4
LATE_S = 1.0
TTL_MS = 3_000
#: The shared token every instance holds (not the admin one, which may replace any lease).
TOKEN = "shared-token"
METADATA = grpc_util.token_metadata(TOKEN)
DRAINING = instance_pb2.INSTANCE_STATE_DRAINING


def _answer_first_register_late(store: Any, grants: list[LeaseGrant]) -> None:
    """Makes the store's `aregister` (aio servicer) and `register` (sync servicer) record every
    grant and answer the first one `LATE_S` late."""
    asynchronous: Callable[..., Any] = store.aregister
    synchronous: Callable[..., LeaseGrant] = store.register

    async def aregister(*args: Any, **kwargs: Any) -> LeaseGrant:
        grant = await asynchronous(*args, **kwargs)
        grants.append(grant)
        if len(grants) == 1:
            await asyncio.sleep(LATE_S)
        return grant

    def register(*args: Any, **kwargs: Any) -> LeaseGrant:
        grant = synchronous(*args, **kwargs)
        grants.append(grant)
        if len(grants) == 1:
            time.sleep(LATE_S)
        return grant

    store.aregister = aregister
    store.register = register


def test_a_register_answered_after_the_deadline_is_retried_into_the_same_lease(
    monkeypatch: pytest.MonkeyPatch, recorder_factory: Callable[..., WatchRecorder]
) -> None:
    monkeypatch.setattr(registration, "_RPC_TIMEOUT_S", DEADLINE_S)
    with running_registry_server(lease_ttl_ms=TTL_MS, token=TOKEN) as server:
        grants: list[LeaseGrant] = []
        _answer_first_register_late(server.store, grants)
        watch = recorder_factory(server.address, token=TOKEN)
        assert wait_until(lambda: watch.of_type(Ev.SNAPSHOT), 5)
        client = RegistrationClient(server.address, make_spec("late-0"), token=TOKEN)
        client.start()
        try:
            # Without the retry being recognised, the id stays held by the lost grant's lease
            # (ALREADY_EXISTS) until that lease expires: the client registers one TTL later,
            # under another lease.
            assert client.wait_registered(TTL_MS / 1000 + 3)
            assert grants, "the registry granted no lease"
            assert client.lease_id == grants[0].lease_id, (client.last_error, grants)
            assert client.registrations == 1
            assert wait_until(lambda: client.heartbeats >= 1, 5)
            # The lease the client holds is the registry's live one.
            with grpc_util.channel(server.address) as chan:
                listed = registry_pb2_grpc.RegistryStub(chan).ListInstances(
                    registry_pb2.ListInstancesRequest(), metadata=METADATA
                )
            assert [i.spec.instance_id for i in listed.instances] == ["late-0"]
            added = [e.instance.spec.instance_id for e in watch.of_type(Ev.ADDED)]
            assert added == ["late-0"]
            assert not watch.of_type(Ev.REMOVED)
        finally:
            client.stop()


@pytest.fixture
def shared() -> Iterator[tuple[RegistryServer, registry_pb2_grpc.RegistryStub]]:
    """A registry with a shared token and a stub to it (raw calls, sent with `METADATA`)."""
    with (
        running_registry_server(lease_ttl_ms=TTL_MS, token=TOKEN) as server,
        grpc_util.channel(server.address) as chan,
    ):
        yield server, registry_pb2_grpc.RegistryStub(chan)


def test_a_request_id_proves_only_a_retry_of_its_own_register(
    shared: tuple[RegistryServer, registry_pb2_grpc.RegistryStub],
) -> None:
    # Raw Registers on a shared-token registry: the same request_id is granted the same lease;
    # another request_id (or the same one with another spec) is refused while the lease lives.
    _, stub = shared

    def register(request_id: str, **spec: Any) -> registry_pb2.RegisterResponse:
        request = registry_pb2.RegisterRequest(spec=make_spec("r-0", **spec), request_id=request_id)
        response: registry_pb2.RegisterResponse = stub.Register(
            request, timeout=5, metadata=METADATA
        )
        return response

    first = register("a" * 32)
    assert register("a" * 32).lease_id == first.lease_id
    for request_id, spec in (("b" * 32, {}), ("", {}), ("a" * 32, {"url": "http://x:1"})):
        with pytest.raises(grpc.RpcError) as info:
            register(request_id, **spec)
        assert info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    # The retry's lease is the live one: it heartbeats.
    beat = registry_pb2.HeartbeatRequest(instance_id="r-0", lease_id=first.lease_id)
    assert stub.Heartbeat(beat, timeout=5, metadata=METADATA).lease_ttl_ms == TTL_MS


def test_a_replayed_register_changes_nothing_a_drain_stays(
    shared: tuple[RegistryServer, registry_pb2_grpc.RegistryStub],
) -> None:
    # A delayed duplicate of the first Register (it stalled past the client's deadline while
    # the retry got the lease) arrives after the instance was drained: it is answered with
    # the lease and writes nothing, so the instance stays DRAINING.
    server, stub = shared
    request = registry_pb2.RegisterRequest(spec=make_spec("d-0"), request_id="c" * 32)
    first = stub.Register(request, timeout=5, metadata=METADATA)
    drain = registry_pb2.DeregisterRequest(instance_id="d-0", lease_id=first.lease_id, drain=True)
    assert stub.Deregister(drain, timeout=5, metadata=METADATA).state == DRAINING
    before = server.store.revision
    replayed = stub.Register(request, timeout=5, metadata=METADATA)
    assert replayed.lease_id == first.lease_id
    assert server.store.revision == before  # nothing written, no event
    got = stub.GetInstance(
        registry_pb2.GetInstanceRequest(instance_id="d-0"), timeout=5, metadata=METADATA
    )
    assert got.state == DRAINING
