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


def _no_tokens(candidate: Candidate) -> int:
    return 0


def _not_live(candidate: Candidate) -> bool:
    return False


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

    From the prefix index (`pdplane.scheduler.kv_index`), filled by the service:
    `cached_tokens(candidate)` is the predicted prefix cache hit of the prompt on that
    instance (tokens, whole blocks; 0 when the instance is not LIVE in the index),
    `kv_live(candidate)` whether its index entries are trusted (False: stale, syncing or no
    index), and `queued_prefill_tokens(candidate)` the uncached prompt tokens this scheduler
    sent it since its last load report. `side` is "prefill" or "decode" (the half picked now).
    """

    request_id: str
    routing_key: str
    prefix_block_hashes: Sequence[int]
    load: Callable[[Candidate], float]
    prefix_hashes: Mapping[int, Sequence[int]] = field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: Callable[[Candidate], int] = _no_tokens
    kv_live: Callable[[Candidate], bool] = _not_live
    queued_prefill_tokens: Callable[[Candidate], int] = _no_tokens
    side: str = "prefill"

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


#: Builds a policy; `seed` makes randomised policies reproducible (ignored by the others);
#: policies with settings take them as further keyword arguments.
PolicyFactory = Callable[..., Policy]
