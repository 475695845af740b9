"""100 instances registering at once from threads: all listed, no duplicate ids, and the
watch stream's revisions strictly increasing; watchers under a burst converge on the truth."""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable

from pdplane.core.grpc import util as grpc_util
from pdplane.registry.client import InstanceWatcher, RegistrationClient
from pdplane.registry.server import RegistryServer
from pdplane.registry.servicer import public
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.conftest import WatchRecorder, wait_until
from tests.integration.registry.fixtures import make_spec, running_registry_server

Ev = registry_pb2.WatchEvent
N = 100


def _role(i: int) -> instance_pb2.Role.ValueType:
    return instance_pb2.ROLE_PREFILL if i % 2 else instance_pb2.ROLE_DECODE


def _why(watch: WatchRecorder, clients: list[RegistrationClient]) -> str:
    again = {c.instance_id: (c.registrations, c.last_error) for c in clients if c.registrations > 1}
    removed = [(e.instance.spec.instance_id, e.reason) for e in watch.of_type(Ev.REMOVED)]
    return f"ADDED {len(watch.of_type(Ev.ADDED))}; registered again: {again}; REMOVED: {removed}"


#: Lease TTL of this test's registry (ms): twice the registry's default, not the suite's 1 s. Each
#: instance must be added once, and a 1 s lease lapsed on a busy 2-core CI host (100 clients'
#: heartbeats late by more than 1 s), which re-registers the instance: a second ADDED.
TTL_MS = 10_000


def test_hundred_concurrent_registrations(recorder_factory: Callable[..., WatchRecorder]) -> None:
    with running_registry_server(lease_ttl_ms=TTL_MS) as registry:
        _register_hundred_at_once(registry, recorder_factory(registry.address))


def _register_hundred_at_once(registry: RegistryServer, watch: WatchRecorder) -> None:
    assert wait_until(lambda: watch.of_type(Ev.SNAPSHOT), 5)
    clients = [
        RegistrationClient(registry.address, make_spec(f"inst-{i:03d}", _role(i))) for i in range(N)
    ]
    barrier = threading.Barrier(N)

    def start(client: RegistrationClient) -> None:
        barrier.wait()
        client.start()

    starters = [threading.Thread(target=start, args=(c,)) for c in clients]
    try:
        for t in starters:
            t.start()
        for t in starters:
            t.join()
        assert all(c.wait_registered(10) for c in clients)

        with grpc_util.channel(registry.address) as chan:
            listed = registry_pb2_grpc.RegistryStub(chan).ListInstances(
                registry_pb2.ListInstancesRequest()
            )
        ids = [i.spec.instance_id for i in listed.instances]
        assert len(ids) == N
        assert sorted(set(ids)) == sorted(c.instance_id for c in clients)
        assert len({c.lease_id for c in clients}) == N
        assert {i.lease_id for i in listed.instances} == {""}  # a capability, never listed

        assert wait_until(lambda: len(watch.of_type(Ev.ADDED)) == N, 5), _why(watch, clients)
        revisions = [e.revision for _, e in watch.events]
        assert all(a < b for a, b in itertools.pairwise(revisions))
        added = [e.instance.spec.instance_id for e in watch.of_type(Ev.ADDED)]
        assert sorted(added) == sorted(ids)
    finally:
        for c in clients:
            c.stop()
    # The bound only stops a hang: on etcd the 100 deletes reach the watcher through etcd's own
    # watch, and 5 s was once too short on a busy 2-core host; a deregister that missed its
    # 1 s deadline leaves the instance to its lease's expiry (TTL_MS).
    assert wait_until(lambda: len(watch.of_type(Ev.REMOVED)) == N, TTL_MS / 1000 + 10)


def test_watchers_with_tiny_queues_converge_under_a_burst(registry_store: str) -> None:
    # Queues of 2 events: a burst of 300 changes forces fresh snapshots, never a gap. On etcd
    # the burst is one load batch of 150 instances, written by another replica.
    with running_registry_server(watch_queue_size=2) as server, contextlib.ExitStack() as stack:
        writer = server.store
        if registry_store == "etcd":
            writer = stack.enter_context(running_registry_server()).store
        changes: list[int] = []
        watcher = InstanceWatcher(server.address, on_change=lambda view: changes.append(1))
        watcher.start()
        try:
            assert watcher.wait_ready(5)
            stubs = [make_spec(f"b{i}") for i in range(150)]
            leases = [writer.register(spec, 0) for spec in stubs]
            for i, (spec, lease) in enumerate(zip(stubs, leases, strict=True)):
                load = instance_pb2.LoadReport(num_waiting=i + 1)
                writer.heartbeat(spec.instance_id, lease.lease_id, load)
            for spec, lease in zip(stubs[::2], leases[::2], strict=True):
                writer.deregister(spec.instance_id, lease.lease_id, drain=False)

            def converged() -> bool:
                listed = server.store.list()[0]
                return len(listed) == 75 and all(i.load.num_waiting for i in listed)

            assert wait_until(converged, 5)
            truth, revision = server.store.list()
            assert wait_until(lambda: watcher.revision == revision, 5)
            assert watcher.snapshot() == {i.spec.instance_id: public(i) for i in truth}
            assert changes
            assert watcher.snapshots >= 2  # the lag path really ran
        finally:
            watcher.stop()
