"""Load reports of the instances a replica holds, written to etcd in batches.

A heartbeat whose load differs from the last one this replica took for that instance is kept
(newest wins) until the next flush, which writes every kept report as one `LoadBatch` value of
`loads/<replica>`: a few etcd writes per second per replica instead of one per heartbeat. Each
flush also carries a rotating share of the unchanged reports (`refresh`), so that every
instance's load is re-sent about every `refresh_s` and a replica that started late learns it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from aetcd import rpc

from pdplane.registry.etcd.client import EtcdClient
from pdplane.registry.etcd.view import Record
from pdplane.v1 import instance_pb2, registry_store_pb2

__all__ = ["LoadReports"]

#: Entries per LoadBatch value (~60 bytes each: far below etcd's 1.5 MiB request limit).
BATCH_ENTRIES = 4096
_Pending = tuple[str, instance_pb2.LoadReport, int]  # (lease id, load, heartbeat unix ms)
#: A report to write: (instance id, lease id, load, heartbeat unix ms, refresh).
_Entry = tuple[str, str, instance_pb2.LoadReport, int, bool]


class LoadReports:
    """Kept reports of one replica; call under the store's lock except `flush`."""

    def __init__(self, replica_id: str, key: bytes, flush_s: float, refresh_s: float) -> None:
        self._replica_id = replica_id
        self._key = key
        self.flush_s = flush_s
        self._refresh_s = refresh_s
        self._sent: dict[str, instance_pb2.LoadReport] = {}
        self._pending: dict[str, _Pending] = {}
        self._refresh_at = 0
        self.writes = 0  # LoadBatch values written

    def note(
        self,
        instance_id: str,
        lease_id: str,
        load: instance_pb2.LoadReport,
        record: Record | None,
        now_ns: int,
    ) -> None:
        """Records a heartbeat's load; a changed one is kept for the next flush and shown by
        this replica's reads at once."""
        if record is not None:
            record.heartbeat_ns = now_ns
        if self._sent.get(instance_id) != load:
            self._sent[instance_id] = load
            self._pending[instance_id] = (lease_id, load, now_ns // 1_000_000)
            if record is not None:
                record.local_load = load

    def forget(self, instance_id: str) -> None:
        """The instance left this replica (removed, re-registered, taken over)."""
        self._sent.pop(instance_id, None)
        self._pending.pop(instance_id, None)

    def clear(self) -> None:
        self._sent.clear()
        self._pending.clear()

    def take(
        self, owned: list[str], records: Mapping[str, Record], lease: int
    ) -> tuple[list[_Entry], dict[str, _Pending]]:
        """(the entries of the next flush, the changed reports they hold); under the lock,
        which is why the entries are tuples: `entries()` makes the messages after it."""
        pending, self._pending = self._pending, {}
        entries: list[_Entry] = [
            (i, lease_id, load, ms, False) for i, (lease_id, load, ms) in pending.items()
        ]
        if owned:
            share = math.ceil(len(owned) * self.flush_s / self._refresh_s)
            for k in range(min(share, len(owned))):
                instance_id = owned[(self._refresh_at + k) % len(owned)]
                record = records.get(instance_id)
                if instance_id in pending or record is None or record.owner_lease != lease:
                    continue
                entries.append(
                    (
                        instance_id,
                        record.instance.lease_id,
                        record.local_load or record.instance.load,
                        record.heartbeat_ns // 1_000_000,
                        True,
                    )
                )
            self._refresh_at = (self._refresh_at + share) % len(owned)
        return entries, pending

    @staticmethod
    def entries(taken: list[_Entry]) -> list[registry_store_pb2.LoadEntry]:
        """The LoadEntry messages of `take()`'s entries (reports are never changed in place:
        a heartbeat's or a record's load is replaced, so this needs no lock)."""
        return [
            registry_store_pb2.LoadEntry(
                instance_id=i, lease_id=lease_id, load=load, heartbeat_unix_ms=ms, refresh=refresh
            )
            for i, lease_id, load, ms, refresh in taken
        ]

    def restore(self, pending: dict[str, _Pending]) -> None:
        """Puts back the reports of a failed flush (reports kept since are newer and win)."""
        for instance_id, report in pending.items():
            self._pending.setdefault(instance_id, report)

    async def flush(
        self, client: EtcdClient, entries: list[registry_store_pb2.LoadEntry], lease: int
    ) -> None:
        """Writes `entries` as LoadBatch values on `lease`; raises StoreError (then `restore`
        what `take` returned)."""
        for start in range(0, len(entries), BATCH_ENTRIES):
            batch = registry_store_pb2.LoadBatch(
                replica_id=self._replica_id,
                replica_lease=lease,
                entries=entries[start : start + BATCH_ENTRIES],
            )
            await client.call(
                "kv",
                "Put",
                rpc.PutRequest(key=self._key, value=batch.SerializeToString(), lease=lease),
            )
            self.writes += 1
