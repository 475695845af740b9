"""random: a uniformly random candidate, ignoring load."""

from __future__ import annotations

import random as _random
from collections.abc import Sequence

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.policies.base import Pick, PickContext

NAME = "random"


def create(*, seed: int | None = None) -> RandomPick:
    """A random policy; `seed` makes its choices reproducible."""
    return RandomPick(seed)


class RandomPick:
    """Uniform choice with its own generator (not the global one)."""

    name = NAME

    def __init__(self, seed: int | None = None) -> None:
        self._rng = _random.Random(seed)

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext) -> Pick:
        index = self._rng.randrange(len(candidates))
        return Pick(candidates[index], f"{NAME}: {index + 1}/{len(candidates)}")
