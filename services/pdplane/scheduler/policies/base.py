"""The policy interface: pick one instance out of a non-empty list of compatible candidates.

The service filters candidates first (model, layout, length, state, decode KV room), so a
policy only ranks. Candidates arrive sorted by instance id, so order-based policies are
deterministic for a given view.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from pdplane.scheduler.candidate import Candidate

__all__ = ["Pick", "PickContext", "Policy", "PolicyFactory"]


@dataclass(frozen=True, slots=True)
class PickContext:
    """Request features a policy may use.

    `load(candidate)` is the effective load: reported running + waiting requests, plus the
    scheduler's own unreleased assignments since that report, plus KV cache usage (0..1) as a
    tie-breaker. Lower is better.

    `prefix_block_hashes` is the `consistent_hash` key: the request's own field, else its
    `prefix_hashes` at the smallest block size. `prefix_hashes` maps a block size (tokens per
    KV cache block) to the prompt's exact chained block hashes at that size
    (`pdplane.core.prefix_hash`), empty when the gateway did not know the token ids; use
    `block_hashes(candidate.block_size)`. `prompt_tokens` is the prompt's length in tokens
    (exact when `prefix_hashes` is given, else an estimate).
    """

    request_id: str
    routing_key: str
    prefix_block_hashes: Sequence[int]
    load: Callable[[Candidate], float]
    prefix_hashes: Mapping[int, Sequence[int]] = field(default_factory=dict)
    prompt_tokens: int = 0

    def block_hashes(self, block_size: int) -> Sequence[int]:
        """The prompt's block hashes at `block_size` tokens per block; () when unknown."""
        return self.prefix_hashes.get(block_size, ())


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
