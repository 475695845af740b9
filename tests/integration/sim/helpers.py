"""Helpers of the simulator's integration tests: polling (no sleep-and-hope), and the guard
that routing tests' sims kept up with their modelled clock."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


def wait_for(probe: Callable[[], T | None], timeout: float = 5.0, interval: float = 0.02) -> T:
    """Polls `probe` until it returns a truthy value; raises AssertionError at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        time.sleep(interval)


#: Most the sims may run late (modelled s per modelled s and instance) for a routing test's
#: orderings to mean anything: 0.002-0.003 on a quiet 2-core host; 0.59 when time scale 10
#: outran a slow one and both rows finished almost nothing.
SIM_LAG_LIMIT = 0.1


def assert_sims_kept_up(rows: dict[str, dict[str, Any]]) -> None:
    """Fails, naming the rows, when the sims of a bench/routing.py point fell behind their
    modelled clock (`sim_lag_fraction` > `SIM_LAG_LIMIT`): an overloaded machine, not a
    policy, would then decide the orderings the test asserts."""
    behind = {
        row: round(r["sim_lag_fraction"], 3)
        for row, r in rows.items()
        if r["sim_lag_fraction"] > SIM_LAG_LIMIT
    }
    assert not behind, f"the sims fell behind their modelled clock (machine overloaded): {behind}"
