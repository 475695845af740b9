"""InstanceWatcher: on_change gets the newest view, survives a failing callback, stops cleanly."""

from __future__ import annotations

import contextlib
import threading

from pdplane.core.grpc import util as grpc_util
from pdplane.registry.client import InstanceWatcher
from pdplane.registry.server import RegistryServer
from pdplane.registry.servicer import public
from pdplane.v1 import instance_pb2, registry_pb2, registry_pb2_grpc
from tests.integration.registry.conftest import wait_until
from tests.integration.registry.fixtures import make_spec, running_registry_server

Ev = registry_pb2.WatchEvent


def test_on_change_sees_the_newest_view_and_survives_errors(registry: RegistryServer) -> None:
    threads_before = set(threading.enumerate())
    views: list[dict[str, instance_pb2.Instance]] = []
    calls = 0

    def on_change(view: dict[str, instance_pb2.Instance]) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a broken callback must not stop the watcher")
        views.append(view)

    watcher = InstanceWatcher(registry.address, on_change=on_change)
    watcher.start()
    try:
        assert watcher.wait_ready(5)
        leases = {f"p{i}": registry.store.register(make_spec(f"p{i}"), 0) for i in range(20)}
        registry.store.deregister("p3", leases["p3"].lease_id, drain=True)
        expected = {i.spec.instance_id: public(i) for i in registry.store.list()[0]}
        assert wait_until(lambda: bool(views) and views[-1] == expected, 5)
        assert views[-1]["p3"].state == instance_pb2.INSTANCE_STATE_DRAINING
        assert watcher.snapshot() == expected
        assert watcher.revision == registry.store.revision
    finally:
        watcher.stop()
    assert not [
        t for t in set(threading.enumerate()) - threads_before if t.name.startswith("pdplane-watch")
    ]


def test_batched_watch_keeps_every_event_in_order(
    registry: RegistryServer, registry_store: str
) -> None:
    """200 changes that queue up while the stream is busy go out as BATCH messages of at most
    the watcher's max_batch. Memory: 200 registrations while the store is locked. etcd: one
    load batch written by another replica updates 200 instances at one etcd revision."""
    with grpc_util.channel(registry.address) as chan, contextlib.ExitStack() as stack:
        stub = registry_pb2_grpc.RegistryStub(chan)
        specs = [make_spec(f"q{i}") for i in range(200)]
        if registry_store == "etcd":
            writer = stack.enter_context(running_registry_server()).store
            leases = [writer.register(spec, 0).lease_id for spec in specs]
            assert wait_until(lambda: len(registry.store.list()[0]) == 200, 5)
        call = stub.WatchInstances(registry_pb2.WatchInstancesRequest(max_batch=50))
        messages = iter(call)
        first = next(messages)
        assert first.type == Ev.SNAPSHOT
        if registry_store == "memory":
            with registry.store.lock:  # the stream cannot drain meanwhile: 200 events queue up
                for spec in specs:
                    registry.store.register(spec, 0)
        else:
            for i, (spec, lease) in enumerate(zip(specs, leases, strict=True)):
                load = instance_pb2.LoadReport(num_running=i + 1)
                writer.heartbeat(spec.instance_id, lease, load)
        events: list[registry_pb2.WatchEvent] = []
        sizes: list[int] = []
        while len(events) < 200:
            message = next(messages)
            if message.type == Ev.BATCH:
                assert message.revision == message.events[-1].revision
                sizes.append(len(message.events))
                events.extend(message.events)
            else:
                events.append(message)
        call.cancel()
    assert sizes and max(sizes) == 50  # packed, and never beyond what the watcher asked for
    revisions = [e.revision for e in events]
    assert len(revisions) == 200 and revisions[0] > first.revision
    assert revisions == sorted(set(revisions))
    if registry_store == "memory":
        assert revisions == list(range(first.revision + 1, first.revision + 201))
    assert [e.instance.spec.instance_id for e in events] == [f"q{i}" for i in range(200)]


def test_changes_since_names_only_what_changed(registry: RegistryServer) -> None:
    """A reader of the watcher's change log (the scheduler's view) pays per change: after a
    heartbeat only that instance is named; a cursor from before the last snapshot (or none)
    answers None (re-read the whole view)."""
    leases = {f"c{i}": registry.store.register(make_spec(f"c{i}"), 60_000) for i in range(5)}
    watcher = InstanceWatcher(registry.address)
    watcher.start()
    try:
        assert watcher.wait_ready(5)
        assert wait_until(lambda: len(watcher.snapshot()) == 5, 5)
        cursor, changes = watcher.changes_since(None)
        assert changes is None
        load = instance_pb2.LoadReport(num_running=3)
        registry.store.heartbeat("c2", leases["c2"].lease_id, load)
        assert wait_until(lambda: watcher.snapshot()["c2"].load.num_running == 3, 5)
        cursor, changes = watcher.changes_since(cursor)
        assert changes is not None and list(changes) == ["c2"]
        assert changes["c2"] is watcher.snapshot()["c2"]
        registry.store.deregister("c4", leases["c4"].lease_id, drain=False)
        assert wait_until(lambda: "c4" not in watcher.snapshot(), 5)
        cursor, changes = watcher.changes_since(cursor)
        assert changes == {"c4": None}
        assert watcher.changes_since(cursor) == (cursor, {})
        stale = (cursor[0] - 1, cursor[1])  # type: ignore[index]
        assert watcher.changes_since(stale)[1] is None
    finally:
        watcher.stop()
