"""CPU stand-ins for NCCL and CUDA, so that the NCCL engine's control plane runs on CPU.

`Fabric` is an in-process "network": communicators made by one `FakeComms` (per worker) meet
their peer by unique id; a send's bytes go to the peer, whose oldest posted receive takes them
by address (sizes must match exactly, as NCCL's do). A receive returns once its data is in
(the CPU runs what a GPU stream would run after it right away), so a receive nobody matches
shows as a wait that times out; an abort makes the peer's waits fail as a dead NCCL peer
does.
The CUDA calls the block mover makes (streams, events, `record_stream`) become no-ops
(`cpu_cuda`), so gather/scatter run at once in issue order. What stays real: the message plan,
the byte views, the copies, the pair table, the control streams over real gRPC.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from pdplane.connector.transports.nccl.communicator import (
    CommState,
    NcclAbortedError,
    NcclTimeoutError,
    P2pOp,
)


class FakeStream:
    def __init__(self) -> None:
        self.waited_on: list[Any] = []

    def wait_stream(self, other: Any) -> None:
        self.waited_on.append(other)

    def wait_event(self, event: Any) -> None:
        pass


class FakeEvent:
    def record(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return True


@pytest.fixture
def cpu_cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """CUDA stand-ins; yields the sizes of the tensors whose memory was handed to a stream.
    Those tensors are kept alive until the test ends, as a stream keeps its buffers until its
    work is done (a receive posted into a staging buffer completes after `enqueue` returned)."""
    handed: list[int] = []
    kept: list[torch.Tensor] = []

    def record_stream(t: torch.Tensor, stream: Any) -> None:
        handed.append(t.numel())
        kept.append(t)

    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "default_stream", lambda d=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda d=None: FakeStream())
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    yield handed
    kept.clear()


class Fabric:
    """Where the fake communicators of all workers of a test meet."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self._ids = itertools.count(1)
        self.comms: dict[bytes, list[FakeComm]] = {}
        self.sent_bytes = 0

    def new_id(self) -> bytes:
        return next(self._ids).to_bytes(8, "little") * 16  # 128 bytes

    def join(self, comm: FakeComm) -> None:
        with self.cond:
            self.comms.setdefault(comm.uid, []).append(comm)
            self.cond.notify_all()


class FakeComm:
    """One rank of a 2-rank fake communicator (the `NcclCommunicator` surface the engine and
    the block mover use)."""

    def __init__(self, fabric: Fabric, uid: bytes, rank: int, label: str) -> None:
        self.fabric = fabric
        self.uid = uid
        self.rank = rank
        self.label = label
        self.state = CommState.INITIALIZING
        self.lock = threading.Lock()
        self.stream = FakeStream()
        self.copy_stream = FakeStream()
        self.device = 0
        self.posted: list[P2pOp] = []  # receives not matched yet
        self.unclaimed: list[bytes] = []  # sends that arrived before their receive
        self.ops: list[P2pOp] = []
        self.aborted_with: list[P2pOp] = []
        fabric.join(self)

    @property
    def usable(self) -> bool:
        return self.state in (CommState.INITIALIZING, CommState.READY)

    def peer(self) -> FakeComm | None:
        return next((c for c in self.fabric.comms.get(self.uid, []) if c is not self), None)

    def _check(self, what: str) -> None:
        if not self.usable:
            raise NcclAbortedError(f"{self.label}: communicator {self.state.value} ({what})")
        peer = self.peer()
        if peer is not None and not peer.usable and (self.posted or what == "group"):
            self.abort(f"{what}: remote error")
            raise NcclAbortedError(f"{self.label}: {what} failed: peer {peer.state.value}")

    def _wait_for(self, done: Any, deadline: float, what: str) -> None:
        with self.fabric.cond:
            while True:
                self._check(what)
                if done():
                    return
                left = deadline - time.monotonic()
                if left <= 0:
                    self.state = CommState.ABORTED
                    self.fabric.cond.notify_all()
                    raise NcclTimeoutError(f"{self.label}: {what} timed out; communicator aborted")
                self.fabric.cond.wait(min(left, 0.05))

    def wait_ready(self, deadline: float) -> None:
        self._wait_for(lambda: self.peer() is not None, deadline, "init")
        self.state = CommState.READY

    def warm_up(self, deadline: float) -> None:
        pass

    def enqueue(self, ops: list[P2pOp], deadline: float) -> None:
        # A send is delivered at once. A receive completes when its data is there, and the
        # call returns only then: on a GPU the kernels after it (the scatter out of the staging
        # buffer) run after it, here they run as soon as the call returns.
        with self.fabric.cond:
            self._check("group")
            peer = self.peer()
            assert peer is not None, "enqueue before both ranks joined"
            for op in ops:
                self.ops.append(op)
                if op.is_send:
                    self.fabric.sent_bytes += op.nbytes
                    if peer.usable:  # a dead peer's buffers may be gone: nothing lands there
                        peer.unclaimed.append(ctypes.string_at(op.ptr, op.nbytes))
                else:
                    self.posted.append(op)
            self.fabric.cond.notify_all()
        self._wait_for(self._match, deadline, "group")

    def _match(self) -> bool:
        # Caller holds the fabric's condition.
        while self.posted and self.unclaimed:
            recv, data = self.posted.pop(0), self.unclaimed.pop(0)
            assert recv.nbytes == len(data), (
                f"{self.label}: a receive of {recv.nbytes} bytes met a send of {len(data)}"
            )
            ctypes.memmove(recv.ptr, data, recv.nbytes)
        return not self.posted

    def wait(self, deadline: float, what: str = "transfer") -> None:
        self._wait_for(lambda: not self.posted, deadline, what)

    def abort(self, reason: str) -> None:
        with self.fabric.cond:
            if self.state in (CommState.ABORTED, CommState.CLOSED):
                return
            self.state = CommState.ABORTED
            self.aborted_with = list(self.posted)  # receives the abort left unmatched
            self.posted.clear()
            self.fabric.cond.notify_all()

    def close(self) -> None:
        with self.fabric.cond:
            if self.state in (CommState.ABORTED, CommState.CLOSED):
                return
            assert not self.posted, f"{self.label} closed with receives posted"
            self.state = CommState.CLOSED
            self.fabric.cond.notify_all()


class FakeComms:
    """A worker's `CommFactory` on the fabric; `made` lists every communicator it started."""

    def __init__(self, fabric: Fabric) -> None:
        self.fabric = fabric
        self.made: list[FakeComm] = []

    def unique_id(self) -> bytes:
        return self.fabric.new_id()

    def start(self, unique_id: bytes, rank: int, label: str) -> FakeComm:
        if len(unique_id) != 128:
            raise ValueError("unique id must be 128 bytes")
        comm = FakeComm(self.fabric, unique_id, rank, label)
        self.made.append(comm)
        return comm
