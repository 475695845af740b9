"""Packing of queued watch events into BATCH messages."""

from __future__ import annotations

from pdplane.cli.instance_json import event_to_dict
from pdplane.registry.servicer import _pack
from pdplane.v1 import registry_pb2

Ev = registry_pb2.WatchEvent


def _events(kinds: str, start: int = 1) -> list[Ev]:
    types = {"S": Ev.SNAPSHOT, "A": Ev.ADDED, "U": Ev.UPDATED, "R": Ev.REMOVED}
    return [Ev(type=types[k], revision=start + i) for i, k in enumerate(kinds)]


def test_no_batching_unless_asked() -> None:
    events = _events("AUR")
    assert _pack(events, 0) == events
    assert _pack(events, 1) == events


def test_runs_are_chunked_and_snapshots_stay_alone() -> None:
    packed = _pack(_events("AUUURS" + "A"), 3)
    assert [m.type for m in packed] == [Ev.BATCH, Ev.BATCH, Ev.SNAPSHOT, Ev.ADDED]
    assert [[e.revision for e in m.events] for m in packed[:2]] == [[1, 2, 3], [4, 5]]
    assert [m.revision for m in packed] == [3, 5, 6, 7]


def test_a_single_event_is_sent_as_itself() -> None:
    (only,) = _pack(_events("U"), 10)
    assert only.type == Ev.UPDATED


def test_json_view_of_a_batch() -> None:
    (batch,) = _pack(_events("AR"), 5)
    view = event_to_dict(batch)
    assert (view["type"], view["revision"]) == ("BATCH", 2)
    assert [e["type"] for e in view["events"]] == ["ADDED", "REMOVED"]
