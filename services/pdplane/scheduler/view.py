"""The scheduler's view of the registry: candidates grouped by served model.

Built from any `InstanceSource` (the registry client's `InstanceWatcher`, or a fake in unit
tests) and refreshed lazily: a decision re-reads the source only when its revision moved (or
`mark_dirty` was called), and re-converts only instances whose message changed. While the
source is disconnected it keeps returning its last snapshot, so scheduling continues on the last
known view.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.port import InstanceSource
from pdplane.v1 import instance_pb2

__all__ = ["CandidateView", "StaticSource"]


class StaticSource:
    """An `InstanceSource` fed by hand (benchmarks, tests, a fleet known in advance).

    Every `put` / `remove` bumps `revision` by one, like a registry event.
    """

    def __init__(self, *instances: instance_pb2.Instance) -> None:
        self.revision = 0
        self._view: dict[str, instance_pb2.Instance] = {}
        self.put(*instances)

    def put(self, *instances: instance_pb2.Instance) -> None:
        """Adds or replaces instances (by spec.instance_id)."""
        for instance in instances:
            self.revision += 1
            self._view[instance.spec.instance_id] = instance

    def remove(self, instance_id: str) -> None:
        """Removes an instance; KeyError when it is unknown."""
        del self._view[instance_id]
        self.revision += 1

    def snapshot(self) -> dict[str, instance_pb2.Instance]:
        """A copy of the instances by id."""
        return dict(self._view)


class CandidateView:
    """Candidates by model, each list sorted by instance id."""

    def __init__(self, source: InstanceSource) -> None:
        self._source = source
        self._lock = threading.Lock()
        self._revision: int | None = None
        self._dirty = True
        # instance id -> (the message it was converted from, the candidate)
        self._cache: dict[str, tuple[instance_pb2.Instance, Candidate]] = {}
        self._by_model: dict[str, tuple[Candidate, ...]] = {}
        self._uniform: set[str] = set()
        self._position: dict[str, int] = {}  # instance id -> index in its model's group

    def mark_dirty(self, *_args: Any) -> None:
        """Forces a re-read on the next decision; usable directly as a watcher `on_change`."""
        self._dirty = True

    def candidates(self, model: str) -> Sequence[Candidate]:
        """Every instance (any role or state) serving `model`, sorted by id."""
        self._refresh()
        return self._by_model.get(model, ())

    def is_uniform(self, model: str) -> bool:
        """True when every instance of `model` has the same pair key (layout, transport,
        max model length): then any prefill pairs with any decode. Call after `candidates`."""
        return model in self._uniform

    def models(self) -> list[str]:
        """Served model names in the view, sorted."""
        self._refresh()
        return sorted(self._by_model)

    def candidate(self, instance_id: str) -> Candidate | None:
        """The current candidate of `instance_id` (refreshed first), None when unknown."""
        self._refresh()
        cached = self._cache.get(instance_id)
        return cached[1] if cached is not None else None

    def all(self) -> list[Candidate]:
        """Every candidate in the view (as of the last refresh; does not refresh)."""
        return [c for group in self._by_model.values() for c in group]

    def _refresh(self) -> None:
        revision = self._source.revision
        if not self._dirty and revision == self._revision:
            return
        with self._lock:
            self._dirty = False
            snapshot = self._source.snapshot()
            changed = self._changed(snapshot)
            if changed is None or not self._patch(changed):
                self._rebuild(snapshot)
            self._revision = revision

    def _changed(
        self, snapshot: Mapping[str, instance_pb2.Instance]
    ) -> list[instance_pb2.Instance] | None:
        """The instances whose message changed, or None when instances came or went."""
        if len(snapshot) != len(self._cache):
            return None
        changed = []
        for instance_id, instance in snapshot.items():
            cached = self._cache.get(instance_id)
            if cached is None:
                return None
            # Sources replace a changed instance's message and never mutate one, so the same
            # message object means the same candidate (revisions may repeat across registry
            # restarts; identity cannot).
            if cached[0] is not instance:
                changed.append(instance)
        return changed

    def _patch(self, changed: list[instance_pb2.Instance]) -> bool:
        """Swaps load/state updates in place (the usual heartbeat case): no regrouping, no
        sorting. False when a change moves an instance to another group or pair key."""
        updates = []
        for instance in changed:
            candidate = Candidate.from_instance(instance)
            old = self._cache[candidate.instance_id][1]
            if candidate.model != old.model or candidate.pair_key != old.pair_key:
                return False
            updates.append((instance, candidate))
        groups: dict[str, list[Candidate]] = {}
        for instance, candidate in updates:
            group = groups.get(candidate.model)
            if group is None:
                group = groups[candidate.model] = list(self._by_model[candidate.model])
            group[self._position[candidate.instance_id]] = candidate
            self._cache[candidate.instance_id] = (instance, candidate)
        for model, group in groups.items():
            self._by_model[model] = tuple(group)
        return True

    def _rebuild(self, snapshot: Mapping[str, instance_pb2.Instance]) -> None:
        cache: dict[str, tuple[instance_pb2.Instance, Candidate]] = {}
        by_model: dict[str, list[Candidate]] = {}
        for instance_id, instance in snapshot.items():
            cached = self._cache.get(instance_id)
            candidate = (
                cached[1]
                if cached is not None and cached[0] is instance
                else Candidate.from_instance(instance)
            )
            cache[instance_id] = (instance, candidate)
            by_model.setdefault(candidate.model, []).append(candidate)
        self._cache = cache
        self._by_model = {
            model: tuple(sorted(group, key=_by_id)) for model, group in by_model.items()
        }
        self._position = {
            c.instance_id: index
            for group in self._by_model.values()
            for index, c in enumerate(group)
        }
        self._uniform = {
            model for model, group in by_model.items() if len({c.pair_key for c in group}) == 1
        }


def _by_id(candidate: Candidate) -> str:
    return candidate.instance_id
