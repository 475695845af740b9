"""The simulated paged KV cache: blocks, reference counts, an LRU free queue and a prefix cache.

Modelled on vLLM v1's `BlockPool` / `KVCacheManager` (`vllm/v1/core/block_pool.py`,
`kv_cache_manager.py`), not copied:
- a block is cached once it is full: its key is a hash chained over the token ids of every block
  before it and its own, so a key names a whole prefix;
- freed blocks go to the tail of one free queue (a request's blocks tail-first, so the end of a
  sequence is evicted before its start) and new blocks come from its head (least recently
  freed first); a cached block stays findable while it sits in the free queue and loses its key
  only when it is taken for new data (an eviction);
- a prefix hit takes blocks out of the free queue (reference count + 1), so cached but unused
  blocks count as free: `usage` is 1 - free / total, vLLM's `kv_cache_usage_perc`.

Every change of the cached set goes to a `KvEventSink` (`stored` / `removed` / `cleared`, the
vLLM KV cache events `BlockStored` / `BlockRemoved` / `AllBlocksCleared`): in a served sim that
is a `pdplane.core.kv_events.log.KvEventLog`, the same typed, sequenced stream the connector
publishes (`KvEvents.Subscribe` on the sim's KvTransfer server). The keys here are the
engine's own hashes (like vLLM's seeded ones); subscribers key their index by
`pdplane.core.prefix_hash` over the token ids the events carry.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

__all__ = ["NO_PARENT", "BlockPool", "KvEventSink", "NullSink", "chain_hashes"]

#: Parent key of a sequence's first block.
NO_PARENT = 0
_MASK = (1 << 64) - 1


def chain_hashes(
    token_ids: Sequence[int], block_size: int, parent: int = NO_PARENT, start: int = 0
) -> list[int]:
    """Keys of the full blocks of `token_ids[start:]`, each chained on the one before.

    Key i = hash((key i-1, token ids of block i)) as an unsigned 64-bit int; Python's hash of
    a tuple of ints is not salted per process, so keys are stable across processes. `start`
    must be a multiple of `block_size` and `parent` the key of the block before it.
    """
    keys: list[int] = []
    end = len(token_ids) - (len(token_ids) - start) % block_size
    for i in range(start, end, block_size):
        parent = hash((parent, tuple(token_ids[i : i + block_size]))) & _MASK
        keys.append(parent)
    return keys


class KvEventSink(Protocol):
    """Receives the cached-block set's changes, in order (vLLM's KV cache events)."""

    def stored(
        self,
        block_hashes: list[int],
        parent_hash: int | None,
        token_ids: list[int],
        block_size: int,
    ) -> object:
        """Full blocks became cached: keys in sequence order, the key before the first (None
        for a sequence's first block) and their token ids (len = len(block_hashes) x size)."""

    def removed(self, block_hashes: list[int]) -> object:
        """Cached blocks were evicted (their keys are no longer findable)."""

    def cleared(self) -> object:
        """Every cached block was dropped (a prefix cache reset)."""


class NullSink:
    """Drops every event (no subscriber)."""

    def stored(
        self,
        block_hashes: list[int],
        parent_hash: int | None,
        token_ids: list[int],
        block_size: int,
    ) -> None:
        return None

    def removed(self, block_hashes: list[int]) -> None:
        return None

    def cleared(self) -> None:
        return None


class BlockPool:
    """`num_blocks` KV cache blocks of `block_size` tokens with vLLM's prefix cache semantics.

    Block ids are 0..num_blocks-1. Not thread safe (one event loop owns it).
    """

    __slots__ = (
        "_free",
        "_hash_of",
        "_ref",
        "block_size",
        "cached",
        "caching",
        "evictions",
        "num_blocks",
        "sink",
    )

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        caching: bool = True,
        sink: KvEventSink | None = None,
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be at least 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = caching
        self.sink: KvEventSink = sink or NullSink()
        self._ref = [0] * num_blocks
        self._hash_of: list[int | None] = [None] * num_blocks
        #: free block ids, least recently freed first (dict order = queue order)
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        #: key -> block id of every findable cached block
        self.cached: dict[int, int] = {}
        self.evictions = 0

    # --- state --------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks not referenced by any request (cached ones included)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks referenced by requests, 0..1 (vLLM's kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks that hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    # --- prefix cache ---------------------------------------------------------------------
    def longest_hit(self, keys: Sequence[int], max_blocks: int) -> list[int]:
        """Block ids of the longest cached prefix of `keys` (at most `max_blocks`); no change."""
        if not self.caching:
            return []
        hit: list[int] = []
        cached = self.cached
        for key in keys[:max_blocks]:
            block = cached.get(key)
            if block is None:
                break
            hit.append(block)
        return hit

    def evictable(self, block_ids: Sequence[int]) -> int:
        """How many of `block_ids` sit in the free queue (touching them takes free blocks)."""
        free = self._free
        return sum(1 for b in block_ids if b in free)

    def touch(self, block_ids: Sequence[int]) -> None:
        """Takes a reference on cached blocks (a prefix hit)."""
        ref, free = self._ref, self._free
        for b in block_ids:
            if ref[b] == 0:
                del free[b]
            ref[b] += 1

    def cache(
        self,
        block_ids: Sequence[int],
        keys: Sequence[int],
        parent: int,
        token_ids: list[int],
    ) -> None:
        """Makes full blocks findable under `keys` (their sequence order); emits `stored`.

        A key already cached under another block is left as it is (this block stays
        uncached), like vLLM. `parent` is the key of the block before the first one
        (NO_PARENT for a sequence's first block); `token_ids` are the blocks' tokens.
        """
        if not self.caching or not keys:
            return
        cached, hash_of = self.cached, self._hash_of
        stored: list[int] = []
        first = -1
        for i, (block, key) in enumerate(zip(block_ids, keys, strict=True)):
            if key in cached:
                if stored:  # a gap: emit what came before it as one run
                    self._emit_stored(stored, parent, keys, first, token_ids)
                    stored = []
                continue
            if not stored:
                first = i
            cached[key] = block
            hash_of[block] = key
            stored.append(key)
        if stored:
            self._emit_stored(stored, parent, keys, first, token_ids)

    def _emit_stored(
        self, stored: list[int], parent: int, keys: Sequence[int], first: int, tokens: list[int]
    ) -> None:
        size = self.block_size
        before = keys[first - 1] if first > 0 else (parent if parent != NO_PARENT else None)
        chunk = tokens[first * size : (first + len(stored)) * size]
        self.sink.stored(stored, before, chunk, size)

    def reset(self) -> None:
        """Forgets every cached key (blocks in use keep their data); emits `cleared`."""
        self.cached.clear()
        self._hash_of = [None] * self.num_blocks
        self.sink.cleared()

    # --- allocation -----------------------------------------------------------------------
    def allocate(self, count: int) -> list[int]:
        """Takes `count` blocks from the head of the free queue, evicting cached ones.

        The caller checks `num_free` first. Raises ValueError when too few are free.
        """
        if count > len(self._free):
            raise ValueError(f"{count} blocks asked, {len(self._free)} free")
        free, ref, hash_of, cached = self._free, self._ref, self._hash_of, self.cached
        out: list[int] = []
        evicted: list[int] = []
        for _ in range(count):
            block, _none = free.popitem(last=False)
            key = hash_of[block]
            if key is not None:
                hash_of[block] = None
                if cached.get(key) == block:
                    del cached[key]
                    evicted.append(key)
            ref[block] = 1
            out.append(block)
        if evicted:
            self.evictions += len(evicted)
            self.sink.removed(evicted)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drops one reference on each block; unreferenced ones join the free queue's tail,
        last block first (a sequence's tail is evicted before its head)."""
        ref, free = self._ref, self._free
        for b in reversed(block_ids):
            ref[b] -= 1
            if ref[b] == 0:
                free[b] = None
