"""`PrefixIndex`: which KV cache blocks every instance holds, keyed by pdplane's own hashes.

Built from the instances' `KvEvents` streams (one `InstanceBlocks` sink per instance, driven by
`pdplane.scheduler.kv_index.stream.KvStreamReader`). Keys are
`pdplane.core.prefix_hash.block_hashes` of
the token ids the events carry, so instances with different vLLM hash seeds share keys; each
instance maps its engine hashes to our hashes, so removals find their entries. A source that
sends our hashes itself (`BlockStored.own_hashes`, same `hash_version`) saves the hashing: the
index then only updates its tables; otherwise the index hashes the token ids.

Layout (chosen for the lookup, which runs on every Schedule):

* per medium, one table `own hash -> bitmask of instance slots holding it` (a Python int);
* per instance, `engine hash -> own hash` per medium (for removals, clears and leaving).

`match(hashes)` walks the prompt's blocks in order, AND-ing the masks, and stops when no
instance holds the prefix: one dict lookup and one int AND per block, independent of the
number of instances until the masks are wide (1,000 instances = 16 machine words).

Only instances in state LIVE (snapshot applied, stream current) are ever reported; the
subscriber manager sets SYNCING / STALE (docs/kv_events.md). Writes come from one thread (the
subscriber manager's); lookups may run on any thread without a lock: each table entry is one
Python int replaced atomically, and a lookup racing an update sees the old or the new mask.

Memory is bounded by `max_blocks` (instance x block entries over all instances); stores beyond
it are dropped and counted (the index then under-predicts, never over-predicts).
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Iterable, Sequence
from enum import StrEnum

import numpy as np
import numpy.typing as npt

from pdplane.core.kv_events.log import DEFAULT_MEDIUM
from pdplane.core.prefix_hash import HASH_VERSION, block_hashes
from pdplane.scheduler.kv_index.batch import apply_batch, apply_events
from pdplane.scheduler.kv_index.holders import HolderSets, HolderTable
from pdplane.scheduler.kv_index.kernels import match_runs, warm_up
from pdplane.scheduler.kv_index.u64map import U64Map, U64s
from pdplane.v1 import kv_events_pb2

__all__ = ["InstanceBlocks", "KvState", "PrefixIndex"]

log = logging.getLogger(__name__)

_FIRST_CHUNK = 64  # blocks probed by match's first step (1k tokens at block size 16)
_FEW_HOLDERS = 16  # holders of one depth written one by one; more: from the bitmask in bulk


class KvState(StrEnum):
    """Whether an instance's entries can be trusted for routing."""

    SYNCING = "syncing"  # subscribed, no snapshot yet: not trusted
    LIVE = "live"  # snapshot applied and events current: trusted
    STALE = "stale"  # stream down or lagging past the bound: not trusted until a snapshot


_Pending = dict[str, dict[int, tuple[int | None, kv_events_pb2.BlockStored]]]


class InstanceBlocks:
    """One instance's blocks in the index; the `KvEventSink` of its stream.

    Created by `PrefixIndex.add_instance`; do not construct directly.
    """

    def __init__(self, index: PrefixIndex, instance_id: str, slot: int) -> None:
        self.index = index
        self.instance_id = instance_id
        self.slot = slot
        self.bit = 1 << slot
        self.state = KvState.SYNCING
        self.state_reason = "no snapshot yet"
        self.blocks: dict[str, U64Map] = {}  # medium -> engine hash -> own hash (uint64)
        self.orphans = 0  # stored blocks whose parent was unknown (not indexed)
        self.dropped = 0  # stored blocks refused by the memory bound
        self._pending: _Pending | None = None

    @property
    def num_blocks(self) -> int:
        """Blocks of this instance in the index (over all media)."""
        return sum(len(m) for m in self.blocks.values())

    # -- KvEventSink ---------------------------------------------------------------------------

    def begin_snapshot(self, epoch: int, sequence: int, total_blocks: int) -> None:
        self._pending = {}

    def snapshot_blocks(self, blocks: Sequence[kv_events_pb2.BlockStored]) -> None:
        pending = self._pending
        assert pending is not None, "snapshot blocks outside a snapshot"
        for b in blocks:
            if len(b.block_hashes) != 1:
                continue  # the server sends one block per entry
            parent = b.parent_block_hash if b.HasField("parent_block_hash") else None
            pending.setdefault(b.medium or DEFAULT_MEDIUM, {})[b.block_hashes[0]] = (parent, b)

    def end_snapshot(self) -> None:
        pending, self._pending = self._pending, None
        assert pending is not None, "end of a snapshot that did not begin"
        self.clear()
        for medium, blocks in pending.items():
            self._apply_snapshot_medium(medium, blocks)

    def apply(self, event: kv_events_pb2.KvEvent) -> None:
        kind = event.WhichOneof("event")
        if kind == "stored":
            self.stored(event.stored)
        elif kind == "removed":
            self.removed(event.removed.block_hashes, event.removed.medium or DEFAULT_MEDIUM)
        elif kind == "cleared":
            self.clear()

    def apply_events(self, events: Sequence[kv_events_pb2.KvEvent]) -> None:
        """Consecutive live events at once: the state of `apply` of each in turn, with runs
        of like events merged into one table update (`pdplane.scheduler.kv_index.batch`)."""
        apply_events(self, events)

    def apply_batch(self, batch: kv_events_pb2.KvEventBatch) -> None:
        """A whole `KvEventBatch`, its columnar stores included (`batch.apply_batch`)."""
        apply_batch(self, batch)

    # -- updates -------------------------------------------------------------------------------

    def stored(self, msg: kv_events_pb2.BlockStored) -> None:
        """Indexes a BlockStored: with the source's own hashes as they are, otherwise hashed
        here (then its parent must be known, or absent = sequence start)."""
        medium = msg.medium or DEFAULT_MEDIUM
        given = _given_own(msg)
        if given is not None:
            self.stored_own(medium, msg.block_hashes, given)
            return
        parent_own: int | None = None
        if msg.HasField("parent_block_hash"):
            parent_own = self._own_of(msg.parent_block_hash, medium)
            if parent_own is None:
                self.orphans += len(msg.block_hashes)
                return
        try:
            own = block_hashes(
                msg.token_ids,
                msg.block_size,
                parent=parent_own,
                lora=msg.lora_name,
                extra_keys=msg.extra_keys or None,
            )
        except ValueError:
            self.orphans += len(msg.block_hashes)
            return
        self._add(medium, msg.block_hashes, own)

    def stored_own(self, medium: str, engine_hashes: Sequence[int], own: Sequence[int]) -> None:
        """Indexes engine blocks under the own hashes given (one per block; as `stored` of a
        BlockStored carrying them)."""
        self._add(medium, engine_hashes, own)

    def removed(self, engine_hashes: Iterable[int], medium: str = DEFAULT_MEDIUM) -> None:
        """Drops these engine blocks; unknown hashes are ignored."""
        mapping = self.blocks.get(medium)
        if not mapping:
            return
        table = self.index.tables[medium]
        if isinstance(engine_hashes, Sequence) and len(engine_hashes) == 1:
            one = table.unstore_one(mapping, int(engine_hashes[0]), self.bit)
            if one is not None:
                self.index.entries -= one
                return
        keys = np.fromiter(engine_hashes, np.uint64)
        released = table.unstore(mapping, keys, self.bit)
        if released is None:  # keys 0 or 1: per-call numpy operations
            own, found = mapping.pop(np.unique(keys))
            released = int(found.sum())
            if released:
                table.remove(np.unique(own[found]), self.bit)
        self.index.entries -= released

    def clear(self) -> None:
        """Forgets every block of this instance (AllBlocksCleared, snapshot, leaving)."""
        for medium, mapping in self.blocks.items():
            _, own = mapping.items()
            self.index.entries -= len(mapping)
            self.index.tables[medium].remove(np.unique(own), self.bit)
        self.blocks = {}

    # -- helpers -------------------------------------------------------------------------------

    def _own_of(self, engine: int, medium: str) -> int | None:
        mapping = self.blocks.get(medium)
        own = mapping.get_one(engine) if mapping is not None else None
        if own is None and medium != DEFAULT_MEDIUM:  # an offloaded block's parent on device
            device = self.blocks.get(DEFAULT_MEDIUM)
            own = device.get_one(engine) if device is not None else None
        return own

    def _add(self, medium: str, engine_hashes: Sequence[int], own: Sequence[int]) -> None:
        index = self.index
        room = index.max_blocks - index.entries
        n = len(own)
        if n > room:
            self.dropped += n - max(room, 0)
            n = max(room, 0)
        if n <= 0:
            return
        mapping, table = self.tables_of(medium)
        if n == 1:  # single-block events: no numpy, no kernel call
            added = table.store_one(mapping, int(engine_hashes[0]), int(own[0]), self.bit)
            if added is not None:
                index.entries += added
                return
        eng = np.fromiter(engine_hashes, np.uint64, len(engine_hashes))[:n]
        new = np.fromiter(own, np.uint64, len(own))[:n]
        added = table.store(mapping, eng, new, self.bit)
        if added is None:
            self._add_slow(mapping, table, eng, new)
        else:
            index.entries += added

    def tables_of(self, medium: str) -> tuple[U64Map, HolderTable]:
        """This instance's engine -> own map of `medium` and the medium's holder table
        (created empty if new)."""
        mapping = self.blocks.get(medium)
        if mapping is None:
            mapping = self.blocks[medium] = U64Map(np.uint64)
        index = self.index
        table = index.tables.get(medium)
        if table is None:
            table = index.tables[medium] = HolderTable(index.holder_sets)
        return mapping, table

    def _add_slow(self, mapping: U64Map, table: HolderTable, eng: U64s, new: U64s) -> None:
        # Batches with the keys 0 or 1 (U64Map's side dict): per-call numpy operations.
        prev, found = mapping.get(eng)
        same = found & (prev == new)  # stored again (vLLM re-announces reused blocks)
        if same.all():
            return
        moved = found & ~same  # an engine block now under another own hash
        if moved.any():
            table.remove(np.unique(prev[moved]), self.bit)
        if same.any():
            eng, new = eng[~same], new[~same]
        self.index.entries += mapping.put(eng, new)
        table.add(np.unique(new), self.bit)

    def _apply_snapshot_medium(
        self, medium: str, blocks: dict[int, tuple[int | None, kv_events_pb2.BlockStored]]
    ) -> None:
        # Order within a snapshot is arbitrary: resolve each block's chain to a known own hash
        # (or the root), then hash back down it. Blocks whose chain leaves the snapshot are
        # unreachable for a prefix hit in the engine as well: skipped (counted as orphans).
        # A block that carries its own hash needs no chain: it is indexed even when its parent
        # was evicted (the engine hits it again once the parent is stored again).
        resolved: dict[int, int | None] = {}
        for engine_key, (_, stored) in blocks.items():
            given = _given_own(stored)
            if given is not None and len(given) == 1:
                resolved[engine_key] = given[0]
        for start in blocks:
            if start in resolved:
                continue
            chain: list[int] = []
            eng: int | None = start
            parent_own: int | None = None
            ok = True
            while eng is not None:
                if eng in resolved:
                    parent_own = resolved[eng]
                    ok = parent_own is not None
                    break
                entry = blocks.get(eng)
                if entry is None or eng in chain:  # parent not cached (or a cycle)
                    ok = False
                    break
                chain.append(eng)
                eng = entry[0]
            for e in reversed(chain):
                if not ok:
                    resolved[e] = None
                    continue
                msg = blocks[e][1]
                try:
                    (own,) = block_hashes(
                        msg.token_ids,
                        msg.block_size,
                        parent=parent_own,
                        lora=msg.lora_name,
                        extra_keys=msg.extra_keys or None,
                    )
                except ValueError:
                    ok = False
                    resolved[e] = None
                    continue
                resolved[e] = parent_own = own
        good = [(e, h) for e, h in resolved.items() if h is not None]
        self.orphans += len(resolved) - len(good)
        self._add(medium, [e for e, _ in good], [h for _, h in good])


class PrefixIndex:
    """Cached prefixes of every instance, for routing.

    Args:
        max_blocks: bound on (instance, block) entries over all instances and media.
    """

    def __init__(self, max_blocks: int = 100_000_000) -> None:
        warm_up()  # compile the table kernels now, not on the first event
        self.max_blocks = max_blocks
        self.entries = 0
        self.holder_sets = HolderSets()  # shared by every medium's table
        self.tables: dict[str, HolderTable] = {}  # medium -> own hash -> holder set
        self._instances: dict[str, InstanceBlocks] = {}
        self._by_slot: dict[int, InstanceBlocks] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._live = 0  # bitmask of LIVE instances
        #: 1 per LIVE slot (the decision tables read it: `pdplane.scheduler.table` KV_SLOT).
        self.live_slots = np.zeros(64, np.uint8)
        #: Bumped whenever an instance gets or gives up its slot.
        self.slots_version = 0

    # -- instances -----------------------------------------------------------------------------

    def add_instance(self, instance_id: str) -> InstanceBlocks:
        """The sink of `instance_id` (created SYNCING; the same object if already there)."""
        inst = self._instances.get(instance_id)
        if inst is not None:
            return inst
        if self._free_slots:
            slot = self._free_slots.pop()
        else:
            slot = self._next_slot
            self._next_slot += 1
        inst = InstanceBlocks(self, instance_id, slot)
        self._instances[instance_id] = inst
        self._by_slot[slot] = inst
        self.slots_version += 1
        return inst

    def remove_instance(self, instance_id: str) -> None:
        """Forgets the instance and all its blocks (it left the registry)."""
        inst = self._instances.pop(instance_id, None)
        if inst is None:
            return
        self.set_state(inst, KvState.STALE, "removed")
        inst.clear()
        del self._by_slot[inst.slot]
        self._free_slots.append(inst.slot)
        self.slots_version += 1

    def instance(self, instance_id: str) -> InstanceBlocks | None:
        return self._instances.get(instance_id)

    def instances(self) -> list[InstanceBlocks]:
        return list(self._instances.values())

    def set_state(self, inst: InstanceBlocks, state: KvState, reason: str = "") -> None:
        """Marks an instance SYNCING / LIVE / STALE; only LIVE ones are matched."""
        inst.state = state
        inst.state_reason = reason
        live = self.live_slots
        if inst.slot >= len(live):
            # Grown whole and then swapped in: a reader sees the old array or the new one.
            grown = np.zeros(max(2 * len(live), inst.slot + 1), np.uint8)
            grown[: len(live)] = live
            self.live_slots = live = grown
        if state is KvState.LIVE:
            self._live |= inst.bit
            live[inst.slot] = 1
        else:
            self._live &= ~inst.bit
            live[inst.slot] = 0

    # -- lookup --------------------------------------------------------------------------------

    def match(
        self,
        hashes: Sequence[int],
        *,
        medium: str = DEFAULT_MEDIUM,
        instances: Collection[str] | None = None,
    ) -> dict[str, int]:
        """The longest cached prefix of a prompt on each LIVE instance.

        Args:
            hashes: the prompt's own block hashes (`pdplane.core.prefix_hash.block_hashes`
                of its token ids with the instances' block size), in order: ints, or a
                contiguous uint64 array (probed without a copy).
            medium: which cache tier to look in ("GPU" = the engine's device cache).
            instances: only these instance ids (e.g. the compatible candidates); None = all.

        Returns:
            instance id -> number of leading blocks of `hashes` it holds (>= 1); instances
            holding none are absent. Cached tokens = blocks * block size.
        """
        alive = self._live
        if instances is not None:
            mask = 0
            for iid in instances:
                inst = self._instances.get(iid)
                if inst is not None:
                    mask |= inst.bit
            alive &= mask
        found: dict[str, int] = {}
        for bits, depth in self.match_groups(hashes, medium=medium, among=alive):
            _report(bits, depth, self._by_slot, found)
        return found

    def match_slots(
        self, hashes: Sequence[int], out: npt.NDArray[np.float64], scale: int = 1
    ) -> bool:
        """`match` for the decision tables, per index slot and in bulk: out[slot] becomes at
        least `scale` x the leading blocks of `hashes` the LIVE instance in `slot` holds
        (`out` float64, at least `len(live_slots)` long, left as it is elsewhere). With a
        shared system prompt every instance holds a prefix: the holders are then written a
        group (same depth) at a time from the group's bitmask, not one by one. Returns
        whether any instance holds one."""
        groups = self.match_groups(hashes)
        n = len(out)
        for bits, depth in groups:
            value = float(depth * scale)
            if bits.bit_count() <= _FEW_HOLDERS:
                while bits:
                    low = bits & -bits
                    slot = low.bit_length() - 1
                    if slot < n and out.item(slot) < value:
                        out[slot] = value
                    bits ^= low
            else:
                held = _slots_of(bits, n)
                np.maximum(out, held * value, out=out)
        return bool(groups)

    def match_groups(
        self, hashes: Sequence[int], *, medium: str = DEFAULT_MEDIUM, among: int | None = None
    ) -> list[tuple[int, int]]:
        """The walk behind `match`: [(bitmask of instance slots, blocks)] — the LIVE instances
        (of `among`, a slot bitmask; None = all) whose cached prefix of `hashes` ends after
        that many blocks, deepest last; one entry per distinct depth."""
        table = self.tables.get(medium)
        alive = self._live if among is None else among
        if not table or not alive or not len(hashes):
            return []
        groups: list[tuple[int, int]] = []
        masks = self.holder_sets.masks
        ids = table.ids
        special = ids.special
        sid0, sid1 = special.get(0, -1), special.get(1, -1)
        depth = 0
        start = 0
        chunk = _FIRST_CHUNK
        if isinstance(hashes, np.ndarray):
            # uint64 already (a received request's): probed whole, the kernel stops at the
            # first block no instance holds.
            chunk = len(hashes)
        while start < len(hashes):
            # Probe a chunk of blocks at a time (64, then doubling): most walks end early, and
            # hashes given as ints are converted only as far as they are probed.
            part = hashes[start : start + chunk]
            keys = part if isinstance(part, np.ndarray) else np.fromiter(part, np.uint64)
            hkeys, hvals, hbits = ids.arrays  # one read: a table growing meanwhile is new
            found = match_runs(hkeys, hvals, hbits, keys, sid0, sid1)
            held, runs = int(found[0]), int(found[1])
            out = found[: 2 + 2 * runs].tolist()
            # Walk runs of blocks with the same holder set: one step per run, not per block.
            for r in range(2, 2 + 2 * runs, 2):
                held_by = masks[out[r]] & alive
                if held_by != alive:
                    if depth:
                        groups.append((alive & ~held_by, depth))
                    alive = held_by
                    if not alive:
                        return groups
                depth += out[r + 1]
            if held < len(keys):
                break
            start += len(keys)
            chunk *= 2
        if depth:
            groups.append((alive, depth))
        return groups


def _slots_of(bits: int, n: int) -> npt.NDArray[np.bool_]:
    """Bitmask of slots -> bool per slot (n of them), in one pass over its bytes."""
    raw = np.frombuffer(bits.to_bytes((max(n, bits.bit_length()) + 7) // 8, "little"), np.uint8)
    return np.unpackbits(raw, bitorder="little")[:n].astype(np.bool_)


def _given_own(msg: kv_events_pb2.BlockStored) -> Sequence[int] | None:
    """The source's own hashes of `msg`, if it sent them in our hash version (one per block)."""
    own = msg.own_hashes
    if own and msg.hash_version == HASH_VERSION and len(own) == len(msg.block_hashes):
        return own
    return None


def _report(bits: int, depth: int, by_slot: dict[int, InstanceBlocks], out: dict[str, int]) -> None:
    while bits:
        low = bits & -bits
        inst = by_slot.get(low.bit_length() - 1)
        if inst is not None:
            out[inst.instance_id] = depth
        bits ^= low
