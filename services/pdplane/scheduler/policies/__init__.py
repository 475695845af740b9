"""Scheduling policies: one per module; adding one is a new module plus one line below.

Each module defines `NAME`, a factory `create(*, seed=None, ...)` and the policy class
(interface in `base`: a policy scores a `Pool`, the candidates' state as arrays).
"""

from __future__ import annotations

from pdplane.scheduler.policies import (
    consistent_hash,
    kv_aware,
    least_loaded,
    power_of_two,
    random,
    round_robin,
)
from pdplane.scheduler.policies.base import Pick, PickContext, Policy, PolicyFactory, Pool

__all__ = ["POLICIES", "Pick", "PickContext", "Policy", "PolicyFactory", "Pool", "make_policy"]

#: policy name -> factory; the names are the values of --prefill-policy / --decode-policy.
POLICIES: dict[str, PolicyFactory] = {
    round_robin.NAME: round_robin.create,
    random.NAME: random.create,
    least_loaded.NAME: least_loaded.create,
    power_of_two.NAME: power_of_two.create,
    consistent_hash.NAME: consistent_hash.create,
    kv_aware.NAME: kv_aware.create,
}


def make_policy(name: str, *, seed: int | None = None, **options: object) -> Policy:
    """Builds the policy called `name` with its `options` (e.g. kv_aware's `weights`).
    Raises ValueError naming the known policies."""
    factory = POLICIES.get(name)
    if factory is None:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return factory(seed=seed, **options)
