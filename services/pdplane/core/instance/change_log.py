"""A bounded log of which instances changed at which registry revision.

Readers of a registry view (the scheduler's `CandidateView`) ask what changed since the
revision they last read instead of copying and comparing the whole view: a heartbeat then
costs them one instance, not a pass over the fleet. Kept by the registry client's
`InstanceWatcher` and by the scheduler's `StaticSource`.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from typing import TypeVar

__all__ = ["ChangeLog"]

_V = TypeVar("_V")


class ChangeLog:
    """(revision, instance id) of every change after `start`, oldest first, at most `limit`
    entries (older ones are dropped and `start` moves up). Revisions only grow until `reset`.
    Not locked: its owner serializes access."""

    def __init__(self, limit: int = 65_536) -> None:
        self._limit = limit
        self._entries: deque[tuple[int, str]] = deque()
        self.start = 0  # every change after this revision is logged

    def reset(self, revision: int) -> None:
        """Forgets every entry: the view was replaced whole at `revision` (a snapshot)."""
        self._entries.clear()
        self.start = revision

    def append(self, revision: int, instance_id: str) -> None:
        """`instance_id` was added, updated or removed at `revision`."""
        self._entries.append((revision, instance_id))
        if len(self._entries) > self._limit:
            self.start = self._entries.popleft()[0]

    def since(self, revision: int, view: Mapping[str, _V]) -> dict[str, _V | None] | None:
        """Instance id -> its entry in `view` now (None: removed) for every instance changed
        after `revision`; None when the log does not reach back that far."""
        if revision < self.start:
            return None
        changed: dict[str, _V | None] = {}
        for at, instance_id in reversed(self._entries):
            if at <= revision:
                break
            if instance_id not in changed:
                changed[instance_id] = view.get(instance_id)
        return changed
