"""The scheduler's own in-flight assignments, so that load between two heartbeats is visible.

An instance's effective load is its last load report plus the assignments the scheduler made
since that report and that are not released yet. A report is identified by the candidate's
`epoch` (its lease and registry revision): when a newer report arrives, earlier assignments
are assumed to be counted in it, and the pending counters start again from zero. The registry
publishes a report only when the load changed, so an unchanged report keeps counting the
assignments made since it (conservative: they are released or expire).

Assignments that are never released (a gateway that died) expire after `timeout_s`, so nothing
grows without bound. Thread-safe: the gRPC loop and the metrics scrape thread both read it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from pdplane.scheduler.candidate import Candidate

__all__ = ["Assignment", "InflightTracker"]


@dataclass(frozen=True, slots=True)
class Assignment:
    """One scheduled request: its pair, the epochs it was counted in, its decode KV blocks."""

    request_id: str
    prefill_id: str
    prefill_epoch: int
    decode_id: str
    decode_epoch: int
    decode_blocks: int
    started_at: float  # clock seconds


@dataclass(slots=True)
class _Pending:
    epoch: int
    requests: int = 0
    blocks: int = 0


class InflightTracker:
    """Counts unreleased assignments per instance, in total and since the latest load report.

    `timeout_s` (seconds) bounds how long an unreleased assignment is counted.
    """

    def __init__(self, timeout_s: float = 600.0, clock: Callable[[], float] = time.monotonic):
        if timeout_s <= 0:
            raise ValueError(f"in-flight timeout must be > 0 s, got {timeout_s}")
        self._timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        # Insertion order == start order, so expired assignments sit at the front.
        self._requests: OrderedDict[str, Assignment] = OrderedDict()
        self._pending: dict[str, _Pending] = {}
        self._total: dict[str, int] = {}

    def __len__(self) -> int:
        return len(self._requests)

    def pending_requests(self, candidate: Candidate) -> int:
        """Unreleased requests assigned to `candidate` since its current load report."""
        pending = self._pending.get(candidate.instance_id)
        return pending.requests if pending and pending.epoch == candidate.epoch else 0

    def effective_load(self, candidate: Candidate) -> float:
        """The candidate's reported load plus its pending requests (see `Candidate`)."""
        pending = self._pending.get(candidate.instance_id)
        if pending is None or pending.epoch != candidate.epoch:
            return candidate.reported_load
        return candidate.reported_load + pending.requests

    def pending_blocks(self, candidate: Candidate) -> int:
        """KV cache blocks reserved on decode `candidate` since its current load report."""
        pending = self._pending.get(candidate.instance_id)
        return pending.blocks if pending and pending.epoch == candidate.epoch else 0

    def add(
        self, request_id: str, prefill: Candidate, decode: Candidate, decode_blocks: int
    ) -> Assignment | None:
        """Counts a new assignment; returns the one it replaced when the id was in flight."""
        record = Assignment(
            request_id=request_id,
            prefill_id=prefill.instance_id,
            prefill_epoch=prefill.epoch,
            decode_id=decode.instance_id,
            decode_epoch=decode.epoch,
            decode_blocks=decode_blocks,
            started_at=self._clock(),
        )
        with self._lock:
            replaced = self._requests.pop(request_id, None)
            if replaced is not None:
                self._uncount(replaced)
            self._requests[request_id] = record
            self._count(prefill.instance_id, prefill.epoch, 0)
            self._count(decode.instance_id, decode.epoch, decode_blocks)
            self._expire_locked()
        return replaced

    def release(self, request_id: str) -> Assignment | None:
        """Ends an assignment; None when the id is unknown (already released or expired)."""
        with self._lock:
            record = self._requests.pop(request_id, None)
            if record is not None:
                self._uncount(record)
            return record

    def expire(self) -> list[Assignment]:
        """Drops assignments older than the timeout; returns them."""
        with self._lock:
            return self._expire_locked()

    def request_ids(self) -> list[str]:
        """The ids in flight, oldest first."""
        with self._lock:
            return list(self._requests)

    def inflight_by_instance(self) -> dict[str, int]:
        """instance id -> unreleased assignments (either side), for metrics."""
        with self._lock:
            return dict(self._total)

    def _expire_locked(self) -> list[Assignment]:
        deadline = self._clock() - self._timeout_s
        expired = []
        while self._requests:
            record = next(iter(self._requests.values()))
            if record.started_at > deadline:
                break
            del self._requests[record.request_id]
            self._uncount(record)
            expired.append(record)
        return expired

    def _count(self, instance_id: str, epoch: int, blocks: int) -> None:
        self._total[instance_id] = self._total.get(instance_id, 0) + 1
        pending = self._pending.get(instance_id)
        if pending is None or pending.epoch != epoch:
            pending = self._pending[instance_id] = _Pending(epoch)
        pending.requests += 1
        pending.blocks += blocks

    def _uncount(self, record: Assignment) -> None:
        for instance_id, epoch, blocks in (
            (record.prefill_id, record.prefill_epoch, 0),
            (record.decode_id, record.decode_epoch, record.decode_blocks),
        ):
            left = self._total.get(instance_id, 0) - 1
            if left > 0:
                self._total[instance_id] = left
            else:
                self._total.pop(instance_id, None)
            pending = self._pending.get(instance_id)
            if pending is not None and pending.epoch == epoch:
                pending.requests -= 1
                pending.blocks -= blocks
                if pending.requests <= 0:
                    del self._pending[instance_id]
