"""plan_moves: drains first, starts within the GPU budget, never below one per role."""

from __future__ import annotations

import pytest

from pdplane.autoscale.state import FleetState, Move, RoleCount, plan_moves


def _state(p: RoleCount, d: RoleCount, gpi: int = 1) -> FleetState:
    return FleetState({"prefill": p, "decode": d}, gpi)


def test_a_move_between_roles_with_the_budget_full_drains_now_and_starts_later() -> None:
    full = _state(RoleCount(ready=2), RoleCount(ready=6))
    assert plan_moves({"prefill": 4, "decode": 4}, full, gpus=8) == [Move("drain", "decode")] * 2
    # The drained decodes still hold their GPUs: nothing starts yet.
    draining = _state(RoleCount(ready=2), RoleCount(ready=4, draining=2))
    assert plan_moves({"prefill": 4, "decode": 4}, draining, gpus=8) == []
    # One GPU freed: one prefill starts.
    one_left = _state(RoleCount(ready=2), RoleCount(ready=4, draining=1))
    assert plan_moves({"prefill": 4, "decode": 4}, one_left, gpus=8) == [Move("start", "prefill")]


def test_starting_instances_count_as_planned_and_the_budget_counts_gpus() -> None:
    s = _state(RoleCount(ready=1, starting=1), RoleCount(ready=1), gpi=2)
    assert plan_moves({"prefill": 2, "decode": 1}, s, gpus=6) == []
    assert plan_moves({"prefill": 3, "decode": 2}, s, gpus=8) == [Move("start", "prefill")]
    assert plan_moves({"prefill": 3, "decode": 2}, s, gpus=0) == [
        Move("start", "prefill"),
        Move("start", "decode"),
    ]


def test_a_role_is_never_wanted_below_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        plan_moves({"prefill": 0, "decode": 1}, _state(RoleCount(1), RoleCount(1)), gpus=0)


def test_label_names_planned_counts_and_what_moves() -> None:
    s = _state(RoleCount(ready=2, starting=1), RoleCount(ready=3, draining=1))
    assert s.label == "3P3D (1 starting, 1 draining)"
    assert s.gpus_held == 7
