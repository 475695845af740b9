"""The sims' lag per modelled second (tests/support/routing_stats.py) and the routing tests'
guard on it."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from pdplane.sim.stats import EngineStats
from tests.integration.sim.helpers import assert_sims_kept_up, run_kept_up
from tests.support.routing_stats import fleet_numbers


def _fleet(clock_s: float, lag_s: tuple[float, float]) -> dict[str, Any]:
    """One `/fleet/stats` read: a prefill and a decode at modelled time `clock_s`."""
    instances = []
    for role, lag in zip(("prefill", "decode"), lag_s, strict=True):
        stats = EngineStats(clock_s=clock_s, lag_s=lag)
        instances.append({"role": role, "stats": stats.to_dict()})
    return {"instances": instances}


def test_lag_fraction_is_lag_per_modelled_second_and_instance() -> None:
    # 100 modelled s on two instances; 30 s of lag between the reads (prefill 10, decode 20).
    got = fleet_numbers(_fleet(50.0, (1.0, 2.0)), _fleet(150.0, (11.0, 22.0)))
    assert got["sim_lag_s"] == pytest.approx(30.0)
    assert got["sim_lag_fraction"] == pytest.approx(30.0 / (100.0 * 2))


def test_guard_names_the_rows_whose_sims_fell_behind() -> None:
    assert_sims_kept_up({"a": {"sim_lag_fraction": 0.003}, "b": {"sim_lag_fraction": 0.099}})
    with pytest.raises(AssertionError, match=r"'b': 0\.101"):
        assert_sims_kept_up({"b": {"sim_lag_fraction": 0.101}})
    with pytest.raises(AssertionError, match=r"fell behind.*'slow': 0\.59") as info:
        assert_sims_kept_up(
            {"fine": {"sim_lag_fraction": 0.002}, "slow": {"sim_lag_fraction": 0.59}}
        )
    assert "fine" not in str(info.value)


@dataclass(frozen=True)
class _Point:
    row: str
    time_scale: float


def test_a_comparison_whose_sims_fell_behind_runs_again_slower_every_row(
    tmp_path: Path,
) -> None:
    ran: list[tuple[str, float]] = []

    def run(p: _Point, logs: Path) -> dict[str, Any]:
        ran.append((p.row, p.time_scale))
        # "b" lags at time scale 4, keeps up at 2.
        lag = 0.3 if p.row == "b" and p.time_scale > 2 else 0.01
        return {"sim_lag_fraction": lag}

    got = run_kept_up([_Point("a", 4.0), _Point("b", 4.0)], tmp_path, run)
    assert ran == [("a", 4.0), ("b", 4.0), ("a", 2.0), ("b", 2.0)]
    assert got == {"a": {"sim_lag_fraction": 0.01}, "b": {"sim_lag_fraction": 0.01}}
    ran.clear()
    with pytest.raises(AssertionError, match="fell behind"):  # lags however slow: fails
        run_kept_up([_Point("a", 4.0)], tmp_path, lambda p, _: {"sim_lag_fraction": 0.5})
