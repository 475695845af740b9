"""The watch hub's event history is bounded in bytes as well as in events."""

from __future__ import annotations

from pdplane.registry import watch_hub
from pdplane.registry.watch_hub import WatchHub
from pdplane.v1 import instance_pb2, registry_pb2
from tests.integration.registry.fixtures import make_spec

Ev = registry_pb2.WatchEvent


def _event(revision: int) -> Ev:
    spec = make_spec(f"i{revision}", labels={f"k{j}": "v" * 250 for j in range(16)})
    return Ev(type=Ev.ADDED, revision=revision, instance=instance_pb2.Instance(spec=spec))


def test_history_keeps_at_most_max_bytes_then_snapshots_older_watchers() -> None:
    snapshot = Ev(type=Ev.SNAPSHOT, revision=1000)
    hub = WatchHub(lambda: snapshot, history=10_000, max_queue=100, max_bytes=64 * 1024)
    size = _event(1).ByteSize()
    for revision in range(1, 201):  # 200 events of ~4 KiB: 800 KiB, far over 64 KiB
        hub.emit(_event(revision))
    assert hub.history_bytes <= 64 * 1024
    kept = hub.history_bytes // size
    assert 10 <= kept <= 16
    # A watcher from a revision still held is replayed to; an older one gets a snapshot.
    recent = hub.watch(200 - kept + 1, 200, lambda: None, ahead_ok=False).poll()
    assert [e.revision for e in recent] == list(range(202 - kept, 201))
    old = hub.watch(100, 200, lambda: None, ahead_ok=False).poll()
    assert [e.type for e in old] == [Ev.SNAPSHOT]


def test_the_default_bound_is_16_mib() -> None:
    assert watch_hub.HISTORY_BYTES == 16 << 20
