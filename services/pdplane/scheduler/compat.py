"""Compatibility filter and decode guard: which instances may serve one request.

Per side (prefill: role PREFILL/BOTH; decode: role DECODE/BOTH) an instance qualifies when it
serves the model (the tables are already per model), is SERVING (not DRAINING), is not
excluded by the request, has `max_model_len >= prompt_tokens + max_tokens` and, for decode,
has KV room for the request when its load report says how much (`total_kv_blocks > 0`):
`(free_kv_blocks - blocks already assigned since that report) * block_size >= tokens`.
Pairing (equal layout fingerprint, transport and max model length) is the service's.

Push mode: a decode that takes pushes (`recv_buffer_capacity_bytes > 0`) and whose receive
buffer cannot take the prompt's KV (`recv_buffer_headroom_bytes - blocks assigned since the
report * kv_block_bytes < blocks_for(prompt) * kv_block_bytes`) is picked only when no decode
with room is left: its prefill's push would be refused and decode would pull instead, which
works but loses what push buys.

One compiled pass over a side's table (`pdplane.scheduler.table`) answers the rows that
qualify and counts the others by reason; the reasons are worded only when a side has none left
(the UNAVAILABLE / RESOURCE_EXHAUSTED message).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass

import numba
import numpy as np
import numpy.typing as npt

from pdplane.core.grpc.echo import echo
from pdplane.scheduler.candidate import PairKey
from pdplane.scheduler.errors import NoInstance, NoRoom
from pdplane.scheduler.table import (
    ASSIGNED_BLOCKS,
    BLOCK_BYTES,
    BLOCK_SIZE,
    COLUMNS,
    FREE_BLOCKS,
    MAX_LEN,
    PENDING_BLOCKS,
    RECV_CAPACITY,
    RECV_HEADROOM,
    SERVING,
    TOTAL_BLOCKS,
    ModelTables,
    SideTable,
)
from pdplane.v1 import instance_pb2

__all__ = [
    "SideCandidates",
    "blocks_for",
    "describe_keys",
    "split_sides",
    "warm_up",
]

I64s = npt.NDArray[np.int64]
F64s = npt.NDArray[np.float64]
U8s = npt.NDArray[np.uint8]

# Reasons counted by the kernel (indices of its `counts`).
_DRAINING, _EXCLUDED, _TOO_LONG, _SMALL, _NO_ROOM, _NO_BUFFER = range(6)
_NO_EXCLUSION: U8s = np.zeros(0, np.uint8)


def blocks_for(tokens: int, block_size: int) -> int:
    """KV cache blocks holding `tokens` tokens (ceil); 0 when the block size is unknown."""
    return -(-tokens // block_size) if block_size > 0 else 0


def _compile_qualify(  # the columns are closure cells: part of numba's cache key
    serving: int = SERVING,
    max_len: int = MAX_LEN,
    block_size: int = BLOCK_SIZE,
    total_blocks: int = TOTAL_BLOCKS,
    free_blocks: int = FREE_BLOCKS,
    pending_blocks: int = PENDING_BLOCKS,
    recv_capacity: int = RECV_CAPACITY,
    recv_headroom: int = RECV_HEADROOM,
    assigned_blocks: int = ASSIGNED_BLOCKS,
    block_bytes_col: int = BLOCK_BYTES,
) -> Callable[..., int]:
    @numba.njit(cache=True, nogil=True)
    def qualify(
        cols: F64s,
        tokens: int,
        push_tokens: int,
        decode: bool,
        excluded: U8s,
        out: I64s,
        counts: I64s,
    ) -> int:  # pragma: no cover - compiled
        """Rows of `cols` that qualify, in order, into out[:k] (returns k); decodes that
        qualify but whose push buffer is full into out[n:n + counts[_NO_BUFFER]]; the others
        counted per reason in `counts` (the first reason that applies, in the order of the
        module doc)."""
        n = cols.shape[0]
        k = 0
        aside = 0
        check_excluded = excluded.shape[0] > 0
        for i in range(n):
            if cols[i, serving] == 0.0:
                counts[_DRAINING] += 1
                continue
            if check_excluded and excluded[i]:
                counts[_EXCLUDED] += 1
                continue
            if cols[i, max_len] < tokens:
                counts[_TOO_LONG] += 1
                continue
            if decode:
                block = np.int64(cols[i, block_size])
                total = cols[i, total_blocks]
                if (
                    total != 0.0
                    and block != 0
                    and (cols[i, free_blocks] - cols[i, pending_blocks]) * block < tokens
                ):
                    # Room that can never come (a cache smaller than the request) is no
                    # capacity refusal: waiting for it would only delay the answer.
                    if total * block < tokens:
                        counts[_SMALL] += 1
                    else:
                        counts[_NO_ROOM] += 1
                    continue
                if cols[i, recv_capacity] != 0.0:
                    block_bytes = cols[i, block_bytes_col]
                    needed = (-(-push_tokens // block) if block > 0 else 0) * block_bytes
                    room = cols[i, recv_headroom] - cols[i, assigned_blocks] * block_bytes
                    if room < needed:
                        out[n + aside] = i
                        aside += 1
                        continue
            out[k] = i
            k += 1
        counts[_NO_BUFFER] = aside
        return k

    return qualify  # type: ignore[no-any-return]


_qualify = _compile_qualify()


def warm_up() -> None:
    """Compiles (or loads from numba's cache) the filter's kernel now, not on a request."""
    _qualify(
        np.zeros((1, COLUMNS)),
        1,
        1,
        True,
        _NO_EXCLUSION,
        np.zeros(2, np.int64),
        np.zeros(6, np.int64),
    )


@dataclass(slots=True)
class SideCandidates:
    """Qualifying rows of one side's table (`rows`, ascending = by instance id), and why the
    others were turned down (`counts`, per reason)."""

    side: str
    table: SideTable | None
    rows: I64s
    counts: I64s
    tokens: int

    @property
    def with_role(self) -> int:
        """Instances of the model that can serve this side."""
        return len(self.table) if self.table is not None else 0

    @property
    def rejected(self) -> dict[str, int]:
        """reason -> instances turned down for it (e.g. {"draining": 1})."""
        tokens = self.tokens
        names = (
            "draining",
            "excluded",
            f"max_model_len < {tokens} tokens",
            f"KV cache smaller than {tokens} tokens",
            f"no KV room for {tokens} tokens",
        )
        return {name: int(n) for name, n in zip(names, self.counts, strict=False) if n}

    def explain(self, model: str, served: Collection[str]) -> str:
        """The UNAVAILABLE message for this side, e.g. "no decode instance for model m: ...".

        `served` = the model names the view holds (for "no instance serves this model").
        """
        head = f"no {self.side} instance for model {echo(model)}"
        if self.with_role == 0 and not served:
            return f"{head}: no instance serves this model (none registered)"
        if self.with_role == 0 and model not in served:
            return f"{head}: no instance serves this model (served: {', '.join(sorted(served))})"
        if self.with_role == 0:
            return f"{head}: none registered with role {self.side} or both"
        why = ", ".join(f"{n} {reason}" for reason, n in sorted(self.rejected.items()))
        return f"{head}: {self.with_role} registered, all turned down ({why})"

    def require(self, model: str, served: Callable[[], Collection[str]]) -> I64s:
        """The qualifying rows; raises NoInstance(side) when there are none, its NoRoom kind
        when at least one instance was turned down for KV room only (room may come).

        `served()` is only called to word the error.
        """
        if not len(self.rows):
            message = self.explain(model, served())
            if self.counts[_NO_ROOM]:
                raise NoRoom(self.side, message)
            raise NoInstance(self.side, message)
        return self.rows


def split_sides(
    tables: ModelTables | None,
    *,
    tokens: int,
    exclude: Collection[str],
    push_tokens: int | None = None,
) -> tuple[SideCandidates, SideCandidates]:
    """(prefill side, decode side) of one request over a model's tables (None: no instance
    serves the model).

    `tokens` = prompt_tokens + max_tokens; `push_tokens` = the prompt tokens a push would carry
    (None: `tokens`); `exclude` = instance ids not to choose. The tables' PENDING_BLOCKS and
    ASSIGNED_BLOCKS columns are the KV room and push buffer checks' blocks since each report.
    """
    pushed = tokens if push_tokens is None else push_tokens
    if tables is None:
        empty = np.zeros(0, np.int64)
        counts = np.zeros(6, np.int64)
        return (
            SideCandidates("prefill", None, empty, counts, tokens),
            SideCandidates("decode", None, empty, counts, tokens),
        )
    return (
        _qualifying(tables.prefill, tokens, pushed, exclude),
        _qualifying(tables.decode, tokens, pushed, exclude),
    )


def _qualifying(
    table: SideTable, tokens: int, push_tokens: int, exclude: Collection[str]
) -> SideCandidates:
    n = len(table)
    excluded = _NO_EXCLUSION
    if exclude:
        excluded = np.zeros(n, np.uint8)
        for instance_id in exclude:
            row = table.row_of.get(instance_id)
            if row is not None:
                excluded[row] = 1
    out = np.empty(2 * n, np.int64)
    counts = np.zeros(6, np.int64)
    k = _qualify(table.cols, tokens, push_tokens, table.side == "decode", excluded, out, counts)
    aside = counts[_NO_BUFFER]
    # With no decode left but those of full push buffers, they still serve it, by pull.
    rows = out[n : n + aside] if k == 0 and aside else out[:k]
    return SideCandidates(table.side, table, rows, counts, tokens)


def describe_keys(keys: set[PairKey]) -> str:
    """Readable keys for error messages: "L2.H2.D32.B16.float32/TCP/len=2048"."""
    return ", ".join(
        sorted(
            f"{fp}/{instance_pb2.Transport.Name(t).removeprefix('TRANSPORT_')}/len={n}"
            for fp, t, n in keys
        )
    )
