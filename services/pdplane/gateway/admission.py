"""The admission queue: a request that finds every instance full, or its model without a usable
instance for a moment, waits for room, as in vLLM.

`vllm serve` keeps a request its KV cache cannot hold yet in its scheduler's waiting queue and
runs it once running requests end. A fleet behind the gateway behaves the same: when the
scheduler refuses a request for capacity only (`SchedulerBusy`: compatible instances exist,
none has KV room now), the request waits here and is scheduled again, bounded in time
(`queue_timeout_s`) and in number (`max_queued_requests`). So does a request of a model that
has no usable prefill/decode pair right now (its only decode restarting after a crash, a
scale-out in progress: `waits_on`); a model nobody serves never gets here (404), and a
refusal while the fleet view shows a usable pair (a remote scheduler unreachable,
incompatible instances, a request larger than every KV cache) stays an immediate 503, but
for `_SETTLE_S` after the model's instances changed: a remote scheduler watches the registry
on its own and may not have seen yet the instance this gateway sees (a restarted decode).

A request that an instance failed (a retry, a stream continued elsewhere) excludes it as the
process that failed it (`incarnation`): one that registers again under the same id (restarted
by `pdplane up`, which keeps its id and port) is a new process and may take the request.

Waiting costs no polling per request. Waiters form one FIFO per model; only the head asks
the scheduler again, when this gateway releases a request (`wake`, called on every Release it
makes) or, for room freed elsewhere (other gateways' requests, load reports), after
`_POLL_S`. A head that gets a decision wakes the next waiter at once (room may be left for
it), so a release drains as many waiters as fit, in arrival order. A request arriving while
its model has waiters queues behind them (no overtaking, as vLLM's FCFS waiting queue).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Awaitable, Callable, Collection, Mapping

from pdplane.gateway.errors import GatewayError, unavailable
from pdplane.gateway.fleet_view import FleetView
from pdplane.gateway.metrics import GatewayMetrics
from pdplane.scheduler import Decision, SchedulerBusy, SchedulerUnavailable

__all__ = ["AdmissionQueue"]

log = logging.getLogger(__name__)

#: How long a queue's head waits for a Release of this gateway before it asks the scheduler
#: again (s): room freed by other gateways or shown by a load report is noticed this late.
#: One Schedule per model every 25 ms costs the scheduler little (a decision is ~10-50 µs).
_POLL_S = 0.025

#: How long after a model's instances changed in this gateway's view (one came, left or
#: registered again) a refusal that the view contradicts (a usable pair shown) still waits
#: (s): the time the scheduler's own watch of the registry may take to see the change on a
#: busy host. A refusal that stays past it is the answer.
_SETTLE_S = 2.0


class _Waiter:
    __slots__ = ("woken",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.woken: asyncio.Future[None] = loop.create_future()


class AdmissionQueue:
    """Bounded FIFO waits for capacity, one queue per model.

    Args:
        timeout_s: longest wait of one request (s); 0 = no queueing (503 at once, as before).
        max_queued: requests waiting at once across models; one more gets 503 at once.
        metrics: where the queue length, wait times and refusals are recorded.
        fleet: the registry's view (which models lack a usable pair); None = only capacity
            refusals wait.
    """

    def __init__(
        self,
        timeout_s: float,
        max_queued: int,
        metrics: GatewayMetrics,
        fleet: Callable[[], FleetView] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_queued = max_queued
        self._metrics = metrics
        self._fleet = fleet
        self._queues: dict[str, collections.deque[_Waiter]] = {}
        #: model -> the latest capacity refusal of its waiters (words the 503 of one that
        #: queued behind them without asking).
        self._reasons: dict[str, str] = {}
        self._waiting = 0

    def __len__(self) -> int:
        """Requests waiting now."""
        return self._waiting

    def has_waiters(self, model: str) -> bool:
        """Whether requests of `model` wait (a new one then queues behind them)."""
        return bool(self._queues.get(model))

    def waits_on(
        self,
        model: str,
        refusal: SchedulerUnavailable,
        excluded: Collection[str] = (),
        room: bool = True,
        on_failed: bool = True,
    ) -> bool:
        """Whether a request of `model` refused with `refusal` waits here: a capacity refusal
        when `room` (a retry's failure is its answer instead); no usable pair in the fleet now;
        when `on_failed`, no usable pair but with the `excluded` instances (which failed this
        request); or a refusal the fleet view contradicts, for `_SETTLE_S` after the model's
        instances changed (the scheduler may not see them yet)."""
        if isinstance(refusal, SchedulerBusy):
            return room
        state = self._fleet().models.get(model) if self._fleet is not None else None
        if state is None:
            return False
        if state.problem():
            return True
        failed = set(excluded)
        prefills = state.prefill - len(state.prefill_ids & failed)
        decodes = state.decode - len(state.decode_ids & failed)
        if not (prefills > 0 and decodes > 0):
            return on_failed
        return time.monotonic() - state.changed_at < _SETTLE_S

    def incarnation(self, model: str, instance_id: str) -> int:
        """Which process `instance_id` of `model` is now: its registration time in the fleet
        view (Unix ns; 0 when the view does not list it as SERVING)."""
        state = self._fleet().models.get(model) if self._fleet is not None else None
        return state.registered_ns.get(instance_id, 0) if state is not None else 0

    def failed(self, model: str, excluded: Mapping[str, int]) -> tuple[str, ...]:
        """The ids of `excluded` (instance id -> the `incarnation` that failed a request) still
        to exclude: those the fleet view lists as that same process, or not at all (the
        scheduler may still list it). One registered again since (a restart) is a new process,
        no longer excluded."""
        state = self._fleet().models.get(model) if self._fleet is not None else None
        if state is None:
            return tuple(excluded)
        registered = state.registered_ns
        return tuple(i for i, was in excluded.items() if registered.get(i, was) == was)

    def wake(self) -> None:
        """Room may have come (this gateway released a request): each model's head asks the
        scheduler again. Cheap; call from the event loop."""
        for queue in self._queues.values():
            if queue:
                _wake(queue[0])

    async def admit(
        self,
        model: str,
        schedule: Callable[[], Awaitable[Decision]],
        refusal: SchedulerUnavailable | None,
        excluded: Callable[[], Collection[str]] = tuple,
        on_failed: bool = True,
        timeout_s: float | None = None,
    ) -> Decision:
        """Waits in `model`'s queue until `schedule()` returns a decision; returns it.

        `refusal` = the refusal that sent the request here (capacity, or no usable pair: see
        `waits_on`; None: it queued behind earlier waiters without asking); `excluded()` = the
        instances that failed a retrying request (`failed`), not counted as usable, and
        `on_failed` whether it waits while only they are left (`waits_on`). `timeout_s`: the
        longest wait (s) instead of the queue's (e.g. math.inf for a caller that bounds the
        wait itself: a stream continued elsewhere, within its `--migration-timeout-s`).
        Raises GatewayError 503 when queueing is off, the
        queue is full (at once) or no room came within the timeout (naming the last refusal
        and the wait); `schedule()`'s other errors as they are; asyncio.CancelledError when
        the client left (the request leaves the queue at once).
        """
        if refusal is not None:
            reason = refusal.reason
        else:
            reason = self._reasons.get(model, "no instance has room now")
        limit_s = self.timeout_s if timeout_s is None else timeout_s
        if limit_s <= 0:
            raise unavailable(reason)
        if self._waiting >= self.max_queued:
            self._metrics.queue_refusals.labels("queue_full").inc()
            raise unavailable(
                f"{reason}; not queued: {self._waiting} requests "
                f"already wait for room (--max-queued-requests {self.max_queued})"
            )
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + limit_s
        queue = self._queues.setdefault(model, collections.deque())
        waiter = _Waiter(loop)
        queue.append(waiter)
        self._reasons[model] = reason
        self._waiting += 1
        self._metrics.queued.inc()
        try:
            while True:
                left = deadline - loop.time()
                if left <= 0:
                    reason = self._reasons.get(model, reason)
                    raise self._timed_out(model, reason, loop.time() - started)
                head = queue[0] is waiter
                await asyncio.wait((waiter.woken,), timeout=min(left, _POLL_S) if head else left)
                if waiter.woken.done():
                    waiter.woken = loop.create_future()
                if queue[0] is not waiter:
                    continue  # woken to find out it is not the head yet (a timeout)
                try:
                    decision = await schedule()
                except SchedulerUnavailable as exc:
                    if not self.waits_on(model, exc, excluded(), True, on_failed):
                        raise
                    reason = self._reasons[model] = exc.reason
                    continue
                self._metrics.queue_wait.observe(loop.time() - started)
                return decision
        finally:
            queue.remove(waiter)
            self._waiting -= 1
            self._metrics.queued.dec()
            if queue:
                _wake(queue[0])  # the next one tries now: room may be left, or it polls
            else:
                del self._queues[model]
                self._reasons.pop(model, None)

    def _timed_out(self, model: str, reason: str, waited_s: float) -> GatewayError:
        self._metrics.queue_refusals.labels("timeout").inc()
        self._metrics.queue_wait.observe(waited_s)
        log.warning(
            "request for model %r waited %.1f s for room, none came: %s", model, waited_s, reason
        )
        return unavailable(
            f"{reason} (waited {waited_s:.1f} s for room; --queue-timeout-s {self.timeout_s:g})"
        )


def _wake(waiter: _Waiter) -> None:
    if not waiter.woken.done():
        waiter.woken.set_result(None)
