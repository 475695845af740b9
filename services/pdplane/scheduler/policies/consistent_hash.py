"""consistent_hash: the same routing key (or prompt prefix) goes to the same instance.

Keys: the request's routing key, else its first `prefix_blocks` prefix block hashes (so
requests sharing a prompt prefix land where that prefix is cached). Instances sit on a hash
ring with `vnodes` points each, so adding or removing one instance moves only ~1/N of the keys.
A request with neither key falls back to least_loaded.

The ring holds every instance of the side (built once per table, i.e. when instances come or
go); a key goes to the first point at or after its hash whose instance is in the pool. That is
the ring of the pool's instances alone: points do not depend on which others are there.

Hashes are blake2b (stable across processes and restarts, unlike Python's salted `hash`).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

import numpy as np

from pdplane.scheduler.policies.base import Pick, PickContext, Pool
from pdplane.scheduler.policies.least_loaded import LeastLoaded
from pdplane.scheduler.table import SideTable

NAME = "consistent_hash"

_RING_CACHE_SIZE = 8  # tables seen recently (one per model and side in practice)
_WALK = 64  # ring points tried one by one before the pool's points are searched in bulk


def create(*, seed: int | None = None, vnodes: int = 64, prefix_blocks: int = 4) -> ConsistentHash:
    """A consistent-hash policy; `seed` is ignored (placement depends only on ids and keys)."""
    return ConsistentHash(vnodes=vnodes, prefix_blocks=prefix_blocks)


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class _Ring:
    __slots__ = ("owner_rows", "owners", "points")

    def __init__(self, ids: Sequence[str], vnodes: int) -> None:
        placed = sorted(
            (_hash64(f"{instance_id}#{v}".encode()), row)
            for row, instance_id in enumerate(ids)
            for v in range(vnodes)
        )
        self.points = [point for point, _ in placed]
        self.owners = [row for _, row in placed]
        self.owner_rows = np.array(self.owners, np.int64)

    def lookup(self, key_hash: int, member: np.ndarray | None) -> int:
        """The row owning `key_hash` among rows with `member[row]` (None: every row)."""
        points, owners = self.points, self.owners
        slot = bisect.bisect_left(points, key_hash)
        n = len(points)
        if member is None:
            return owners[slot % n]
        for step in range(min(_WALK, n)):
            owner = owners[(slot + step) % n]
            if member[owner]:
                return owner
        # Few of the side's instances are in the pool: the first of theirs after the slot.
        order = np.roll(self.owner_rows, -(slot % n))
        return int(order[np.argmax(member[order])])


class ConsistentHash:
    """Hash ring over the side's instance ids, cached per table."""

    name = NAME

    def __init__(self, *, vnodes: int = 64, prefix_blocks: int = 4) -> None:
        if vnodes < 1 or prefix_blocks < 1:
            raise ValueError("vnodes and prefix_blocks must be >= 1")
        self._vnodes = vnodes
        self._prefix_blocks = prefix_blocks
        self._rings: dict[SideTable, _Ring] = {}
        self._fallback = LeastLoaded()

    def _key(self, ctx: PickContext) -> tuple[str, bytes] | None:
        if ctx.routing_key:
            return "routing key", ctx.routing_key.encode()
        if len(ctx.prefix_block_hashes):  # ints, or a uint64 array (a received request's)
            head = ctx.prefix_block_hashes[: self._prefix_blocks]
            return "prefix", b"".join(int(h).to_bytes(8, "big") for h in head)
        return None

    def _ring(self, table: SideTable) -> _Ring:
        ring = self._rings.get(table)
        if ring is None:
            if len(self._rings) >= _RING_CACHE_SIZE:
                self._rings.clear()
            ids = [c.instance_id for c in table.candidates]
            ring = self._rings[table] = _Ring(ids, self._vnodes)
        return ring

    def pick(self, pool: Pool, ctx: PickContext) -> Pick:
        key = self._key(ctx)
        if key is None:
            fallback = self._fallback.pick(pool, ctx)
            return Pick(
                fallback.candidate, f"{NAME}: no key, {fallback.reason}", fallback.cached_tokens
            )
        kind, data = key
        table = pool.table
        member = None
        if len(pool) < len(table):
            member = np.zeros(len(table), np.bool_)
            member[pool.rows] = True
        row = self._ring(table).lookup(_hash64(data), member)
        return pool.pick(int(np.searchsorted(pool.rows, row)), f"{NAME}: by {kind}")
