"""Decodes that leave while streams are open on them: the streams move before they break.

The relay registers each stream's decode leg here while it relays it. On every change of the
registry's instances (`pdplane.gateway.fleet_view.FleetTracker`), a decode that left the registry
(lease expired, deregistered) has its streams moved at once, and one that turned DRAINING
(`pdplane drain`, the Helm preStop, scale-in) after `--drain-grace-s`: streams that finish
within the grace never move. Moving a stream is closing its decode leg with a reason
(`Evictable.evict`); the relay then resumes it on another decode
(`pdplane.gateway.migration`), and the drained instance, idle, leaves.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Protocol

from pdplane.v1 import instance_pb2

__all__ = ["Departures", "Evictable"]

log = logging.getLogger(__name__)


class Evictable(Protocol):
    """A stream whose decode leg can be closed for a reason (the relay then moves it)."""

    def evict(self, reason: str) -> None:
        """Closes the decode leg; `reason` is `deregistered` or `drain`."""


class Departures:
    """Open streams by decode instance id, moved off instances that leave or drain.

    Args:
        grace_s: how long streams may finish on a DRAINING decode before they move (s).
    """

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self._streams: dict[str, set[Evictable]] = {}
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._instances: Mapping[str, instance_pb2.Instance] | None = None

    def add(self, instance_id: str, stream: Evictable) -> None:
        """`stream` relays from decode `instance_id` now."""
        self._streams.setdefault(instance_id, set()).add(stream)

    def discard(self, instance_id: str, stream: Evictable) -> None:
        """`stream` no longer relays from `instance_id`."""
        streams = self._streams.get(instance_id)
        if streams is not None:
            streams.discard(stream)
            if not streams:
                del self._streams[instance_id]

    def open_streams(self, instance_id: str) -> int:
        """Streams relaying from `instance_id` now."""
        return len(self._streams.get(instance_id, ()))

    def update(self, instances: Mapping[str, instance_pb2.Instance]) -> None:
        """The registry's instances changed (on the event loop): evicts streams of decodes
        that left; starts the grace of decodes that drain."""
        self._instances = instances
        draining = instance_pb2.INSTANCE_STATE_DRAINING
        for instance_id in list(self._streams):
            inst = instances.get(instance_id)
            if inst is None:
                self._evict(instance_id, "deregistered")
            elif inst.state == draining and instance_id not in self._timers:
                log.info(
                    "decode %s drains: %d open streams move in %g s unless they finish",
                    instance_id,
                    self.open_streams(instance_id),
                    self.grace_s,
                )
                loop = asyncio.get_running_loop()
                self._timers[instance_id] = loop.call_later(
                    self.grace_s, self._evict, instance_id, "drain"
                )
        for instance_id in list(self._timers):
            inst = instances.get(instance_id)
            if inst is not None and inst.state != draining:
                self._timers.pop(instance_id).cancel()  # serving again

    def _evict(self, instance_id: str, reason: str) -> None:
        self._timers.pop(instance_id, None)
        streams = self._streams.pop(instance_id, set())
        if streams:
            log.warning("decode %s %s: moving %d open streams", instance_id, reason, len(streams))
        for stream in streams:
            stream.evict(reason)

    async def follow(
        self, snapshot: Callable[[], Mapping[str, instance_pb2.Instance]], changed: asyncio.Event
    ) -> None:
        """Runs until cancelled: `update(snapshot())` each time `changed` is set."""
        while True:
            await changed.wait()
            changed.clear()
            self.update(snapshot())

    def close(self) -> None:
        """Cancels the grace timers (shutdown)."""
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
