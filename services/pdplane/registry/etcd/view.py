"""A replica's view of the registry kept in etcd, and the watch events it derives (no I/O).

Every replica applies the same etcd history in the same order and derives the same events
from it, so event revisions agree across replicas and a watcher can resume on any of them:

    revision = etcd revision * 2**20 + index of the event among those of that etcd revision

(one etcd revision can carry many events: a load batch updates many instances at once).

Keys under the prefix (values are `pdplane.v1.registry_store` messages):
    instances/<id>   StoredInstance; attached to the owner replica's etcd lease
    loads/<replica>  LoadBatch: load reports that changed at that replica
    removed/<id>     the reason of a deregistration, written with the delete
    replicas/<id>    ReplicaRecord of a live replica (on its lease)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import groupby

from aetcd import rpc

from pdplane.core.grpc.echo import echo
from pdplane.registry.store import NotFoundError
from pdplane.registry.watch_hub import WatchHub, change_event, filter_instances
from pdplane.v1 import instance_pb2, registry_pb2, registry_store_pb2

__all__ = ["SHIFT", "EtcdView", "Record", "composite", "etcd_revision"]

#: Bits of a revision that number the events of one etcd revision.
SHIFT = 20
_LAST = (1 << SHIFT) - 1
_Event = registry_pb2.WatchEvent
_PUT = rpc.Event.EventType.PUT
_EXPIRED = "lease_expired"


def composite(etcd_rev: int, index: int) -> int:
    """The registry revision of the `index`-th event of etcd revision `etcd_rev`."""
    return (etcd_rev << SHIFT) | min(index, _LAST)


def etcd_revision(revision: int) -> int:
    """The etcd revision a registry revision belongs to."""
    return revision >> SHIFT


@dataclass
class Record:
    """One instance as this replica knows it. `instance` is never mutated once stored."""

    instance: instance_pb2.Instance
    ttl_ms: int
    owner_lease: int  # etcd lease of the replica that holds its heartbeats
    mod_revision: int  # etcd mod_revision of its key
    heartbeat_ns: int  # unix ns of the last heartbeat known here
    # A load this replica received and has not seen come back through etcd yet: reads here
    # show it at once (read-your-writes); watch events follow etcd.
    local_load: instance_pb2.LoadReport | None = None


#: (record, report, the record's new instance or None, its UPDATED event or None).
_LoadUpdate = tuple[
    Record, registry_store_pb2.LoadEntry, instance_pb2.Instance | None, _Event | None
]
#: Most load reports committed under one hold of the lock (~0.5 ms of work).
_LOCKED_CHUNK = 256


class EtcdView:
    """Instances and the event log of one replica, fed with etcd KVs and events.

    Thread-safe through `lock` (the watch hub's); `revision` is the revision of the last
    event, or the floor the view was loaded at.
    """

    def __init__(self, prefix: bytes, *, history: int, max_queue: int) -> None:
        self.instances_prefix = prefix + b"instances/"
        self.loads_prefix = prefix + b"loads/"
        self.removed_prefix = prefix + b"removed/"
        self.replicas_prefix = prefix + b"replicas/"
        self.hub = WatchHub(self.snapshot_event, history=history, max_queue=max_queue)
        self.lock = self.hub.lock
        self.records: dict[str, Record] = {}
        self.revision = 0
        self.applied = 0  # etcd revision applied so far
        self.replicas: dict[str, registry_store_pb2.ReplicaRecord] = {}

    # ----------------------------------------------------------------------------- loading

    def load(self, kvs: Iterable[rpc.KeyValue], etcd_rev: int) -> None:
        """Replaces the view with the KVs read at `etcd_rev` (start-up, or after etcd
        compacted past the view): watchers get a fresh SNAPSHOT."""
        with self.lock:
            self.records.clear()
            self.replicas.clear()
            batches = []
            for kv in kvs:
                if kv.key.startswith(self.instances_prefix):
                    self._put_instance(kv, composite(kv.mod_revision, 0), emit=False)
                elif kv.key.startswith(self.loads_prefix):
                    batches.append(kv)
                elif kv.key.startswith(self.replicas_prefix):
                    self._put_replica(kv)
            for kv in batches:  # whatever they hold is older than the instances' own values
                self._apply_loads(kv, etcd_rev, 0, refresh_only=True)
            self.applied = etcd_rev
            self.revision = composite(etcd_rev, _LAST)
            self.hub.reset(self.revision)

    # ---------------------------------------------------------------------------- applying

    def apply(self, events: Iterable[rpc.Event]) -> None:
        """Applies etcd watch events (in order) and emits the derived watch events. `events`
        holds whole revisions, as etcd's watch guarantees (it never splits a revision's events
        over two responses); revisions already applied are skipped. Called from one thread
        (the store's follower), the only one that changes `records` and `applied`."""
        for etcd_rev, group in groupby(events, key=lambda e: e.kv.mod_revision):
            if etcd_rev <= self.applied:
                continue  # already in the view (a re-opened etcd watch overlapped)
            batch = list(group)
            if (
                len(batch) == 1
                and batch[0].type == _PUT
                and batch[0].kv.key.startswith(self.loads_prefix)
            ):
                # A replica's load flush: thousands of reports in a large fleet, prepared
                # without the lock every heartbeat takes, then committed a chunk at a time.
                updates, _ = self._load_updates(batch[0].kv, etcd_rev, 0, refresh_only=False)
                for start in range(0, len(updates), _LOCKED_CHUNK):
                    self._commit_loads(updates[start : start + _LOCKED_CHUNK])
                with self.lock:
                    self.applied = etcd_rev
                continue
            with self.lock:
                reasons = {
                    e.kv.key[len(self.removed_prefix) :].decode(): e.kv.value.decode()
                    for e in batch
                    if e.type == _PUT and e.kv.key.startswith(self.removed_prefix)
                }
                index = 0
                for event in batch:
                    index = self._apply_one(event, etcd_rev, index, reasons)
                self.applied = etcd_rev

    def advance(self, etcd_rev: int) -> None:
        """Notes that etcd reached `etcd_rev` with nothing for this view (progress)."""
        with self.lock:
            self.applied = max(self.applied, etcd_rev)

    def _apply_one(
        self, event: rpc.Event, etcd_rev: int, index: int, reasons: dict[str, str]
    ) -> int:
        kv = event.kv
        if kv.key.startswith(self.instances_prefix):
            instance_id = kv.key[len(self.instances_prefix) :].decode()
            if event.type == _PUT:
                if self._put_instance(kv, composite(etcd_rev, index), emit=True):
                    index += 1
            elif instance_id in self.records:
                record = self.records.pop(instance_id)
                gone = instance_pb2.Instance()
                gone.CopyFrom(record.instance)
                gone.revision = composite(etcd_rev, index)
                self._emit(_Event.REMOVED, gone, reasons.get(instance_id, _EXPIRED))
                index += 1
        elif kv.key.startswith(self.loads_prefix) and event.type == _PUT:
            index = self._apply_loads(kv, etcd_rev, index, refresh_only=False)
        elif kv.key.startswith(self.replicas_prefix):
            if event.type == _PUT:
                self._put_replica(kv)
            else:
                self.replicas.pop(kv.key[len(self.replicas_prefix) :].decode(), None)
        return index

    def _put_replica(self, kv: rpc.KeyValue) -> None:
        record = registry_store_pb2.ReplicaRecord.FromString(kv.value)
        self.replicas[record.replica_id] = record

    def _put_instance(self, kv: rpc.KeyValue, revision: int, *, emit: bool) -> bool:
        stored = registry_store_pb2.StoredInstance.FromString(kv.value)
        instance = stored.instance
        instance_id = instance.spec.instance_id
        old = self.records.get(instance_id)
        if old is not None:
            # The load is soft state carried by load batches: a membership write (drain,
            # re-register, change of owner) keeps the newest one known here.
            instance.load.CopyFrom(old.instance.load)
            instance.last_heartbeat.CopyFrom(old.instance.last_heartbeat)
        heartbeat_ns = old.heartbeat_ns if old else instance.last_heartbeat.ToNanoseconds()
        changed = old is None or not _same(old.instance, instance)
        if changed:
            instance.revision = revision
        else:
            assert old is not None
            instance = old.instance  # only the owner moved: no event
        self.records[instance_id] = Record(
            instance,
            stored.lease_ttl_ms,
            kv.lease,
            kv.mod_revision,
            heartbeat_ns,
            old.local_load if old is not None else None,
        )
        if changed and emit:
            self._emit(_Event.ADDED if old is None else _Event.UPDATED, instance)
        return changed and emit

    def _apply_loads(self, kv: rpc.KeyValue, etcd_rev: int, index: int, refresh_only: bool) -> int:
        updates, index = self._load_updates(kv, etcd_rev, index, refresh_only)
        self._commit_loads(updates)
        return index

    def _load_updates(
        self, kv: rpc.KeyValue, etcd_rev: int, index: int, refresh_only: bool
    ) -> tuple[list[_LoadUpdate], int]:
        """What a LoadBatch changes, with the new instances and events built (reads `records`
        only: safe without the lock on the thread that alone changes them), and the next
        event index."""
        batch = registry_store_pb2.LoadBatch.FromString(kv.value)
        updates: list[_LoadUpdate] = []
        for entry in batch.entries:
            record = self.records.get(entry.instance_id)
            if (
                record is None
                or record.instance.lease_id != entry.lease_id
                or record.owner_lease != batch.replica_lease
            ):
                continue  # a late report of a registration or owner that is gone
            silent = entry.refresh or refresh_only
            if silent and record.instance.load == entry.load:
                updates.append((record, entry, None, None))
                continue
            instance = instance_pb2.Instance()
            instance.CopyFrom(record.instance)
            instance.load.CopyFrom(entry.load)
            instance.last_heartbeat.FromMilliseconds(entry.heartbeat_unix_ms)
            if silent:
                # A refresh is no event (replicas that watched all along already hold it):
                # the view takes the load silently, keeping its revision.
                updates.append((record, entry, instance, None))
                continue
            instance.revision = composite(etcd_rev, index)
            event = change_event(_Event.UPDATED, instance.revision, instance)
            updates.append((record, entry, instance, event))
            index += 1
        return updates, index

    def _commit_loads(self, updates: list[_LoadUpdate]) -> None:
        """Stores `_load_updates`' instances and emits their events (takes the lock)."""
        with self.lock:
            for record, entry, instance, event in updates:
                record.heartbeat_ns = max(record.heartbeat_ns, entry.heartbeat_unix_ms * 1_000_000)
                if record.local_load is not None and record.local_load == entry.load:
                    record.local_load = None
                if instance is not None:
                    record.instance = instance
                if event is not None:
                    self.revision = event.revision
                    self.hub.emit(event)

    def _emit(
        self, kind: _Event.Type.ValueType, instance: instance_pb2.Instance, reason: str = ""
    ) -> None:
        self.revision = instance.revision
        self.hub.emit(change_event(kind, instance.revision, instance, reason))

    # ------------------------------------------------------------------------------ reading

    def materialize(self, record: Record) -> instance_pb2.Instance:
        """The instance with the freshest heartbeat time known here."""
        instance = instance_pb2.Instance()
        instance.CopyFrom(record.instance)
        instance.last_heartbeat.FromNanoseconds(record.heartbeat_ns)
        if record.local_load is not None:
            instance.load.CopyFrom(record.local_load)
        return instance

    def list(
        self,
        role: instance_pb2.Role.ValueType,
        model: str,
        state: instance_pb2.InstanceState.ValueType,
    ) -> tuple[list[instance_pb2.Instance], int]:
        with self.lock:
            records = [self.records[i] for i in sorted(self.records)]
            matched = {
                i.spec.instance_id
                for i in filter_instances((r.instance for r in records), role, model, state)
            }
            out = [self.materialize(r) for r in records if r.instance.spec.instance_id in matched]
            return out, self.revision

    def get(self, instance_id: str) -> instance_pb2.Instance:
        with self.lock:
            record = self.records.get(instance_id)
            if record is None:
                raise NotFoundError(f"instance_id: unknown instance {echo(instance_id)}")
            return self.materialize(record)

    def snapshot_event(self) -> registry_pb2.WatchEvent:
        """A SNAPSHOT of every instance at the current revision."""
        with self.lock:
            return _Event(
                type=_Event.SNAPSHOT,
                revision=self.revision,
                instances=[r.instance for r in self.records.values()],
            )


def _same(a: instance_pb2.Instance, b: instance_pb2.Instance) -> bool:
    """Equal but for the revision."""
    return (
        a.spec == b.spec
        and a.state == b.state
        and a.lease_id == b.lease_id
        and a.registered_at == b.registered_at
        and a.load == b.load
    )
