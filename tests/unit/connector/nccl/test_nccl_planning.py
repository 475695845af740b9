"""CPU-only parts of the NCCL data path: message planning, byte views, options, binding."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pdplane.connector.transports.nccl.binding import UniqueId, _Config, nccl_version_code
from pdplane.connector.transports.nccl.blocks import layer_byte_view, physical_order
from pdplane.connector.transports.nccl.chunk_plan import Chunk, Piece, plan_chunks


def test_plan_chunks_packs_whole_layers_while_they_fit() -> None:
    chunks = plan_chunks([100, 100, 100], num_blocks=4, chunk_bytes=800)
    assert chunks == [
        Chunk((Piece(0, 0, 4), Piece(1, 0, 4)), 800),
        Chunk((Piece(2, 0, 4),), 400),
    ]


def test_plan_chunks_splits_a_layer_larger_than_a_chunk() -> None:
    chunks = plan_chunks([100, 100], num_blocks=5, chunk_bytes=300)
    assert [c.pieces for c in chunks] == [
        (Piece(0, 0, 3),),
        (Piece(0, 3, 2), Piece(1, 0, 1)),
        (Piece(1, 1, 3),),
        (Piece(1, 4, 1),),
    ]
    assert all(c.nbytes <= 300 for c in chunks)
    # Every block of every layer appears exactly once.
    covered = sorted(
        (p.layer, p.first + k) for c in chunks for p in c.pieces for k in range(p.count)
    )
    assert covered == [(layer, b) for layer in range(2) for b in range(5)]


def test_plan_chunks_rejects_a_chunk_smaller_than_a_block() -> None:
    with pytest.raises(ValueError, match="cannot hold one"):
        plan_chunks([100], num_blocks=1, chunk_bytes=99)
    assert plan_chunks([100], num_blocks=0, chunk_bytes=100) == []


def test_physical_order_follows_strides() -> None:
    # FlashAttention NHD: logical order is the memory order.
    t = torch.empty(2, 10, 16, 8, 4)
    assert physical_order(t.shape, t.stride()) == [0, 1, 2, 3, 4]
    # An HND cache exposed with NHD shape via a permuted view.
    hnd = torch.empty(2, 10, 8, 16, 4).permute(0, 1, 3, 2, 4)
    assert physical_order(hnd.shape, hnd.stride()) == [0, 1, 3, 2, 4]


@pytest.mark.parametrize("block_dim", [0, 1])
def test_layer_byte_view_addresses_whole_blocks(block_dim: int) -> None:
    # block_dim 1: FlashAttention [2, blocks, ...]; block_dim 0: FlashInfer [blocks, 2, ...]
    shape = [2, 6, 4, 3, 5] if block_dim == 1 else [6, 2, 4, 3, 5]
    t = torch.randn(shape, dtype=torch.bfloat16)
    view = layer_byte_view(t, block_dim)
    outer = 1 if block_dim == 0 else 2
    assert tuple(view.shape) == (outer, 6, t.numel() * 2 // (outer * 6))
    # Block 3's bytes in the view are block 3's elements of the tensor.
    block = t.select(block_dim, 3).contiguous().view(torch.uint8).reshape(outer, -1)
    assert torch.equal(view[:, 3, :], block)
    view[:, 2, :] = 0  # shares memory
    assert bool((t.select(block_dim, 2) == 0).all())


def test_layer_byte_view_of_a_permuted_cache_uses_physical_order() -> None:
    base = torch.randn(2, 6, 3, 4, 5)  # physical [2, blocks, heads, tokens, dim]
    t = base.permute(0, 1, 3, 2, 4)  # logical NHD
    view = layer_byte_view(t, 1)
    assert torch.equal(view[:, 4, :], base[:, 4].contiguous().view(torch.uint8).reshape(2, -1))


def test_layer_byte_view_rejects_gaps() -> None:
    t = torch.randn(2, 6, 4, 8)[..., :4]
    with pytest.raises(ValueError, match="not dense"):
        layer_byte_view(t, 1)


def test_nccl_ctypes_layouts_match_the_c_api() -> None:
    # ncclUniqueId is 128 bytes; ncclConfig_t (2.14 prefix) is size_t + 2 uints + 4 ints +
    # a pointer + an int, padded to 8.
    assert UniqueId().internal._length_ == 128
    assert ctypes.sizeof(_Config) == 48
    assert nccl_version_code(2, 28, 9) == 22809
    assert nccl_version_code(2, 8, 4) == 2804


def test_transport_options_are_validated_without_a_gpu() -> None:
    from pdplane.connector.transports import create_transport

    t = create_transport("nccl", nccl_chunk_bytes=1 << 20)
    assert t.name == "nccl"
    with pytest.raises(TypeError, match="nccl_strategy"):  # a removed option is refused
        create_transport("nccl", nccl_strategy="gather")
    with pytest.raises(ValueError):
        create_transport("nccl", nccl_chunk_bytes=0)
    with pytest.raises(RuntimeError, match="before bind"):
        _ = t.engine


def test_transport_refuses_a_cpu_cache() -> None:
    from pdplane.connector.kv_cache import KvCacheView
    from pdplane.connector.transports.nccl import NcclTransport

    cache = KvCacheView({"l0": torch.zeros(2, 4, 16, 2, 8)}, num_blocks=4)
    with pytest.raises(ValueError, match="CUDA KV cache"):
        NcclTransport().bind(cache)
