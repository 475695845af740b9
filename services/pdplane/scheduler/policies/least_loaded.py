"""least_loaded: the candidate with the lowest effective load; ties taken in turn."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.policies.base import Pick, PickContext

NAME = "least_loaded"


def create(*, seed: int | None = None) -> LeastLoaded:
    """A least-loaded policy; `seed` is ignored (it is deterministic)."""
    return LeastLoaded()


class LeastLoaded:
    """Scans all candidates; with in-flight accounting a burst spreads instead of herding.

    Equally loaded candidates are taken in turn: with light sequential traffic every instance
    reports zero load, and a fixed tie-break would send everything to one instance and nothing
    to a newly added one.
    """

    name = NAME

    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext) -> Pick:
        load = ctx.load
        ties = [candidates[0]]
        best_load = load(ties[0])
        for candidate in candidates[1:]:
            value = load(candidate)
            if value < best_load:
                ties, best_load = [candidate], value
            elif value == best_load:
                ties.append(candidate)
        best = ties[next(self._turn) % len(ties)]
        return Pick(best, f"{NAME}: load={best_load:.2f} of {len(candidates)}")
