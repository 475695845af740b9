"""Candidate state as arrays: per served model and side, one row per instance, one column each
for what a decision reads.

A decision filters and scores a whole side with one compiled pass over these columns
(`pdplane.scheduler.compat`, the policies' kernels) instead of calling Python per candidate:
at 1,000 instances a scan in Python cost ~0.2-1 ms per decision, one pass over a float64
table costs a few microseconds. The tables are never rebuilt per decision: the view
(`pdplane.scheduler.view`) builds them when instances come or go and rewrites only the rows of
the instances whose load report, in-flight count or peer estimate changed since the last
decision (`CandidateView.tables`).

Rows are sorted by instance id (the order policies such as round-robin rely on). Every column
is float64 (counts of blocks, tokens and bytes stay below 2**53, so they are exact):

=================  ======================================================================
column             meaning
=================  ======================================================================
SERVING            1 when SERVING, 0 when DRAINING
MAX_LEN            max model length (tokens)
LOAD               reported running + waiting + KV cache usage, plus own pending requests
REQUESTS           reported running + waiting plus own pending requests (whole requests)
USAGE              reported KV cache usage (0..1)
FREE_BLOCKS        reported free KV cache blocks
TOTAL_BLOCKS       reported KV cache blocks (0 = not reported: no KV room check)
BLOCK_SIZE         tokens per KV cache block
PENDING_BLOCKS     KV blocks assigned since the report, less those freed since
                   (`InflightTracker.pending_blocks`)
ASSIGNED_BLOCKS    KV blocks assigned since the report (`InflightTracker.assigned_blocks`)
QUEUED_TOKENS      uncached prompt tokens sent since the report (prefill)
RECV_CAPACITY      push receive buffer (bytes; 0 = takes no pushes)
RECV_HEADROOM      the largest push the buffer takes now (bytes)
BLOCK_BYTES        bytes of one KV cache block (all layers)
UNSEEN             peers' assignments estimated but not received yet (`exchange`)
RELEASED           decode: requests its report counts that were released since (so
                   REQUESTS - RELEASED is what it runs, as far as this scheduler knows)
BUSY_UNTIL         prefill: when its queued prompts are predicted to be computed (the
                   in-flight tracker's clock, s; `InflightTracker.busy_until`; 0 = idle)
CONTEXT            decode: the mean context (tokens) each request this scheduler sent there
                   and has not released is predicted to attend over
                   (`InflightTracker.decode_context`; 0 = none)
PAIR               code of the pair key (layout, transport, length) within the model
KV_SLOT            the instance's slot in the prefix index (-1: not in it)
=================  ======================================================================

The effective load of `InflightTracker.effective_load` is LOAD + UNSEEN.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

import numpy as np
import numpy.typing as npt

from pdplane.scheduler.candidate import Candidate, PairKey

if TYPE_CHECKING:
    from pdplane.scheduler.inflight import InflightTracker
    from pdplane.scheduler.kv_index import PrefixIndex

__all__ = [
    "ASSIGNED_BLOCKS",
    "BLOCK_BYTES",
    "BLOCK_SIZE",
    "BUSY_UNTIL",
    "COLUMNS",
    "CONTEXT",
    "FREE_BLOCKS",
    "KV_SLOT",
    "LOAD",
    "MAX_LEN",
    "PAIR",
    "PENDING_BLOCKS",
    "QUEUED_TOKENS",
    "RECV_CAPACITY",
    "RECV_HEADROOM",
    "RELEASED",
    "REQUESTS",
    "SERVING",
    "TOTAL_BLOCKS",
    "UNSEEN",
    "USAGE",
    "ModelTables",
    "SideTable",
]

(
    SERVING,
    MAX_LEN,
    USAGE,
    FREE_BLOCKS,
    TOTAL_BLOCKS,
    BLOCK_SIZE,
    RECV_CAPACITY,
    RECV_HEADROOM,
    BLOCK_BYTES,
    # What in-flight changes move (written alone then): LOAD .. CONTEXT, in this order.
    LOAD,
    REQUESTS,
    PENDING_BLOCKS,
    ASSIGNED_BLOCKS,
    QUEUED_TOKENS,
    UNSEEN,
    RELEASED,
    BUSY_UNTIL,
    CONTEXT,
    PAIR,
    KV_SLOT,
) = range(20)
#: Number of columns.
COLUMNS = 20

F64s = npt.NDArray[np.float64]


class SideTable:
    """The candidates of one model that can serve one side ("prefill": role PREFILL or BOTH;
    "decode": DECODE or BOTH), `cols[row, COLUMN]` (float64, C order), rows sorted by id.

    `candidates[row]` is the row's current `Candidate`; `row_of[instance_id]` its row.
    Written by the view on one thread; a decision reads it on that same thread.
    """

    __slots__ = ("candidates", "cols", "kv_version", "row_of", "side")

    def __init__(
        self,
        side: str,
        candidates: Sequence[Candidate],
        pair_codes: dict[PairKey, int] | None = None,
    ) -> None:
        """`candidates` sorted by id; `pair_codes` numbers the model's pair keys (None: the
        candidates' own, in order). Rows start zero: `write` them before a decision."""
        if pair_codes is None:
            pair_codes = {}
            for c in candidates:
                pair_codes.setdefault(c.pair_key, len(pair_codes))
        self.side = side
        self.candidates = list(candidates)
        self.row_of = {c.instance_id: row for row, c in enumerate(self.candidates)}
        self.cols: F64s = np.zeros((len(self.candidates), COLUMNS))
        self.cols[:, KV_SLOT] = -1
        self.kv_version = -1  # PrefixIndex.slots_version the KV_SLOT column was read at
        for row, c in enumerate(self.candidates):
            self.cols[row, PAIR] = pair_codes[c.pair_key]

    def __len__(self) -> int:
        return len(self.candidates)

    def write(self, row: int, c: Candidate, inflight: InflightTracker) -> None:
        """Rewrites `row` from candidate `c` (its latest load report) and what `inflight`
        counts on it since that report."""
        self.candidates[row] = c
        self.cols[row, SERVING:LOAD] = (
            1.0 if c.serving else 0.0,
            c.max_model_len,
            c.kv_cache_usage,
            c.free_kv_blocks,
            c.total_kv_blocks,
            c.block_size,
            c.recv_capacity_bytes,
            c.recv_headroom_bytes,
            c.kv_block_bytes,
        )
        self.write_counts(row, inflight)

    def write_counts(self, row: int, inflight: InflightTracker) -> None:
        """Rewrites the in-flight columns (LOAD .. CONTEXT) of `row` from `inflight`. On
        decode, reading the pending blocks also starts the report's KV credit
        (`InflightTracker.counts`), as a scan of every decode did."""
        c = self.candidates[row]
        requests, pending_blocks, assigned_blocks, queued, released, context = inflight.counts(
            c, self.side == "decode"
        )
        # One slice assignment: a numpy item write costs ~100 ns each.
        self.cols[row, LOAD:PAIR] = (
            c.reported_load + requests,
            c.num_running + c.num_waiting + requests,
            pending_blocks,
            assigned_blocks,
            queued,
            inflight.unseen_count(c.instance_id),
            released,
            inflight.busy_until(c.instance_id),
            context,
        )

    def write_all(self, inflight: InflightTracker) -> None:
        """Rewrites every row (a new table, or in tests)."""
        for row, c in enumerate(self.candidates):
            self.write(row, c, inflight)

    def read_kv_slots(self, index: PrefixIndex) -> None:
        """Refreshes KV_SLOT from `index` when its slots moved since the last read (instances
        added to or removed from the index: rare, O(rows) then)."""
        version = index.slots_version
        if version == self.kv_version:
            return
        column = self.cols[:, KV_SLOT]
        for row, c in enumerate(self.candidates):
            inst = index.instance(c.instance_id)
            column[row] = inst.slot if inst is not None else -1
        self.kv_version = version


class ModelTables:
    """One served model's prefill and decode `SideTable`s.

    `uniform`: every instance of the model has the same pair key, so any prefill pairs with
    any decode (the usual fleet); `pair_keys[code]` is the key a PAIR code stands for.
    """

    __slots__ = ("decode", "pair_keys", "prefill", "uniform")

    def __init__(self, candidates: Iterable[Candidate]) -> None:
        ordered = sorted(candidates, key=_by_id)
        codes: dict[PairKey, int] = {}
        for c in ordered:
            codes.setdefault(c.pair_key, len(codes))
        self.pair_keys = list(codes)
        self.uniform = len(codes) == 1
        self.prefill = SideTable("prefill", [c for c in ordered if c.can_prefill], codes)
        self.decode = SideTable("decode", [c for c in ordered if c.can_decode], codes)

    def sides(self) -> tuple[SideTable, SideTable]:
        """(prefill, decode)."""
        return self.prefill, self.decode


def _by_id(candidate: Candidate) -> str:
    return candidate.instance_id
