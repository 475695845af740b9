"""Coalesced watch fan-out (`--watch-coalesce-ms`): a watcher that takes batches gets the
changes of one interval as one message, every change still there and in order; a watcher that
takes no batches still gets one message per change."""

from __future__ import annotations

import time
from collections.abc import Callable

from pdplane.core.grpc import util as grpc_util
from pdplane.v1 import registry_pb2, registry_pb2_grpc
from tests.integration.registry.conftest import WatchRecorder, wait_until
from tests.integration.registry.fixtures import make_spec, running_registry_server

Ev = registry_pb2.WatchEvent
#: Changes made, one every SPACING_S: together far shorter than the interval below, each far
#: longer than a wake-up of the watch stream (so an uncoalesced watcher gets them one by one).
CHANGES, SPACING_S = 5, 0.03
COALESCE_MS = 1000


def _changes(recorder: WatchRecorder) -> list[list[registry_pb2.WatchEvent]]:
    """The messages after the SNAPSHOT, each as the list of events it carries."""
    messages = [m for _, m in list(recorder.events) if m.type != Ev.SNAPSHOT]
    return [list(m.events) if m.type == Ev.BATCH else [m] for m in messages]


def test_changes_of_one_interval_come_as_one_batch(
    recorder_factory: Callable[..., WatchRecorder],
) -> None:
    with running_registry_server(watch_coalesce_ms=COALESCE_MS) as registry:
        batched = recorder_factory(registry.address, max_batch=256)
        single = recorder_factory(registry.address)
        assert wait_until(lambda: batched.of_type(Ev.SNAPSHOT) and single.of_type(Ev.SNAPSHOT), 5)
        with grpc_util.channel(registry.address) as chan:
            stub = registry_pb2_grpc.RegistryStub(chan)
            for i in range(CHANGES):
                stub.Register(registry_pb2.RegisterRequest(spec=make_spec(f"c{i}")), timeout=10)
                time.sleep(SPACING_S)

        def received(recorder: WatchRecorder) -> int:
            return sum(len(m) for m in _changes(recorder))

        assert wait_until(lambda: received(batched) == received(single) == CHANGES, 10), (
            _changes(batched),
            _changes(single),
        )
        # Every change once, in order, with increasing revisions, in one or (an interval
        # boundary falling among them on a slow host) two messages.
        events = [e for m in _changes(batched) for e in m]
        assert [e.type for e in events] == [Ev.ADDED] * CHANGES
        assert [e.instance.spec.instance_id for e in events] == [f"c{i}" for i in range(CHANGES)]
        revisions = [e.revision for e in events]
        assert revisions == sorted(set(revisions))
        assert len(_changes(batched)) <= 2, [len(m) for m in _changes(batched)]
        # The watcher without batches is not held back: one message per change.
        assert [len(m) for m in _changes(single)] == [1] * CHANGES
        assert [e.revision for m in _changes(single) for e in m] == revisions
