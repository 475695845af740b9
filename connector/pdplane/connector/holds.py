"""Prefill side: the KV cache blocks held for remote decodes, keyed by transfer id.

A hold starts when vLLM finishes a prefill request whose `kv_transfer_params` ask for a remote
decode (the request's blocks stay allocated) and ends, exactly once, on the first of:
CompleteTransfer (decode has the KV or gave up), AbortTransfer (gateway cancellation) or the
hold's timeout. The engine learns of the end through `pop_finished()` (vLLM's "finished
sending"), which frees the blocks; a hold being read by a pull is reported only once the read
is over, so blocks are never reused while their bytes are on the wire.

Thread safety: gRPC handler threads pin/release; the engine thread adds holds and pops finished
ids. `pop_finished` is called on every engine step and only takes the lock briefly.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = ["HeldTransfer", "HoldTable", "HoldUnknown"]

log = logging.getLogger(__name__)

_RECENT_LIMIT = 10_000


class HoldUnknown(KeyError):
    """No live hold for the transfer id (never issued, expired, completed or aborted)."""


@dataclass(slots=True)
class HeldTransfer:
    """One held transfer. `block_ids`: prefill block ids in token order."""

    transfer_id: str
    req_id: str
    block_ids: tuple[int, ...]
    deadline: float  # monotonic seconds
    readers: int = 0
    end_reason: str | None = None  # set once the hold is over; reported when readers == 0
    #: decode instances it is meant for or being read by: their leaving ends it
    peers: set[str] = field(default_factory=set)


class HoldTable:
    """Live holds plus the vLLM request ids whose hold ended and are not yet reported."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._holds: dict[str, HeldTransfer] = {}
        self._finished: list[str] = []
        # transfer id -> expiry: ended before the hold arrived (abort raced prefill's reply)
        self._tombstones: dict[str, float] = {}
        # vLLM request ids already held once: a second hold would be a second report (fatal)
        self._seen_reqs: OrderedDict[str, None] = OrderedDict()
        self._next_deadline = float("inf")
        self.ended: dict[str, str] = {}  # transfer id -> reason, last _RECENT_LIMIT (for logs)

    def add(
        self,
        req_id: str,
        transfer_id: str,
        block_ids: Sequence[int],
        timeout_s: float,
        peer_id: str = "",
    ) -> bool:
        """Starts holding `block_ids` for `transfer_id` for at most `timeout_s` seconds, for
        decode instance `peer_id` when it is known (see `release_peer`).

        Returns False (and holds nothing new) if `req_id` was held before or `transfer_id` is
        live. A transfer already completed/aborted before it arrived ends at once."""
        now = self._clock()
        with self._cond:
            if req_id in self._seen_reqs or transfer_id in self._holds:
                return False
            self._seen_reqs[req_id] = None
            if len(self._seen_reqs) > _RECENT_LIMIT:
                self._seen_reqs.popitem(last=False)
            hold = HeldTransfer(transfer_id, req_id, tuple(block_ids), now + timeout_s)
            if peer_id:
                hold.peers.add(peer_id)
            self._holds[transfer_id] = hold
            if self._tombstones.pop(transfer_id, None) is not None:
                self._end(hold, "released before hold started")
            else:
                self._next_deadline = min(self._next_deadline, hold.deadline)
            self._cond.notify_all()
            return True

    def pin(self, transfer_id: str, wait_s: float = 0.0, reader: str = "") -> HeldTransfer:
        """Marks the hold as being read (by decode instance `reader`, if named) and returns
        it; waits up to `wait_s` seconds for a hold that has not arrived yet. Raises
        HoldUnknown. Every pin needs one `unpin`."""
        deadline = self._clock() + wait_s
        with self._cond:
            while True:
                hold = self._holds.get(transfer_id)
                if hold is not None and hold.end_reason is None:
                    hold.readers += 1
                    if reader:
                        hold.peers.add(reader)
                    return hold
                left = deadline - self._clock()
                if hold is not None or transfer_id in self.ended or left <= 0:
                    raise HoldUnknown(transfer_id)
                self._cond.wait(left)

    def unpin(self, hold: HeldTransfer) -> None:
        """Ends a read started by `pin`."""
        with self._cond:
            hold.readers -= 1
            if hold.end_reason is not None and hold.readers == 0:
                self._report(hold)

    def release(
        self, transfer_id: str, reason: str, wait_s: float = 0.0, tombstone_s: float = 0.0
    ) -> bool:
        """Ends the hold now (blocks freed once no pull reads them). A hold not yet arrived is
        waited for up to `wait_s` seconds. Returns False when the transfer is not held; then, if
        `tombstone_s` > 0, a hold arriving within that many seconds ends at once (an abort
        that overtook prefill's own bookkeeping)."""
        deadline = self._clock() + wait_s
        with self._cond:
            while True:
                hold = self._holds.get(transfer_id)
                if hold is not None and hold.end_reason is None:
                    self._end(hold, reason)
                    return True
                left = deadline - self._clock()
                if hold is not None or transfer_id in self.ended or left <= 0:
                    break
                self._cond.wait(left)
            if hold is None and tombstone_s > 0 and transfer_id not in self.ended:
                if len(self._tombstones) >= _RECENT_LIMIT:  # bounded even under a flood
                    del self._tombstones[next(iter(self._tombstones))]
                expiry = self._clock() + tombstone_s
                self._tombstones[transfer_id] = expiry
                self._next_deadline = min(self._next_deadline, expiry)
            return False

    def release_peer(self, peer_id: str, reason: str) -> int:
        """Ends the holds meant for or read by decode instance `peer_id` (it left the
        registry: nobody else pulls them). Returns how many."""
        with self._cond:
            mine = [h for h in self._holds.values() if h.end_reason is None and peer_id in h.peers]
            for hold in mine:
                self._end(hold, reason)
            self._cond.notify_all()
        return len(mine)

    def pop_finished(self) -> set[str]:
        """vLLM request ids whose hold ended since the last call (each id exactly once).
        Also ends holds past their deadline. Cheap when nothing is due."""
        now = self._clock()
        if not self._finished and now < self._next_deadline:
            return set()
        with self._cond:
            if now >= self._next_deadline:
                self._expire(now)
            done, self._finished = self._finished, []
        return set(done)

    def __len__(self) -> int:
        """Number of live holds (including ended ones still being read)."""
        return len(self._holds)

    def _expire(self, now: float) -> None:
        nxt = float("inf")
        for hold in list(self._holds.values()):
            if hold.end_reason is None:
                if hold.deadline <= now:
                    log.warning("transfer %s: not pulled in time; freeing", hold.transfer_id)
                    self._end(hold, "timeout")
                else:
                    nxt = min(nxt, hold.deadline)
        for tid, expiry in list(self._tombstones.items()):
            if expiry <= now:
                del self._tombstones[tid]
            else:
                nxt = min(nxt, expiry)
        self._next_deadline = nxt

    def _end(self, hold: HeldTransfer, reason: str) -> None:
        hold.end_reason = reason
        self.ended[hold.transfer_id] = reason
        if len(self.ended) > _RECENT_LIMIT:
            del self.ended[next(iter(self.ended))]
        if hold.readers == 0:
            self._report(hold)

    def _report(self, hold: HeldTransfer) -> None:
        if self._holds.pop(hold.transfer_id, None) is not None:
            self._finished.append(hold.req_id)
