"""The gather path of `BlockMover` on CPU: the CUDA streams and events are replaced by
stand-ins that run everything at once, in issue order, and the "wire" copies each sent
staging buffer into the next posted receive by address. What stays real: the message plan,
the byte views, the widened copy kernels (int64/int16 views), the double buffering and the
scatter into the destination blocks. Stream ordering itself is covered by tests/gpu."""

from __future__ import annotations

import ctypes

import pytest
import torch

from pdplane.connector.transports.nccl import blocks
from pdplane.connector.transports.nccl.blocks import BlockMover, layer_byte_view
from pdplane.connector.transports.nccl.communicator import P2pOp
from tests.unit.connector.nccl.fabric import FakeStream, cpu_cuda  # noqa: F401 - a fixture

NUM_BLOCKS = 12


class Wire:
    """Messages in flight between two fake communicators, in send order."""

    def __init__(self) -> None:
        self.messages: list[bytes] = []


class FakeComm:
    def __init__(self, wire: Wire, fail_at: int | None = None) -> None:
        self.wire = wire
        self.stream = FakeStream()
        self.copy_stream = FakeStream()
        self.ops: list[P2pOp] = []
        self.fail_at = fail_at
        self.waits: list[str] = []

    def wait(self, deadline: float, what: str = "transfer") -> None:
        self.waits.append(what)

    def enqueue(self, ops: list[P2pOp], deadline: float) -> None:
        if self.fail_at is not None and len(self.ops) == self.fail_at:
            raise RuntimeError("communicator aborted")
        for op in ops:
            self.ops.append(op)
            if op.is_send:
                self.wire.messages.append(ctypes.string_at(op.ptr, op.nbytes))
            else:
                data = self.wire.messages.pop(0)
                assert len(data) == op.nbytes, "send and receive sizes differ"
                ctypes.memmove(op.ptr, data, op.nbytes)


@pytest.fixture
def recorded(cpu_cuda: list[int]) -> list[int]:  # noqa: F811 - the fixture imported above
    """CUDA stand-ins; the sizes of the tensors whose memory was handed to a stream."""
    return cpu_cuda


def _caches(seed: int) -> list[torch.Tensor]:
    """Two layers in FlashAttention layout `[2, blocks, block_size, kv_heads, head_size]`:
    one whose block halves are 8-byte multiples (int64 copies), one of 6 bytes (int16)."""
    gen = torch.Generator().manual_seed(seed)
    wide = torch.randint(-1000, 1000, (2, NUM_BLOCKS, 4, 2, 8), generator=gen, dtype=torch.int16)
    narrow = torch.randint(-1000, 1000, (2, NUM_BLOCKS, 1, 1, 3), generator=gen, dtype=torch.int16)
    return [wide, narrow]


def _mover(caches: list[torch.Tensor]) -> BlockMover:
    return BlockMover([layer_byte_view(t, 1) for t in caches], device="cpu")


@pytest.mark.parametrize("chunk_blocks", [1, 3, 100])
def test_gathered_blocks_land_in_the_requested_blocks(
    recorded: list[int], chunk_blocks: int
) -> None:
    src_caches, dst_caches = _caches(1), [torch.zeros_like(t) for t in _caches(1)]
    sender, receiver = _mover(src_caches), _mover(dst_caches)
    assert [v.dtype for v in sender.wide_views] == [torch.int64, torch.int16]
    chunk_bytes = chunk_blocks * max(sender.layer_block_bytes)
    src, dst = [7, 2, 9, 0, 11], [1, 10, 4, 5, 3]
    wire = Wire()
    sent = sender.enqueue(FakeComm(wire), True, src, 0.0, chunk_bytes)
    got = receiver.enqueue(FakeComm(wire), False, dst, 0.0, chunk_bytes)
    assert sent == got == len(src) * sum(sender.layer_block_bytes)
    assert wire.messages == []
    for s_cache, d_cache in zip(src_caches, dst_caches, strict=True):
        assert torch.equal(d_cache[:, dst], s_cache[:, src])
        untouched = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert not d_cache[:, untouched].any()


def test_many_chunks_use_two_staging_buffers(recorded: list[int]) -> None:
    sender = _mover(_caches(2))
    comm = FakeComm(Wire())
    sender.enqueue(comm, True, list(range(8)), 0.0, max(sender.layer_block_bytes))
    assert len(comm.ops) > 2
    assert len({op.ptr for op in comm.ops}) == 2  # alternating between two buffers
    assert comm.stream.waited_on[-1] is comm.copy_stream  # comm.wait covers the last copies


def test_a_failed_enqueue_still_hands_the_memory_to_both_streams(recorded: list[int]) -> None:
    sender = _mover(_caches(3))
    comm = FakeComm(Wire(), fail_at=1)  # the second message fails (an abort meanwhile)
    with pytest.raises(RuntimeError, match="aborted"):
        sender.enqueue(comm, True, [0, 1, 2, 3], 0.0, 256)
    assert comm.stream.waited_on[-1] is comm.copy_stream
    # two staging buffers and the index, each recorded on both streams
    assert len(recorded) == 6


@pytest.mark.parametrize("rows_on", ["both", "sender", "receiver"])
@pytest.mark.parametrize("src,dst", [([7], [2]), ([3, 11], [0, 6])])
def test_few_blocks_copied_slice_by_slice_keep_the_staging_layout(
    recorded: list[int],
    monkeypatch: pytest.MonkeyPatch,
    rows_on: str,
    src: list[int],
    dst: list[int],
) -> None:
    """A small single-chunk transfer copies slices with one batched copy instead of a gather
    per layer; its staging bytes equal the per-layer gather's, so a peer on either path
    receives the right blocks."""
    gen = torch.Generator().manual_seed(3)
    shape = (2, NUM_BLOCKS, 4, 2, 8)
    src_caches = [torch.randint(-999, 999, shape, generator=gen, dtype=torch.int16) for _ in "abc"]
    dst_caches = [torch.zeros_like(t) for t in src_caches]
    sender, receiver = _mover(src_caches), _mover(dst_caches)
    chunk_bytes = 1 << 20
    wire = Wire()
    limit = {True: 10_000, False: 0}
    monkeypatch.setattr(blocks, "ROW_COPY_MAX_SLICES", limit[rows_on in ("both", "sender")])
    built: list[int] = []
    monkeypatch.setattr(sender, "_index", lambda ids: built.append(len(ids)) or torch.tensor(ids))
    sender.enqueue(FakeComm(wire), True, src, 0.0, chunk_bytes)
    assert built == ([] if rows_on in ("both", "sender") else [len(src)])
    monkeypatch.setattr(blocks, "ROW_COPY_MAX_SLICES", limit[rows_on in ("both", "receiver")])
    receiver.enqueue(FakeComm(wire), False, dst, 0.0, chunk_bytes)
    for s, d in zip(src_caches, dst_caches, strict=True):
        assert torch.equal(d[:, dst], s[:, src])
        others = [b for b in range(NUM_BLOCKS) if b not in dst]
        assert not d[:, others].any()


@pytest.mark.parametrize("rows", [True, False], ids=["batched-slices", "per-layer"])
def test_a_pair_warm_up_runs_the_first_small_transfers_copy_on_the_pairs_streams(
    recorded: list[int], monkeypatch: pytest.MonkeyPatch, rows: bool
) -> None:
    """The pair warm-up takes the copy path a 1-block transfer takes (the batched slice copy,
    or the per-layer gather with an index), allocates its staging buffers on the pair's
    stream and hands them to both of its streams, waits for it, and leaves the cache as it
    was: no bytes sent, none written into the cache."""
    gen = torch.Generator().manual_seed(4)
    shape = (2, NUM_BLOCKS, 4, 2, 8)
    caches = [torch.randint(-999, 999, shape, generator=gen, dtype=torch.int16) for _ in "ab"]
    before = [t.clone() for t in caches]
    mover = _mover(caches)
    monkeypatch.setattr(blocks, "ROW_COPY_MAX_SLICES", 10_000 if rows else 0)
    copies: list[tuple[bool, int, bool]] = []
    real_copy = mover._copy
    monkeypatch.setattr(
        mover,
        "_copy",
        lambda is_send, staging, ids, index, chunk: (
            copies.append((is_send, len(ids), index is None))
            or real_copy(is_send, staging, ids, index, chunk)
        ),
    )
    batched: list[int] = []
    real_foreach = torch._foreach_copy_
    monkeypatch.setattr(
        torch,
        "_foreach_copy_",
        lambda into, src: batched.append(len(into)) or real_foreach(into, src),
    )
    comm = FakeComm(Wire())
    mover.warm_pair(comm, 1 << 20, 0.0)
    assert copies == [(True, 1, rows)]  # a 1-block gather, by the path a real one takes
    assert batched == ([2 * 2, 2 * 2] if rows else [])  # 2 layers x K/V slices, both ways
    first = mover.first_message_bytes(1, 1 << 20)
    assert sorted(recorded).count(first) == 4  # two staging buffers, each to both streams
    assert comm.ops == [] and comm.waits == ["pair warm-up"]
    assert comm.stream.waited_on and comm.copy_stream.waited_on == [comm.stream]
    for t, b in zip(caches, before, strict=True):
        assert torch.equal(t, b)
