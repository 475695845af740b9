"""round_robin: each decision takes the next candidate in id order, ignoring load."""

from __future__ import annotations

from collections.abc import Sequence

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.policies.base import Pick, PickContext

NAME = "round_robin"


def create(*, seed: int | None = None) -> RoundRobin:
    """A round-robin policy; `seed` is ignored (it is deterministic)."""
    return RoundRobin()


class RoundRobin:
    """Cycles through candidates with one counter per policy instance."""

    name = NAME

    def __init__(self) -> None:
        self._next = 0

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext) -> Pick:
        index = self._next % len(candidates)
        self._next = index + 1
        return Pick(candidates[index], f"{NAME}: {index + 1}/{len(candidates)}")
