"""least_loaded: the candidate with the lowest effective load (ties: lowest instance id)."""

from __future__ import annotations

from collections.abc import Sequence

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.policies.base import Pick, PickContext

NAME = "least_loaded"


def create(*, seed: int | None = None) -> LeastLoaded:
    """A least-loaded policy; `seed` is ignored (it is deterministic)."""
    return LeastLoaded()


class LeastLoaded:
    """Scans all candidates; with in-flight accounting a burst spreads instead of herding."""

    name = NAME

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext) -> Pick:
        load = ctx.load
        best = candidates[0]
        best_load = load(best)
        for candidate in candidates[1:]:
            value = load(candidate)
            if value < best_load:
                best, best_load = candidate, value
        return Pick(best, f"{NAME}: load={best_load:.2f} of {len(candidates)}")
