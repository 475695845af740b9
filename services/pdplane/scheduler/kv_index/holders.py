"""`HolderTable`: own block hash -> which instance slots hold it, one small int per block.

A block's holders are an interned *holder set*: one Python int bitmask of instance slots per
distinct set, shared by every block with the same holders, with a reference count. The table
keeps, per block, only the set's id (int32) in a `U64Map`: 12 bytes a slot whether one or
1,000 instances hold the block. Why interned sets and not a mask per block: a prompt's blocks
are held by few distinct sets (a shared system prompt by every instance, a conversation by
one or a few), so memory is per distinct set, and a batch of updates (one instance storing or
dropping blocks) is one Python step per distinct old set in the batch, not one per block.

Readers on other threads: a new set id is written to the table only after its mask exists,
and a freed id is reused last (FIFO), so a lookup racing an update sees the old or the new
holders of a block (a freed set reads as "no holders" until it is reused).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

import numpy as np

from pdplane.scheduler.kv_index.kernels import HEADER, apply_holders, stage_remove, stage_store
from pdplane.scheduler.kv_index.u64map import U64Map, U64s, probe_one

__all__ = ["HolderSets", "HolderTable"]


class HolderSets:
    """Interned holder sets: id -> bitmask of instance slots, with reference counts."""

    def __init__(self) -> None:
        self.masks: list[int] = []  # id -> mask (0: free id)
        self._refs: list[int] = []
        self._ids: dict[int, int] = {}  # mask -> id
        self._free: deque[int] = deque()

    def __len__(self) -> int:
        return len(self._ids)

    def acquire(self, mask: int, count: int) -> int:
        """The id of `mask` (created if new), referenced `count` more times."""
        sid = self._ids.get(mask)
        if sid is None:
            if self._free:
                sid = self._free.popleft()
                self.masks[sid] = mask
                self._refs[sid] = 0
            else:
                sid = len(self.masks)
                self.masks.append(mask)
                self._refs.append(0)
            self._ids[mask] = sid
        self._refs[sid] += count
        return sid

    def release(self, sid: int, count: int) -> None:
        """Drops `count` references to `sid`; frees it at zero."""
        self._refs[sid] -= count
        if self._refs[sid] <= 0:
            del self._ids[self.masks[sid]]
            self.masks[sid] = 0
            self._free.append(sid)

    @property
    def nbytes(self) -> int:
        """Approximate bytes of the masks, the intern dict and the lists."""
        import sys

        masks = sum(sys.getsizeof(m) for m in self._ids)
        return masks + sys.getsizeof(self._ids) + 16 * len(self.masks)


class HolderTable:
    """One medium's own hash -> holder set id, over the index's shared `HolderSets`."""

    def __init__(self, sets: HolderSets) -> None:
        self.sets = sets
        self.ids = U64Map(np.int32)

    def __len__(self) -> int:
        return len(self.ids)

    def store(self, mapping: U64Map, eng: U64s, own: U64s, bit: int) -> int | None:
        """One instance (`bit`) stores engine blocks eng[i] under own hashes own[i]: updates
        its engine -> own `mapping` and the holders, in two fused kernel calls.

        Returns the number of engine blocks new to `mapping`, or None (nothing done) when a
        key is 0 or 1: the caller then takes the per-call path (`add` / `remove`).
        """
        n = len(eng)
        mapping.reserve(n)
        self.ids.reserve(n)
        work = np.empty(HEADER + 4 * n, np.int64)
        keys = np.empty(2 * n, np.uint64)
        ekeys, evals, ebits = mapping.arrays
        hkeys, hvals, hbits = self.ids.arrays
        groups = stage_store(ekeys, evals, ebits, hkeys, hvals, hbits, eng, own, work, keys)
        if groups < 0:
            return None
        new, moved = int(work[0]), int(work[1])
        mapping.added(new)
        self._apply(work, keys, groups, n, lambda m: m | bit)
        if moved:  # rare: an engine block re-stored under another own hash
            self.remove(np.unique(keys[n : n + moved]), bit)
        return new

    def store_one(self, mapping: U64Map, eng: int, own: int, bit: int) -> int | None:
        """`store` of one block without numpy or kernel calls (single-block events: their
        cost is per call). None (nothing done): keys 0 / 1, or the engine block moved to
        another own hash; the caller then takes the per-call path."""
        if eng <= 1 or own <= 1:
            return None
        mapping.reserve(1)
        ekeys, evals, ebits = mapping.arrays
        eslot, efound = probe_one(ekeys, ebits, eng)
        if efound:
            return 0 if evals.item(eslot) == own else None
        self.ids.reserve(1)
        hkeys, hvals, hbits = self.ids.arrays
        slot, found = probe_one(hkeys, hbits, own)
        sets = self.sets
        if not found:
            hvals[slot] = sets.acquire(bit, 1)  # the value before the key (readers)
            hkeys[slot] = own
            self.ids.added(1)
        else:
            sid = hvals.item(slot)
            mask = sets.masks[sid]
            if mask | bit != mask:
                hvals[slot] = sets.acquire(mask | bit, 1)
                sets.release(sid, 1)
        evals[eslot] = own
        ekeys[eslot] = eng
        mapping.added(1)
        return 1

    def unstore_one(self, mapping: U64Map, eng: int, bit: int) -> int | None:
        """`unstore` of one engine block without numpy or kernel calls; None (nothing done)
        for the keys 0 / 1."""
        if eng <= 1:
            return None
        ekeys, evals, ebits = mapping.arrays
        eslot, efound = probe_one(ekeys, ebits, eng)
        if not efound:
            return 0
        own = evals.item(eslot)
        if own <= 1:
            return None
        ekeys[eslot] = 1  # tombstone
        mapping.removed(1)
        hkeys, hvals, hbits = self.ids.arrays
        slot, found = probe_one(hkeys, hbits, own)
        if found:
            sets = self.sets
            sid = hvals.item(slot)
            mask = sets.masks[sid]
            if mask & ~bit != mask:
                if mask & ~bit:
                    hvals[slot] = sets.acquire(mask & ~bit, 1)
                else:
                    hkeys[slot] = 1  # no holder left: tombstone
                    self.ids.removed(1)
                sets.release(sid, 1)
        return 1

    def unstore(self, mapping: U64Map, eng: U64s, bit: int) -> int | None:
        """One instance (`bit`) drops engine blocks eng (absent ones ignored): from `mapping`
        and from the holders of their own hashes, in two fused kernel calls.

        Returns the number of engine blocks removed from `mapping`, or None (nothing done)
        when an engine key is 0 or 1 (the caller then uses `U64Map.pop` / `remove`).
        """
        n = len(eng)
        work = np.empty(HEADER + 4 * n, np.int64)
        keys = np.empty(2 * n, np.uint64)
        ekeys, evals, ebits = mapping.arrays
        hkeys, hvals, hbits = self.ids.arrays
        groups = stage_remove(ekeys, evals, ebits, hkeys, hvals, hbits, eng, work, keys)
        if groups < 0:
            return None
        gone, small = int(work[0]), int(work[1])
        mapping.removed(gone)
        self._apply(work, keys, groups, n, lambda m: m & ~bit)
        if small:  # own hashes 0 / 1 live in the side dict
            self.remove(np.unique(keys[n : n + small]), bit)
        return gone

    def _apply(
        self, work: np.ndarray, keys: U64s, groups: int, n: int, change: Callable[[int], int]
    ) -> None:
        """The new holder set of each group a stage found, written by `apply_holders`."""
        if not groups:
            return
        sets = self.sets
        masks = sets.masks
        base = HEADER + 2 * n
        sids = work[base : base + groups].tolist()
        counts = work[base + n : base + n + groups].tolist()
        new_sid: list[int] = []
        released: list[tuple[int, int]] = []
        inserted = deleted = 0
        for sid, count in zip(sids, counts, strict=True):
            mask = masks[sid] if sid >= 0 else 0
            new = change(mask)
            if new == mask:
                new_sid.append(-2)  # unchanged (or absent and still no holder)
                continue
            if sid >= 0:
                released.append((sid, count))
            else:
                inserted += count
            if new:
                new_sid.append(sets.acquire(new, count))
            else:
                new_sid.append(-1)
                deleted += count
        hkeys, hvals, hbits = self.ids.arrays
        apply_holders(hkeys, hvals, hbits, work, keys, np.array(new_sid, np.int64))
        self.ids.added(inserted)
        self.ids.removed(deleted)
        for sid, count in released:  # after the table points elsewhere (readers)
            sets.release(sid, count)

    def add(self, own: U64s, bit: int) -> None:
        """Adds the instance `bit` to the holders of each own hash (unique within `own`)."""
        codes, found = self.ids.get(own)
        fresh = own[~found]
        if len(fresh):
            sid = self.sets.acquire(bit, len(fresh))
            self.ids.put(fresh, np.full(len(fresh), sid, np.int32))
        if found.any():
            self._rewrite(own[found], codes[found], lambda m: m | bit)

    def remove(self, own: U64s, bit: int) -> None:
        """Removes the instance `bit` from the holders of each own hash (unique within `own`);
        a block left with no holder leaves the table."""
        codes, found = self.ids.get(own)
        if found.any():
            self._rewrite(own[found], codes[found], lambda m: m & ~bit)

    def _rewrite(self, keys: U64s, old: np.ndarray, change: Callable[[int], int]) -> None:
        sets = self.sets
        uniq, inverse, counts = np.unique(old, return_inverse=True, return_counts=True)
        repl = uniq.copy()
        gone = np.zeros(len(uniq), bool)
        released: list[tuple[int, int]] = []
        for j, (sid, n) in enumerate(zip(uniq.tolist(), counts.tolist(), strict=True)):
            mask = sets.masks[sid]
            new = change(mask)
            if new == mask:
                continue
            released.append((sid, n))
            if new:
                repl[j] = sets.acquire(new, n)
            else:
                gone[j] = True
        if not released:
            return
        drop = gone[inverse]
        if drop.any():
            self.ids.pop(keys[drop])
            keys, inverse = keys[~drop], inverse[~drop]
        if len(keys):
            self.ids.put(keys, repl[inverse])
        for sid, n in released:  # after the table points elsewhere (readers, above)
            sets.release(sid, n)
