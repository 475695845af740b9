"""The scheduler's own in-flight assignments, so that load between two heartbeats is visible.

An instance's effective load is its last load report plus the assignments the scheduler made
since that report and that are not released yet. A report is identified by the candidate's
`epoch` (its lease and registry revision): when a newer report arrives, earlier assignments
are assumed to be counted in it, and the pending counters start again from zero (on a decode,
but for the assignments whose prompt is predicted still computing on their prefill: they
cannot be in its report yet, `_new_epoch_locked`). The registry
publishes a report only when the load changed, so an unchanged report keeps counting the
assignments made since it (conservative: they are released or expire).

Assignments that are never released (a gateway that died) expire after `timeout_s`, so nothing
grows without bound. An assignment reserves its instance's load and decode KV blocks only for
`reservation_s` after it was made: a real request shows in the instance's own load report
within a few heartbeats, so one that still does not (its report unchanged) is not taken on
trust any longer (counted in flight until released or expired, but no longer as pending load
or KV room). 512 Schedule calls never released had kept every decode "no KV room" for the
whole 600 s timeout. Thread-safe: the gRPC loop and the metrics scrape thread both read it.

Per decode it also keeps the mean context its unreleased assignments are predicted to attend
over (`decode_context`), which its KV cache usage understates when streams share a prefix.

A prefill's queue is also predicted in time: each assignment with a predicted prefill duration
(`add(..., prefill_s=...)`, kv_aware's latency model) moves the instance's `busy_until` (when
its queued prompts will have been computed) to `max(now, busy_until) + prefill_s`. Load
reports correct it: a report with no request running or waiting brings it down to now, one
with requests it did not predict (a slower engine than the model, or a scheduler it does not
hear from) up to their expected work.

Several replicas deciding over one fleet share their assignments
(`pdplane.scheduler.inflight_exchange`):
a peer's assignment is counted here exactly like an own one made at the moment it arrives (in
the epoch of the report this replica's view holds then), keyed by (peer, request id). Own
changes are told to `listener` so that they can be sent to the peers.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from pdplane.scheduler.candidate import Candidate

__all__ = ["Assignment", "InflightListener", "InflightTracker", "UnseenEstimate"]


@dataclass(frozen=True, slots=True)
class Assignment:
    """One scheduled request: its pair, the epochs it was counted in, its decode KV blocks and
    the uncached prompt tokens sent to its prefill (`prefill_tokens`).

    `prefill_id` is "" when decode computes the prompt itself (no prefill leg).

    `prefill_s`: the predicted time it adds to its prefill's queue (s; 0 = not predicted).
    `decode_context`: the context (tokens) the request is predicted to hold on its decode,
    averaged over its life (its prompt plus half its answer budget; 0 = not known).
    `origin` is "" for this replica's own assignments, else the peer replica's id. `pending`
    False: counted in flight but not as load since the current reports (a peer's assignments
    received in a snapshot, made before an unknown number of reports).
    """

    request_id: str
    prefill_id: str
    prefill_epoch: int
    decode_id: str
    decode_epoch: int
    decode_blocks: int
    started_at: float  # clock seconds
    origin: str = ""
    pending: bool = True
    prefill_tokens: int = 0
    prefill_s: float = 0.0
    decode_context: int = 0


#: Told of own changes, outside the tracker's lock: (assigned, released) assignments.
InflightListener = Callable[[list[Assignment], list[Assignment]], None]


class UnseenEstimate(Protocol):
    """Peers' assignments estimated but not received yet (`pdplane.scheduler.inflight_exchange`)."""

    def count(self, instance_id: str) -> int:
        """Estimated assignments to `instance_id` (>= 0)."""
        ...

    def refresh(self) -> None:
        """Brings the estimate up to date (the clock moved); it tells the tracker which
        instances changed (`InflightTracker.touch`). Called before every decision."""
        ...


_Key = str | tuple[str, str]  # own request id, or (peer replica id, its request id)


@dataclass(slots=True)
class _Pending:
    epoch: int
    requests: int = 0
    blocks: int = 0
    tokens: int = 0  # uncached prompt tokens sent to this prefill
    # KV blocks of assignments made before this report and released since: the report still
    # shows them in use, but decode has freed them (or will as the request ends).
    freed: int = 0
    released: int = 0  # those requests (the report counts them running or waiting)


class InflightTracker:
    """Counts unreleased assignments per instance, in total and since the latest load report.

    `timeout_s` (seconds) bounds how long an unreleased assignment is counted; `reservation_s`
    (seconds) how long it counts as pending load and KV blocks of its instances (see above).
    """

    def __init__(
        self,
        timeout_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        reservation_s: float = 10.0,
    ):
        if timeout_s <= 0:
            raise ValueError(f"in-flight timeout must be > 0 s, got {timeout_s}")
        if reservation_s <= 0:
            raise ValueError(f"reservation window must be > 0 s, got {reservation_s}")
        self._timeout_s = timeout_s
        self._reservation_s = reservation_s
        self._clock = clock
        self._lock = threading.Lock()
        self.listener: InflightListener | None = None
        #: Peers' assignments estimated but not visible yet (see inflight_exchange.py); None: no
        # peers.
        self.unseen: UnseenEstimate | None = None
        # Instances whose counters changed since `take_dirty` (the decision tables' rows).
        self._dirty: set[str] = set()
        # Insertion order == start order, so expired assignments sit at the front.
        self._requests: OrderedDict[_Key, Assignment] = OrderedDict()
        # Pending assignments in start order, to end their reservation (stale entries skipped).
        self._reserving: deque[tuple[_Key, float]] = deque()
        self._pending: dict[str, _Pending] = {}
        self._total: dict[str, int] = {}
        # Prefill queues in time: instance id -> [busy until (clock s), mean queue s per
        # assignment (for reports of requests not predicted), epoch of the last report read].
        self._busy: dict[str, list[float]] = {}
        # assignment -> (its prefill, when its prompt is predicted computed): a release before
        # then ends it early (the request is done, so is its prefill)
        self._until: dict[_Key, tuple[str, float]] = {}
        # decode id -> its pending assignments whose prompt is predicted still being computed
        # on their prefill (`_new_epoch_locked`); stale keys are dropped when read
        self._upstream: dict[str, set[_Key]] = {}
        # decode id -> [unreleased assignments with a known decode_context, their sum]
        self._context: dict[str, list[int]] = {}
        #: What a peer's assignment of N uncached prompt tokens adds to its prefill's queue
        #: (s), given the queue it finds there (s): kv_aware's latency model,
        #: `LatencyModel.busy_s(new, cached, wait_s)`, as for an own decision (the peer's
        #: cached tokens are not on the wire: 0). None: peers' assignments move no queue.
        self.prefill_seconds: Callable[[int, int, float], float] | None = None

    def __len__(self) -> int:
        return len(self._requests)

    def pending_requests(self, candidate: Candidate) -> int:
        """Unreleased requests assigned to `candidate` since its current load report."""
        pending = self._pending.get(candidate.instance_id)
        return pending.requests if pending and pending.epoch == candidate.epoch else 0

    def counts(self, candidate: Candidate, decode: bool) -> tuple[int, int, int, int, int, float]:
        """(`pending_requests`, `pending_blocks`, `assigned_blocks`, `queued_prefill_tokens`,
        released, `decode_context`) of `candidate` in one lookup; the block counts only for a
        `decode` side (0 on prefill), and `pending_blocks` only when its report says how many
        blocks it has, reading it then as `pending_blocks` does (its KV credit starts).
        `released`: on decode, requests assigned before its report (so counted in it) and
        released since."""
        pending = self._pending.get(candidate.instance_id)
        context = self.decode_context(candidate.instance_id) if decode else 0.0
        if pending is None or pending.epoch != candidate.epoch:
            if not decode:
                self._reported(candidate)
                return 0, 0, 0, 0, 0, 0.0
            if not (candidate.total_kv_blocks and candidate.block_size):
                return 0, 0, 0, 0, 0, context
            self.pending_blocks(candidate)  # the report's credit starts now
            pending = self._pending.get(candidate.instance_id)
            if pending is None or pending.epoch != candidate.epoch:
                return 0, 0, 0, 0, 0, context
        if not decode:
            return pending.requests, 0, 0, pending.tokens, 0, 0.0
        blocks = 0
        if candidate.total_kv_blocks and candidate.block_size:
            net = pending.blocks - pending.freed
            floor = candidate.free_kv_blocks - candidate.total_kv_blocks
            blocks = net if net >= floor else floor
        return pending.requests, blocks, pending.blocks, pending.tokens, pending.released, context

    def decode_context(self, instance_id: str) -> float:
        """The mean `Assignment.decode_context` (tokens) of the unreleased assignments to
        decode `instance_id` that carry one (0 = none): what each of its sequences is
        predicted to attend over. Its KV cache usage cannot say that: a block shared by
        several sequences is one block of cache but is read by each of them."""
        context = self._context.get(instance_id)
        return context[1] / context[0] if context else 0.0

    def busy_until(self, instance_id: str) -> float:
        """When prefill `instance_id`'s queued prompts are predicted to be computed (clock
        seconds; 0 = never predicted busy)."""
        busy = self._busy.get(instance_id)
        return busy[0] if busy is not None else 0.0

    def now(self) -> float:
        """The tracker's clock (s)."""
        return self._clock()

    def _reported(self, candidate: Candidate) -> None:
        """A prefill report with nothing assigned since: it says how busy the instance is."""
        busy = self._busy.get(candidate.instance_id)
        if busy is None or busy[2] == candidate.epoch:
            return
        busy[2] = candidate.epoch
        now = self._clock()
        if candidate.num_running + candidate.num_waiting == 0:
            busy[0] = min(busy[0], now)
        else:
            # Running prompts are half done on average, waiting ones not started.
            left = (0.5 * candidate.num_running + candidate.num_waiting) * busy[1]
            busy[0] = max(busy[0], now + left)

    def effective_load(self, candidate: Candidate) -> float:
        """The candidate's reported load plus its pending requests (see `Candidate`), plus the
        peers' assignments estimated but not received yet (`unseen`, with peers only)."""
        load = candidate.reported_load
        pending = self._pending.get(candidate.instance_id)
        if pending is not None and pending.epoch == candidate.epoch:
            load += pending.requests
        unseen = self.unseen
        return load + unseen.count(candidate.instance_id) if unseen is not None else load

    def unseen_count(self, instance_id: str) -> int:
        """Peers' assignments to `instance_id` estimated but not received yet (0: no peers)."""
        unseen = self.unseen
        return unseen.count(instance_id) if unseen is not None else 0

    def touch(self, instance_ids: Iterable[str]) -> None:
        """Marks instances whose counts changed outside the tracker (the unseen estimate)."""
        with self._lock:
            self._dirty.update(instance_ids)

    def take_dirty(self) -> set[str]:
        """The instances whose counts may have changed since the last call (and forgets
        them): what a decision table must rewrite before it is read."""
        if not self._dirty:
            return set()  # nothing to take: skip the lock (the common case)
        with self._lock:
            dirty, self._dirty = self._dirty, set()
        return dirty

    def pending_blocks(self, candidate: Candidate) -> int:
        """KV cache blocks reserved on decode `candidate` since its current load report, less
        the blocks of requests counted in that report and released since (so it can be
        negative, never below `free_kv_blocks - total_kv_blocks`: the report's free blocks plus
        the credit never exceed the instance's total).

        Without the credit, a report taken while 8 requests of 5 blocks each ran on a 64-block
        decode left room for 4 assignments until the next report, however many of the 8 had
        finished: at ~24 requests/s and one report a second the guard turned down 34 of 48
        requests (`git show a4bcc95:docs/benchmarks.md`, "Lost requests"). The credit starts
        once this tracker saw the report's epoch (here or in `add`), so only releases after the
        report was taken count."""
        instance_id = candidate.instance_id
        pending = self._pending.get(instance_id)
        if pending is None or pending.epoch != candidate.epoch:
            with self._lock:
                pending = self._pending.get(instance_id)
                if pending is None or pending.epoch != candidate.epoch:
                    pending = self._new_epoch_locked(instance_id, candidate.epoch)
            if not pending.blocks:
                return 0
        net = pending.blocks - pending.freed
        floor = candidate.free_kv_blocks - candidate.total_kv_blocks
        return net if net >= floor else floor

    def assigned_blocks(self, candidate: Candidate) -> int:
        """KV cache blocks of unreleased assignments made to decode `candidate` since its
        current load report, without `pending_blocks`' credit: in push mode these are what
        may sit in its receive buffer beyond the report's headroom (a request the report
        counted that ends frees KV blocks, not buffer room)."""
        pending = self._pending.get(candidate.instance_id)
        return pending.blocks if pending and pending.epoch == candidate.epoch else 0

    def queued_prefill_tokens(self, candidate: Candidate) -> int:
        """Uncached prompt tokens sent to prefill `candidate` since its current load report,
        by unreleased assignments (the prefill work it has queued that its report may not
        show yet)."""
        pending = self._pending.get(candidate.instance_id)
        return pending.tokens if pending and pending.epoch == candidate.epoch else 0

    def add(
        self,
        request_id: str,
        prefill: Candidate | None,
        decode: Candidate,
        decode_blocks: int,
        prefill_tokens: int = 0,
        prefill_s: float = 0.0,
        decode_context: int = 0,
    ) -> Assignment | None:
        """Counts a new assignment (`prefill` None: decode computes the prompt itself, and
        `prefill_tokens` uncached prompt tokens go to the prefill, adding a predicted
        `prefill_s` seconds to its queue; `decode_context` as `Assignment`'s); returns the
        one it replaced when the id was in flight."""
        record = Assignment(
            request_id=request_id,
            prefill_id=prefill.instance_id if prefill is not None else "",
            prefill_epoch=prefill.epoch if prefill is not None else 0,
            decode_id=decode.instance_id,
            decode_epoch=decode.epoch,
            decode_blocks=decode_blocks,
            started_at=self._clock(),
            prefill_tokens=prefill_tokens if prefill is not None else 0,
            prefill_s=prefill_s if prefill is not None else 0.0,
            decode_context=max(decode_context, 0),
        )
        with self._lock:
            replaced = self._put_locked(request_id, record)
            expired = self._expire_locked()
        self._tell([record], [r for r in (replaced, *expired) if r is not None])
        return replaced

    def release(self, request_id: str) -> Assignment | None:
        """Ends an assignment; None when the id is unknown (already released or expired)."""
        with self._lock:
            record = self._pop_locked(request_id)
        if record is not None:
            self._tell([], [record])
        return record

    def age(self) -> int:
        """Ends the reservation of pending assignments older than `reservation_s` (they stay
        in flight); returns how many. Call before a decision: cheap when none is due."""
        reserving = self._reserving
        if not reserving or reserving[0][1] > self._clock() - self._reservation_s:
            return 0
        with self._lock:
            return self._age_locked()

    def expire(self) -> list[Assignment]:
        """Drops assignments older than the timeout; returns them."""
        with self._lock:
            expired = self._expire_locked()
        self._tell([], expired)
        return expired

    def request_ids(self) -> list[str]:
        """This replica's own ids in flight, oldest first."""
        with self._lock:
            return [k for k in self._requests if isinstance(k, str)]

    def own(self) -> list[Assignment]:
        """This replica's own assignments in flight, oldest first (what peers get first)."""
        with self._lock:
            return [a for a in self._requests.values() if not a.origin]

    # --- assignments of peer replicas ------------------------------------------------------

    def add_peer(
        self,
        origin: str,
        request_id: str,
        prefill: Candidate | None,
        decode: Candidate | None,
        decode_blocks: int,
        *,
        prefill_id: str = "",
        decode_id: str = "",
        pending: bool = True,
        prefill_tokens: int = 0,
    ) -> None:
        """Counts peer `origin`'s assignment of `request_id` as if made here now: pending on
        the reports this replica's view holds (`prefill`/`decode`, None when the view does not
        know the instance yet: counted in flight only). Replaces the peer's earlier one of
        that id. `prefill_id`/`decode_id` name the instances when the candidate is None
        (`prefill_id` "": no prefill leg); `prefill_tokens` as in `add`."""
        record_prefill_id = prefill.instance_id if prefill else prefill_id
        record = Assignment(
            request_id=request_id,
            prefill_id=record_prefill_id,
            prefill_epoch=prefill.epoch if prefill else 0,
            decode_id=decode.instance_id if decode else decode_id,
            decode_epoch=decode.epoch if decode else 0,
            decode_blocks=decode_blocks,
            started_at=self._clock(),
            origin=origin,
            pending=pending and (prefill is not None or not prefill_id) and decode is not None,
            prefill_tokens=prefill_tokens,
            # A snapshot's assignments (pending False) were sent before this replica knew of
            # them, most of their prompts computed long ago: they move no queue.
            prefill_s=self._peer_prefill_s(record_prefill_id, prefill_tokens) if pending else 0.0,
        )
        with self._lock:
            self._put_locked((origin, request_id), record)

    def _peer_prefill_s(self, prefill_id: str, tokens: int) -> float:
        """What a peer's prompt of `tokens` uncached tokens adds to `prefill_id`'s queue (s)."""
        seconds = self.prefill_seconds
        if not tokens or not prefill_id or seconds is None:
            return 0.0
        return seconds(tokens, 0, max(self.busy_until(prefill_id) - self._clock(), 0.0))

    def release_peer(self, origin: str, request_id: str) -> bool:
        """Ends peer `origin`'s assignment of `request_id`; False when it was not counted."""
        with self._lock:
            return self._pop_locked((origin, request_id)) is not None

    def drop_peer(self, origin: str) -> int:
        """Forgets every assignment of peer `origin` (its stream ended); returns how many."""
        with self._lock:
            keys = [k for k, a in self._requests.items() if a.origin == origin]
            for key in keys:
                self._pop_locked(key)
        return len(keys)

    def _put_locked(self, key: _Key, record: Assignment) -> Assignment | None:
        replaced = self._pop_locked(key)
        self._requests[key] = record
        if record.pending:
            self._reserving.append((key, record.started_at))
        if record.prefill_id:
            self._count(
                record.prefill_id, record.prefill_epoch, 0, record.pending, record.prefill_tokens
            )
            if record.prefill_s > 0:
                until = self._queue(record.prefill_id, record.started_at, record.prefill_s)
                self._until[key] = (record.prefill_id, until)
        self._count(record.decode_id, record.decode_epoch, record.decode_blocks, record.pending)
        if record.pending and key in self._until:  # after `_count`: not carried into its own
            self._upstream.setdefault(record.decode_id, set()).add(key)
        if record.decode_context:
            context = self._context.setdefault(record.decode_id, [0, 0])
            context[0] += 1
            context[1] += record.decode_context
            self._dirty.add(record.decode_id)
        return replaced

    def _pop_locked(self, key: _Key) -> Assignment | None:
        record = self._requests.pop(key, None)
        if record is not None:
            self._uncount(record)
            upstream = self._upstream.get(record.decode_id)
            if upstream is not None:
                upstream.discard(key)
        until = self._until.pop(key, None)
        if until is not None:
            busy = self._busy.get(until[0])
            now = self._clock()
            if busy is not None and until[1] > now:
                busy[0] = max(now, busy[0] - (until[1] - now))
                self._dirty.add(until[0])
        return record

    def queue_prefill(self, instance_id: str, seconds: float) -> float:
        """Adds `seconds` of predicted work that is no assignment (a prefix warm) to prefill
        `instance_id`'s queue; returns when it is predicted done (the tracker's clock, s)."""
        with self._lock:
            return self._queue(instance_id, self._clock(), seconds)

    def _queue(self, instance_id: str, now: float, seconds: float) -> float:
        """Adds `seconds` of predicted work to a prefill's queue; returns when it is done."""
        busy = self._busy.get(instance_id)
        if busy is None:
            busy = self._busy[instance_id] = [0.0, seconds, 0.0]
        busy[0] = max(busy[0], now) + seconds
        busy[1] += 0.1 * (seconds - busy[1])  # mean of the recent ones (EWMA)
        self._dirty.add(instance_id)
        return busy[0]

    def _tell(self, assigned: list[Assignment], released: Iterable[Assignment]) -> None:
        listener = self.listener
        if listener is None:
            return
        own_released = [r for r in released if not r.origin]
        if assigned or own_released:
            listener(assigned, own_released)

    def inflight_by_instance(self) -> dict[str, int]:
        """instance id -> unreleased assignments (either side), for metrics."""
        with self._lock:
            return dict(self._total)

    def _age_locked(self) -> int:
        cutoff = self._clock() - self._reservation_s
        reserving, aged = self._reserving, 0
        while reserving and reserving[0][1] <= cutoff:
            key, started_at = reserving.popleft()
            record = self._requests.get(key)
            if record is None or not record.pending or record.started_at != started_at:
                continue  # released, replaced or expired since
            self._unpend(record)
            self._requests[key] = dataclasses.replace(record, pending=False)
            aged += 1
        return aged

    def _expire_locked(self) -> list[Assignment]:
        deadline = self._clock() - self._timeout_s
        expired = []
        while self._requests:
            key, record = next(iter(self._requests.items()))
            if record.started_at > deadline:
                break
            del self._requests[key]
            self._uncount(record)
            expired.append(record)
        return expired

    def _count(
        self, instance_id: str, epoch: int, blocks: int, pending_too: bool, tokens: int = 0
    ) -> None:
        self._total[instance_id] = self._total.get(instance_id, 0) + 1
        if not pending_too:
            return
        self._dirty.add(instance_id)
        pending = self._pending.get(instance_id)
        if pending is None or pending.epoch != epoch:
            pending = self._new_epoch_locked(instance_id, epoch)
        pending.requests += 1
        pending.blocks += blocks
        pending.tokens += tokens

    def _new_epoch_locked(self, instance_id: str, epoch: int) -> _Pending:
        """Starts counting `instance_id`'s assignments since its report `epoch`.

        Assignments made before the report are inside it, except a decode's whose prompt is
        predicted to be still computing on its prefill (`Assignment.prefill_s`): that request
        has not reached its decode, so the report cannot show it, and it stays pending in the
        new epoch. Dropping them had made every report of an overloaded fleet (seconds of
        prefill queue) hide the requests on their way to that decode: the least loaded decode
        by report took more and more until they arrived, and decodes swung between idle and
        twice their share (`docs/benchmarks/scorecard.md`, cold prompts past saturation)."""
        pending = self._pending[instance_id] = _Pending(epoch)
        upstream = self._upstream.get(instance_id)
        if not upstream:
            return pending
        now = self._clock()
        for key in list(upstream):
            record = self._requests.get(key)
            until = self._until.get(key)
            if (
                record is None
                or not record.pending
                or record.decode_id != instance_id
                or until is None
                or until[1] <= now
                or self.busy_until(until[0]) <= now  # its prefill reported its queue empty
            ):
                upstream.discard(key)  # released, aged, or its prompt computed: in reports
                continue
            pending.requests += 1
            pending.blocks += record.decode_blocks
            self._requests[key] = dataclasses.replace(record, decode_epoch=epoch)
        if not upstream:
            del self._upstream[instance_id]
        return pending

    def _uncount(self, record: Assignment) -> None:
        for instance_id in (record.prefill_id, record.decode_id):
            if not instance_id:
                continue  # no prefill leg
            left = self._total.get(instance_id, 0) - 1
            if left > 0:
                self._total[instance_id] = left
            else:
                self._total.pop(instance_id, None)
        if record.pending:
            self._unpend(record)
        if record.decode_context:
            context = self._context.get(record.decode_id)
            if context is not None:
                context[0] -= 1
                context[1] -= record.decode_context
                if context[0] <= 0:
                    del self._context[record.decode_id]
                self._dirty.add(record.decode_id)
        pending = self._pending.get(record.decode_id)
        if pending is not None and pending.epoch != record.decode_epoch:
            pending.freed += record.decode_blocks  # counted in an older report, freed now
            pending.released += 1
            self._dirty.add(record.decode_id)

    def _unpend(self, record: Assignment) -> None:
        for instance_id, epoch, blocks, tokens in (
            (record.prefill_id, record.prefill_epoch, 0, record.prefill_tokens),
            (record.decode_id, record.decode_epoch, record.decode_blocks, 0),
        ):
            if not instance_id:
                continue  # no prefill leg
            pending = self._pending.get(instance_id)
            if pending is not None and pending.epoch == epoch:
                self._dirty.add(instance_id)
                pending.requests -= 1
                pending.blocks -= blocks
                pending.tokens -= tokens
                if pending.requests <= 0 and not pending.freed:
                    del self._pending[instance_id]
