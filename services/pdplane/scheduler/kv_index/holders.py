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

from pdplane.scheduler.kv_index.u64map import U64Map, U64s

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
