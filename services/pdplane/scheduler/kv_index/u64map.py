"""`U64Map`: a uint64 -> fixed-width value hash table in numpy arrays, updated per batch.

Why not a dict: a dict entry holding two Python ints costs ~90-110 bytes (two 32-36 byte int
objects plus the slot); here a slot is the key (8 bytes) plus the value (8 bytes for uint64,
4 for int32), at a load factor of 0.4-0.8 (the prefix index's 100M entries: 2.3-3.6 GiB
measured, docs/benchmarks/scheduler.md, instead of 8.5-22.7 GiB projected for dicts, `git show
a4bcc95:docs/benchmarks.md`).

Layout: open addressing over a power-of-two capacity, Fibonacci hashing of the key (so
sequential keys spread), triangular probing (`pos + i*(i+1)/2`, visits every slot of a
power-of-two table). Key 0 marks an empty slot and 1 a deleted one (tombstone); the real
keys 0 and 1 live in a two-entry side dict. Every operation takes a batch of keys
(numpy uint64 arrays); the probing loops are compiled with numba (a well-kept JIT, already a
dependency of vLLM), so the Python work is per batch, not per key.

Readers on other threads: the arrays are swapped as one tuple on growth, so a reader sees a
whole old or a whole new table; a value is written before its key, so a reader never sees a
key with a stale value.
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

__all__ = ["U64Map", "probe_one"]

_EMPTY = np.uint64(0)
_TOMB = np.uint64(1)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # 2**64 / golden ratio (Knuth's multiplicative hash)
_MAX_LOAD = 0.8  # triangular probing stays short up to ~0.8; less slack per entry
_MIN_CAPACITY = 8

U64s = npt.NDArray[np.uint64]
Slots = npt.NDArray[np.int64]


class U64Map:
    """uint64 keys -> values of `dtype` (np.uint64 or np.int32), batch operations.

    Keys passed to `put` must be unique within the batch (callers dedupe with `np.unique`).
    """

    def __init__(self, dtype: type[np.generic], capacity: int = _MIN_CAPACITY) -> None:
        self.dtype = np.dtype(dtype)
        self._used = 0  # live keys in the arrays
        self._tombs = 0
        self._special: dict[int, int] = {}  # the real keys 0 and 1
        self._arrays = self._alloc(capacity)

    def _alloc(self, capacity: int) -> tuple[U64s, np.ndarray, int]:
        cap = _MIN_CAPACITY
        while cap < capacity:
            cap *= 2
        return np.zeros(cap, np.uint64), np.zeros(cap, self.dtype), cap.bit_length() - 1

    def __len__(self) -> int:
        return self._used + len(self._special)

    @property
    def nbytes(self) -> int:
        """Bytes held by the arrays (the side dict's two entries at most not counted)."""
        keys, vals, _ = self._arrays
        return int(keys.nbytes + vals.nbytes)

    # -- probing -------------------------------------------------------------------------------

    @staticmethod
    def _find(arrays: tuple[U64s, np.ndarray, int], keys: U64s) -> Slots:
        """Slot of each key (keys >= 2) in `arrays`, -1 when absent."""
        return _find_kernel(arrays[0], keys, arrays[2])

    @staticmethod
    def _insert_new(arrays: tuple[U64s, np.ndarray, int], keys: U64s, vals: np.ndarray) -> int:
        """Writes keys known to be absent from `arrays` (>= 2) into empty slots; a key repeated
        in the batch is written once (its last value). Returns the number of keys inserted."""
        return int(_insert_kernel(arrays[0], arrays[1], keys, vals, arrays[2]))

    def _grow(self, extra: int) -> None:
        keys, vals, bits = self._arrays
        if self._used + self._tombs + extra <= _MAX_LOAD * (1 << bits):
            return
        need = int((self._used + extra) / _MAX_LOAD) + 1
        arrays = self._alloc(max(need, _MIN_CAPACITY))
        live = keys > _TOMB
        self._insert_new(arrays, keys[live], vals[live])
        self._tombs = 0
        self._arrays = arrays

    # -- for the fused kernels (pdplane.scheduler.kv_index.kernels) ---------------------------

    @property
    def arrays(self) -> tuple[U64s, np.ndarray, int]:
        """(keys, values, log2 capacity): the table a kernel probes and writes in place."""
        return self._arrays

    @property
    def special(self) -> dict[int, int]:
        """The entries of the keys 0 and 1 (the table's empty and deleted markers)."""
        return self._special

    def reserve(self, extra: int) -> None:
        """Grows the table, if needed, so that `extra` more keys fit under the load bound."""
        self._grow(extra)

    def added(self, n: int) -> None:
        """A kernel wrote `n` new keys into empty slots."""
        self._used += n

    def removed(self, n: int) -> None:
        """A kernel tombstoned `n` keys."""
        self._used -= n
        self._tombs += n

    # -- batch operations ----------------------------------------------------------------------

    def get(self, keys: U64s) -> tuple[np.ndarray, npt.NDArray[np.bool_]]:
        """(values, found) for each key; values of absent keys are 0."""
        arrays = self._arrays  # one read: a table growing meanwhile is a new tuple
        values = arrays[1]
        small = keys <= _TOMB
        any_small = bool(small.any())
        slots = self._find(arrays, np.where(small, np.uint64(2), keys) if any_small else keys)
        if any_small:
            slots[small] = -1
        found = slots >= 0
        out = np.where(found, values[np.maximum(slots, 0)], 0).astype(self.dtype)
        if any_small:
            for i in np.flatnonzero(small):
                v = self._special.get(int(keys[i]))
                if v is not None:
                    out[i], found[i] = v, True
        return out, found

    def get_one(self, key: int) -> int | None:
        """The value of one key (scalar path: no numpy passes), None when absent."""
        if key <= 1:
            return self._special.get(key)
        table, values, bits = self._arrays
        slot, found = probe_one(table, bits, key)
        return int(values.item(slot)) if found else None

    def put(self, keys: U64s, vals: np.ndarray) -> int:
        """Sets each key to its value (a key repeated in the batch: its last value); returns
        how many keys were not there before."""
        small = keys <= _TOMB
        added = 0
        if small.any():
            for i in np.flatnonzero(small):
                added += int(keys[i]) not in self._special
                self._special[int(keys[i])] = int(vals[i])
            keys, vals = keys[~small], vals[~small]
        if not len(keys):
            return added
        slots = self._find(self._arrays, keys)
        there = slots >= 0
        self._arrays[1][slots[there]] = vals[there]
        new = ~there
        n_new = int(new.sum())
        if n_new:
            self._grow(n_new)
            n = self._insert_new(self._arrays, keys[new], vals[new].astype(self.dtype))
            self._used += n
            added += n
        return added

    def pop(self, keys: U64s) -> tuple[np.ndarray, npt.NDArray[np.bool_]]:
        """Removes the keys; (their former values, found). Duplicates count once."""
        vals, found = self.get(keys)
        small = keys <= _TOMB
        if small.any():
            for i in np.flatnonzero(small):
                self._special.pop(int(keys[i]), None)
        big = keys[found & ~small]
        if len(big):
            big = np.unique(big)
            slots = self._find(self._arrays, big)
            self._arrays[0][slots] = _TOMB
            self._used -= len(big)
            self._tombs += len(big)
        return vals, found

    def items(self) -> tuple[U64s, np.ndarray]:
        """(keys, values) of every entry, in no particular order."""
        keys, vals, _ = self._arrays
        live = keys > _TOMB
        k, v = keys[live], vals[live]
        if self._special:
            k = np.concatenate([k, np.array(list(self._special), np.uint64)])
            v = np.concatenate([v, np.array(list(self._special.values()), self.dtype)])
        return k, v


def probe_one(table: U64s, bits: int, key: int) -> tuple[int, bool]:
    """One key's probe in plain Python (a single key: cheaper than a kernel call):
    (its slot, True), or (the empty slot ending its probe sequence, False). key >= 2."""
    mask = (1 << bits) - 1
    pos = ((key * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF) >> (64 - bits)
    step = 0
    while True:
        slot = pos & mask
        seen = table.item(slot)
        if seen == key:
            return slot, True
        if seen == 0:
            return slot, False
        step += 1
        pos += step


# The probing loops, compiled (numba, cached on disk): a numpy pass per probe step costs ~1 us
# of call overhead each, which made a 32-block event ~40x slower than these loops.


@numba.njit(cache=True, nogil=True)
def _find_kernel(table: U64s, keys: U64s, bits: int) -> Slots:  # pragma: no cover - compiled
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    out = np.empty(len(keys), np.int64)
    for i in range(len(keys)):
        key = keys[i]
        pos = np.int64((key * _GOLDEN) >> shift)
        step = 0
        out[i] = -1
        while True:
            slot = pos & mask
            seen = table[slot]
            if seen == key:
                out[i] = slot
                break
            if seen == _EMPTY:
                break
            step += 1
            pos += step
    return out


@numba.njit(cache=True, nogil=True)
def _insert_kernel(
    table: U64s, values: np.ndarray, keys: U64s, vals: np.ndarray, bits: int
) -> int:  # pragma: no cover - compiled
    mask = (1 << bits) - 1
    shift = np.uint64(64 - bits)
    inserted = 0
    for i in range(len(keys)):
        key = keys[i]
        pos = np.int64((key * _GOLDEN) >> shift)
        step = 0
        while True:
            slot = pos & mask
            seen = table[slot]
            if seen == key:  # repeated in the batch: the last value wins
                values[slot] = vals[i]
                break
            if seen == _EMPTY:
                values[slot] = vals[i]  # the value before the key (lock-free readers)
                table[slot] = key
                inserted += 1
                break
            step += 1
            pos += step
    return inserted
