"""A worker's communicators with its peers: one `Pair` per (peer instance, TP rank, purpose), at
most `max_peer_communicators` of them, the least recently used idle one evicted first.

A pair is a 2-rank NCCL communicator plus the control stream it was created over
(`NcclKvTransfer.Pair`, see control.py): the stream carries every transfer's control, and its
end is the communicator's end on both sides. `users` counts the transfers using a pair (or
waiting for its lock); a pair in use is never evicted, so the cap may be passed for a moment
when every pair is busy (then the next release evicts). Closing a pair is the engine's job
(`on_retire`); this table only decides which and counts (`counters`).
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from pdplane.connector.transports.nccl.errors import NcclTransferError

if TYPE_CHECKING:
    from pdplane.v1 import kv_transfer_nccl_pb2

__all__ = ["COUNTERS", "Link", "Pair", "PairKey", "PairTable", "Purpose"]

#: what `PairTable.counters` counts (cumulative): pairs created, evicted to respect the cap,
#: dropped because their peer left, failed (stream broken, transfer failed), closed otherwise
COUNTERS = ("created", "evicted", "dropped", "failed", "closed")


class Purpose(enum.IntEnum):
    """Values of `pdplane.v1.NcclPurpose`."""

    PULL = 1  # decode calls, receives; prefill serves, sends
    PUSH = 2  # prefill calls, sends; decode serves, receives


@dataclass(frozen=True, slots=True)
class PairKey:
    """Names a pair on one worker: the peer's instance id, the TP rank, the purpose."""

    peer_id: str
    tp_rank: int
    purpose: Purpose

    def __str__(self) -> str:
        return f"{self.peer_id}#{self.tp_rank}/{self.purpose.name.lower()}"


class Link(Protocol):
    """One end of a pair's control stream (control.py)."""

    alive: bool

    def send(self, message: kv_transfer_nccl_pb2.NcclControl) -> None: ...

    def close(self, reason: str) -> None: ...

    def cancel(self, reason: str) -> None: ...


class _Waiter:
    """The answer to one request on a pair's stream (a verdict or a push_ready)."""

    __slots__ = ("_event", "error", "message")

    def __init__(self) -> None:
        self._event = threading.Event()
        self.message: Any = None
        self.error = ""

    def set(self, message: Any = None, error: str = "") -> None:
        self.message, self.error = message, error
        self._event.set()

    def wait(self, deadline: float, what: str) -> Any:
        """The answer; raises NcclTransferError (DEADLINE_EXCEEDED, or UNAVAILABLE when the
        stream ended first)."""
        if not self._event.wait(max(deadline - time.monotonic(), 0.0)):
            raise NcclTransferError(f"no {what} in time", grpc.StatusCode.DEADLINE_EXCEEDED)
        if self.error:
            raise NcclTransferError(f"no {what}: {self.error}", grpc.StatusCode.UNAVAILABLE)
        return self.message


class Pair:
    """One communicator with one peer worker and its control stream.

    `caller`: this side opened the stream (rank 0). `lock` (the communicator's) is held for a
    whole transfer: NCCL matches point-to-point operations in issue order."""

    def __init__(self, key: PairKey, comm: Any, caller: bool) -> None:
        self.key = key
        self.comm = comm
        self.caller = caller
        self.link: Link | None = None
        self.users = 0  # guarded by the table's lock
        self.last_used = time.monotonic()
        self.closing = ""  # why, once it is being closed: no new transfer takes it
        self.close_pending = False  # closing, waiting for its last user
        self.ready = _Waiter()  # caller: the server's `ready`
        self._seq = itertools.count(1)
        self._waiters: dict[int, _Waiter] = {}
        self._lock = threading.Lock()

    @property
    def lock(self) -> threading.Lock:
        return self.comm.lock  # type: ignore[no-any-return]

    @property
    def usable(self) -> bool:
        link = self.link
        return bool(self.comm.usable and not self.closing and link is not None and link.alive)

    def expect(self) -> tuple[int, _Waiter]:
        """A new request number and the waiter its answer will be handed to."""
        waiter = _Waiter()
        with self._lock:
            seq = next(self._seq)
            self._waiters[seq] = waiter
        return seq, waiter

    def answer(self, seq: int, message: Any) -> bool:
        """Hands the answer to request `seq` over (the stream's reader thread)."""
        with self._lock:
            waiter = self._waiters.pop(seq, None)
        if waiter is not None:
            waiter.set(message)
        return waiter is not None

    def fail_waiters(self, reason: str) -> None:
        """The stream ended: every pending request (and `ready`) gets `reason`."""
        with self._lock:
            waiters, self._waiters = list(self._waiters.values()), {}
        for waiter in [*waiters, self.ready]:
            if not waiter._event.is_set():
                waiter.set(error=reason)

    def __repr__(self) -> str:
        side = "caller" if self.caller else "server"
        return f"Pair({self.key}, {side}, users={self.users}, {self.comm.state.value})"


class PairTable:
    """The pairs of one worker, in least-recently-used order.

    Args:
        cap: at most this many pairs (`max_peer_communicators`); idle ones beyond it are
            evicted, least recently used first.
        on_retire: closes a pair taken out of the table, `(pair, reason, graceful)`; called
            outside the table's lock.
    """

    def __init__(self, cap: int, on_retire: Callable[[Pair, str, bool], None]) -> None:
        if cap < 1:
            raise ValueError("max_peer_communicators must be >= 1")
        self.cap = cap
        self._on_retire = on_retire
        self._pairs: OrderedDict[PairKey, Pair] = OrderedDict()
        self._lock = threading.Lock()
        self.counters = dict.fromkeys(COUNTERS, 0)
        #: the last pairs taken out: (key, how), newest last (for tests and logs)
        self.retired: deque[tuple[str, str]] = deque(maxlen=256)

    def __len__(self) -> int:
        return len(self._pairs)

    def get(self, key: PairKey) -> Pair | None:
        """The usable pair for `key`, if any (not acquired)."""
        with self._lock:
            pair = self._pairs.get(key)
        return pair if pair is not None and pair.usable else None

    def acquire(self, key: PairKey) -> Pair | None:
        """The usable pair for `key`, counted as in use until `release`; None when none."""
        with self._lock:
            pair = self._pairs.get(key)
            if pair is None or not pair.usable:
                return None
            pair.users += 1
            self._pairs.move_to_end(key)
            return pair

    def hold(self, pair: Pair) -> None:
        """Counts `pair` as in use (a server-side request, receives still posted)."""
        with self._lock:
            pair.users += 1

    def release(self, pair: Pair) -> None:
        """Ends one use. A pair asked to close while in use closes now if it was the last;
        a cap passed while every pair was busy is restored."""
        with self._lock:
            pair.users -= 1
            pair.last_used = time.monotonic()
            close_now = pair.close_pending and pair.users == 0
            if close_now:
                pair.close_pending = False
            victims = self._over_cap_locked()
        if close_now:
            self._on_retire(pair, pair.closing, True)
        self._retire(victims)

    def close_when_idle(self, pair: Pair, reason: str, how: str) -> bool:
        """Takes `pair` out (counted as `how`) and marks it closing: no transfer takes it any
        more. True when it is idle, so the caller closes it now; else the last `release`
        closes it. False as well when it was closing already."""
        with self._lock:
            if pair.closing:
                return False
            pair.closing = reason
            if self._pairs.get(pair.key) is pair:
                self._take_locked(pair, how)
            if pair.users == 0:
                return True
            pair.close_pending = True
            return False

    def make_room(self, evict: bool = True) -> bool:
        """Before adding one: evicts idle pairs (least recently used first) until one more
        fits. Returns False when the table is full and `evict` is False or nothing is idle
        (the caller may still add: the cap is passed until a pair is released)."""
        with self._lock:
            if len(self._pairs) < self.cap:
                return True
            if not evict:
                return False
            victims = self._idle_locked(len(self._pairs) - self.cap + 1)
            for pair in victims:
                self._take_locked(pair, "evicted")
        self._retire(victims)
        return len(victims) > 0

    def add(self, pair: Pair) -> None:
        """Adds a new pair (most recently used); an older one with the same key is closed."""
        with self._lock:
            old = self._pairs.pop(pair.key, None)
            if old is not None:
                self.retired.append((str(old.key), "replaced"))
                self.counters["closed"] += 1
            self._pairs[pair.key] = pair
            self.counters["created"] += 1
        if old is not None:
            self._on_retire(old, "replaced by a new communicator", False)

    def remove(self, pair: Pair, how: str) -> bool:
        """Takes `pair` out (`how` names the counter); False when it was not in the table."""
        with self._lock:
            if self._pairs.get(pair.key) is not pair:
                return False
            self._take_locked(pair, how)
            return True

    def by_peer(self, peer_id: str) -> list[Pair]:
        """Every pair with instance `peer_id` (any rank, purpose, side)."""
        with self._lock:
            return [p for k, p in self._pairs.items() if k.peer_id == peer_id]

    def all(self) -> list[Pair]:
        with self._lock:
            return list(self._pairs.values())

    def states(self) -> dict[str, str]:
        """{"peer#rank/purpose": communicator state} of the pairs in the table."""
        with self._lock:
            return {str(k): p.comm.state.value for k, p in self._pairs.items()}

    # -- inside the lock ------------------------------------------------------------------------

    def _take_locked(self, pair: Pair, how: str) -> None:
        del self._pairs[pair.key]
        if how:
            self.counters[how] += 1
        self.retired.append((str(pair.key), how or "closed"))

    def _idle_locked(self, n: int) -> list[Pair]:
        victims = [p for p in self._pairs.values() if p.users == 0][:n]
        return victims

    def _over_cap_locked(self) -> list[Pair]:
        excess = len(self._pairs) - self.cap
        if excess <= 0:
            return []
        victims = self._idle_locked(excess)
        for pair in victims:
            self._take_locked(pair, "evicted")
        return victims

    def _retire(self, victims: list[Pair]) -> None:
        for pair in victims:
            self._on_retire(pair, "idle, evicted for max_peer_communicators", True)
