"""InMemoryStore: leases, revisions, events and bounded watch queues (fake clock, no gRPC)."""

from __future__ import annotations

import pytest

from pdplane.registry.memory_store import InMemoryStore
from pdplane.registry.store import AlreadyExistsError, LeasePolicy, NotFoundError
from pdplane.v1 import instance_pb2, registry_pb2
from tests.integration.registry.fixtures import make_spec

Ev = registry_pb2.WatchEvent


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(clock: Clock) -> InMemoryStore:
    return InMemoryStore(LeasePolicy(default_ttl_ms=5000), max_queue=8, clock=clock)


def _drain(store: InMemoryStore, from_revision: int = 0) -> tuple[list[Ev], object]:
    sub = store.watch(from_revision, lambda: None)
    return sub.poll(), sub


def test_lease_policy_caps_and_floors() -> None:
    policy = LeasePolicy(default_ttl_ms=5000, max_ttl_ms=10_000, heartbeat_interval_ms=1000)
    assert policy.grant(0) == (5000, 1000)
    assert policy.grant(60_000) == (10_000, 1000)
    assert policy.grant(500) == (2000, 666)  # never below two heartbeats


def test_register_heartbeat_expire(store: InMemoryStore, clock: Clock) -> None:
    grant = store.register(make_spec("p0"), 0)
    assert grant.ttl_ms == 5000
    clock.now += 4.0
    ttl, state = store.heartbeat("p0", grant.lease_id, instance_pb2.LoadReport(num_running=2))
    assert (ttl, state) == (5000, instance_pb2.INSTANCE_STATE_SERVING)
    assert store.get("p0").load.num_running == 2
    clock.now += 4.9  # 8.9 s after registering, 4.9 s after the heartbeat: still live
    assert store.expire() == 0
    clock.now += 0.2
    assert store.expire() == 1
    assert store.list()[0] == []
    with pytest.raises(NotFoundError):
        store.heartbeat("p0", grant.lease_id, instance_pb2.LoadReport())


def test_heartbeat_with_stale_lease_is_not_found(store: InMemoryStore) -> None:
    first = store.register(make_spec("p0"), 0)
    # Identical spec and the live lease id (the holder's proof): replaces the lease.
    second = store.register(make_spec("p0"), 0, lease_id=first.lease_id)
    assert first.lease_id != second.lease_id
    with pytest.raises(NotFoundError, match="lease_id"):
        store.heartbeat("p0", first.lease_id, instance_pb2.LoadReport())
    with pytest.raises(NotFoundError, match="instance_id"):
        store.heartbeat("nope", first.lease_id, instance_pb2.LoadReport())


def test_different_spec_needs_the_old_lease_expired(store: InMemoryStore, clock: Clock) -> None:
    store.register(make_spec("p0"), 0)
    with pytest.raises(AlreadyExistsError, match=r"spec\.instance_id"):
        store.register(make_spec("p0", model="other"), 0)
    clock.now += 5.1  # lease expired, reaper not yet run
    store.register(make_spec("p0", model="other"), 0)
    assert store.get("p0").spec.model == "other"


def test_events_have_strictly_increasing_revisions(store: InMemoryStore, clock: Clock) -> None:
    sub = store.watch(0, lambda: None)
    assert [e.type for e in sub.poll()] == [Ev.SNAPSHOT]
    grant = store.register(make_spec("p0"), 0)
    store.heartbeat("p0", grant.lease_id, instance_pb2.LoadReport(num_waiting=1))
    store.heartbeat("p0", grant.lease_id, instance_pb2.LoadReport(num_waiting=1))  # no change
    store.deregister("p0", grant.lease_id, drain=True)
    store.deregister("p0", grant.lease_id, drain=False)
    events = sub.poll()
    assert [e.type for e in events] == [Ev.ADDED, Ev.UPDATED, Ev.UPDATED, Ev.REMOVED]
    assert events[2].instance.state == instance_pb2.INSTANCE_STATE_DRAINING
    assert events[3].reason == "deregistered"
    revisions = [e.revision for e in events]
    assert revisions == sorted(set(revisions))
    assert [e.instance.revision for e in events] == revisions


def test_drained_instance_is_listed_but_filtered_by_state(store: InMemoryStore) -> None:
    grant = store.register(make_spec("p0"), 0)
    store.register(make_spec("d0", role=instance_pb2.ROLE_DECODE), 0)
    assert store.deregister("p0", grant.lease_id, drain=True) == (
        instance_pb2.INSTANCE_STATE_DRAINING
    )
    ids = [i.spec.instance_id for i in store.list()[0]]
    serving = store.list(state=instance_pb2.INSTANCE_STATE_SERVING)[0]
    assert ids == ["d0", "p0"]
    assert [i.spec.instance_id for i in serving] == ["d0"]
    _, state = store.heartbeat("p0", grant.lease_id, instance_pb2.LoadReport())
    assert state == instance_pb2.INSTANCE_STATE_DRAINING


def test_list_filters(store: InMemoryStore) -> None:
    store.register(make_spec("p0"), 0)
    store.register(make_spec("d0", role=instance_pb2.ROLE_DECODE), 0)
    store.register(make_spec("b0", role=instance_pb2.ROLE_BOTH, model="big"), 0)

    def ids(**kw: object) -> list[str]:
        return [i.spec.instance_id for i in store.list(**kw)[0]]  # type: ignore[arg-type]

    assert ids(role=instance_pb2.ROLE_PREFILL) == ["b0", "p0"]
    assert ids(role=instance_pb2.ROLE_DECODE) == ["b0", "d0"]
    assert ids(model="tiny") == ["d0", "p0"]


def test_slow_watcher_gets_a_fresh_snapshot_not_a_gap(store: InMemoryStore) -> None:
    sub = store.watch(0, lambda: None)
    sub.poll()
    for i in range(20):  # more than max_queue=8 events
        store.register(make_spec(f"p{i}"), 0)
    events = sub.poll()
    assert [e.type for e in events] == [Ev.SNAPSHOT]
    assert len(events[0].instances) == 20
    assert events[0].revision == store.revision
    store.register(make_spec("late"), 0)
    (late,) = sub.poll()
    assert late.type == Ev.ADDED and late.revision == events[0].revision + 1


def test_rewatch_replays_missed_events_or_snapshots(store: InMemoryStore) -> None:
    store.register(make_spec("p0"), 0)
    seen = store.revision
    store.register(make_spec("p1"), 0)
    store.register(make_spec("p2"), 0)
    replay, _ = _drain(store, seen)
    assert [(e.type, e.instance.spec.instance_id) for e in replay] == [
        (Ev.ADDED, "p1"),
        (Ev.ADDED, "p2"),
    ]
    up_to_date, _ = _drain(store, store.revision)
    assert up_to_date == []
    for from_revision in (1, store.revision + 100):  # unknown: too old, or from another registry
        (snap,), _ = _drain(store, from_revision)
        assert snap.type == Ev.SNAPSHOT and len(snap.instances) == 3


def test_notify_once_per_poll_and_close_unsubscribes(store: InMemoryStore) -> None:
    calls: list[int] = []
    sub = store.watch(0, lambda: calls.append(1))
    sub.poll()
    store.register(make_spec("p0"), 0)
    store.register(make_spec("p1"), 0)
    assert len(calls) == 2  # one for the initial snapshot, one for both events
    sub.close()
    assert store.watcher_count == 0
    store.register(make_spec("p2"), 0)
    assert sub.poll() == []
