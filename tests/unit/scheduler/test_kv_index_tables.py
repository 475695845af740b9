"""U64Map and the fused holder-table kernels against plain dicts (growth, tombstones, keys 0
and 1, repeated keys in a batch, distinct keys probing to the same empty slot)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from pdplane.scheduler.kv_index import KvState, PrefixIndex
from pdplane.scheduler.kv_index.u64map import U64Map

# Small keys (0, 1: the empty / deleted markers; few values: repeats and collisions) mixed
# with full-width ones.
_keys = st.one_of(st.integers(0, 40), st.integers(0, 2**64 - 1))
_ops = st.lists(
    st.tuples(st.sampled_from(["put", "pop", "get"]), st.lists(_keys, max_size=40)),
    max_size=30,
)


@settings(max_examples=150, deadline=None)
@given(_ops)
def test_u64map_matches_a_dict(ops: list[tuple[str, list[int]]]) -> None:
    table = U64Map(np.uint64)
    ref: dict[int, int] = {}
    for i, (op, keys) in enumerate(ops):
        arr = np.array(keys, np.uint64)
        if op == "put":
            vals = np.array([(k * 7 + i) % 2**64 for k in keys], np.uint64)
            uniq: dict[int, int] = dict(zip(keys, vals.tolist(), strict=True))
            uarr = np.array(list(uniq), np.uint64)  # put takes unique keys
            added = table.put(uarr, np.array(list(uniq.values()), np.uint64))
            assert added == sum(k not in ref for k in uniq)
            ref.update(uniq)
        elif op == "pop":
            vals, found = table.pop(arr)
            assert found.tolist() == [k in ref for k in keys]
            for k in keys:
                ref.pop(k, None)
        got, found = table.get(arr)
        assert found.tolist() == [k in ref for k in keys]
        assert [int(v) for v, f in zip(got, found, strict=True) if f] == [
            ref[k] for k in keys if k in ref
        ]
        assert len(table) == len(ref)
    k, v = table.items()
    assert dict(zip(k.tolist(), v.tolist(), strict=True)) == ref


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 3),  # instance
            st.booleans(),  # store / remove
            # (engine hash, version): own hash 4 * engine + version, so engine blocks of one
            # instance never share an own hash, and a new version re-stores a block under
            # another own hash; engine 0 gives the own hashes 0 and 1
            st.lists(st.tuples(st.integers(0, 60), st.integers(0, 3)), max_size=40),
        ),
        max_size=25,
    )
)
def test_index_tables_match_a_dict_model(
    ops: list[tuple[int, bool, list[tuple[int, int]]]],
) -> None:
    """Stores / removals through the fused kernels (and the key 0/1 fallback) leave the same
    holders as a dict model: engine hash -> own hash per instance, own hash -> holders."""
    index = PrefixIndex()
    insts = [index.add_instance(f"i{n}") for n in range(4)]
    for inst in insts:
        index.set_state(inst, KvState.LIVE)
    model: list[dict[int, int]] = [{} for _ in insts]
    for n, store, pairs in ops:
        inst = insts[n]
        if store:
            eng = list(dict.fromkeys(e for e, _ in pairs))
            own = {e: 4 * e + v for e, v in pairs}
            inst._add("GPU", eng, [own[e] for e in eng])
            model[n].update((e, own[e]) for e in eng)
        else:
            inst.removed([e for e, _ in pairs])
            for e, _ in pairs:
                model[n].pop(e, None)
        assert index.entries == sum(len(m) for m in model)
        holders: dict[int, int] = {}
        for j, m in enumerate(model):
            for o in m.values():
                holders[o] = holders.get(o, 0) | 1 << j
        table = index.tables.get("GPU")
        if table is None:
            assert not holders
            continue
        keys, sids = table.ids.items()
        masks = index.holder_sets.masks
        assert {k: masks[s] for k, s in zip(keys.tolist(), sids.tolist(), strict=True)} == holders
        for o, mask in holders.items():  # match walks the same table (one block prompts)
            assert set(index.match([o])) == {f"i{j}" for j in range(4) if mask >> j & 1}
    for inst in insts:
        inst.clear()
    assert len(index.tables["GPU"]) == 0 if "GPU" in index.tables else True
    assert len(index.holder_sets) == 0
