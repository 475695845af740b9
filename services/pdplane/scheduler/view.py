"""The scheduler's view of the registry: candidates grouped by served model, and their tables.

Built from any `InstanceSource` (the registry client's `InstanceWatcher`, or a fake in unit
tests) and refreshed lazily: a decision re-reads the source only when its revision moved (or
`mark_dirty` was called). A source that keeps a log of its changes (`changes_since`, as
`InstanceWatcher` and `StaticSource` do) is read by its changes only, so a heartbeat costs the
view one row, not a pass over the fleet; any other source is re-read whole and compared by
message identity. While the source is disconnected the view keeps its last state, so scheduling
continues on the last known view.

Per model, `ModelTables` (`pdplane.scheduler.table`) hold the candidates' state as arrays for
the decision: rebuilt when instances come or go (or change model or pair key), otherwise
rewritten row by row for the instances whose report changed, or whose in-flight counts did
(`tables`).
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from pdplane.core.instance.change_log import ChangeLog
from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.port import InstanceSource
from pdplane.scheduler.table import ModelTables, SideTable
from pdplane.v1 import instance_pb2

if TYPE_CHECKING:
    from pdplane.scheduler.inflight import InflightTracker
    from pdplane.scheduler.kv_index import PrefixIndex

__all__ = ["CandidateView", "ChangeSource", "Changes", "StaticSource"]

#: Changed instances since a cursor: instance id -> its message, None when it was removed.
Changes = Mapping[str, instance_pb2.Instance | None]


class ChangeSource(Protocol):
    """A source that can say what changed since a cursor (optional part of an InstanceSource).

    `changes_since(cursor)` -> (the cursor of now, the changes since `cursor`); the changes are
    None when the log cannot tell (`cursor` None, too old, or from before a snapshot replaced
    the whole view): then the reader re-reads `snapshot()`.
    """

    def changes_since(self, cursor: Hashable | None) -> tuple[Hashable, Changes | None]: ...


class StaticSource:
    """An `InstanceSource` fed by hand (benchmarks, tests, a fleet known in advance).

    Every `put` / `remove` bumps `revision` by one, like a registry event.
    """

    def __init__(self, *instances: instance_pb2.Instance) -> None:
        self.revision = 0
        self._view: dict[str, instance_pb2.Instance] = {}
        self._log = ChangeLog()
        self.put(*instances)

    def put(self, *instances: instance_pb2.Instance) -> None:
        """Adds or replaces instances (by spec.instance_id)."""
        for instance in instances:
            self.revision += 1
            self._view[instance.spec.instance_id] = instance
            self._log.append(self.revision, instance.spec.instance_id)

    def remove(self, instance_id: str) -> None:
        """Removes an instance; KeyError when it is unknown."""
        del self._view[instance_id]
        self.revision += 1
        self._log.append(self.revision, instance_id)

    def snapshot(self) -> dict[str, instance_pb2.Instance]:
        """A copy of the instances by id."""
        return dict(self._view)

    def changes_since(self, cursor: Hashable | None) -> tuple[Hashable, Changes | None]:
        """`ChangeSource.changes_since`; the cursor is a revision."""
        if not isinstance(cursor, int):
            return self.revision, None
        return self.revision, self._log.since(cursor, self._view)


class CandidateView:
    """Candidates by model (sorted by instance id) and the decision tables built from them."""

    def __init__(self, source: InstanceSource) -> None:
        self._source = source
        log = getattr(source, "changes_since", None)
        self._log: Any = log if callable(log) else None
        self._cursor: Hashable | None = None
        self._lock = threading.Lock()
        self._revision: int | None = None
        self._dirty = True
        # instance id -> (the message it was converted from, the candidate)
        self._cache: dict[str, tuple[instance_pb2.Instance, Candidate]] = {}
        self._tables: dict[str, ModelTables] = {}
        self._groups: dict[str, tuple[Candidate, ...] | None] = {}  # None: to sort again
        self._rows: dict[str, list[tuple[SideTable, int]]] = {}  # instance id -> its rows
        # Instances whose rows must be rewritten before the next decision (None: all rows).
        self._changed: set[str] | None = None

    def mark_dirty(self, *_args: Any) -> None:
        """Forces a re-read on the next decision; usable directly as a watcher `on_change`."""
        self._dirty = True

    def candidates(self, model: str) -> Sequence[Candidate]:
        """Every instance (any role or state) serving `model`, sorted by id."""
        self._refresh()
        group = self._groups.get(model, ())
        if group is None:
            with self._lock:
                group = self._groups[model] = _sorted(self._cache.values(), model)
        return group

    def is_uniform(self, model: str) -> bool:
        """True when every instance of `model` has the same pair key (layout, transport,
        max model length): then any prefill pairs with any decode. Call after `candidates`."""
        tables = self._tables.get(model)
        return tables is not None and tables.uniform

    def models(self) -> list[str]:
        """Served model names in the view, sorted."""
        self._refresh()
        return sorted(self._tables)

    def candidate(self, instance_id: str) -> Candidate | None:
        """The current candidate of `instance_id` (refreshed first), None when unknown."""
        self._refresh()
        cached = self._cache.get(instance_id)
        return cached[1] if cached is not None else None

    def all(self) -> list[Candidate]:
        """Every candidate in the view (as of the last refresh; does not refresh)."""
        return [c for _, c in list(self._cache.values())]

    def tables(
        self, model: str, inflight: InflightTracker, index: PrefixIndex | None = None
    ) -> ModelTables | None:
        """The decision tables of `model` (None when no instance serves it), every row current:
        the view refreshed, then the rows of every instance whose report, in-flight counts
        (`inflight.take_dirty`) or peer estimate changed rewritten, and the KV slots read
        from `index` when its instances moved. Call from the one thread that decides."""
        self._refresh()
        if inflight.unseen is not None:
            inflight.unseen.refresh()
        dirty = inflight.take_dirty()
        with self._lock:
            changed, self._changed = self._changed, set()
            if changed is None:
                for model_tables in self._tables.values():
                    for table in model_tables.sides():
                        table.write_all(inflight)
            else:
                rows = self._rows
                for instance_id in changed:
                    for table, row in rows.get(instance_id, ()):
                        table.write(row, table.candidates[row], inflight)
                for instance_id in dirty - changed:
                    for table, row in rows.get(instance_id, ()):
                        table.write_counts(row, inflight)
            tables = self._tables.get(model)
            if tables is not None and index is not None:
                tables.prefill.read_kv_slots(index)
                tables.decode.read_kv_slots(index)
        return tables

    # -- refresh -------------------------------------------------------------------------------

    def _refresh(self) -> None:
        revision = self._source.revision
        if not self._dirty and revision == self._revision:
            return
        with self._lock:
            self._dirty = False
            if self._log is not None:
                self._cursor, changes = self._log(self._cursor)
                if changes is not None and self._apply_changes(changes):
                    self._revision = revision
                    return
            snapshot = self._source.snapshot()
            changed = self._changed_in(snapshot)
            if changed is None or not self._patch(changed):
                self._rebuild(snapshot)
            self._revision = revision

    def _apply_changes(self, changes: Changes) -> bool:
        """Patches the view from a change log; False when instances came or went (the caller
        rebuilds from a snapshot)."""
        changed = []
        for instance_id, instance in changes.items():
            cached = self._cache.get(instance_id)
            if instance is None or cached is None:
                return False
            if cached[0] is not instance:
                changed.append(instance)
        return self._patch(changed)

    def _changed_in(
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
        sorting. False when a change moves an instance to another group, role or pair key."""
        updates = []
        for instance in changed:
            candidate = Candidate.from_instance(instance)
            old = self._cache[candidate.instance_id][1]
            if (
                candidate.model != old.model
                or candidate.pair_key != old.pair_key
                or candidate.can_prefill != old.can_prefill
                or candidate.can_decode != old.can_decode
            ):
                return False
            updates.append((instance, candidate))
        pending = self._changed
        for instance, candidate in updates:
            instance_id = candidate.instance_id
            self._cache[instance_id] = (instance, candidate)
            for table, row in self._rows[instance_id]:
                table.candidates[row] = candidate
            self._groups[candidate.model] = None
            if pending is not None:
                pending.add(instance_id)
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
        self._tables = {model: ModelTables(group) for model, group in by_model.items()}
        self._groups = dict.fromkeys(by_model)
        rows: dict[str, list[tuple[SideTable, int]]] = {}
        for tables in self._tables.values():
            for table in tables.sides():
                for row, c in enumerate(table.candidates):
                    rows.setdefault(c.instance_id, []).append((table, row))
        self._rows = rows
        self._changed = None  # every row of the new tables is written before the next decision


def _sorted(candidates: Any, model: str) -> tuple[Candidate, ...]:
    return tuple(sorted((c for _, c in candidates if c.model == model), key=_by_id))


def _by_id(candidate: Candidate) -> str:
    return candidate.instance_id
