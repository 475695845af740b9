"""A local, consistent view of the registry's instances, kept by `WatchInstances`.

Thread-based (usable from any process). The view survives reconnects: after a broken stream
the watcher re-watches from its last revision (the registry replays the missed events or sends
a fresh SNAPSHOT) and keeps serving the last view meanwhile.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable

import grpc

from pdplane.core.grpc import util as grpc_util
from pdplane.core.instance.change_log import ChangeLog
from pdplane.registry._backoff import Backoff
from pdplane.registry.failover import FAILOVER_CODES, RegistryEndpoints
from pdplane.v1 import instance_pb2, registry_pb2

__all__ = ["InstanceWatcher"]

log = logging.getLogger(__name__)

_Event = registry_pb2.WatchEvent
OnChange = Callable[[dict[str, instance_pb2.Instance]], None]
#: Events per message the watcher accepts: a busy registry then sends fewer, larger messages.
_MAX_BATCH = 256


class InstanceWatcher:
    """Watches the registry at `registry` and mirrors its instances locally.

    `registry` is "host:port" or several replicas' "h1:port,h2:port": a broken stream moves to
    the next one and resumes from the last revision (every replica of one etcd-backed registry
    numbers events alike, so the watcher continues without a gap or a snapshot).

    `on_change` is called with a copy of the view (instance id -> Instance) after changes, from
    a notifier thread of its own: a burst of events coalesces into one call with the newest view
    (one O(N) copy per call, not per event), and a slow callback never stalls the stream.
    `token` and `tls_ca` as for `RegistrationClient`.
    """

    def __init__(
        self,
        registry: str,
        *,
        token: str | None = None,
        tls_ca: str | None = None,
        on_change: OnChange | None = None,
    ) -> None:
        self._metadata = grpc_util.token_metadata(token)
        self._endpoints = RegistryEndpoints(registry, tls_ca, grpc_util.FAST_RECONNECT_OPTIONS)
        self._on_change = on_change
        self._lock = threading.Lock()
        self._view: dict[str, instance_pb2.Instance] = {}
        self._revision = 0
        self._ready = threading.Event()
        self._stopping = threading.Event()
        self._call: grpc.Future | None = None
        self._thread: threading.Thread | None = None
        self._changed = threading.Event()
        self._notifier: threading.Thread | None = None
        self.snapshots = 0  # SNAPSHOT events applied (first one included)
        self.reconnects = 0  # streams re-opened after an error
        self._misses = 0  # replicas that failed since the last event
        self._parts: list[registry_pb2.WatchEvent] = []  # parts of a snapshot, last one pending
        self._log = ChangeLog()  # the changes since the last snapshot

    @property
    def revision(self) -> int:
        """Registry revision the local view reflects (0 before the first snapshot)."""
        with self._lock:
            return self._revision

    def snapshot(self) -> dict[str, instance_pb2.Instance]:
        """A copy of the view: instance id -> Instance (messages shared, never mutated)."""
        with self._lock:
            return dict(self._view)

    def changes_since(
        self, cursor: Hashable | None
    ) -> tuple[Hashable, dict[str, instance_pb2.Instance | None] | None]:
        """(cursor of now, instance id -> its message or None when removed, for every instance
        changed since `cursor`); the changes are None when this cannot tell (no cursor, one
        from before the last snapshot, or older than the log): then re-read `snapshot()`.
        A reader of heartbeats pays per change, not per instance."""
        with self._lock:
            now = (self.snapshots, self._revision)
            if not isinstance(cursor, tuple) or cursor[0] != now[0]:
                return now, None
            return now, self._log.since(cursor[1], self._view)

    def start(self) -> None:
        """Starts the watch thread; returns immediately."""
        if self._thread is not None:
            raise RuntimeError("InstanceWatcher already started")
        self._thread = threading.Thread(target=self._run, name="pdplane-watch", daemon=True)
        self._thread.start()
        if self._on_change is not None:
            self._notifier = threading.Thread(
                target=self._notify_loop, name="pdplane-watch-notify", daemon=True
            )
            self._notifier.start()

    def wait_ready(self, timeout: float) -> bool:
        """Waits up to `timeout` seconds for the first snapshot; True once it arrived."""
        return self._ready.wait(timeout)

    def stop(self) -> None:
        """Cancels the stream and joins the threads (bounded: about 2 s at most, plus a running
        `on_change` call)."""
        self._stopping.set()
        self._changed.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        if self._notifier is not None:
            self._notifier.join(timeout=5.0)
        self._endpoints.close()

    def _run(self) -> None:
        backoff = Backoff()
        while not self._stopping.is_set():
            try:
                self._watch_once(backoff)
            except grpc.RpcError as exc:
                if self._stopping.is_set():
                    return
                code = exc.code() if isinstance(exc, grpc.Call) else None
                # UNAVAILABLE is a registry restart or outage; anything else (e.g.
                # UNAUTHENTICATED) needs a person, so say it louder.
                level = logging.INFO if code == grpc.StatusCode.UNAVAILABLE else logging.WARNING
                log.log(level, "registry watch on %s broken (%s)", self._endpoints.address, code)
                if code in FAILOVER_CODES and self._endpoints.several:
                    self._endpoints.failover()
                    self._misses += 1
                    if self._misses < len(self._endpoints.addresses):
                        self.reconnects += 1  # the next replica is probably up: go at once
                        self._stopping.wait(0.05)
                        continue
            except Exception:
                log.exception("registry watch failed")
            self.reconnects += 1
            self._stopping.wait(backoff.next_delay())

    def _watch_once(self, backoff: Backoff) -> None:
        request = registry_pb2.WatchInstancesRequest(
            from_revision=self.revision, max_batch=_MAX_BATCH, chunked_snapshots=True
        )
        self._parts = []  # a snapshot cut off by a broken stream is dropped
        call = self._endpoints.stub.WatchInstances(request, metadata=self._metadata)
        with self._lock:
            self._call = call
        if self._stopping.is_set():  # stop() ran before the call was published
            call.cancel()
        for event in call:
            self._apply(event)
            backoff.reset()
            self._misses = 0

    def _apply(self, message: registry_pb2.WatchEvent) -> None:
        if message.type == _Event.SNAPSHOT and (message.more or self._parts):
            # A snapshot in parts: the view is replaced once the last part arrived.
            self._parts.append(message)
            if message.more:
                return
            whole = _Event(type=_Event.SNAPSHOT, revision=message.revision)
            for part in self._parts:
                whole.instances.extend(part.instances)
            self._parts = []
            message = whole
        events = message.events if message.type == _Event.BATCH else [message]
        with self._lock:
            for event in events:
                self._apply_locked(event)
        self._ready.set()
        self._changed.set()

    def _apply_locked(self, event: registry_pb2.WatchEvent) -> None:
        if event.type == _Event.SNAPSHOT:
            self._view = {i.spec.instance_id: i for i in event.instances}
            self.snapshots += 1
            self._log.reset(event.revision)
        elif event.revision <= self._revision:
            return  # already reflected (replayed after a reconnect)
        elif event.type in (_Event.ADDED, _Event.UPDATED):
            self._view[event.instance.spec.instance_id] = event.instance
        elif event.type == _Event.REMOVED:
            self._view.pop(event.instance.spec.instance_id, None)
        else:
            log.warning("ignoring watch event of unknown type %s", event.type)
            return
        if event.type != _Event.SNAPSHOT:
            self._log.append(event.revision, event.instance.spec.instance_id)
        self._revision = event.revision

    def _notify_loop(self) -> None:
        assert self._on_change is not None
        while True:
            self._changed.wait()
            if self._stopping.is_set():
                return
            self._changed.clear()
            try:
                self._on_change(self.snapshot())
            except Exception:
                log.exception("on_change callback failed")
