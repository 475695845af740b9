"""Decode's receive buffer for push mode: one interface, one implementation per transport.

A pushed transfer reserves room for all of its blocks of every layer when it is announced (all
or nothing: a push that does not fit is refused at once and the decode request pulls), fills
while prefill's forward runs, and then waits until the decode request naming it takes it into
the blocks vLLM allocated (`take`), until decode decides to pull instead (`discard`), until its
TTL (`expire`), or until its sender leaves the registry (`drop_sender`). TCP keeps it in host
memory (`transports/tcp/buffer.py`); NCCL on the GPU with a pinned-host spill
(`transports/nccl/push.py`). Every wait is bounded by the caller.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

__all__ = ["ReceiveBuffer"]


class ReceiveBuffer(ABC):
    """Pushed transfers of one decode worker awaiting their decode request."""

    @property
    @abstractmethod
    def capacity_bytes(self) -> int:
        """Bytes the buffer may hold in all (its largest part, when it has several)."""

    @property
    @abstractmethod
    def headroom_bytes(self) -> int:
        """The largest transfer (bytes, all layers) a push could reserve now: the registry
        load report's `recv_buffer_headroom_bytes`."""

    @abstractmethod
    def take(
        self,
        transfer_id: str,
        local_block_ids: Sequence[int],
        deadline: float,
        *,
        sender_id: str = "",
        remote_block_indices: Sequence[int] | None = None,
        wait_s: float = 0.0,
    ) -> int:
        """Copies the pushed blocks at `remote_block_indices` (default: all, in order) of
        `transfer_id`, pushed by instance `sender_id`, into `local_block_ids` of every layer and
        frees their room; waits up to `wait_s` (never past `deadline`, monotonic s) for a push
        still arriving. Returns bytes copied. Raises TransferError (NOT_FOUND: nothing usable
        was pushed — pull instead; INVALID_ARGUMENT: a selection this buffer cannot take)."""

    @abstractmethod
    def discard(self, transfer_id: str, reason: str) -> None:
        """Decode will not use a push of `transfer_id` (it pulled instead, or gave up): free it
        and refuse it if it arrives later."""

    @abstractmethod
    def expire(self) -> int:
        """Frees pushes past their TTL; returns how many. Called on every engine step, so it
        is cheap when nothing is due."""

    @abstractmethod
    def drop_sender(self, sender_id: str) -> int:
        """Frees every push from instance `sender_id` (it left the registry); returns how
        many."""

    @abstractmethod
    def close(self) -> None:
        """Frees everything (connector shutdown)."""
