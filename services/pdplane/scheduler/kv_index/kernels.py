"""Fused numba kernels of the prefix index: one compiled call per event batch and per lookup.

Why fused: a numpy call costs ~1 us of overhead whatever its size, and a stored event of 32
blocks made ~30 of them (the engine map's get/put, dedups, the holder table's get/put); a
numba call costs ~0.3 us per argument once. So a batch of blocks is two kernel calls:

1. `stage_store` / `stage_remove` update the instance's engine -> own map in place, find the
   holder-table slot of every own hash touched (present, or the empty slot it goes to),
   drop repeats, and group them by their current holder set id;
2. Python computes the new set once per group (`HolderSets`, Python int bitmasks);
3. `apply_holders` writes the new set ids (value before key, for lock-free readers) or
   tombstones the blocks left with no holder.

Between 1 and 3 nothing else writes the tables (one writer thread), so the slots stay valid;
the caller grows both tables for the batch before 1. Keys 0 and 1 (the tables' empty and
deleted markers, kept in `U64Map`'s side dict) make a stage return -1 before it changes
anything: the caller then takes the per-call numpy path (`U64Map` methods).

Table layout and probing are `U64Map`'s (pdplane.scheduler.kv_index.u64map): Fibonacci hashing
of the key into a power-of-two table, triangular probing, key 0 empty, key 1 deleted.

Scratch `work` (int64, >= 5 * n + 8, n = the batch's blocks) after a stage:
``work[0]`` new engine entries (store) / engine entries removed (remove),
``work[1]`` old own hashes to take this instance off by the slow path (`keys[n:n + work[1]]`),
``work[2]`` distinct holder slots touched (u), ``work[3]`` groups (g); then from offset 8:
slots[u], group of each slot[u], group set ids[g] (-1 = not in the table), group sizes[g].
`keys` (uint64, 2 * n): the own hash of each absent key (slot -1), then the slow-path ones.
"""

from __future__ import annotations

import numba
import numpy as np
import numpy.typing as npt

__all__ = [
    "HEADER",
    "apply_holders",
    "match_runs",
    "stage_remove",
    "stage_store",
    "store_conflicts",
    "warm_up",
]

HEADER = 8  # work[:HEADER] are the counts above

_EMPTY = np.uint64(0)
_TOMB = np.uint64(1)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # as U64Map: 2**64 / golden ratio

U64s = npt.NDArray[np.uint64]
I64s = npt.NDArray[np.int64]


@numba.njit(cache=True, nogil=True, inline="always")
def _probe(table: U64s, bits: int, key: np.uint64) -> tuple[np.int64, bool]:  # pragma: no cover
    """(slot of key, True), or (the empty slot ending its probe sequence, False)."""
    mask = (1 << bits) - 1
    pos = np.int64((key * _GOLDEN) >> np.uint64(64 - bits))
    step = 0
    while True:
        slot = pos & mask
        seen = table[slot]
        if seen == key:
            return slot, True
        if seen == _EMPTY:
            return slot, False
        step += 1
        pos += step


@numba.njit(cache=True, nogil=True)
def _group(
    hkeys: U64s, hvals: npt.NDArray[np.int32], hbits: int, own: U64s, m: int, work: I64s, keys: U64s
) -> None:  # pragma: no cover - compiled
    """Holder slots of own[:m], deduplicated and grouped by set id, into work / keys.

    Own hashes not in the table form group 0 (set id -1) with slot -1: distinct absent keys
    can end their probes at the same empty slot, so `apply_holders` probes for them when it
    inserts; they are deduplicated by key, present ones by slot.
    """
    n = len(keys) // 2
    comb = np.empty(m, np.int64)
    absent = np.empty(m, np.uint64)
    na = 0
    npres = 0
    for j in range(m):
        slot, found = _probe(hkeys, hbits, own[j])
        if found:
            comb[npres] = (np.int64(hvals[slot]) << 32) | slot  # by set id, then slot
            npres += 1
        else:
            absent[na] = own[j]
            na += 1
    slots = work[HEADER : HEADER + n]
    grp = work[HEADER + n : HEADER + 2 * n]
    gsid = work[HEADER + 2 * n : HEADER + 3 * n]
    gcnt = work[HEADER + 3 * n : HEADER + 4 * n]
    u = 0
    g = 0
    if na:
        gsid[0] = -1
        gcnt[0] = 0
        g = 1
        prev_key = _EMPTY  # absent keys are >= 2
        for key in np.sort(absent[:na]):
            if key == prev_key:
                continue
            prev_key = key
            gcnt[0] += 1
            slots[u] = -1
            grp[u] = 0
            keys[u] = key
            u += 1
    prev = np.int64(-1)
    for c in np.sort(comb[:npres]):
        if c == prev:
            continue
        prev = c
        sid = c >> 32
        if g == 0 or gsid[g - 1] != sid:
            gsid[g] = sid
            gcnt[g] = 0
            g += 1
        gcnt[g - 1] += 1
        slots[u] = c & 0xFFFFFFFF
        grp[u] = g - 1
        u += 1
    work[2] = u
    work[3] = g


@numba.njit(cache=True, nogil=True)
def stage_store(
    ekeys: U64s,
    evals: U64s,
    ebits: int,
    hkeys: U64s,
    hvals: npt.NDArray[np.int32],
    hbits: int,
    eng: U64s,
    own: U64s,
    work: I64s,
    keys: U64s,
) -> int:  # pragma: no cover - compiled
    """Maps eng[i] -> own[i] in the engine map; groups the own hashes whose holders change.

    Returns -1 (nothing changed) if a key is 0 or 1, else the number of groups.
    """
    n = len(eng)
    for i in range(n):
        if eng[i] <= _TOMB or own[i] <= _TOMB:
            return -1
    touched = np.empty(n, np.uint64)
    m = 0
    new = 0
    moved = 0
    for i in range(n):
        slot, found = _probe(ekeys, ebits, eng[i])
        if found:
            old = evals[slot]
            if old == own[i]:
                continue  # stored again (vLLM re-announces reused blocks)
            keys[n + moved] = old  # an engine block now under another own hash
            moved += 1
            evals[slot] = own[i]
        else:
            evals[slot] = own[i]
            ekeys[slot] = eng[i]
            new += 1
        touched[m] = own[i]
        m += 1
    work[0] = new
    work[1] = moved
    _group(hkeys, hvals, hbits, touched, m, work, keys)
    return work[3]


@numba.njit(cache=True, nogil=True)
def store_conflicts(
    ekeys: U64s, evals: U64s, ebits: int, eng: U64s, own: U64s
) -> bool:  # pragma: no cover - compiled
    """True when `stage_store` of eng -> own as ONE batch could leave other holders than
    storing the pairs one at a time, in order; nothing is changed.

    `stage_store` adds the instance to every own hash first and takes it off the hashes it
    moved blocks away from last, so a batch is exact unless a block moves: an engine hash
    already mapped to another own hash, or repeated in the batch under different own hashes.
    Keys 0 / 1 also conflict (they take the per-call path, whose `put` wants unique keys).
    """
    n = len(eng)
    for i in range(n):
        if eng[i] <= _TOMB or own[i] <= _TOMB:
            return True
        slot, found = _probe(ekeys, ebits, eng[i])
        if found and evals[slot] != own[i]:
            return True
    if n < 2:
        return False
    ordered = np.sort(eng)
    repeats = False
    for k in range(1, n):
        if ordered[k] == ordered[k - 1]:
            repeats = True
            break
    if not repeats:  # the usual case: no second sort
        return False
    order = np.argsort(eng)
    for k in range(1, n):
        a = order[k - 1]
        b = order[k]
        if eng[a] == eng[b] and own[a] != own[b]:
            return True
    return False


@numba.njit(cache=True, nogil=True)
def stage_remove(
    ekeys: U64s,
    evals: U64s,
    ebits: int,
    hkeys: U64s,
    hvals: npt.NDArray[np.int32],
    hbits: int,
    eng: U64s,
    work: I64s,
    keys: U64s,
) -> int:  # pragma: no cover - compiled
    """Drops eng[i] from the engine map (absent ones ignored); groups their own hashes.

    Returns -1 (nothing changed) if a key is 0 or 1, else the number of groups. Own hashes
    0 / 1 go to the slow-path list (work[1]).
    """
    n = len(eng)
    for i in range(n):
        if eng[i] <= _TOMB:
            return -1
    touched = np.empty(n, np.uint64)
    m = 0
    gone = 0
    small = 0
    for i in range(n):
        slot, found = _probe(ekeys, ebits, eng[i])
        if not found:
            continue
        o = evals[slot]
        ekeys[slot] = _TOMB
        gone += 1
        if o <= _TOMB:
            keys[n + small] = o
            small += 1
        else:
            touched[m] = o
            m += 1
    work[0] = gone
    work[1] = small
    _group(hkeys, hvals, hbits, touched, m, work, keys)
    return work[3]


@numba.njit(cache=True, nogil=True)
def apply_holders(
    hkeys: U64s, hvals: npt.NDArray[np.int32], hbits: int, work: I64s, keys: U64s, new_sid: I64s
) -> None:  # pragma: no cover - compiled
    """Writes group g's new set id new_sid[g] to its slots; -1 deletes (tombstone), -2 keeps.
    Slot -1: a key not in the table, inserted into the empty slot ending its probe."""
    n = len(keys) // 2
    for k in range(work[2]):
        slot = work[HEADER + k]
        sid = new_sid[work[HEADER + n + k]]
        if sid == -2:
            continue
        if slot < 0:
            slot, _ = _probe(hkeys, hbits, keys[k])
            hvals[slot] = sid  # the value before the key (lock-free readers)
            hkeys[slot] = keys[k]
        elif sid == -1:
            hkeys[slot] = _TOMB
        else:
            hvals[slot] = sid


@numba.njit(cache=True, nogil=True)
def match_runs(
    hkeys: U64s, hvals: npt.NDArray[np.int32], hbits: int, prompt: U64s, sid0: int, sid1: int
) -> I64s:  # pragma: no cover - compiled
    """Runs of equal holder sets along the prompt's leading held blocks.

    Returns int64 [held, runs, sid_0, length_0, sid_1, length_1, ...]: `held` leading blocks
    are in the table, in `runs` runs of the same set id. sid0 / sid1: the set ids of the
    keys 0 / 1 (U64Map's side dict), -1 when absent.
    """
    out = np.empty(2 + 2 * len(prompt), np.int64)
    runs = 0
    prev = np.int64(-1)
    held = 0
    for i in range(len(prompt)):
        key = prompt[i]
        if key <= _TOMB:
            sid = np.int64(sid0 if key == _EMPTY else sid1)
            if sid < 0:
                break
        else:
            slot, found = _probe(hkeys, hbits, key)
            if not found:
                break
            sid = np.int64(hvals[slot])
        if sid == prev:
            out[2 * runs + 1] += 1
        else:
            out[2 * runs + 2] = sid
            out[2 * runs + 3] = 1
            runs += 1
            prev = sid
        held += 1
    out[0] = held
    out[1] = runs
    return out


_warm = False


def warm_up() -> None:
    """Compiles (or loads from the disk cache) every kernel now, once per process.

    Called when a `PrefixIndex` is built, so that the first KV event does not stall the
    subscriber thread: ~8 s with an empty cache on a 2-core VM (long enough for the streams
    to look silent), ~0.2 s from the cache.
    """
    global _warm
    if _warm:
        return
    from pdplane.scheduler.kv_index.u64map import U64Map

    ekeys, evals, ebits = U64Map(np.uint64).arrays
    hkeys, hvals, hbits = U64Map(np.int32).arrays
    one = np.array([2], np.uint64)
    work = np.zeros(HEADER + 4, np.int64)
    keys = np.zeros(2, np.uint64)
    stage_store(ekeys, evals, ebits, hkeys, hvals, hbits, one, one, work, keys)
    stage_remove(ekeys, evals, ebits, hkeys, hvals, hbits, one, work, keys)
    store_conflicts(ekeys, evals, ebits, one, one)
    apply_holders(hkeys, hvals, hbits, work, keys, np.full(1, -2, np.int64))
    match_runs(hkeys, hvals, hbits, one, -1, -1)
    probe = U64Map(np.uint64)
    probe.put(one, one)  # U64Map's own kernels
    probe.get(one)
    _warm = True
