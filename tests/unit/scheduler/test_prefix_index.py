"""PrefixIndex: own hashes from events, removal mapping, eviction, snapshots, memory bound."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from pdplane.core.kv_events.log import KvEventLog, SubscriptionCursor
from pdplane.core.prefix_hash import HASH_VERSION, block_hashes
from pdplane.scheduler.kv_index import KvState, PrefixIndex
from pdplane.scheduler.kv_index.stream import KvStreamReader
from pdplane.v1 import kv_events_pb2

BS = 16
_OWN_FROM_SOURCE = [True]


@pytest.fixture(autouse=True, params=[True, False], ids=["own-from-source", "hashed-here"])
def _hash_path(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test runs twice: the engines' logs send our own hashes, or leave them to the index."""
    _OWN_FROM_SOURCE[0] = request.param
    yield
    _OWN_FROM_SOURCE[0] = True


def _tokens(seed: int, blocks: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(blocks * BS)]


class Engine:
    """A fake engine with its own (seeded) block hashes, logging like vLLM does."""

    def __init__(self, seed: int) -> None:
        self.log = KvEventLog(own_hashes=_OWN_FROM_SOURCE[0])
        self.salt = seed

    def ehash(self, tokens: list[int], i: int) -> int:
        return hash((self.salt, tuple(tokens[: (i + 1) * BS]))) & (2**64 - 1)

    def store(self, tokens: list[int], first: int = 0, last: int | None = None) -> None:
        last = len(tokens) // BS if last is None else last
        hashes = [self.ehash(tokens, i) for i in range(first, last)]
        parent = self.ehash(tokens, first - 1) if first else None
        self.log.stored(hashes, parent, tokens[first * BS : last * BS], BS)

    def evict(self, tokens: list[int], *blocks: int) -> None:
        self.log.removed([self.ehash(tokens, i) for i in blocks])


def _live(
    index: PrefixIndex, name: str, engine: Engine
) -> tuple[KvStreamReader, SubscriptionCursor]:
    inst = index.add_instance(name)
    reader = KvStreamReader(inst)
    cursor = SubscriptionCursor(engine.log, 0, 0)
    _pump(reader, cursor)
    index.set_state(inst, KvState.LIVE)
    return reader, cursor


def _pump(reader: KvStreamReader, cursor: SubscriptionCursor) -> None:
    while (msg := cursor.next_message()) is not None:
        reader.feed(msg)


def test_longest_prefix_per_instance_across_hash_seeds() -> None:
    index = PrefixIndex()
    a, b = Engine(1), Engine(2)  # different engine hash seeds
    prompt = _tokens(0, 8)
    a.store(prompt)  # all 8 blocks
    b.store(prompt, 0, 3)  # first 3
    _ra, _ca = _live(index, "a", a)
    _rb, _cb = _live(index, "b", b)
    hashes = block_hashes(prompt, BS)
    assert index.match(hashes) == {"a": 8, "b": 3}
    assert index.match(hashes, instances={"b"}) == {"b": 3}
    other = block_hashes(_tokens(9, 4), BS)
    assert index.match(other) == {}


def test_live_events_extend_and_removal_maps_engine_hashes() -> None:
    index = PrefixIndex()
    e = Engine(3)
    prompt = _tokens(1, 6)
    reader, cursor = _live(index, "e", e)
    e.store(prompt, 0, 2)
    e.store(prompt, 2, 6)  # continues from its parent's engine hash
    _pump(reader, cursor)
    hashes = block_hashes(prompt, BS)
    assert index.match(hashes) == {"e": 6}
    e.evict(prompt, 4, 5)  # vLLM evicts tail blocks first
    _pump(reader, cursor)
    assert index.match(hashes) == {"e": 4}
    e.evict(prompt, 1)  # a hole: the prefix stops there, as vLLM's lookup does
    _pump(reader, cursor)
    assert index.match(hashes) == {"e": 1}
    e.log.cleared()
    _pump(reader, cursor)
    assert index.match(hashes) == {}
    assert index.entries == 0 and len(index.tables["GPU"]) == 0 and len(index.holder_sets) == 0


def test_evicted_prefix_is_no_longer_predicted_on_that_instance_only() -> None:
    index = PrefixIndex()
    a, b = Engine(4), Engine(5)
    prompt = _tokens(2, 4)
    a.store(prompt)
    b.store(prompt)
    ra, ca = _live(index, "a", a)
    _rb, _cb = _live(index, "b", b)
    a.evict(prompt, 0, 1, 2, 3)
    _pump(ra, ca)
    assert index.match(block_hashes(prompt, BS)) == {"b": 4}


def test_orphan_store_is_not_indexed() -> None:
    index = PrefixIndex()
    e = Engine(6)
    reader, cursor = _live(index, "e", e)
    prompt = _tokens(3, 4)
    e.store(prompt, 2, 4)  # parent never stored: cannot be hashed, unreachable in vLLM too
    _pump(reader, cursor)
    inst = index.instance("e")
    assert inst is not None and inst.orphans == 2 and index.entries == 0


def test_snapshot_in_any_order_rebuilds_the_same_keys() -> None:
    index = PrefixIndex()
    e = Engine(7)
    prompt = _tokens(4, 5)
    e.store(prompt, 0, 2)
    e.evict(prompt, 0)
    e.store(prompt, 0, 1)  # parent re-stored after its child: later in the cached set's order
    e.store(prompt, 2, 5)
    _live(index, "e", e)
    assert index.match(block_hashes(prompt, BS)) == {"e": 5}


def test_snapshot_replaces_state_and_restart_is_exact() -> None:
    e = Engine(8)
    p1, p2 = _tokens(5, 3), _tokens(6, 3)
    e.store(p1)
    first = PrefixIndex()
    _live(first, "e", e)
    e.evict(p1, 0, 1, 2)
    e.store(p2)
    restarted = PrefixIndex()  # a scheduler that restarts: exact from the snapshot alone
    _live(restarted, "e", e)
    assert restarted.match(block_hashes(p1, BS)) == {}
    assert restarted.match(block_hashes(p2, BS)) == {"e": 3}


def test_only_live_instances_are_matched() -> None:
    index = PrefixIndex()
    e = Engine(9)
    prompt = _tokens(7, 2)
    e.store(prompt)
    _live(index, "e", e)
    inst = index.instance("e")
    assert inst is not None
    index.set_state(inst, KvState.STALE, "test")
    assert index.match(block_hashes(prompt, BS)) == {}
    index.set_state(inst, KvState.LIVE)
    assert index.match(block_hashes(prompt, BS)) == {"e": 2}


def test_removed_instance_frees_its_entries_and_slot() -> None:
    index = PrefixIndex()
    e = Engine(10)
    prompt = _tokens(8, 3)
    e.store(prompt)
    _live(index, "e", e)
    slot = index.instance("e").slot  # type: ignore[union-attr]
    index.remove_instance("e")
    assert index.entries == 0 and len(index.tables["GPU"]) == 0 and len(index.holder_sets) == 0
    assert index.add_instance("f").slot == slot


def test_media_are_matched_separately() -> None:
    index = PrefixIndex()
    inst = index.add_instance("e")
    index.set_state(inst, KvState.LIVE)
    prompt = _tokens(11, 2)
    msg = kv_events_pb2.BlockStored(
        block_hashes=[1, 2], token_ids=prompt, block_size=BS, medium="CPU"
    )
    inst.stored(msg)
    hashes = block_hashes(prompt, BS)
    assert index.match(hashes) == {}
    assert index.match(hashes, medium="CPU") == {"e": 2}


def test_memory_bound_drops_and_counts() -> None:
    index = PrefixIndex(max_blocks=5)
    e = Engine(12)
    prompt = _tokens(9, 8)
    e.store(prompt)
    _live(index, "e", e)
    inst = index.instance("e")
    assert inst is not None
    assert index.entries == 5 and inst.dropped == 3
    assert index.match(block_hashes(prompt, BS)) == {"e": 5}  # under-predicts, never over


def test_lora_blocks_do_not_match_base_prompts() -> None:
    index = PrefixIndex()
    inst = index.add_instance("e")
    index.set_state(inst, KvState.LIVE)
    prompt = _tokens(13, 2)
    inst.stored(
        kv_events_pb2.BlockStored(
            block_hashes=[1, 2], token_ids=prompt, block_size=BS, lora_name="adapter"
        )
    )
    assert index.match(block_hashes(prompt, BS)) == {}
    assert index.match(block_hashes(prompt, BS, lora="adapter")) == {"e": 2}


def test_source_hashes_equal_the_gateways_and_a_wrong_version_is_rehashed() -> None:
    prompt = _tokens(20, 4)
    e = Engine(20)
    e.store(prompt, 0, 2)
    e.store(prompt, 2, 4)
    events = e.log.read(1, 10)
    assert events is not None
    sent = [list(ev.stored.own_hashes) for ev in events]
    if _OWN_FROM_SOURCE[0]:
        assert sent[0] + sent[1] == block_hashes(prompt, BS)  # the gateway's keys
        assert all(ev.stored.hash_version == HASH_VERSION for ev in events)
    else:
        assert sent == [[], []]
    # A source of another hash version (or a corrupt list) is not trusted: hashed here.
    index = PrefixIndex()
    inst = index.add_instance("e")
    index.set_state(inst, KvState.LIVE)
    for ev in events:
        msg = kv_events_pb2.KvEvent()
        msg.CopyFrom(ev)
        del msg.stored.own_hashes[:]
        msg.stored.own_hashes.extend([1, 2])
        msg.stored.hash_version = HASH_VERSION + 1
        inst.apply(msg)
    assert index.match(block_hashes(prompt, BS)) == {"e": 4}


def test_snapshot_indexes_a_block_whose_parent_was_evicted_when_hashes_are_sent() -> None:
    # vLLM keeps a child cached after evicting its parent; once the parent is stored again the
    # child hits again. An index restarted in between must agree with one that followed along.
    e = Engine(21)
    prompt = _tokens(21, 3)
    following = PrefixIndex()
    rf, cf = _live(following, "e", e)
    e.store(prompt)
    e.evict(prompt, 0)
    restarted = PrefixIndex()
    rr, cr = _live(restarted, "e", e)  # its snapshot: blocks 1 and 2, their parent gone
    e.store(prompt, 0, 1)  # the parent is back
    _pump(rf, cf)
    _pump(rr, cr)
    hashes = block_hashes(prompt, BS)
    assert following.match(hashes) == {"e": 3}
    if _OWN_FROM_SOURCE[0]:
        assert restarted.match(hashes) == {"e": 3}
    else:  # without the source's hashes the children's chain cannot be resolved (under-predicts)
        assert restarted.match(hashes) == {"e": 1}
