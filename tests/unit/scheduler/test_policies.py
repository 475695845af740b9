"""Each policy's choice rule, on plain candidates with controllable effective loads."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pytest

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.policies import POLICIES, Pick, PickContext, Pool, make_policy
from pdplane.scheduler.table import LOAD, SideTable


def ctx(*, routing_key: str = "", prefix: Sequence[int] = ()) -> PickContext:
    return PickContext("req", routing_key, prefix)


def pool(candidates: Sequence[Candidate], loads: Mapping[str, float] | None = None) -> Pool:
    """Every candidate in the pool, with these effective loads (0 unless given)."""
    table = SideTable("prefill", candidates)
    for row, c in enumerate(candidates):
        table.cols[row, LOAD] = (loads or {}).get(c.instance_id, 0.0)
    return Pool(table, np.arange(len(candidates), dtype=np.int64))


def pick(policy: Any, candidates: Sequence[Candidate], **kwargs: Any) -> Pick:
    loads = kwargs.pop("loads", None)
    return policy.pick(pool(candidates, loads), ctx(**kwargs))  # type: ignore[no-any-return]


@pytest.fixture
def four(make_candidate: Callable[..., Candidate]) -> list[Candidate]:
    return [make_candidate(f"p{i}") for i in range(4)]


def test_table_names_the_six_policies() -> None:
    assert set(POLICIES) == {
        "round_robin",
        "random",
        "least_loaded",
        "power_of_two",
        "consistent_hash",
        "kv_aware",
    }
    for name in POLICIES:
        assert make_policy(name, seed=1).name == name


def test_unknown_policy_is_a_value_error_naming_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown policy 'fastest'.*round_robin"):
        make_policy("fastest")


def test_round_robin_cycles_in_id_order(four: list[Candidate]) -> None:
    policy = make_policy("round_robin")
    picked = [pick(policy, four).candidate.instance_id for _ in range(6)]
    assert picked == ["p0", "p1", "p2", "p3", "p0", "p1"]


def test_round_robin_survives_a_shrinking_list(four: list[Candidate]) -> None:
    policy = make_policy("round_robin")
    for _ in range(3):
        pick(policy, four)
    assert pick(policy, four[:2]).candidate.instance_id in {"p0", "p1"}


def test_random_is_reproducible_with_a_seed_and_covers_all(four: list[Candidate]) -> None:
    a, b = make_policy("random", seed=7), make_policy("random", seed=7)
    picks_a = [pick(a, four).candidate.instance_id for _ in range(200)]
    picks_b = [pick(b, four).candidate.instance_id for _ in range(200)]
    assert picks_a == picks_b
    assert set(picks_a) == {"p0", "p1", "p2", "p3"}


def test_least_loaded_takes_the_minimum_and_takes_ties_in_turn(four: list[Candidate]) -> None:
    policy = make_policy("least_loaded")
    loads = {"p0": 3, "p1": 1.5, "p2": 0.5, "p3": 0.5}
    picks = [pick(policy, four, loads=loads) for _ in range(8)]
    assert {p.candidate.instance_id for p in picks} == {"p2", "p3"}  # never a loaded one
    assert Counter(p.candidate.instance_id for p in picks) == {"p2": 4, "p3": 4}
    assert picks[0].reason == "least_loaded: load=0.50 of 4"


def test_least_loaded_spreads_sequential_requests_over_idle_instances(
    four: list[Candidate],
) -> None:
    policy = make_policy("least_loaded")
    picked = Counter(pick(policy, four).candidate.instance_id for _ in range(8))
    assert picked == {"p0": 2, "p1": 2, "p2": 2, "p3": 2}


def test_power_of_two_never_picks_the_most_loaded(four: list[Candidate]) -> None:
    policy = make_policy("power_of_two", seed=3)
    loads = {"p0": 1, "p1": 2, "p2": 3, "p3": 9}
    picked = Counter(pick(policy, four, loads=loads).candidate.instance_id for _ in range(300))
    assert "p3" not in picked
    # p0 wins every sample it is in (half of all pairs), so it is the most picked.
    assert picked.most_common(1)[0][0] == "p0"


def test_power_of_two_with_one_candidate(four: list[Candidate]) -> None:
    only = pick(make_policy("power_of_two"), four[:1])
    assert only.candidate.instance_id == "p0"


def test_consistent_hash_sticks_to_a_routing_key_and_spreads_keys(four: list[Candidate]) -> None:
    policy = make_policy("consistent_hash")
    owners = {key: pick(policy, four, routing_key=key).candidate for key in map(str, range(200))}
    for key, owner in owners.items():
        assert pick(policy, four, routing_key=key).candidate == owner
    spread = Counter(c.instance_id for c in owners.values())
    assert set(spread) == {"p0", "p1", "p2", "p3"}
    assert min(spread.values()) >= 20  # 200 keys, 4 instances: none starved


def test_consistent_hash_moves_only_the_removed_instances_keys(four: list[Candidate]) -> None:
    policy = make_policy("consistent_hash")
    keys = [f"user-{i}" for i in range(300)]
    before = {k: pick(policy, four, routing_key=k).candidate.instance_id for k in keys}
    without_p2 = [c for c in four if c.instance_id != "p2"]
    after = {k: pick(policy, without_p2, routing_key=k).candidate.instance_id for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert moved and all(before[k] == "p2" for k in moved)


def test_consistent_hash_uses_the_prompt_prefix_without_a_key(four: list[Candidate]) -> None:
    policy = make_policy("consistent_hash")
    shared = [11, 22, 33, 44]
    owners = {
        pick(policy, four, prefix=[*shared, tail]).candidate.instance_id for tail in range(50)
    }
    assert len(owners) == 1  # same first 4 blocks -> same instance, whatever follows
    assert pick(policy, four, prefix=shared).reason == "consistent_hash: by prefix"


def test_consistent_hash_without_any_key_falls_back_to_least_loaded(
    four: list[Candidate],
) -> None:
    loads = {"p0": 2, "p1": 2, "p2": 0, "p3": 2}
    chosen = pick(make_policy("consistent_hash"), four, loads=loads)
    assert chosen.candidate.instance_id == "p2"
    assert chosen.reason.startswith("consistent_hash: no key, least_loaded")
