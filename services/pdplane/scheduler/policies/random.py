"""random: a uniformly random candidate, ignoring load."""

from __future__ import annotations

import random as _random

from pdplane.scheduler.policies.base import Pick, PickContext, Pool

NAME = "random"


def create(*, seed: int | None = None) -> RandomPick:
    """A random policy; `seed` makes its choices reproducible."""
    return RandomPick(seed)


class RandomPick:
    """Uniform choice with its own generator (not the global one)."""

    name = NAME

    def __init__(self, seed: int | None = None) -> None:
        self._rng = _random.Random(seed)

    def pick(self, pool: Pool, ctx: PickContext) -> Pick:
        n = len(pool)
        index = self._rng.randrange(n)
        return pool.pick(index, f"{NAME}: {index + 1}/{n}")
