"""How the requested KV blocks become NCCL messages. Pure Python (no torch, no GPU).

Both ranks derive the same message sequence from the same inputs, which is what NCCL needs
(point-to-point operations between two ranks match in issue order, by size): the requested
blocks of one or more consecutive layers are copied on the GPU into a staging buffer of at most
`chunk_bytes`, sent as one message, and scattered into the destination blocks on the receiver.
Few large messages, whatever the block ids (docs/nccl.md: 0.97-0.99 of a raw send's rate).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["DEFAULT_CHUNK_BYTES", "Chunk", "Piece", "plan_chunks"]

DEFAULT_CHUNK_BYTES = 64 * 1024 * 1024  #: gather staging buffer (bytes); see docs/nccl.md


@dataclass(frozen=True, slots=True)
class Piece:
    """Blocks `[first, first + count)` of the request's block list, of layer `layer`."""

    layer: int
    first: int
    count: int


@dataclass(frozen=True, slots=True)
class Chunk:
    """One message: pieces packed back to back, `nbytes` in all."""

    pieces: tuple[Piece, ...]
    nbytes: int


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
