"""least_loaded: the candidate with the lowest effective load; ties taken in turn."""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numba
import numpy as np
import numpy.typing as npt

from pdplane.scheduler.policies.base import Pick, PickContext, Pool
from pdplane.scheduler.table import COLUMNS, LOAD, UNSEEN

NAME = "least_loaded"

F64s = npt.NDArray[np.float64]
I64s = npt.NDArray[np.int64]


def create(*, seed: int | None = None) -> LeastLoaded:
    """A least-loaded policy; `seed` is ignored (it is deterministic)."""
    return LeastLoaded()


class LeastLoaded:
    """Scans all candidates (one compiled pass); with in-flight accounting a burst spreads
    instead of herding.

    Equally loaded candidates are taken in turn: with light sequential traffic every instance
    reports zero load, and a fixed tie-break would send everything to one instance and nothing
    to a newly added one.
    """

    name = NAME

    def __init__(self) -> None:
        self._turn = itertools.count()
        least_loaded_row(np.zeros((1, COLUMNS)), np.zeros(1, np.int64), 0)  # compile now

    def pick(self, pool: Pool, ctx: PickContext) -> Pick:
        i, best_load = least_loaded_row(pool.cols, pool.rows, next(self._turn))
        return pool.pick(i, f"{NAME}: load={best_load:.2f} of {len(pool)}")


def _compile(load_col: int = LOAD, unseen_col: int = UNSEEN) -> Callable[..., tuple[int, float]]:
    # The columns are closure cells: part of numba's cache key (table.py's globals are not).
    @numba.njit(cache=True, nogil=True)
    def least_loaded_row(
        cols: F64s, rows: I64s, turn: int
    ) -> tuple[int, float]:  # pragma: no cover
        """(position in `rows` of the least effective load (LOAD + UNSEEN), that load); among
        equal loads the `turn % ties`-th in row order, so equal candidates are taken in turn."""
        best = np.inf
        ties = 0
        for i in range(rows.shape[0]):
            row = rows[i]
            load = cols[row, load_col] + cols[row, unseen_col]
            if load < best:
                best = load
                ties = 1
            elif load == best:
                ties += 1
        nth = turn % ties
        for i in range(rows.shape[0]):
            row = rows[i]
            if cols[row, load_col] + cols[row, unseen_col] == best:
                if nth == 0:
                    return i, best
                nth -= 1
        return 0, best

    return least_loaded_row  # type: ignore[no-any-return]


least_loaded_row = _compile()
