"""`PrefixIndex`: which KV cache blocks every instance holds, keyed by pdplane's own hashes.

Built from the instances' `KvEvents` streams (one `InstanceBlocks` sink per instance, driven by
`pdplane.core.kv_stream.KvStreamReader`). Keys are `pdplane.core.prefix_hash.block_hashes` of
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

from pdplane.core.kv_events import DEFAULT_MEDIUM
from pdplane.core.prefix_hash import HASH_VERSION, block_hashes
from pdplane.v1 import kv_events_pb2

__all__ = ["InstanceBlocks", "KvState", "PrefixIndex"]

log = logging.getLogger(__name__)


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
        self.blocks: dict[str, dict[int, int]] = {}  # medium -> engine hash -> own hash
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

    # -- updates -------------------------------------------------------------------------------

    def stored(self, msg: kv_events_pb2.BlockStored) -> None:
        """Indexes a BlockStored: with the source's own hashes as they are, otherwise hashed
        here (then its parent must be known, or absent = sequence start)."""
        medium = msg.medium or DEFAULT_MEDIUM
        given = _given_own(msg)
        if given is not None:
            self._add(medium, msg.block_hashes, given)
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

    def removed(self, engine_hashes: Iterable[int], medium: str = DEFAULT_MEDIUM) -> None:
        """Drops these engine blocks; unknown hashes are ignored."""
        mapping = self.blocks.get(medium)
        if not mapping:
            return
        table = self.index.tables.get(medium)
        if table is None:
            return
        keep = ~self.bit
        released = 0
        for eng in engine_hashes:
            own = mapping.pop(eng, None)
            if own is None:
                continue
            released += 1
            mask = table.get(own, 0) & keep
            if mask:
                table[own] = mask
            else:
                table.pop(own, None)
        self.index.entries -= released

    def clear(self) -> None:
        """Forgets every block of this instance (AllBlocksCleared, snapshot, leaving)."""
        for medium, mapping in self.blocks.items():
            self.removed(list(mapping), medium)
        self.blocks = {}

    # -- helpers -------------------------------------------------------------------------------

    def _own_of(self, engine: int, medium: str) -> int | None:
        own = self.blocks.get(medium, {}).get(engine)
        if own is None and medium != DEFAULT_MEDIUM:  # an offloaded block's parent on device
            own = self.blocks.get(DEFAULT_MEDIUM, {}).get(engine)
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
        mapping = self.blocks.setdefault(medium, {})
        table = index.tables.setdefault(medium, {})
        bit = self.bit
        added = 0
        for i in range(n):
            eng = engine_hashes[i]
            h = own[i]
            prev = mapping.get(eng)
            if prev == h:
                continue  # stored again (vLLM re-announces reused blocks)
            if prev is not None:
                self.removed((eng,), medium)
            mapping[eng] = h
            table[h] = table.get(h, 0) | bit
            added += 1
        index.entries += added

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
        self.max_blocks = max_blocks
        self.entries = 0
        self.tables: dict[str, dict[int, int]] = {}
        self._instances: dict[str, InstanceBlocks] = {}
        self._by_slot: dict[int, InstanceBlocks] = {}
        self._free_slots: list[int] = []
        self._next_slot = 0
        self._live = 0  # bitmask of LIVE instances

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

    def instance(self, instance_id: str) -> InstanceBlocks | None:
        return self._instances.get(instance_id)

    def instances(self) -> list[InstanceBlocks]:
        return list(self._instances.values())

    def set_state(self, inst: InstanceBlocks, state: KvState, reason: str = "") -> None:
        """Marks an instance SYNCING / LIVE / STALE; only LIVE ones are matched."""
        inst.state = state
        inst.state_reason = reason
        if state is KvState.LIVE:
            self._live |= inst.bit
        else:
            self._live &= ~inst.bit

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
                of its token ids with the instances' block size), in order.
            medium: which cache tier to look in ("GPU" = the engine's device cache).
            instances: only these instance ids (e.g. the compatible candidates); None = all.

        Returns:
            instance id -> number of leading blocks of `hashes` it holds (>= 1); instances
            holding none are absent. Cached tokens = blocks * block size.
        """
        table = self.tables.get(medium)
        alive = self._live
        if instances is not None:
            mask = 0
            for iid in instances:
                inst = self._instances.get(iid)
                if inst is not None:
                    mask |= inst.bit
            alive &= mask
        if not table or not alive:
            return {}
        found: dict[str, int] = {}
        by_slot = self._by_slot
        depth = 0
        get = table.get
        for h in hashes:
            held = get(h, 0) & alive
            if held != alive:
                if depth:
                    _report(alive & ~held, depth, by_slot, found)
                alive = held
                if not alive:
                    return found
            depth += 1
        if depth:
            _report(alive, depth, by_slot, found)
        return found


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
