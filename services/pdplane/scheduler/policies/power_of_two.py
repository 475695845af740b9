"""power_of_two: sample two distinct candidates at random, keep the less loaded one.

Cheaper than a full scan and avoids every scheduler replica herding onto the same instance.
"""

from __future__ import annotations

import random as _random
from collections.abc import Sequence

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.policies.base import Pick, PickContext

NAME = "power_of_two"


def create(*, seed: int | None = None) -> PowerOfTwo:
    """A power-of-two-choices policy; `seed` makes its samples reproducible."""
    return PowerOfTwo(seed)


class PowerOfTwo:
    """Two random choices, lower effective load wins (ties: the first sampled)."""

    name = NAME

    def __init__(self, seed: int | None = None) -> None:
        self._rng = _random.Random(seed)

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext) -> Pick:
        if len(candidates) == 1:
            only = candidates[0]
            return Pick(only, f"{NAME}: only candidate, load={ctx.load(only):.2f}")
        first, second = self._rng.sample(range(len(candidates)), 2)
        a, b = candidates[first], candidates[second]
        load_a, load_b = ctx.load(a), ctx.load(b)
        if load_b < load_a:
            a, load_a, load_b = b, load_b, load_a
        return Pick(a, f"{NAME}: load={load_a:.2f} vs {load_b:.2f}")
