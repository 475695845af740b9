"""pdplane's own chained block hashes."""

from __future__ import annotations

import pytest

from pdplane.core.prefix_hash import block_hashes, root_hash


def test_full_blocks_only_and_deterministic() -> None:
    toks = list(range(100))
    hs = block_hashes(toks, 16)
    assert len(hs) == 6
    assert hs == block_hashes(toks, 16)
    assert all(0 <= h < 2**64 for h in hs)
    assert block_hashes(toks[:15], 16) == []


def test_chained_a_block_names_its_whole_prefix() -> None:
    a = block_hashes([1] * 16 + [2] * 16, 16)
    b = block_hashes([3] * 16 + [2] * 16, 16)
    assert a[1] != b[1]  # same tokens, different prefix


def test_parent_continues_the_chain() -> None:
    toks = list(range(64))
    whole = block_hashes(toks, 16)
    assert block_hashes(toks[32:], 16, parent=whole[1]) == whole[2:]


def test_lora_and_extra_keys_change_the_hash() -> None:
    toks = list(range(32))
    base = block_hashes(toks, 16)
    assert block_hashes(toks, 16, lora="adapter-a") != base
    salted = block_hashes(toks, 16, extra_keys=['["salt"]', ""])
    assert salted[0] != base[0]
    assert root_hash("") != root_hash("adapter-a")


def test_block_sizes_do_not_collide() -> None:
    toks = list(range(64))
    assert set(block_hashes(toks, 16)).isdisjoint(block_hashes(toks, 32))


def test_bad_input() -> None:
    with pytest.raises(ValueError):
        block_hashes([1, 2], 0)
    with pytest.raises(ValueError):
        block_hashes([-1] * 16, 16)
    with pytest.raises(ValueError):
        block_hashes(list(range(32)), 16, extra_keys=[""])


def test_known_value_is_stable() -> None:
    # The definition is a cross-process contract (gateway, scheduler, simulator): pin it.
    assert block_hashes(list(range(4)), 4) == [2450421232988260925]
