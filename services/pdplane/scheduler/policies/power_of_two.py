"""power_of_two: sample two distinct candidates at random, keep the less loaded one.

Cheaper than a full scan and avoids every scheduler replica herding onto the same instance.
"""

from __future__ import annotations

import random as _random

from pdplane.scheduler.policies.base import Pick, PickContext, Pool

NAME = "power_of_two"


def create(*, seed: int | None = None) -> PowerOfTwo:
    """A power-of-two-choices policy; `seed` makes its samples reproducible."""
    return PowerOfTwo(seed)


class PowerOfTwo:
    """Two random choices, lower effective load wins (ties: the first sampled)."""

    name = NAME

    def __init__(self, seed: int | None = None) -> None:
        self._rng = _random.Random(seed)

    def pick(self, pool: Pool, ctx: PickContext) -> Pick:
        if len(pool) == 1:
            return pool.pick(0, f"{NAME}: only candidate, load={pool.load(0):.2f}")
        first, second = self._rng.sample(range(len(pool)), 2)
        load_a, load_b = pool.load(first), pool.load(second)
        if load_b < load_a:
            first, load_a, load_b = second, load_b, load_a
        return pool.pick(first, f"{NAME}: load={load_a:.2f} vs {load_b:.2f}")
