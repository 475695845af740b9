"""The simulated engine's scheduler state: running slots, a FIFO wait queue and KV blocks.

Everything here runs on one asyncio loop (no locks). Admission is first come, first served
like vLLM's default scheduler: a request waits while `max_running` requests are computing or
the KV cache lacks the blocks it needs, and nothing overtakes the head of the queue.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from dataclasses import dataclass

__all__ = ["Admission", "EngineState"]


@dataclass(slots=True)
class Admission:
    """A running slot plus the KV cache block ids granted to one request."""

    block_ids: list[int]


class EngineState:
    """Running/waiting counters and the paged KV cache of one simulated instance."""

    def __init__(self, *, max_running: int, kv_blocks: int, block_size: int) -> None:
        self.max_running = max_running
        self.total_blocks = kv_blocks
        self.block_size = block_size
        self.running = 0
        #: requests admitted but still waiting for remote KV (vLLM: WAITING_FOR_REMOTE_KVS).
        self.pulling = 0
        #: transfers this instance holds for a remote decode (prefill side).
        self.held_transfers = 0
        self._free: deque[int] = deque(range(kv_blocks))
        self._queue: deque[tuple[int, asyncio.Future[Admission]]] = deque()

    # --- load -------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        """Requests being computed (vllm:num_requests_running)."""
        return self.running - self.pulling

    @property
    def num_waiting(self) -> int:
        """Queued requests plus those waiting for remote KV (vllm:num_requests_waiting)."""
        return len(self._queue) + self.pulling

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV cache blocks in use, 0..1 (vllm:kv_cache_usage_perc)."""
        return 1.0 - len(self._free) / self.total_blocks

    def blocks_for(self, tokens: int) -> int:
        """Blocks needed to hold `tokens` tokens, capped at the cache size."""
        return min(self.total_blocks, max(1, math.ceil(tokens / self.block_size)))

    # --- admission --------------------------------------------------------------------
    def _fits(self, need: int) -> bool:
        return self.running < self.max_running and len(self._free) >= need

    def _grant(self, need: int) -> Admission:
        self.running += 1
        return Admission([self._free.popleft() for _ in range(need)])

    async def admit(self, need: int) -> Admission:
        """Waits (FIFO) for a running slot and `need` KV blocks; cancellable while waiting."""
        if not self._queue and self._fits(need):
            return self._grant(need)
        fut: asyncio.Future[Admission] = asyncio.get_running_loop().create_future()
        entry = (need, fut)
        self._queue.append(entry)
        try:
            return await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                # Granted in the same tick as the cancellation: give it back.
                self.finish(fut.result(), keep=0)
            else:
                self._queue.remove(entry)
                self._pump()
            raise

    def finish(self, admission: Admission, keep: int = 0) -> list[int]:
        """Ends a request: frees its slot and all but its first `keep` blocks (returned)."""
        self.running -= 1
        kept = admission.block_ids[:keep]
        self._free.extend(admission.block_ids[keep:])
        self._pump()
        return kept

    def free(self, block_ids: list[int]) -> None:
        """Returns blocks held beyond a request's life (a finished transfer) to the pool."""
        self._free.extend(block_ids)
        self._pump()

    def _pump(self) -> None:
        while self._queue and self._fits(self._queue[0][0]):
            need, fut = self._queue.popleft()
            if not fut.cancelled():
                fut.set_result(self._grant(need))
