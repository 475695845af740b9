"""Watch fan-out shared by the stores: an event log for replay and bounded per-watcher queues.

A store owns one `WatchHub`, calls `emit` (under the hub's lock) for every change, and hands
`watch` the current revision; the hub replays logged events to a re-watching client or asks
the store for a SNAPSHOT, and turns a watcher that lagged `max_queue` events into one fresh
SNAPSHOT instead of a silent gap.

The log is bounded by `history` events and by `max_bytes` serialized bytes (`HISTORY_BYTES`,
16 MiB): 10,000 events of large specs had kept a registry at 315 MB RSS after all 5,000 of its
instances were gone (81 MB with the log emptied); a watcher asking for an event no longer held
gets a SNAPSHOT, as for any event older than the log.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable

from pdplane.v1 import instance_pb2, registry_pb2

__all__ = ["HISTORY_BYTES", "WatchHub", "change_event", "filter_instances"]

_Event = registry_pb2.WatchEvent
#: Default bound of a hub's event log (serialized bytes of its events).
HISTORY_BYTES = 16 << 20


def filter_instances(
    instances: Iterable[instance_pb2.Instance],
    role: instance_pb2.Role.ValueType,
    model: str,
    state: instance_pb2.InstanceState.ValueType,
) -> list[instance_pb2.Instance]:
    """The instances matching the filter (zero values match anything; a BOTH instance matches
    role PREFILL and DECODE too), in the given order."""
    out = []
    for instance in instances:
        spec = instance.spec
        if role and spec.role not in (role, instance_pb2.ROLE_BOTH):
            continue
        if (model and spec.model != model) or (state and instance.state != state):
            continue
        out.append(instance)
    return out


def change_event(
    kind: registry_pb2.WatchEvent.Type.ValueType,
    revision: int,
    instance: instance_pb2.Instance,
    reason: str = "",
) -> registry_pb2.WatchEvent:
    """A change event of `kind` holding its own copy of `instance` (a store emits one per
    change: with every heartbeat's load changed, one per heartbeat)."""
    # CopyFrom into the event's field: passing the instance to the constructor copies it
    # too, at about 3x the cost (3.2 against 0.9 us for a bench/registry/load.py instance).
    event = _Event(type=kind, revision=revision, reason=reason)
    event.instance.CopyFrom(instance)
    return event


class _Subscription:
    """A watcher's bounded event queue; overflow turns into one fresh SNAPSHOT."""

    def __init__(self, hub: WatchHub, notify: Callable[[], None], skip_until: int) -> None:
        self._hub = hub
        self._notify = notify
        self._queue: deque[registry_pb2.WatchEvent] = deque()
        self.needs_snapshot = False
        self._notified = False
        self.closed = False
        # Events at or below this revision were already seen by the watcher (it re-watched a
        # replica whose view is a little behind the one it came from).
        self.skip_until = skip_until

    def push(self, event: registry_pb2.WatchEvent) -> None:
        """Queues `event` (hub lock held)."""
        if self.closed or self.needs_snapshot or event.revision <= self.skip_until:
            return
        if len(self._queue) >= self._hub.max_queue:
            self._queue.clear()
            self.needs_snapshot = True
        else:
            self._queue.append(event)
        self._wake()

    def lagged(self) -> None:
        """Drops the queue and asks for a SNAPSHOT on the next poll (hub lock held)."""
        self._queue.clear()
        self.needs_snapshot = True
        self.skip_until = 0
        self._wake()

    def _wake(self) -> None:
        # One notification per poll is enough: the poller drains everything.
        if not self._notified:
            self._notified = True
            self._notify()

    def poll(self) -> list[registry_pb2.WatchEvent]:
        with self._hub.lock:
            self._notified = False
            if self.needs_snapshot:
                self.needs_snapshot = False
                self._queue.clear()
                return [self._hub.snapshot()]
            events = list(self._queue)
            self._queue.clear()
            return events

    def close(self) -> None:
        with self._hub.lock:
            self.closed = True
            self._queue.clear()
            self._hub.unsubscribe(self)


class WatchHub:
    """The event log (`history` events) and the open subscriptions of one store.

    `snapshot` returns a SNAPSHOT event of the store at its current revision; it is called with
    `lock` held, which the store also holds while it changes its state and calls `emit`.
    """

    def __init__(
        self,
        snapshot: Callable[[], registry_pb2.WatchEvent],
        *,
        history: int,
        max_queue: int,
        floor: int = 0,
        max_bytes: int = HISTORY_BYTES,
    ) -> None:
        self.lock = threading.RLock()
        self._snapshot = snapshot
        self.max_queue = max_queue
        self.max_bytes = max_bytes
        self._log: deque[registry_pb2.WatchEvent] = deque(maxlen=history)
        self._sizes: deque[int] = deque(maxlen=history)  # ByteSize of each logged event
        self.history_bytes = 0  # sum of `_sizes`
        # Every event above `_floor` is in the log: a watcher that saw up to any revision from
        # `_floor` on can be replayed to.
        self._floor = floor
        self._subs: set[_Subscription] = set()

    def snapshot(self) -> registry_pb2.WatchEvent:
        """The store's SNAPSHOT without lease ids (lock held; see `emit`)."""
        event = self._snapshot()
        for instance in event.instances:
            instance.ClearField("lease_id")
        return event

    def emit(self, event: registry_pb2.WatchEvent) -> None:
        """Logs `event` and queues it for every watcher (lock held). Its instance loses its
        lease id: the lease id is the instance's capability, never sent to watchers (`event`
        holds its own copy of the instance, made when the event was built)."""
        if event.HasField("instance"):
            event.instance.ClearField("lease_id")
        log, sizes = self._log, self._sizes
        if len(log) == log.maxlen:
            self._floor = log[0].revision if log else event.revision
            if sizes:
                self.history_bytes -= sizes[0]
        if log.maxlen != 0:  # --event-history 0 keeps nothing
            size = event.ByteSize()
            log.append(event)
            sizes.append(size)
            self.history_bytes += size
        while self.history_bytes > self.max_bytes and len(log) > 1:
            self._floor = log.popleft().revision
            self.history_bytes -= sizes.popleft()
        for sub in self._subs:
            sub.push(event)

    def reset(self, floor: int) -> None:
        """Forgets the log and sends every watcher a fresh SNAPSHOT (lock held): the store lost
        the continuity of its history (e.g. etcd compacted past it) and now stands at `floor`."""
        self._log.clear()
        self._sizes.clear()
        self.history_bytes = 0
        self._floor = floor
        for sub in self._subs:
            sub.lagged()

    def watch(
        self, from_revision: int, revision: int, notify: Callable[[], None], *, ahead_ok: bool
    ) -> _Subscription:
        """Subscribes at the store's current `revision`: replays the logged events after
        `from_revision` when the log still holds all of them, else starts with a SNAPSHOT
        (always for 0). `ahead_ok`: a `from_revision` above `revision` is one this store will
        reach (a replica a little behind another one): events up to it are skipped, not
        snapshotted."""
        with self.lock:
            ahead = ahead_ok and from_revision > revision
            sub = _Subscription(self, notify, from_revision if ahead else 0)
            if ahead:
                pass  # nothing to replay yet; later events above from_revision flow in
            elif from_revision > 0 and self._floor <= from_revision <= revision:
                for event in self._log:
                    if event.revision > from_revision:
                        sub.push(event)
            else:
                sub.lagged()
            self._subs.add(sub)
        return sub

    def unsubscribe(self, sub: _Subscription) -> None:
        """Forgets a closed subscription."""
        with self.lock:
            self._subs.discard(sub)

    @property
    def watcher_count(self) -> int:
        """Open subscriptions."""
        with self.lock:
            return len(self._subs)
