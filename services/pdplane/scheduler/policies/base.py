"""The policy interface: pick one instance out of a non-empty pool of compatible candidates.

The service filters candidates first (model, layout, length, state, decode KV room), so a
policy only ranks. A policy reads the pool as arrays (`Pool.cols`, columns of
`pdplane.scheduler.table`) and scores them in bulk (numpy, or a numba kernel of its own
module), never with a Python call per candidate: a decision over 1,000 instances then costs
about what one over 10 does. Pools are in instance-id order, so order-based policies are
deterministic for a given view.

This is the scoring seam: a policy takes the candidates' state (`Pool`) and the request's
features (`PickContext`) and returns its choice, a reason and the predicted prefix cache hit
on the chosen instance (`Pick`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numba
import numpy as np
import numpy.typing as npt

from pdplane.scheduler.candidate import Candidate
from pdplane.scheduler.table import BLOCK_SIZE, COLUMNS, KV_SLOT, LOAD, UNSEEN, SideTable

__all__ = ["Pick", "PickContext", "Policy", "PolicyFactory", "Pool"]

I64s = npt.NDArray[np.int64]
F64s = npt.NDArray[np.float64]
U8s = npt.NDArray[np.uint8]

_NO_LIVE: U8s = np.zeros(0, np.uint8)


@dataclass(slots=True)
class PickContext:
    """Request features a policy may use.

    `prefix_block_hashes` is the `consistent_hash` key: the request's own field, else its
    `prefix_hashes` at the smallest block size. `prefix_hashes` maps a block size (tokens per
    KV cache block) to the prompt's exact chained block hashes at that size
    (`pdplane.core.prefix_hash`), empty when the gateway did not know the token ids; use
    `block_hashes(candidate.block_size)`. `prompt_tokens` is the prompt's length in tokens
    (exact when `prefix_hashes` is given, else an estimate). `side` is "prefill" or "decode"
    (the half picked now). `max_tokens`: tokens to generate (0 = unknown). `now`: the
    in-flight tracker's clock (s; the table's BUSY_UNTIL is on it). `prefill_ms`: on decode,
    the prefill pick's predicted time to its prompt's KV (`Pick.predicted_ms`, 0 = unknown).
    `first_from_prefill`: the client's first token comes from prefill's answer
    (`RequestFeatures.first_token_from_prefill`).
    """

    request_id: str
    routing_key: str
    prefix_block_hashes: Sequence[int]
    prefix_hashes: Mapping[int, Sequence[int]] = field(default_factory=dict)
    prompt_tokens: int = 0
    side: str = "prefill"
    max_tokens: int = 0
    now: float = 0.0
    prefill_ms: float = 0.0
    first_from_prefill: bool = False

    def block_hashes(self, block_size: int) -> Sequence[int]:
        """The prompt's block hashes at `block_size` tokens per block; () when unknown."""
        return self.prefix_hashes.get(block_size, ())


class Pool:
    """The candidates of one side a policy chooses from: rows `rows` (int64, ascending, never
    empty) of `table`, whose columns `cols` hold their state (`pdplane.scheduler.table`).

    The prefix index's predicted prefix cache hit of the prompt on a candidate is
    `cached[slot]` for its index slot (the KV_SLOT column; float64 per slot, tokens, times
    the row's block size when `cached_per_block`; None: no hit anywhere): the lookup writes
    only the instances that hold a prefix, a group of equal depth at a time, every other slot
    is 0. `live_slots` (uint8 per index slot, 1 = LIVE; empty without an index) says whose
    index entries are trusted.
    """

    __slots__ = ("cached", "cached_per_block", "cols", "live_slots", "rows", "table")

    def __init__(
        self,
        table: SideTable,
        rows: I64s,
        cached: F64s | None = None,
        live_slots: U8s = _NO_LIVE,
        cached_per_block: bool = False,
    ) -> None:
        self.table = table
        self.cols = table.cols
        self.rows = rows
        self.cached = cached
        self.cached_per_block = cached_per_block
        self.live_slots = live_slots

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int) -> Candidate:
        return self.candidate(i)

    def candidate(self, i: int) -> Candidate:
        """The candidate at position `i` of the pool."""
        return self.table.candidates[self.rows.item(i)]

    def cached_tokens(self, i: int) -> int:
        """Predicted prefix cache hit (tokens) on the candidate at position `i`."""
        cached = self.cached
        if cached is None:
            return 0
        row = self.rows.item(i)
        slot = int(self.cols.item(row, KV_SLOT))
        if not 0 <= slot < len(cached):
            return 0
        scale = self.cols.item(row, BLOCK_SIZE) if self.cached_per_block else 1.0
        return int(cached.item(slot) * scale)

    def load(self, i: int) -> float:
        """Effective load of the candidate at position `i` (`InflightTracker.effective_load`)."""
        row = self.rows.item(i)
        cols = self.cols
        return cols.item(row, LOAD) + cols.item(row, UNSEEN)  # type: ignore[no-any-return]

    def live_count(self) -> int:
        """How many of the pool's instances are LIVE in the prefix index."""
        return int(_live_count(self.cols, self.rows, self.live_slots))

    def pick(self, i: int, reason: str) -> Pick:
        """The `Pick` of position `i`, with its predicted prefix cache hit."""
        return Pick(self.candidate(i), reason, self.cached_tokens(i))


@dataclass(slots=True)
class Pick:
    """The chosen candidate, a short human-readable reason ("least_loaded: load=1.20") and
    the predicted prefix cache hit of the prompt on it (tokens; 0 = none or unknown).

    A policy that predicts latency also says (0 / False otherwise): on prefill, the predicted
    time until the prompt's KV is computed (`predicted_ms`) and how long the prompt adds to
    the instance's queue (`queue_s`, seconds, `InflightTracker.add`); on decode,
    `skip_prefill`: decode computes the prompt itself (conditional disaggregation).
    """

    candidate: Candidate
    reason: str
    cached_tokens: int = 0
    predicted_ms: float = 0.0
    queue_s: float = 0.0
    skip_prefill: bool = False


class Policy(Protocol):
    """Chooses one candidate of `pool` (never empty)."""

    name: str

    def pick(self, pool: Pool, ctx: PickContext) -> Pick:
        """Returns the chosen candidate; must not raise for a non-empty pool."""
        ...


#: Builds a policy; `seed` makes randomised policies reproducible (ignored by the others);
#: policies with settings take them as further keyword arguments.
PolicyFactory = Callable[..., Policy]


def _compile_live_count(kv_slot: int = KV_SLOT) -> Callable[..., int]:
    # The column is a closure cell: part of numba's cache key (a global of another module is
    # not, and a cached kernel would keep reading a moved column).
    @numba.njit(cache=True, nogil=True)
    def live_count(cols: F64s, rows: I64s, live_slots: U8s) -> int:  # pragma: no cover
        n = 0
        slots = live_slots.shape[0]
        for i in range(rows.shape[0]):
            slot = np.int64(cols[rows[i], kv_slot])
            if 0 <= slot < slots and live_slots[slot]:
                n += 1
        return n

    return live_count  # type: ignore[no-any-return]


_live_count = _compile_live_count()


def warm_up() -> None:
    """Compiles (or loads from numba's cache) the shared kernels now, not on a request."""
    _live_count(np.zeros((1, COLUMNS)), np.zeros(1, np.int64), np.ones(1, np.uint8))
