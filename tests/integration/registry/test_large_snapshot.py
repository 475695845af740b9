"""Snapshots larger than a gRPC message: WatchInstances and ListInstancesStream send them in
bounded parts, the watcher puts them together, and oversized specs are refused.

The registry's part bound is lowered to 64 KiB and the client's receive limit to 256 KiB so
that 120 specs of about 4 KiB (480 KiB in all) stand for 5,000 large specs against 64 MiB.
"""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from pdplane.core.grpc import util as grpc_util
from pdplane.registry import servicer as registry_servicer
from pdplane.registry.server import RegistryServer
from pdplane.registry.watcher import InstanceWatcher
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.fixtures import make_spec

N = 120
CLIENT_LIMIT = 256 * 1024


def _big_spec(i: int) -> instance_pb2.InstanceSpec:
    labels = {f"k{j}": chr(97 + (i + j) % 26) * 250 for j in range(16)}  # about 4 KiB
    return make_spec(f"big-{i:04d}", url=f"http://127.0.0.1:{9000 + i}", labels=labels)


@pytest.fixture
def small_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_servicer, "SNAPSHOT_PART_BYTES", 64 * 1024, raising=False)


@pytest.fixture
def filled(registry: RegistryServer, small_parts: None) -> Iterator[str]:
    with grpc_util.channel(registry.address) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        for i in range(N):
            stub.Register(
                registry_pb2.RegisterRequest(spec=_big_spec(i), lease_ttl_ms=60_000), timeout=10
            )
    yield registry.address


def _limited(address: str) -> grpc.Channel:
    return grpc.insecure_channel(
        address, options=[("grpc.max_receive_message_length", CLIENT_LIMIT)]
    )


def test_watch_sends_a_large_snapshot_in_bounded_parts(filled: str) -> None:
    with _limited(filled) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        call = stub.WatchInstances(
            registry_pb2.WatchInstancesRequest(chunked_snapshots=True), timeout=10
        )
        parts = []
        for event in call:
            assert event.type == registry_pb2.WatchEvent.SNAPSHOT
            assert event.ByteSize() <= 80 * 1024  # the 64 KiB bound plus one instance
            parts.append(event)
            if not event.more:
                break
        call.cancel()
    assert len(parts) > 1 and len({p.revision for p in parts}) == 1
    ids = [i.spec.instance_id for p in parts for i in p.instances]
    assert sorted(ids) == [f"big-{i:04d}" for i in range(N)]


def test_list_stream_sends_a_large_list_in_bounded_parts(filled: str) -> None:
    with _limited(filled) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        with pytest.raises(grpc.RpcError) as err:  # the one-message form cannot carry it
            stub.ListInstances(registry_pb2.ListInstancesRequest(), timeout=10)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        parts = list(stub.ListInstancesStream(registry_pb2.ListInstancesRequest(), timeout=10))
    assert len(parts) > 1 and len({p.revision for p in parts}) == 1
    assert sum(len(p.instances) for p in parts) == N


def test_the_watcher_puts_a_snapshot_in_parts_together(filled: str) -> None:
    watcher = InstanceWatcher(filled)
    watcher.start()
    try:
        assert watcher.wait_ready(10)
        assert len(watcher.snapshot()) == N and watcher.snapshots == 1
    finally:
        watcher.stop()


def test_a_spec_over_8_kib_is_refused(registry: RegistryServer) -> None:
    labels = {f"k{j}": "v" * 250 for j in range(40)}  # about 10 KiB, each label valid
    with grpc_util.channel(registry.address) as channel:
        stub = registry_pb2_grpc.RegistryStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Register(registry_pb2.RegisterRequest(spec=make_spec(labels=labels)), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "spec: at most 8192 bytes" in (err.value.details() or "")
