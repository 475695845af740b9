"""round_robin: each decision takes the next candidate in id order, ignoring load."""

from __future__ import annotations

from pdplane.scheduler.policies.base import Pick, PickContext, Pool

NAME = "round_robin"


def create(*, seed: int | None = None) -> RoundRobin:
    """A round-robin policy; `seed` is ignored (it is deterministic)."""
    return RoundRobin()


class RoundRobin:
    """Cycles through candidates with one counter per policy instance."""

    name = NAME

    def __init__(self) -> None:
        self._next = 0

    def pick(self, pool: Pool, ctx: PickContext) -> Pick:
        n = len(pool)
        index = self._next % n
        self._next = index + 1
        return pool.pick(index, f"{NAME}: {index + 1}/{n}")
