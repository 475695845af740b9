"""How the requested KV blocks become NCCL messages. Pure Python (no torch, no GPU).

Both ranks derive the same message sequence from the same inputs, which is what NCCL needs
(point-to-point operations between two ranks match in issue order, by size):

* **gather** (default): the requested blocks of one or more consecutive layers are copied on the
  GPU into a staging buffer of at most `chunk_bytes`, sent as one message, and scattered into the
  destination blocks on the receiver. Few large messages, whatever the block ids.
* **grouped**: one message per run of blocks that are consecutive on *both* sides, per layer and
  per leading slice (K and V), straight from/into the paged cache, all in NCCL groups. No copy,
  but many messages when blocks are scattered.

docs/nccl.md records the measurement that picked the default.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_CHUNK_BYTES",
    "MAX_GROUP_OPS",
    "Chunk",
    "Piece",
    "Run",
    "Strategy",
    "contiguous_runs",
    "plan_chunks",
    "split_runs",
]

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024  #: gather staging buffer (bytes); see docs/nccl.md
MAX_GROUP_OPS = 512  #: NCCL operations per group in the grouped strategy


class Strategy(enum.Enum):
    GATHER = "gather"
    GROUPED = "grouped"

    @classmethod
    def parse(cls, value: str) -> Strategy:
        """Raises ValueError naming the accepted values."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(
                f"unknown NCCL strategy {value!r}; use one of {[s.value for s in cls]}"
            ) from None


@dataclass(frozen=True, slots=True)
class Piece:
    """Blocks `[first, first + count)` of the request's block list, of layer `layer`."""

    layer: int
    first: int
    count: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """One gather-strategy message: pieces packed back to back, `nbytes` in all."""

    pieces: tuple[Piece, ...]
    nbytes: int


@dataclass(frozen=True, slots=True)
class Run:
    """`length` requested blocks from position `first`: consecutive ids on both sides."""

    first: int
    length: int


def plan_chunks(layer_block_bytes: Sequence[int], num_blocks: int, chunk_bytes: int) -> list[Chunk]:
    """Packs `num_blocks` requested blocks of every layer into messages of <= `chunk_bytes`.

    `layer_block_bytes[l]` is the size of one block of layer `l` (bytes, K and V together).
    Layers are packed whole while they fit; a layer larger than a chunk is split by blocks.
    Raises ValueError when `chunk_bytes` cannot hold one block of some layer.
    """
    if num_blocks < 0:
        raise ValueError("num_blocks must be >= 0")
    chunks: list[Chunk] = []
    pieces: list[Piece] = []
    used = 0
    for layer, block_bytes in enumerate(layer_block_bytes):
        if block_bytes <= 0:
            raise ValueError(f"layer {layer}: block size must be > 0 bytes")
        if block_bytes > chunk_bytes:
            raise ValueError(
                f"chunk of {chunk_bytes} bytes cannot hold one {block_bytes}-byte block"
            )
        first = 0
        while first < num_blocks:
            room = (chunk_bytes - used) // block_bytes
            if room == 0:
                chunks.append(Chunk(tuple(pieces), used))
                pieces, used = [], 0
                continue
            count = min(room, num_blocks - first)
            pieces.append(Piece(layer, first, count))
            used += count * block_bytes
            first += count
    if pieces:
        chunks.append(Chunk(tuple(pieces), used))
    return chunks


def contiguous_runs(src: Sequence[int], dst: Sequence[int]) -> list[Run]:
    """Splits positions `0..len(src)` into runs where both `src` and `dst` ids go up by one.

    Raises ValueError when the lists differ in length."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source blocks but {len(dst)} destination blocks")
    runs: list[Run] = []
    start = 0
    for i in range(1, len(src) + 1):
        if i == len(src) or src[i] != src[i - 1] + 1 or dst[i] != dst[i - 1] + 1:
            if i > start:
                runs.append(Run(start, i - start))
            start = i
    return runs


def split_runs(run_lengths: Sequence[int], ids: Sequence[int]) -> list[Run]:
    """Rebuilds the runs a peer computed (`run_lengths`) over this side's `ids`, checking
    that each run is consecutive here too. Raises ValueError otherwise."""
    if any(n <= 0 for n in run_lengths) or sum(run_lengths) != len(ids):
        raise ValueError(f"run lengths {list(run_lengths)[:8]}... do not cover {len(ids)} blocks")
    runs: list[Run] = []
    first = 0
    for n in run_lengths:
        seg = ids[first : first + n]
        if any(seg[k] != seg[0] + k for k in range(n)):
            raise ValueError(f"blocks {list(seg)[:8]} of run at {first} are not consecutive")
        runs.append(Run(first, n))
        first += n
    return runs
