"""consistent_hash: the same routing key (or prompt prefix) goes to the same instance.

Keys: the request's routing key, else its first `prefix_blocks` prefix block hashes (so
requests sharing a prompt prefix land where that prefix is cached). Instances sit on a hash
ring with `vnodes` points each, so adding or removing one instance moves only ~1/N of the keys.
A request with neither key falls back to least_loaded.

Hashes are blake2b (stable across processes and restarts, unlike Python's salted `hash`).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.policies.base import Pick, PickContext
from pdplane.scheduler.policies.least_loaded import LeastLoaded

NAME = "consistent_hash"

_RING_CACHE_SIZE = 8  # candidate sets seen recently (one per model/side in practice)


def create(*, seed: int | None = None, vnodes: int = 64, prefix_blocks: int = 4) -> ConsistentHash:
    """A consistent-hash policy; `seed` is ignored (placement depends only on ids and keys)."""
    return ConsistentHash(vnodes=vnodes, prefix_blocks=prefix_blocks)


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")


class _Ring:
    __slots__ = ("owners", "points")

    def __init__(self, ids: Sequence[str], vnodes: int) -> None:
        placed = sorted(
            (_hash64(f"{instance_id}#{v}".encode()), index)
            for index, instance_id in enumerate(ids)
            for v in range(vnodes)
        )
        self.points = [point for point, _ in placed]
        self.owners = [index for _, index in placed]

    def lookup(self, key_hash: int) -> int:
        slot = bisect.bisect_left(self.points, key_hash)
        return self.owners[slot % len(self.points)]


class ConsistentHash:
    """Hash ring over the candidates' instance ids, cached per candidate set."""

    name = NAME

    def __init__(self, *, vnodes: int = 64, prefix_blocks: int = 4) -> None:
        if vnodes < 1 or prefix_blocks < 1:
            raise ValueError("vnodes and prefix_blocks must be >= 1")
        self._vnodes = vnodes
        self._prefix_blocks = prefix_blocks
        self._rings: dict[tuple[str, ...], _Ring] = {}
        self._fallback = LeastLoaded()

    def _key(self, ctx: PickContext) -> tuple[str, bytes] | None:
        if ctx.routing_key:
            return "routing key", ctx.routing_key.encode()
        if ctx.prefix_block_hashes:
            head = ctx.prefix_block_hashes[: self._prefix_blocks]
            return "prefix", b"".join(h.to_bytes(8, "big") for h in head)
        return None

    def _ring(self, candidates: Sequence[Candidate]) -> _Ring:
        ids = tuple(c.instance_id for c in candidates)
        ring = self._rings.get(ids)
        if ring is None:
            if len(self._rings) >= _RING_CACHE_SIZE:
                self._rings.clear()
            ring = self._rings[ids] = _Ring(ids, self._vnodes)
        return ring

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext) -> Pick:
        key = self._key(ctx)
        if key is None:
            fallback = self._fallback.pick(candidates, ctx)
            return Pick(fallback.candidate, f"{NAME}: no key, {fallback.reason}")
        kind, data = key
        chosen = candidates[self._ring(candidates).lookup(_hash64(data))]
        return Pick(chosen, f"{NAME}: by {kind}")
