"""Where a registry heartbeat's CPU goes, without gRPC: the stores' own paths, in-process.

    .venv/bin/python bench/registry/paths.py            # N = 10000 instances, one etcd member

Measures (us of one core per operation, median of 5 rounds): a heartbeat with a changed load
on the memory store and on the etcd store's fast path (the replica holds the instance: no etcd
request), an etcd replica applying one load report from a LoadBatch (what every replica does
for every changed report: decode, copy, event), and the watch fan-out of one event to one
watcher (queue, poll, BATCH packing). The rest of `bench/registry/load.py`'s us/hb is gRPC
Python's per-message cost of the HeartbeatStream (one read, one write) and of the watch stream.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from aetcd import rpc

from bench.registry.load import _spec  # the load benchmark's instance specs
from pdplane.launch.etcd import EtcdCluster
from pdplane.registry.etcd.store import EtcdStore, EtcdStoreConfig
from pdplane.registry.memory_store import InMemoryStore
from pdplane.registry.servicer import MAX_BATCH, _pack
from pdplane.v1 import instance_pb2, registry_store_pb2


def _rounds(fn: object, ops: int, rounds: int = 5) -> float:
    """Median us per operation of `fn()` (which performs `ops` operations)."""
    times = []
    for _ in range(rounds):
        start = time.process_time()
        fn()  # type: ignore[operator]
        times.append((time.process_time() - start) * 1e6 / ops)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=10_000, help="instances")
    args = parser.parse_args()
    n = args.n
    loads = [instance_pb2.LoadReport(num_running=i % 64, kv_cache_usage=0.5) for i in range(64)]
    rows: list[tuple[str, float]] = []

    memory = InMemoryStore()
    grants = [memory.register(_spec(i), 60_000) for i in range(n)]
    sub = memory.watch(0, lambda: None)
    sub.poll()
    k = [0]

    def memory_beats() -> None:
        k[0] += 1
        for i, grant in enumerate(grants):
            memory.heartbeat(f"sim-{i:05d}", grant.lease_id, loads[(i + k[0]) % 64])

    rows.append(
        ("memory store: heartbeat, changed load (incl. event queued)", _rounds(memory_beats, n))
    )

    def fan_out() -> None:
        memory_beats()
        _pack(sub.poll(), MAX_BATCH)

    rows.append(("memory: heartbeat + fan-out to one watcher (poll, pack)", _rounds(fan_out, n)))

    data = Path(tempfile.mkdtemp(prefix="pdplane-paths-", dir="/dev/shm"))
    cluster = EtcdCluster(data, size=1)
    cluster.start()
    store = EtcdStore(
        EtcdStoreConfig(endpoints=cluster.endpoints.split(","), prefix="/paths/"),
        history=1000,
    )
    try:
        store.start()
        egrants = [store.register(_spec(i), 60_000) for i in range(n)]

        def etcd_beats() -> None:
            k[0] += 1
            for i, grant in enumerate(egrants):
                store.heartbeat(f"sim-{i:05d}", grant.lease_id, loads[(i + k[0]) % 64])

        rows.append(("etcd store: heartbeat fast path, changed load", _rounds(etcd_beats, n)))

        def encode() -> None:
            etcd_beats()
            with store.lock:
                taken, _ = store.loads.take([], store.view.records, 0)
            entries = store.loads.entries(taken)
            registry_store_pb2.LoadBatch(entries=entries).SerializeToString()

        rows.append(
            ("etcd store: heartbeat + its share of a LoadBatch (encode)", _rounds(encode, n))
        )
        # One replica's view applying a LoadBatch of n reports, as every replica does.
        view = store.view
        batch = registry_store_pb2.LoadBatch(replica_id="x", replica_lease=0)
        with view.lock:
            for i in range(n):
                record = view.records[f"sim-{i:05d}"]
                batch.replica_lease = record.owner_lease
                batch.entries.add(
                    instance_id=f"sim-{i:05d}",
                    lease_id=record.instance.lease_id,
                    load=loads[i % 64],
                    heartbeat_unix_ms=1,
                )
        value = batch.SerializeToString()

        def apply_batch() -> None:
            kv = rpc.KeyValue(key=b"/paths/loads/x", value=value, mod_revision=view.applied + 1)
            view.apply([rpc.Event(type=rpc.Event.EventType.PUT, kv=kv)])

        rows.append(("etcd replica: apply one load report of a LoadBatch", _rounds(apply_batch, n)))
    finally:
        store.close()
        cluster.stop()
    print(f"N = {n}")
    for name, us in rows:
        print(f"{us:8.1f} us  {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
