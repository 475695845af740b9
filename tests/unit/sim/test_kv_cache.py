"""The simulated prefix cache: chained keys, LRU eviction of unreferenced blocks, events."""

from __future__ import annotations

from pdplane.sim.kv_cache import NO_PARENT, BlockPool, chain_hashes


class Recorder:
    def __init__(self) -> None:
        self.events: list[tuple] = []

    def stored(self, block_hashes, parent_hash, token_ids, block_size):  # type: ignore[no-untyped-def]
        self.events.append(("stored", list(block_hashes), parent_hash, list(token_ids), block_size))

    def removed(self, block_hashes):  # type: ignore[no-untyped-def]
        self.events.append(("removed", list(block_hashes)))

    def cleared(self):  # type: ignore[no-untyped-def]
        self.events.append(("cleared",))


def test_keys_chain_so_a_key_names_the_whole_prefix() -> None:
    a = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    b = chain_hashes([9, 9, 9, 9, 5, 6, 7, 8], 4)
    assert len(a) == 2  # the partial last block has no key
    assert a[1] != b[1]  # same block tokens, other parent
    assert chain_hashes([5, 6, 7, 8], 4, parent=a[0]) == [a[1]]
    assert all(0 <= k < 2**64 for k in a)


def test_cached_blocks_stay_findable_while_free_and_count_as_free() -> None:
    pool = BlockPool(4, 2)
    blocks = pool.allocate(2)
    keys = chain_hashes([1, 2, 3, 4], 2)
    pool.cache(blocks, keys, NO_PARENT, [1, 2, 3, 4])
    assert pool.usage == 0.5
    pool.free(blocks)
    assert pool.usage == 0.0 and pool.num_free == 4
    assert pool.longest_hit(keys, 2) == blocks
    assert pool.evictable(blocks) == 2
    pool.touch(blocks)
    assert pool.num_free == 2


def test_lru_eviction_takes_the_least_recently_freed_and_a_sequence_tail_first() -> None:
    sink = Recorder()
    pool = BlockPool(4, 2, sink=sink)
    blocks = pool.allocate(4)
    keys = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2)
    pool.cache(blocks, keys, NO_PARENT, [1, 2, 3, 4, 5, 6, 7, 8])
    pool.free(blocks)  # queue order: 3, 2, 1, 0 (tail of the sequence first)
    pool.allocate(1)
    assert sink.events[-1] == ("removed", [keys[3]])
    assert pool.longest_hit(keys, 4) == blocks[:3]  # the head of the prefix survives
    pool.allocate(2)
    assert pool.longest_hit(keys, 4) == blocks[:1]
    assert pool.evictions == 3


def test_events_carry_parent_and_tokens_and_skip_already_cached_keys() -> None:
    sink = Recorder()
    pool = BlockPool(8, 2, sink=sink)
    tokens = [1, 2, 3, 4, 5, 6]
    keys = chain_hashes(tokens, 2)
    first = pool.allocate(3)
    pool.cache(first[:1], keys[:1], NO_PARENT, tokens[:2])
    pool.cache(first[1:], keys[1:], keys[0], tokens[2:])
    assert sink.events == [
        ("stored", keys[:1], None, [1, 2], 2),
        ("stored", keys[1:], keys[0], [3, 4, 5, 6], 2),
    ]
    twin = pool.allocate(3)  # another request computed the same prompt
    pool.cache(twin, keys, NO_PARENT, tokens)
    assert len(sink.events) == 2 and pool.cached[keys[0]] == first[0]
    pool.reset()
    assert sink.events[-1] == ("cleared",) and not pool.cached


def test_caching_off_finds_nothing() -> None:
    pool = BlockPool(4, 2, caching=False)
    blocks = pool.allocate(1)
    keys = chain_hashes([1, 2], 2)
    pool.cache(blocks, keys, NO_PARENT, [1, 2])
    assert pool.longest_hit(keys, 1) == []
