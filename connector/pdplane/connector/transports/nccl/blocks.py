"""Moving requested KV blocks between a paged KV cache and NCCL messages, on the GPU.

A layer's KV cache tensor comes from vLLM in its attention backend's layout (FlashAttention:
`[2, num_blocks, block_size, num_kv_heads, head_size]`; others put the block axis first or
permute the physical order with strides). `layer_byte_view` turns any of them into the same
*physical* byte view `[outer, num_blocks, inner_bytes]`, so one block of one layer is `outer`
slices of `inner_bytes` contiguous bytes (FlashAttention: outer = 2, K and V). Two instances
with the same backend and fingerprint have identical views, which is all a byte copy needs.

`BlockMover` enqueues, on a communicator's stream, the gather/scatter kernels and NCCL
operations of one transfer following a `plan` (see chunk_plan.py); the caller waits with
`NcclCommunicator.wait`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from pdplane.connector.transports.nccl.chunk_plan import Chunk, plan_chunks
from pdplane.connector.transports.nccl.communicator import NcclCommunicator, P2pOp

if TYPE_CHECKING:
    import torch

#: a single-chunk transfer of at most this many block slices (layers x outer x blocks) is
#: copied slice by slice with one batched `_foreach_copy_` instead of a gather kernel per
#: layer: no index upload, one launch. Measured on an H200 (docs/nccl.md, state E), 32
#: layers x K/V: 1 block (64 slices) 0.39 ms of launching against 0.57 ms per layer; 2 blocks
#: 0.78 against 0.58 ms (Python builds one view per slice), hence 64.
ROW_COPY_MAX_SLICES = 64

__all__ = ["BlockMover", "layer_byte_view", "physical_order"]


def physical_order(shape: Sequence[int], strides: Sequence[int]) -> list[int]:
    """Dimensions from outermost to innermost in memory (strides descending; size-1 dimensions
    keep their logical place). Pure function, e.g. FlashAttention NHD -> [0, 1, 2, 3, 4]."""
    dims = [d for d in range(len(shape)) if shape[d] != 1]
    ordered = sorted(dims, key=lambda d: -strides[d])
    out: list[int] = []
    it = iter(ordered)
    for d in range(len(shape)):
        out.append(d if shape[d] == 1 else next(it))
    return out


def layer_byte_view(tensor: torch.Tensor, block_dim: int) -> torch.Tensor:
    """The physical byte view `[outer, num_blocks, inner_bytes]` (uint8) of a KV cache tensor
    whose block axis is `block_dim`. Shares memory with `tensor`.

    Raises ValueError when the tensor's memory is not dense (gaps between elements)."""
    import torch

    perm = physical_order(tensor.shape, tensor.stride())
    dense = tensor.permute(perm)
    if not dense.is_contiguous():
        raise ValueError(f"KV cache tensor {tuple(tensor.shape)} is not dense in memory")
    pos = perm.index(block_dim)
    num_blocks = int(tensor.shape[block_dim])
    outer = 1
    for d in dense.shape[:pos]:
        outer *= int(d)
    raw = dense.reshape(-1).view(torch.uint8)
    return raw.view(outer, num_blocks, raw.numel() // (outer * num_blocks))


def _widest(view: torch.Tensor) -> torch.Tensor:
    """`view` (uint8 `[outer, num_blocks, inner]`) reinterpreted as int64, int32 or int16
    `[outer, num_blocks, inner / width]`, the widest that divides `inner` and the address."""
    import torch

    for dtype, width in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if view.shape[2] % width == 0 and view.data_ptr() % width == 0:
            return view.view(dtype)
    return view


class BlockMover:
    """Enqueues the GPU copies and NCCL operations of transfers for one worker's KV cache.

    `views` are the layers' byte views (`layer_byte_view`), in model order; `device` their
    CUDA device index ("cpu" only in tests with stand-ins for the CUDA calls).
    """

    def __init__(self, views: Sequence[torch.Tensor], device: int | str) -> None:
        if not views:
            raise ValueError("no KV cache layers")
        self.views = list(views)
        self.device = device
        self._torch_device = f"cuda:{device}" if isinstance(device, int) else device
        self._filler: Any = None
        self.num_blocks = int(self.views[0].shape[1])
        self.layer_block_bytes = [int(v.shape[0]) * int(v.shape[2]) for v in self.views]
        self.wide_views = [_widest(v) for v in self.views]
        # `[outer * num_blocks, inner]` per layer: row `o * num_blocks + b` is slice o of block b
        self._rows_of = [v.reshape(-1, v.shape[2]) for v in self.wide_views]

    def transfer_bytes(self, num_blocks: int) -> int:
        """Bytes a transfer of `num_blocks` blocks moves (all layers)."""
        return num_blocks * sum(self.layer_block_bytes)

    def first_message_bytes(self, num_blocks: int, chunk_bytes: int) -> int:
        """Bytes of the first message of a transfer of `num_blocks` blocks
        (what a receiver may post before the sender accepted). Raises ValueError."""
        chunks = plan_chunks(self.layer_block_bytes, num_blocks, chunk_bytes)
        return chunks[0].nbytes if chunks else 0

    def warm_up(self, chunk_bytes: int) -> None:
        """Runs the gather and scatter kernels once on scratch memory (CUDA loads kernels on
        first use) and leaves two staging buffers in the allocator's cache, so that the first
        transfer costs what the later ones do. Writes nothing into the KV cache."""
        import torch

        with torch.cuda.device(self.device):
            index = self._index([0])
            by_dtype = {v.dtype: v for v in [*self.wide_views, *self.views]}
            for view in by_dtype.values():  # the calls `_gather_chunks` makes, on scratch
                gathered = torch.empty_like(view[:, :1])
                torch.index_select(view, 1, index, out=gathered)
                torch.empty_like(view[:, :2]).index_copy_(1, index, gathered)
            rows = torch.empty_like(self._rows_of[0][:2])  # the batched slice copy (`_copy`)
            torch._foreach_copy_([rows[0]], [rows[1]])
            nbytes = min(chunk_bytes, self.transfer_bytes(self.num_blocks))
            staging = [
                torch.empty(nbytes, dtype=torch.uint8, device=self._torch_device) for _ in range(2)
            ]
            torch.cuda.synchronize(self.device)
            del staging

    def warm_pair(self, comm: NcclCommunicator, chunk_bytes: int, deadline: float) -> None:
        """Runs the local half of a pair's first small transfer on scratch, on the calling
        thread: a 1-block gather transfer's staging buffer allocated on the pair's stream, the
        copy path that transfer takes (`_by_rows`: one batched `_foreach_copy_`; else the
        per-layer kernels with an index) launched on the pair's copy stream between the same
        events, and the index of a few-block transfer. Called on the thread that will serve
        the pair's requests (its server-side reader): a first pull there otherwise pays that
        thread's first CUDA calls on these streams, ~1.3 ms on one H200 (warming on another
        thread did not help: docs/nccl.md). Leaves at most one 20 MiB allocator segment per
        pair cached, which the first real pull would cache anyway. Reads block 0 of the cache,
        writes nothing into it; the caller holds `comm.lock`. Raises as `comm.wait`."""
        import torch

        chunk = plan_chunks(self.layer_block_bytes, 1, chunk_bytes)[0]
        with torch.cuda.device(self.device), torch.cuda.stream(comm.stream):
            index = self._index([0, min(1, self.num_blocks - 1)])  # a few-block transfer's
            comm.stream.wait_stream(torch.cuda.default_stream(self.device))
            copies = comm.copy_stream
            copies.wait_stream(comm.stream)
            device = self._torch_device
            sent, received = (
                torch.empty(chunk.nbytes, dtype=torch.uint8, device=device) for _ in range(2)
            )
            ready = torch.cuda.Event()
            ready.record(comm.stream)
            with torch.cuda.stream(copies):
                copies.wait_event(ready)
                rows = self._by_rows([chunk], 1)
                self._copy(True, sent, [0], None if rows else index[:1], chunk)  # a gather
                if rows:  # the receiver's batched copy, into scratch instead of the cache
                    n = len(self.views) * int(self.wide_views[0].shape[0])
                    dtype = self.wide_views[0].dtype
                    into = received[: chunk.nbytes].view(dtype).view(n, -1).unbind(0)
                    torch._foreach_copy_(
                        into, sent[: chunk.nbytes].view(dtype).view(n, -1).unbind(0)
                    )
                else:
                    received.copy_(sent)
                done = torch.cuda.Event()
                done.record(copies)
            comm.stream.wait_event(done)
            for buf in (sent, received, index):
                buf.record_stream(comm.stream)
                buf.record_stream(copies)
        comm.wait(deadline, "pair warm-up")

    def send_filler(self, comm: NcclCommunicator, nbytes: int, deadline: float) -> None:
        """Sends `nbytes` of meaningless bytes: the message a refused request's receiver
        already posted a receive for. The caller holds `comm.lock`, then `comm.wait`s."""
        import torch

        if self._filler is None or self._filler.numel() < nbytes:
            self._filler = torch.empty(nbytes, dtype=torch.uint8, device=self._torch_device)
        filler = self._filler
        with torch.cuda.device(self.device), torch.cuda.stream(comm.stream):
            comm.enqueue([P2pOp(True, filler.data_ptr(), nbytes)], deadline)
            filler.record_stream(comm.stream)

    def check_ids(self, ids: Sequence[int]) -> None:
        """Raises ValueError unless every id is a block of this cache."""
        bad = [b for b in ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids out of range [0, {self.num_blocks}): {bad[:8]}")

    def _index(self, ids: Sequence[int]) -> torch.Tensor:
        """`ids` as a long tensor on this device, uploaded on the current stream without a
        host synchronisation (pinned host memory, non-blocking copy; the host allocator keeps
        the pinned block until the copy is done). A pageable upload would wait for the GPU,
        and on a GPU shared with the peer's process that wait includes the peer's kernels."""
        import torch

        host = torch.tensor(list(ids), dtype=torch.long)
        if not str(self._torch_device).startswith("cuda"):
            return host.to(self._torch_device)
        return host.pin_memory().to(self._torch_device, non_blocking=True)

    def enqueue(
        self,
        comm: NcclCommunicator,
        is_send: bool,
        ids: Sequence[int],
        deadline: float,
        chunk_bytes: int,
        gate: Callable[[], None] | None = None,
    ) -> int:
        """Enqueues one transfer of blocks `ids` (in request order) on `comm`'s stream, in
        messages of at most `chunk_bytes` (chunk_plan.py): sends when `is_send`, else receives into
        `ids`. Returns the bytes it moves. `gate()` runs once,
        right after the first message's operation is enqueued (a receiver's before its
        scatter; a sender's before the next gather), whatever it raises ends the enqueue;
        not called when `ids` is empty. The caller holds
        `comm.lock` and then calls `comm.wait(deadline)`. Raises ValueError, NcclError,
        NcclTimeoutError, NcclAbortedError, or what `gate` raised."""
        import torch

        self.check_ids(ids)
        if not ids:
            return 0
        with torch.cuda.device(self.device), torch.cuda.stream(comm.stream):
            chunks = plan_chunks(self.layer_block_bytes, len(ids), chunk_bytes)
            # Uploaded first, before the stream waits for the compute stream.
            index = None if self._by_rows(chunks, len(ids)) else self._index(ids)
            # The blocks were written by the compute stream; order our reads/writes after it.
            comm.stream.wait_stream(torch.cuda.default_stream(self.device))
            self._gather_chunks(comm, is_send, ids, index, chunks, deadline, gate)
        return self.transfer_bytes(len(ids))

    def _gather_chunks(
        self,
        comm: NcclCommunicator,
        is_send: bool,
        ids: Sequence[int],
        index: torch.Tensor | None,
        chunks: Sequence[Chunk],
        deadline: float,
        gate: Callable[[], None] | None = None,
    ) -> None:
        # Two staging buffers and a second stream for the gathers/scatters: chunk k+1 is
        # gathered (sender) or chunk k scattered (receiver) while NCCL moves the other buffer,
        # so on NVLink the copies hide behind the wire instead of adding to it. Events order a
        # buffer's reuse after the NCCL operation / scatter that last used it.
        import torch

        copies = comm.copy_stream  # the communicator's own: a slow peer stalls only its pair
        copies.wait_stream(comm.stream)  # after the compute stream and the index upload
        nbuf = min(2, len(chunks))
        size = max(c.nbytes for c in chunks)
        device = self._torch_device
        buffers = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(nbuf)]
        released: list[torch.cuda.Event | None] = [None] * nbuf
        try:
            for k, chunk in enumerate(chunks):
                slot = k % nbuf
                previous = released[slot]
                done = torch.cuda.Event()
                if is_send:
                    with torch.cuda.stream(copies):
                        if previous is not None:
                            copies.wait_event(previous)
                        self._copy(True, buffers[slot], ids, index, chunk)
                        gathered = torch.cuda.Event()
                        gathered.record(copies)
                    comm.stream.wait_event(gathered)
                    comm.enqueue([P2pOp(True, buffers[slot].data_ptr(), chunk.nbytes)], deadline)
                    done.record(comm.stream)
                    if k == 0 and gate is not None:
                        gate()
                else:
                    if previous is not None:
                        comm.stream.wait_event(previous)
                    comm.enqueue([P2pOp(False, buffers[slot].data_ptr(), chunk.nbytes)], deadline)
                    if k == 0 and gate is not None:
                        gate()
                    received = torch.cuda.Event()
                    received.record(comm.stream)
                    with torch.cuda.stream(copies):
                        copies.wait_event(received)
                        self._copy(False, buffers[slot], ids, index, chunk)
                        done.record(copies)
                released[slot] = done
        finally:
            # Also when an enqueue failed half way: `comm.wait` (the caller's) and the drain of
            # an abort then cover the copies already queued, and the memory stays owned by both
            # streams until their kernels are done (no scatter lands after a failed pull).
            comm.stream.wait_stream(copies)
            for buf in (*buffers, *([] if index is None else [index])):
                buf.record_stream(comm.stream)
                buf.record_stream(copies)

    def _by_rows(self, chunks: Sequence[Chunk], n: int) -> bool:
        """Whether a transfer of `n` blocks in `chunks` takes the slice-by-slice copy: one
        chunk of whole layers, all of one shape and width, few slices."""
        if len(chunks) != 1:
            return False
        first = self.wide_views[0]
        if len(self.views) * int(first.shape[0]) * n > ROW_COPY_MAX_SLICES:
            return False
        pieces = chunks[0].pieces
        return len(pieces) == len(self.views) and all(
            p.first == 0
            and p.count == n
            and self.wide_views[p.layer].dtype == first.dtype
            and self.wide_views[p.layer].shape == first.shape
            for p in pieces
        )

    def _copy(
        self,
        is_send: bool,
        staging: torch.Tensor,
        ids: Sequence[int],
        index: torch.Tensor | None,
        chunk: Chunk,
    ) -> None:
        """Enqueues, on the current stream, the copies of `chunk` between the cache and
        `staging` (cache -> staging when `is_send`). The staging layout is the same either way:
        per piece `[outer, blocks, inner]`, so both sides may take different paths."""
        import torch

        if index is None:  # `_by_rows`: one batched launch over the slices, in staging order
            rows = self._rows_of
            nb = self.num_blocks
            outer = range(int(self.wide_views[0].shape[0]))
            cache = [rows[p.layer][o * nb + b] for p in chunk.pieces for o in outer for b in ids]
            inner = int(self.wide_views[0].shape[2])
            dtype = self.wide_views[0].dtype
            flat = staging[: chunk.nbytes].view(dtype).view(len(cache), inner).unbind(0)
            if is_send:
                torch._foreach_copy_(flat, cache)
            else:
                torch._foreach_copy_(cache, flat)
            return
        for view, part, idx in self._parts(staging, index, chunk):
            # one kernel per layer (K and V together): launches are most of a small
            # transfer's cost
            if is_send:
                torch.index_select(view, 1, idx, out=part)
            else:
                view.index_copy_(1, idx, part)

    def _parts(
        self, staging: torch.Tensor, index: torch.Tensor, chunk: Chunk
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
        """(layer view, staging part, index slice) per piece of `chunk`; views and parts are
        `[outer, blocks, inner]` in the widest integer type that divides a block's bytes, so
        the copy kernels move 8 bytes per element rather than 1."""
        uniform = self._uniform_parts(staging, index, chunk)
        if uniform is not None:
            return uniform
        parts = []
        offset = 0
        for piece in chunk.pieces:
            view = self.wide_views[piece.layer]
            if offset % view.element_size():  # layers of mixed widths: stay on bytes
                view = self.views[piece.layer]
            nbytes = piece.count * self.layer_block_bytes[piece.layer]
            part = (
                staging[offset : offset + nbytes]
                .view(view.dtype)
                .view(view.shape[0], piece.count, view.shape[2])
            )
            parts.append((view, part, index[piece.first : piece.first + piece.count]))
            offset += nbytes
        return parts

    def _uniform_parts(
        self, staging: torch.Tensor, index: torch.Tensor, chunk: Chunk
    ) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None:
        """`_parts` in a few tensor operations for the usual chunk: whole layers (every
        requested block of each), all of one shape and width. None for any other chunk."""
        pieces = chunk.pieces
        n = int(index.shape[0])
        first = self.wide_views[pieces[0].layer]
        shape, dtype = tuple(first.shape), first.dtype
        for piece in pieces:
            view = self.wide_views[piece.layer]
            if piece.first or piece.count != n or view.dtype != dtype or view.shape != shape:
                return None
        stacked = staging[: chunk.nbytes].view(dtype).view(len(pieces), shape[0], n, shape[2])
        return [(self.wide_views[p.layer], stacked[i], index) for i, p in enumerate(pieces)]
