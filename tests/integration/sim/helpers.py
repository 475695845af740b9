"""Helpers of the simulator's integration tests: polling (no sleep-and-hope), and the guard
that routing tests' sims kept up with their modelled clock."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from pathlib import Path
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
    """Fails, naming the rows, when the sims of a bench/routing/routing.py point fell behind their
    modelled clock (`sim_lag_fraction` > `SIM_LAG_LIMIT`): an overloaded machine, not a
    policy, would then decide the orderings the test asserts."""
    behind = {
        row: round(r["sim_lag_fraction"], 3)
        for row, r in rows.items()
        if r["sim_lag_fraction"] > SIM_LAG_LIMIT
    }
    assert not behind, f"the sims fell behind their modelled clock (machine overloaded): {behind}"


#: How many times a routing comparison is run again, each at half the previous time scale,
#: when its sims fell behind: a slower modelled clock gives them the CPU a busy host lacks.
SLOWER_RERUNS = 2


def run_kept_up(
    points: Sequence[Any],
    logs: Path,
    run_point: Callable[[Any, Path], dict[str, Any]],
    reruns: int = SLOWER_RERUNS,
) -> dict[str, dict[str, Any]]:
    """Runs every `bench/routing/routing.py` point (`run_point(point, dir)`), keyed by row. When any
    row's sims fell behind (`assert_sims_kept_up`), every row runs again at half the time
    scale (every row of a comparison gives the sims the same work), at most `reruns` times;
    then the guard decides. Each try's logs under `logs/try-N/`."""
    for attempt in range(reruns + 1):
        scale = 0.5**attempt
        rows = {
            p.row: run_point(
                dataclasses.replace(p, time_scale=p.time_scale * scale),
                logs / f"try-{attempt}" / p.row.replace(":", "-"),
            )
            for p in points
        }
        behind = [r for r in rows.values() if r["sim_lag_fraction"] > SIM_LAG_LIMIT]
        if not behind:
            break
    assert_sims_kept_up(rows)
    return rows
