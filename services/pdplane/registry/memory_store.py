"""The single-node `InstanceStore`: a dict under one lock, an event log and bounded queues.

Revisions start at the wall-clock time in microseconds, so that a restarted registry keeps
handing out revisions above those its watchers saw before (they get a fresh SNAPSHOT, whose
revision is then still larger than anything they hold).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from pdplane.core.grpc.echo import echo
from pdplane.registry.store import (
    LeaseGrant,
    LeasePolicy,
    NotFoundError,
    Subscription,
    check_replace,
    granted_lease_id,
    is_replay,
)
from pdplane.registry.watch_hub import WatchHub, change_event, filter_instances
from pdplane.v1 import instance_pb2, registry_pb2

__all__ = ["InMemoryStore"]

_Event = registry_pb2.WatchEvent
_SERVING = instance_pb2.INSTANCE_STATE_SERVING
_DRAINING = instance_pb2.INSTANCE_STATE_DRAINING


@dataclass
class _Entry:
    # `instance` is never mutated once stored (it is shared with events and readers): every
    # change stores a new message.
    instance: instance_pb2.Instance
    ttl_s: float
    deadline: float  # time.monotonic() after which the lease is expired
    last_heartbeat_ns: int


class InMemoryStore:
    """Thread-safe in-memory `InstanceStore`.

    `history` events are kept for replay to re-watching clients; each watcher queues at most
    `max_queue` events before it is switched to a fresh SNAPSHOT. `clock` (monotonic seconds)
    is injectable for tests.
    """

    def __init__(
        self,
        policy: LeasePolicy | None = None,
        *,
        history: int = 10_000,
        max_queue: int = 4_096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.policy = policy or LeasePolicy()
        self._revision = time.time_ns() // 1_000
        self._hub = WatchHub(
            self.snapshot_event, history=history, max_queue=max_queue, floor=self._revision
        )
        self.lock = self._hub.lock
        self._clock = clock
        self._entries: dict[str, _Entry] = {}

    @property
    def revision(self) -> int:
        """The revision of the last change."""
        with self.lock:
            return self._revision

    def _emit(
        self, kind: _Event.Type.ValueType, instance: instance_pb2.Instance, reason: str = ""
    ) -> None:
        self._hub.emit(change_event(kind, self._revision, instance, reason))

    def _store(self, entry: _Entry, kind: _Event.Type.ValueType) -> int:
        """Bumps the revision, stamps it on the entry's new instance and emits `kind`."""
        self._revision += 1
        entry.instance.revision = self._revision
        self._entries[entry.instance.spec.instance_id] = entry
        self._emit(kind, entry.instance)
        return self._revision

    def _remove(self, instance_id: str, reason: str) -> None:
        entry = self._entries.pop(instance_id)
        self._revision += 1
        gone = instance_pb2.Instance()
        gone.CopyFrom(entry.instance)
        gone.revision = self._revision
        self._emit(_Event.REMOVED, gone, reason)

    def _live(self, instance_id: str, now: float) -> _Entry | None:
        """The entry when its lease is live; an expired one is removed on the spot."""
        entry = self._entries.get(instance_id)
        if entry is not None and entry.deadline <= now:
            self._remove(instance_id, "lease_expired")
            return None
        return entry

    def register(
        self,
        spec: instance_pb2.InstanceSpec,
        ttl_ms: int,
        lease_id: str = "",
        admin: bool = False,
        request_id: str = "",
    ) -> LeaseGrant:
        ttl_ms, interval_ms = self.policy.grant(ttl_ms)
        now, now_ns = self._clock(), time.time_ns()
        granted = granted_lease_id(spec.instance_id, request_id)
        with self.lock:
            old = self._live(spec.instance_id, now)
            if old is not None and is_replay(old.instance, spec, request_id, granted):
                old_ttl_ms, old_interval_ms = self.policy.grant(round(old.ttl_s * 1000))
                return LeaseGrant(granted, old_ttl_ms, old_interval_ms, old.instance.revision)
            if old is not None:
                check_replace(old.instance, spec, lease_id, admin)
            instance = instance_pb2.Instance(spec=spec, state=_SERVING, lease_id=granted)
            if old is None:
                instance.registered_at.FromNanoseconds(now_ns)
            else:
                instance.registered_at.CopyFrom(old.instance.registered_at)
                instance.load.CopyFrom(old.instance.load)
            instance.last_heartbeat.FromNanoseconds(now_ns)
            entry = _Entry(instance, ttl_ms / 1000.0, now + ttl_ms / 1000.0, now_ns)
            revision = self._store(entry, _Event.ADDED if old is None else _Event.UPDATED)
            return LeaseGrant(instance.lease_id, ttl_ms, interval_ms, revision)

    def _leased(self, instance_id: str, lease_id: str, now: float) -> _Entry:
        entry = self._live(instance_id, now)
        if entry is None:
            raise NotFoundError(f"instance_id: no live lease for {echo(instance_id)}")
        if entry.instance.lease_id != lease_id:
            raise NotFoundError(
                f"lease_id: {echo(lease_id)} is not the live lease of {echo(instance_id)}"
            )
        return entry

    def heartbeat(
        self, instance_id: str, lease_id: str, load: instance_pb2.LoadReport
    ) -> tuple[int, instance_pb2.InstanceState.ValueType]:
        now, now_ns = self._clock(), time.time_ns()
        with self.lock:
            entry = self._leased(instance_id, lease_id, now)
            entry.deadline = now + entry.ttl_s
            entry.last_heartbeat_ns = now_ns
            if entry.instance.load != load:
                instance = instance_pb2.Instance()
                instance.CopyFrom(entry.instance)
                instance.load.CopyFrom(load)
                instance.last_heartbeat.FromNanoseconds(now_ns)
                entry.instance = instance
                self._store(entry, _Event.UPDATED)
            return int(entry.ttl_s * 1000), entry.instance.state

    def deregister(
        self, instance_id: str, lease_id: str, drain: bool
    ) -> instance_pb2.InstanceState.ValueType:
        with self.lock:
            entry = self._leased(instance_id, lease_id, self._clock())
            if not drain:
                self._remove(instance_id, "deregistered")
                return instance_pb2.INSTANCE_STATE_UNSPECIFIED
            if entry.instance.state != _DRAINING:
                instance = instance_pb2.Instance()
                instance.CopyFrom(entry.instance)
                instance.state = _DRAINING
                entry.instance = instance
                self._store(entry, _Event.UPDATED)
            return _DRAINING

    def expire(self) -> int:
        now = self._clock()
        with self.lock:
            expired = [iid for iid, e in self._entries.items() if e.deadline <= now]
            for instance_id in expired:
                self._remove(instance_id, "lease_expired")
            return len(expired)

    def _materialize(self, entry: _Entry) -> instance_pb2.Instance:
        # Heartbeats that change nothing only move the deadline; readers see the true time.
        instance = instance_pb2.Instance()
        instance.CopyFrom(entry.instance)
        instance.last_heartbeat.FromNanoseconds(entry.last_heartbeat_ns)
        return instance

    def list(
        self,
        role: instance_pb2.Role.ValueType = instance_pb2.ROLE_UNSPECIFIED,
        model: str = "",
        state: instance_pb2.InstanceState.ValueType = instance_pb2.INSTANCE_STATE_UNSPECIFIED,
    ) -> tuple[list[instance_pb2.Instance], int]:
        """Filter semantics: a BOTH instance matches role PREFILL and DECODE too."""
        with self.lock:
            entries = [self._entries[i] for i in sorted(self._entries)]
            matched = filter_instances((e.instance for e in entries), role, model, state)
            by_id = {e.instance.spec.instance_id: e for e in entries}
            return [self._materialize(by_id[i.spec.instance_id]) for i in matched], self._revision

    def get(self, instance_id: str) -> instance_pb2.Instance:
        with self.lock:
            entry = self._entries.get(instance_id)
            if entry is None:
                raise NotFoundError(f"instance_id: unknown instance {echo(instance_id)}")
            return self._materialize(entry)

    def snapshot_event(self) -> registry_pb2.WatchEvent:
        """A SNAPSHOT of every instance at the current revision."""
        with self.lock:
            return _Event(
                type=_Event.SNAPSHOT,
                revision=self._revision,
                instances=[e.instance for e in self._entries.values()],
            )

    def watch(self, from_revision: int, notify: Callable[[], None]) -> Subscription:
        with self.lock:
            return self._hub.watch(from_revision, self._revision, notify, ahead_ok=False)

    async def aregister(
        self,
        spec: instance_pb2.InstanceSpec,
        ttl_ms: int,
        lease_id: str = "",
        admin: bool = False,
        request_id: str = "",
    ) -> LeaseGrant:
        # Never blocks: one lock, no I/O.
        return self.register(spec, ttl_ms, lease_id, admin, request_id)

    async def aheartbeat(
        self, instance_id: str, lease_id: str, load: instance_pb2.LoadReport
    ) -> tuple[int, instance_pb2.InstanceState.ValueType]:
        return self.heartbeat(instance_id, lease_id, load)

    async def aderegister(
        self, instance_id: str, lease_id: str, drain: bool
    ) -> instance_pb2.InstanceState.ValueType:
        return self.deregister(instance_id, lease_id, drain)

    def start(self) -> None:
        """Nothing to prepare."""

    def close(self) -> None:
        """Nothing to release."""

    @property
    def watcher_count(self) -> int:
        """Open subscriptions."""
        return self._hub.watcher_count
