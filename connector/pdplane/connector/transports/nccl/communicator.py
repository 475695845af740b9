"""A 2-rank NCCL communicator whose every wait is bounded.

The communicator is created non-blocking (`ncclConfig_t.blocking = 0`), so neither its
initialisation nor a group of sends/receives can block the calling thread inside NCCL: the
thread polls `ncclCommGetAsyncError` (and a CUDA event for the kernels) until done or until the
deadline, and on a deadline or an error calls `ncclCommAbort`, which also stops kernels stuck
waiting for a dead peer. An aborted communicator is never used again.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from pdplane.connector.transports.nccl.binding import (
    NCCL_IN_PROGRESS,
    NCCL_SUCCESS,
    NcclError,
    NcclLibrary,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "CommFactory",
    "CommState",
    "NcclAbortedError",
    "NcclComms",
    "NcclCommunicator",
    "NcclTimeoutError",
    "P2pOp",
]

logger = logging.getLogger(__name__)


class NcclTimeoutError(TimeoutError):
    """A bounded wait on a communicator ran out; the communicator was aborted."""


class NcclAbortedError(RuntimeError):
    """The communicator failed (async error) or was aborted; it cannot be used any more."""


class CommState(enum.Enum):
    INITIALIZING = "initializing"
    READY = "ready"
    ABORTED = "aborted"
    CLOSED = "closed"


@dataclass(frozen=True, slots=True)
class P2pOp:
    """One point-to-point operation of a group: send (`is_send`) or receive `nbytes` raw bytes
    at device address `ptr` to/from the other rank."""

    is_send: bool
    ptr: int
    nbytes: int


#: bound on each of the two waits of an abort (NCCL's own call, then the stream's kernels) (s)
ABORT_WAIT_S = 2.0


#: bytes each rank sends the other in `warm_up`: NCCL connects a pair's channels lazily, and a
#: message this large uses all of them, so the first transfer finds them connected
WARMUP_BYTES = 8 << 20
#: how long a wait spins (yielding the GIL each turn) before it sleeps between polls (s): a
#: control-plane round trip costs about this much, so a short transfer is seen done at once
_SPIN_S = 0.005


def _sleep_backoff(started: float) -> None:
    # Spin first (transfers often finish within a few milliseconds), then yield the CPU.
    elapsed = time.monotonic() - started
    time.sleep(0 if elapsed < _SPIN_S else 0.0001 if elapsed < 0.05 else 0.001)


class NcclCommunicator:
    """One rank of a 2-rank communicator on one CUDA device, with its own CUDA stream.

    Not thread-safe by design: the owner serialises use (NCCL requires both ranks to issue
    point-to-point operations in the same order), see `lock`.
    """

    def __init__(self, lib: NcclLibrary, handle: int, rank: int, device: int, label: str) -> None:
        import torch

        self._lib = lib
        self._handle = handle
        self.rank = rank
        self.peer = 1 - rank
        self.device = device
        self.label = label
        self.state = CommState.INITIALIZING
        self.lock = threading.Lock()  #: held by the owner for one whole transfer
        self.created_at = time.monotonic()
        self.abort_wait_s = ABORT_WAIT_S
        # Every libnccl call on the handle holds this: an abort from another thread (peer
        # gone, eviction) then never frees the communicator under a call in progress.
        self._handle_lock = threading.Lock()
        with torch.cuda.device(device):
            self.stream: torch.cuda.Stream = torch.cuda.Stream(device=device)
            #: the gather path's copies (blocks.py), overlapping this stream's NCCL operations
            self.copy_stream: torch.cuda.Stream = torch.cuda.Stream(device=device)
        self._state_lock = threading.Lock()

    @classmethod
    def start(
        cls, unique_id: bytes, rank: int, device: int, label: str, lib: NcclLibrary | None = None
    ) -> NcclCommunicator:
        """Starts a non-blocking ncclCommInitRankConfig for `rank` (0 or 1) of a 2-rank
        communicator named by `unique_id` (128 bytes) on CUDA `device`; returns at once.

        Call `wait_ready` before use. Raises ValueError (bad rank/id), NcclError."""
        import torch

        if rank not in (0, 1):
            raise ValueError(f"rank must be 0 or 1, got {rank}")
        lib = lib or NcclLibrary.get()
        with torch.cuda.device(device):
            handle = lib.comm_init_rank_nonblocking(2, unique_id, rank)
        return cls(lib, handle, rank, device, label)

    @property
    def usable(self) -> bool:
        return self.state in (CommState.INITIALIZING, CommState.READY)

    def _async_error(self, what: str) -> int:
        """ncclCommGetAsyncError, unless the communicator is (being) aborted: then raises
        NcclAbortedError. Never waits long for a concurrent abort."""
        if not self._handle_lock.acquire(timeout=0.1):
            raise NcclAbortedError(f"{self.label}: communicator busy aborting ({what})")
        try:
            if not self.usable:
                raise NcclAbortedError(f"{self.label}: communicator {self.state.value} ({what})")
            return self._lib.comm_async_error(self._handle)
        finally:
            self._handle_lock.release()

    def _poll_async(self, deadline: float, what: str) -> None:
        started = time.monotonic()
        while True:
            result = self._async_error(what)
            if result == NCCL_SUCCESS:
                return
            if result != NCCL_IN_PROGRESS:
                with self._handle_lock:
                    detail = self._lib.last_error(self._handle) if self.usable else ""
                self.abort(f"{what}: {NcclError('NCCL', result, detail)}")
                raise NcclAbortedError(f"{self.label}: {what} failed: {NcclError('NCCL', result)}")
            if time.monotonic() >= deadline:
                self.abort(f"{what}: timed out")
                raise NcclTimeoutError(f"{self.label}: {what} timed out; communicator aborted")
            _sleep_backoff(started)

    def wait_ready(self, deadline: float) -> None:
        """Waits until initialisation completed, at most until `deadline` (time.monotonic()).

        Raises NcclTimeoutError / NcclAbortedError (communicator aborted in both cases)."""
        if self.state is CommState.READY:
            return
        self._poll_async(deadline, "init")
        self.state = CommState.READY
        logger.info("NCCL communicator %s ready (rank %d)", self.label, self.rank)

    def enqueue(self, ops: Sequence[P2pOp], deadline: float) -> None:
        """Issues `ops` as one NCCL group on this communicator's stream (kernels enqueued,
        not finished). Raises NcclTimeoutError / NcclAbortedError / NcclError."""
        if not ops:
            return
        if self.state is not CommState.READY:
            raise NcclAbortedError(f"{self.label}: communicator {self.state.value}")
        stream = int(self.stream.cuda_stream)
        lib = self._lib
        with self._handle_lock:
            if self.state is not CommState.READY:
                raise NcclAbortedError(f"{self.label}: communicator {self.state.value}")
            lib.group_start()
            try:
                for op in ops:
                    if op.is_send:
                        lib.send(op.ptr, op.nbytes, self.peer, self._handle, stream)
                    else:
                        lib.recv(op.ptr, op.nbytes, self.peer, self._handle, stream)
            finally:
                result = lib.group_end()
        if result == NCCL_IN_PROGRESS:
            self._poll_async(deadline, "group")

    def wait(self, deadline: float, what: str = "transfer") -> None:
        """Waits until all work enqueued on the stream so far finished, at most until
        `deadline`; polls NCCL's async error meanwhile (a dead peer surfaces there).

        Raises NcclTimeoutError / NcclAbortedError after aborting the communicator."""
        import torch

        event = torch.cuda.Event()
        event.record(self.stream)
        started = time.monotonic()
        while not event.query():
            result = self._async_error(what)
            if result not in (NCCL_SUCCESS, NCCL_IN_PROGRESS):
                self.abort(f"{what}: async error {result}")
                raise NcclAbortedError(f"{self.label}: {what} failed: {NcclError('NCCL', result)}")
            if time.monotonic() >= deadline:
                self.abort(f"{what}: timed out")
                raise NcclTimeoutError(f"{self.label}: {what} timed out; communicator aborted")
            _sleep_backoff(started)

    def _drain(self, timeout_s: float) -> bool:
        # After ncclCommAbort the stuck kernels exit; wait (bounded) for them so that no buffer
        # the stream still uses is handed back to the caching allocator.
        import torch

        event = torch.cuda.Event()
        event.record(self.stream)
        deadline = time.monotonic() + timeout_s
        started = time.monotonic()
        while not event.query():
            if time.monotonic() >= deadline:
                return False
            _sleep_backoff(started)
        return True

    def abort(self, reason: str) -> None:
        """ncclCommAbort (idempotent, never raises, bounded): stops in-flight kernels and frees
        the communicator. Waits at most `abort_wait_s` for NCCL and again for the kernels on
        the stream to stop; past that it logs an error and returns (the call is left running
        on a daemon thread), so a misbehaving peer can never hang the caller."""
        with self._state_lock:
            if self.state in (CommState.ABORTED, CommState.CLOSED):
                return
            self.state = CommState.ABORTED
        logger.warning("aborting NCCL communicator %s: %s", self.label, reason)
        t0 = time.monotonic()
        done = threading.Event()

        def run() -> None:
            with self._handle_lock:
                self._lib.comm_abort(self._handle)
            done.set()

        threading.Thread(target=run, name=f"nccl-abort-{self.label}", daemon=True).start()
        if not done.wait(self.abort_wait_s):
            logger.error(
                "ncclCommAbort of %s still running after %.1f s", self.label, self.abort_wait_s
            )
        elif not self._drain(self.abort_wait_s):
            logger.error(
                "kernels of %s still running %.1f s after ncclCommAbort",
                self.label,
                self.abort_wait_s,
            )
        else:
            logger.info("NCCL communicator %s aborted in %.3f s", self.label, time.monotonic() - t0)

    def close(self) -> None:
        """Releases the communicator. Work already finished, so ncclCommAbort is safe and,
        unlike ncclCommFinalize, never waits for the peer (who may be gone)."""
        with self._state_lock:
            if self.state in (CommState.ABORTED, CommState.CLOSED):
                return
            self.state = CommState.CLOSED
        with self._handle_lock:
            self._lib.comm_abort(self._handle)

    def warm_up(self, deadline: float) -> None:
        """Exchanges `WARMUP_BYTES` each way, so that NCCL's lazily built connections exist
        before the first transfer (both ranks call it). Raises as `wait`."""
        import torch

        buf = torch.zeros(2 * WARMUP_BYTES, dtype=torch.uint8, device=f"cuda:{self.device}")
        ptr = buf.data_ptr()
        self.enqueue(
            [P2pOp(True, ptr, WARMUP_BYTES), P2pOp(False, ptr + WARMUP_BYTES, WARMUP_BYTES)],
            deadline,
        )
        self.wait(deadline, "warm-up")

    def __repr__(self) -> str:
        return f"NcclCommunicator({self.label!r}, rank={self.rank}, {self.state.value})"


class CommFactory(Protocol):
    """Makes the communicators of one worker (`NcclComms`; tests pass a stand-in)."""

    def unique_id(self) -> bytes:
        """A new ncclUniqueId (128 bytes) for a communicator this side creates as rank 0."""
        ...

    def start(self, unique_id: bytes, rank: int, label: str) -> Any:
        """Starts rank `rank` of the 2-rank communicator `unique_id` without blocking (see
        `NcclCommunicator.start`). Raises ValueError, NcclError."""
        ...


class NcclComms:
    """`CommFactory` of real NCCL communicators on CUDA `device`."""

    def __init__(self, device: int, lib: NcclLibrary | None = None) -> None:
        self.device = device
        self._lib = lib

    def _library(self) -> NcclLibrary:
        if self._lib is None:
            self._lib = NcclLibrary.get()
        return self._lib

    def unique_id(self) -> bytes:
        return self._library().get_unique_id()

    def start(self, unique_id: bytes, rank: int, label: str) -> NcclCommunicator:
        return NcclCommunicator.start(unique_id, rank, self.device, label, self._library())
