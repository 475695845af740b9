"""A view of one worker's paged KV cache as whole blocks, whatever the attention backend.

vLLM hands the connector one tensor per attention layer (`register_kv_caches`). On CPU the block
index is the first axis (e.g. `[num_blocks, num_kv_heads, block_size, 2 * head_size]`); GPU
backends may put K/V first (`[2, num_blocks, ...]`). A transfer only ever moves whole blocks
between identical layouts, so this view finds the block axis and reads/writes blocks by id
without caring what the inner axes mean.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

__all__ = ["KvCacheView", "LayerCache"]


@dataclass(frozen=True, slots=True)
class LayerCache:
    """One layer's KV cache tensor and where its block axis is."""

    name: str
    tensor: torch.Tensor
    block_dim: int

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block (the tensor's shape without the block axis)."""
        shape = list(self.tensor.shape)
        del shape[self.block_dim]
        return tuple(shape)

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block of this layer."""
        n = self.tensor.element_size()
        for d in self.block_shape:
            n *= d
        return n


class KvCacheView:
    """The KV cache tensors of one worker (one TP rank), addressed by (layer index, block id).

    Layers keep the order vLLM registered them in (model order), so layer `i` on prefill is
    layer `i` on decode when their layout fingerprints match.
    """

    def __init__(self, caches: Mapping[str, torch.Tensor], num_blocks: int | None = None) -> None:
        """`caches`: layer name -> KV tensor as given to `register_kv_caches`; `num_blocks`: the
        engine's KV cache block count (`KVCacheConfig.num_blocks`), used to find the block axis
        (defaults to the first axis' size). Raises ValueError when no axis has that size."""
        if not caches:
            raise ValueError("no KV cache tensors registered")
        layers: list[LayerCache] = []
        for name, tensor in caches.items():
            n = num_blocks if num_blocks is not None else int(tensor.shape[0])
            dim = next((i for i, size in enumerate(tensor.shape) if size == n), None)
            if dim is None:
                raise ValueError(f"KV cache {name} {tuple(tensor.shape)} has no axis of {n} blocks")
            layers.append(LayerCache(name, tensor, dim))
        self.layers: list[LayerCache] = layers
        self.num_blocks = int(layers[0].tensor.shape[layers[0].block_dim])
        self.dtype: torch.dtype = layers[0].tensor.dtype
        self.device: torch.device = layers[0].tensor.device

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def check_block_ids(self, block_ids: Sequence[int]) -> None:
        """Raises ValueError unless every id is a valid block index of this cache."""
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids out of range [0, {self.num_blocks}): {bad[:8]}")

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def read_blocks(self, layer: int, block_ids: Sequence[int]) -> torch.Tensor:
        """A contiguous copy `[len(block_ids), *block_shape]` of the blocks, in the given order."""
        lc = self.layers[layer]
        picked = lc.tensor.index_select(lc.block_dim, self._index(block_ids))
        return picked.movedim(lc.block_dim, 0).contiguous()

    def write_blocks(self, layer: int, block_ids: Sequence[int], data: torch.Tensor) -> None:
        """Writes `data` (`[len(block_ids), *block_shape]`, same dtype) into the blocks, in order.

        Raises ValueError on a shape or dtype mismatch."""
        lc = self.layers[layer]
        expected = (len(block_ids), *lc.block_shape)
        if tuple(data.shape) != expected or data.dtype != lc.tensor.dtype:
            raise ValueError(
                f"layer {layer}: got {tuple(data.shape)} {data.dtype}, "
                f"expected {expected} {lc.tensor.dtype}"
            )
        lc.tensor.index_copy_(
            lc.block_dim, self._index(block_ids), data.to(lc.tensor.device).movedim(0, lc.block_dim)
        )
