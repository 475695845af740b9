"""register -> list -> heartbeat updates load -> heartbeats stop -> removed within TTL + 1 s,
with a REMOVED event on an open watch."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from pdplane.core.grpc import util as grpc_util
from pdplane.registry.client import RegistrationClient
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.conftest import WatchRecorder, wait_until
from tests.integration.registry.fixtures import make_spec, running_registry, running_registry_server

Ev = registry_pb2.WatchEvent
TTL_MS = 1000


def test_lease_lifecycle(recorder_factory: Callable[..., WatchRecorder]) -> None:
    with (
        running_registry(lease_ttl_ms=TTL_MS, heartbeat_interval_ms=200) as addr,
        grpc_util.channel(addr) as chan,
    ):
        stub = registry_pb2_grpc.RegistryStub(chan)
        watch = recorder_factory(addr)
        assert wait_until(lambda: len(watch.of_type(Ev.SNAPSHOT)) == 1, 5)

        reg = stub.Register(registry_pb2.RegisterRequest(spec=make_spec("p0")))
        assert (reg.lease_ttl_ms, reg.heartbeat_interval_ms) == (TTL_MS, 200)
        (listed,) = stub.ListInstances(registry_pb2.ListInstancesRequest()).instances
        assert listed.spec == make_spec("p0")
        assert listed.state == instance_pb2.INSTANCE_STATE_SERVING

        load = instance_pb2.LoadReport(num_running=3, kv_cache_usage=0.5, free_kv_blocks=7)
        sent = time.monotonic()
        beat = stub.Heartbeat(
            registry_pb2.HeartbeatRequest(instance_id="p0", lease_id=reg.lease_id, load=load)
        )
        answered = time.monotonic()
        assert beat.state == instance_pb2.INSTANCE_STATE_SERVING
        got = stub.GetInstance(registry_pb2.GetInstanceRequest(instance_id="p0"))
        assert got.load == load
        assert wait_until(lambda: len(watch.of_type(Ev.UPDATED)) == 1, 5)
        assert watch.of_type(Ev.UPDATED)[0].instance.load == load

        # No more heartbeats: the reaper must remove it within TTL + 1 s, not before the TTL.
        assert wait_until(lambda: watch.of_type(Ev.REMOVED), TTL_MS / 1000 + 1.0)
        removed_at = next(t for t, e in watch.events if e.type == Ev.REMOVED)
        # The lease was renewed between `sent` and `answered`: never removed before the TTL.
        assert removed_at - sent >= TTL_MS / 1000
        assert removed_at - answered <= TTL_MS / 1000 + 1.0
        (removed,) = watch.of_type(Ev.REMOVED)
        assert (removed.instance.spec.instance_id, removed.reason) == ("p0", "lease_expired")
        assert stub.ListInstances(registry_pb2.ListInstancesRequest()).instances == []
        revisions = [e.revision for _, e in watch.events]
        assert revisions == sorted(set(revisions))


def test_client_library_reports_load_and_drains(
    recorder_factory: Callable[..., WatchRecorder],
) -> None:
    load = instance_pb2.LoadReport(num_running=1)
    with running_registry(lease_ttl_ms=TTL_MS, heartbeat_interval_ms=100) as addr:
        watch = recorder_factory(addr)
        client = RegistrationClient(addr, make_spec("d0"), lambda: load)
        client.start()
        assert client.wait_registered(5)
        load = instance_pb2.LoadReport(num_running=4, num_waiting=2)

        def seen(n: int) -> bool:
            return any(e.instance.load.num_running == n for e in watch.of_type(Ev.UPDATED))

        assert wait_until(lambda: seen(4), 5)

        # Draining: listed as DRAINING while busy, removed once load_fn reports idle.
        def become_idle() -> None:
            nonlocal load
            assert wait_until(lambda: client.state == instance_pb2.INSTANCE_STATE_DRAINING, 5)
            load = instance_pb2.LoadReport()

        idler = threading.Thread(target=become_idle)
        idler.start()
        client.stop(drain=True, drain_timeout=10)
        idler.join()
        assert wait_until(lambda: watch.of_type(Ev.REMOVED), 5)
        kinds = [(e.type, e.instance.state) for _, e in watch.events]
        draining = (Ev.UPDATED, instance_pb2.INSTANCE_STATE_DRAINING)
        assert draining in kinds
        assert kinds[-1][0] == Ev.REMOVED
        assert kinds.index(draining) < len(kinds) - 1
        assert watch.of_type(Ev.REMOVED)[0].reason == "deregistered"


def test_failing_load_probe_keeps_the_lease() -> None:
    reads = 0

    def broken_after_first() -> instance_pb2.LoadReport:
        nonlocal reads
        reads += 1
        if reads > 1:
            raise RuntimeError("engine stats unavailable")
        return instance_pb2.LoadReport(num_running=5)

    with running_registry_server(lease_ttl_ms=TTL_MS, heartbeat_interval_ms=100) as server:
        client = RegistrationClient(server.address, make_spec("p0"), broken_after_first)
        client.start()
        try:
            assert client.wait_registered(5)
            assert wait_until(lambda: reads > 3 * TTL_MS / 100, 10)  # several TTLs of failures
            (instance,) = server.store.list()[0]
            assert instance.load.num_running == 5  # the last good report
            assert client.registrations == 1  # the lease never lapsed
        finally:
            client.stop()
