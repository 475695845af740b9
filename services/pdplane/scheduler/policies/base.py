"""The policy interface: pick one instance out of a non-empty list of compatible candidates.

The service filters candidates first (model, layout, length, state, decode KV room), so a
policy only ranks. Candidates arrive sorted by instance id, so order-based policies are
deterministic for a given view.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pdplane.scheduler.candidate import Candidate

__all__ = ["Pick", "PickContext", "Policy", "PolicyFactory"]


@dataclass(frozen=True, slots=True)
class PickContext:
    """Request features a policy may use.

    `load(candidate)` is the effective load: reported running + waiting requests, plus the
    scheduler's own unreleased assignments since that report, plus KV cache usage (0..1) as a
    tie-breaker. Lower is better.
    """

    request_id: str
    routing_key: str
    prefix_block_hashes: Sequence[int]
    load: Callable[[Candidate], float]


@dataclass(frozen=True, slots=True)
class Pick:
    """The chosen candidate and a short human-readable reason ("least_loaded: load=1.20")."""

    candidate: Candidate
    reason: str


class Policy(Protocol):
    """Chooses one of `candidates` (never empty)."""

    name: str

    def pick(self, candidates: Sequence[Candidate], ctx: PickContext) -> Pick:
        """Returns the chosen candidate; must not raise for a non-empty list."""
        ...


#: Builds a policy; `seed` makes randomised policies reproducible (ignored by the others).
PolicyFactory = Callable[..., Policy]
