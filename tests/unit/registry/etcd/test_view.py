"""EtcdView: the events every replica derives from one etcd history (no etcd, no gRPC)."""

from __future__ import annotations

from itertools import groupby

from aetcd import rpc

from pdplane.registry.etcd.view import SHIFT, EtcdView, composite, etcd_revision
from pdplane.v1 import instance_pb2, registry_pb2, registry_store_pb2
from tests.integration.registry.fixtures import make_spec

Ev = registry_pb2.WatchEvent
PREFIX = b"/p/"
PUT, DELETE = rpc.Event.EventType.PUT, rpc.Event.EventType.DELETE


class History:
    """A tiny etcd: every write is one revision; `events` is its watch history."""

    def __init__(self) -> None:
        self.rev = 1
        self.created: dict[bytes, int] = {}
        self.events: list[rpc.Event] = []

    def put(self, key: bytes, value: bytes, lease: int = 7) -> rpc.KeyValue:
        self.rev += 1
        created = self.created.setdefault(key, self.rev)
        kv = rpc.KeyValue(
            key=key, value=value, lease=lease, create_revision=created, mod_revision=self.rev
        )
        self.events.append(rpc.Event(type=PUT, kv=kv))
        return kv

    def delete(self, key: bytes, reason: bytes = b"") -> None:
        self.rev += 1
        self.created.pop(key, None)
        self.events.append(rpc.Event(type=DELETE, kv=rpc.KeyValue(key=key, mod_revision=self.rev)))
        if reason:  # the tombstone of a deregistration, in the same revision
            name = key.rsplit(b"/", 1)[1]
            tomb = rpc.KeyValue(
                key=PREFIX + b"removed/" + name, value=reason, mod_revision=self.rev
            )
            self.events.append(rpc.Event(type=PUT, kv=tomb))


def _instance(instance_id: str, lease_id: str = "L1") -> bytes:
    instance = instance_pb2.Instance(
        spec=make_spec(instance_id), state=instance_pb2.INSTANCE_STATE_SERVING, lease_id=lease_id
    )
    return registry_store_pb2.StoredInstance(
        instance=instance, lease_ttl_ms=5000
    ).SerializeToString()


def _loads(*entries: tuple[str, int], refresh: bool = False) -> bytes:
    batch = registry_store_pb2.LoadBatch(replica_id="r", replica_lease=7)
    for instance_id, running in entries:
        batch.entries.add(
            instance_id=instance_id,
            lease_id="L1",
            load=instance_pb2.LoadReport(num_running=running),
            heartbeat_unix_ms=1_000,
            refresh=refresh,
        )
    return batch.SerializeToString()


def _drain(view: EtcdView, from_revision: int = 0) -> list[Ev]:
    return view.hub.watch(from_revision, view.revision, lambda: None, ahead_ok=False).poll()


def test_composite_revisions_round_trip() -> None:
    assert composite(5, 3) == (5 << SHIFT) | 3
    assert etcd_revision(composite(5, 3)) == 5
    assert composite(5, 0) > composite(4, (1 << SHIFT) - 1)


def test_two_replicas_derive_the_same_events() -> None:
    h = History()
    h.put(PREFIX + b"instances/p0", _instance("p0"))
    h.put(PREFIX + b"instances/p1", _instance("p1"))
    h.put(PREFIX + b"loads/r", _loads(("p0", 3), ("p1", 4)))  # one revision, two events
    h.put(PREFIX + b"instances/p0", _instance("p0"), lease=9)  # only the owner moves: no event
    h.delete(PREFIX + b"instances/p1", b"deregistered")
    h.delete(PREFIX + b"instances/p0")  # expired (no tombstone)

    views = [EtcdView(PREFIX, history=100, max_queue=100) for _ in range(2)]
    for view in views:
        view.load([], 1)
    subs = [v.hub.watch(0, v.revision, lambda: None, ahead_ok=False) for v in views]
    for sub in subs:
        sub.poll()  # the initial snapshot
    views[0].apply(h.events)
    # The other replica gets one response per revision (etcd never splits a revision's events
    # over two responses: its watch guarantees are atomic per revision).
    for _, group in groupby(h.events, key=lambda e: e.kv.mod_revision):
        views[1].apply(list(group))
    a, b = (sub.poll() for sub in subs)
    assert [(e.type, e.revision, e.reason) for e in a] == [
        (e.type, e.revision, e.reason) for e in b
    ]
    assert [e.type for e in a] == [
        Ev.ADDED,
        Ev.ADDED,
        Ev.UPDATED,
        Ev.UPDATED,
        Ev.REMOVED,
        Ev.REMOVED,
    ]
    revisions = [e.revision for e in a]
    assert revisions == sorted(set(revisions))
    assert revisions[2:4] == [composite(4, 0), composite(4, 1)]  # one load batch, two events
    assert [e.reason for e in a[4:]] == ["deregistered", "lease_expired"]
    assert a[2].instance.load.num_running == 3 and a[3].instance.load.num_running == 4


def test_late_replica_resumes_a_watcher_or_snapshots() -> None:
    h = History()
    h.put(PREFIX + b"instances/p0", _instance("p0"))
    early = EtcdView(PREFIX, history=100, max_queue=100)
    early.load([], 1)
    early.apply(h.events)
    seen = early.revision
    kv = h.put(PREFIX + b"loads/r", _loads(("p0", 5)))
    early.apply(h.events[-1:])
    # A replica that starts now reads the current keys: its history begins here.
    late = EtcdView(PREFIX, history=100, max_queue=100)
    instance_kv = rpc.KeyValue(
        key=PREFIX + b"instances/p0", value=_instance("p0"), lease=7, mod_revision=2
    )
    late.load([instance_kv, kv], h.rev)
    assert late.get("p0").load.num_running == 5  # the load batch applied silently
    (snapshot,) = _drain(late, seen)  # older than what it holds: a snapshot, never a gap
    assert snapshot.type == Ev.SNAPSHOT
    h.put(PREFIX + b"loads/r", _loads(("p0", 6)))
    early.apply(h.events[-1:])
    late.apply(h.events[-1:])
    assert early.revision == late.revision  # from here on both number events alike
    (replayed,) = _drain(late, late.revision - 1)
    assert replayed.instance.load.num_running == 6


def test_refresh_entries_are_no_events_and_stale_entries_are_ignored() -> None:
    h = History()
    h.put(PREFIX + b"instances/p0", _instance("p0"))
    view = EtcdView(PREFIX, history=100, max_queue=100)
    view.load([], 1)
    view.apply(h.events)
    before = view.revision
    h.put(PREFIX + b"loads/r", _loads(("p0", 2), refresh=True))
    h.put(PREFIX + b"loads/r", _loads(("ghost", 2)))
    view.apply(h.events[-2:])
    assert view.revision == before
    assert view.get("p0").load.num_running == 2
