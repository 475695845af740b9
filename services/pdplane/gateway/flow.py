"""Flow control: an in-flight budget per model, and a queue in front of it that is ordered by
priority and fair between tenants by tokens.

Why at the gateway: every engine queues what it is given first come, first served, so work
must be held back before the engines to be ordered at all. Each model has a budget of tokens
in flight (`budget(model)`: by default the KV cache of its SERVING decode instances, in
tokens, times `--inflight-budget`); a request weighs `prompt + max_tokens` tokens (its KV
need) from its admission until its answer ends. While the budget is full, requests wait:

- **priority first** (vLLM's meaning: the lower `priority` value is served first): each
  priority is a band, and a band is served only when every better band is empty; a request
  fits when the tokens in flight of its priority and better ones leave room for it in the
  budget (worse priorities' work in flight does not count against it) and everything in
  flight stays within the ceiling (the decode instances' KV cache);
- **fair between tenants within a band, by tokens**: self-clocked fair queueing (Golestani,
  "A Self-Clocked Fair Queueing Scheme for Broadband Applications", INFOCOM 1994): a request
  of tenant t with weight w gets the finish tag `max(V, last_t) + tokens / w`, where V is the
  tag of the request admitted last in its band and `last_t` the tag of t's previous request;
  the smallest tag goes first. A tenant sending 10x the others' rate only lengthens its own
  queue; a 32k-token prompt weighs 320 times a 100-token one. `policy="fifo"` is one band in
  arrival order (`--flow-policy fifo`: no fairness between tenants, as a plain vLLM queue).
- only the head of the best band is admitted, when its tokens fit the budget (or nothing is
  in flight: a request larger than the whole budget goes alone), so big requests never starve;
- **a tenant within its share needs no turn**: every tenant with requests in flight or
  waiting is guaranteed its weighted share of the budget (budget x w / the active tenants'
  weights); a request that keeps its tenant within that share, with no better priority
  waiting, is admitted at once even when the budget is full. So a quiet tenant beside a
  flooding one is not held behind the flood's completions; the flood, over its share, waits.
  The budget may then be exceeded by those shares, never past the ceiling (the decode
  instances' KV cache): `--inflight-budget` below 1 leaves that room (at 1 there is none,
  and every request waits for its turn).
- **a burst of a tenant that is not flooding uses that room**: while other tenants' requests
  wait (they filled the budget) and none of its own does, a tenant may go past its share of
  the budget up to its share of the ceiling (ceiling x w / the active tenants' weights). A
  flood always has requests waiting, so it never gets this room; a lone tenant has nobody
  waiting beside it, so it stays within the budget. Why: a quiet tenant's requests arrive at
  random; beside a flood that keeps the budget full, a burst of them past half the budget
  waited for the flood's completions, which was most of its TTFT's rise beside a flood
  (docs/benchmarks/flow-control.md).

Under overload, requests are shed with 429 and `Retry-After` (never a hang), the lowest
priority first: a request whose projected wait exceeds `timeout_s` is refused at arrival or,
once queued, as soon as its projection passes its remaining time (checked every 100 ms). The
projection: tokens queued ahead of it / the rate the better priorities leave over, i.e. the
model's drain rate less the tokens per second of better-priority requests that arrived over
the same window (they keep going ahead of it: counting only those queued now, a low priority
behind a steady better stream projected a short wait until its timeout). With `max_queued`
requests waiting, a newcomer of better priority takes the place of the last-served waiter of
the worst band (429) and any other newcomer is refused. A request still waiting after
`timeout_s` (the shared `--queue-timeout-s`) gets 429 too when requests of the model ended
during its wait (the model drains others' work: overloaded), 503 when none did (it makes no
progress). `timeout_s` 0 = no flow control (every request admitted at once).

The drain rate is measured only while requests wait (the model at its budget): the tokens of
the requests that ended during the last 10 s of such time, over that time; the arrivals of
each priority likewise (requests queued or admitted while others waited). What a model
drains while nothing waits is what it was given, not what it can do: over an idle window the
rate would fall towards zero and a burst after a quiet spell would be shed on a false
projection. Until 2 s of waiting were seen there is no rate, and nobody is shed on a
projection (a full queue and the timeout still apply); nor until the window's completions
add up to the tokens in flight: requests admitted together end together, and the first few
to end would read as a rate a fraction of the model's. Short waits that end with a
completion make the rate read high, which errs towards admitting, never towards shedding.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import logging
import time
from collections.abc import Callable
from typing import Any

from pdplane.gateway.errors import GatewayError, too_many_requests, unavailable
from pdplane.gateway.metrics import GatewayMetrics

__all__ = ["FlowControl", "FlowTicket"]

log = logging.getLogger(__name__)

#: Period of the queue's check (s): capacity changes (load reports) and projected waits.
_TICK_S = 0.1
#: Window of the drain rate (s): tokens of requests that ended in the last 10 s during which
#: requests waited.
_RATE_WINDOW_S = 10.0
#: The drain rate is trusted once it covers this much time with requests waiting (s).
_RATE_MIN_SPAN_S = 2.0

_WAITING, _ADMITTED, _GONE = 0, 1, 2


class FlowTicket:
    """One request in flow control: waiting, admitted (counted in the budget) or gone."""

    __slots__ = (
        "arrived",
        "cost",
        "ended",
        "finish",
        "future",
        "model",
        "priority",
        "seq",
        "state",
        "tenant",
    )

    def __init__(self, model: str, tenant: str, priority: int, cost: int, arrived: float) -> None:
        self.model = model
        self.tenant = tenant
        self.priority = priority
        self.cost = cost  # tokens
        self.arrived = arrived
        self.finish = 0.0
        self.ended = 0  # the model's requests ended when this one started waiting
        self.seq = 0
        self.state = _WAITING
        self.future: asyncio.Future[None] | None = None

    def __lt__(self, other: FlowTicket) -> bool:
        return (self.finish, self.seq) < (other.finish, other.seq)


class _Band:
    """The waiters of one priority: a heap by finish tag, the virtual clock, tenants' tags."""

    __slots__ = ("count", "heap", "last", "tokens", "vclock")

    def __init__(self) -> None:
        self.heap: list[FlowTicket] = []
        self.count = 0
        self.tokens = 0
        self.vclock = 0.0
        self.last: dict[str, float] = {}

    def head(self) -> FlowTicket | None:
        while self.heap and self.heap[0].state != _WAITING:
            heapq.heappop(self.heap)
        return self.heap[0] if self.heap else None

    def live(self) -> list[FlowTicket]:
        """The waiters in service order."""
        return sorted(t for t in self.heap if t.state == _WAITING)


class _Use:
    """A tenant's requests of one model: tokens admitted, requests not ended (admitted or
    waiting), requests waiting, its weight."""

    __slots__ = ("inflight", "requests", "waiting", "weight")

    def __init__(self, weight: float) -> None:
        self.inflight = 0
        self.requests = 0
        self.waiting = 0
        self.weight = weight


class _ModelFlow:
    __slots__ = (
        "active_weight",
        "arrived",
        "arrived_sum",
        "bands",
        "by_priority",
        "drained",
        "drained_sum",
        "ended",
        "inflight",
        "saturated_s",
        "saturated_since",
        "use",
        "waiting",
    )

    def __init__(self) -> None:
        self.bands: dict[int, _Band] = {}
        self.use: dict[str, _Use] = {}  # tenants with requests admitted or waiting
        self.active_weight = 0.0
        self.inflight = 0  # tokens admitted and not ended
        self.by_priority: dict[int, int] = {}  # the same by priority
        self.waiting = 0
        # (the saturated clock when it ended, tokens) of requests that ended while others
        # waited, and their sum: the drain rate's samples
        self.drained: collections.deque[tuple[float, int]] = collections.deque()
        self.drained_sum = 0
        # (the saturated clock, priority, tokens) of requests that arrived while others waited
        # and were not refused, and their sums by priority: what each band's betters take
        self.arrived: collections.deque[tuple[float, int, int]] = collections.deque()
        self.arrived_sum: dict[int, int] = {}
        self.ended = 0  # requests admitted and ended, ever
        self.saturated_s = 0.0  # seconds with requests waiting, up to saturated_since
        self.saturated_since: float | None = None  # since when requests wait (None: none do)

    def saturated_clock(self, now: float) -> float:
        """Seconds during which requests of this model waited, up to `now`."""
        since = self.saturated_since
        return self.saturated_s + (now - since if since is not None else 0.0)


class FlowControl:
    """The flow control of all models (one per gateway).

    Args:
        budget: model -> (its in-flight budget, the ceiling its tenants' shares may reach)
            in tokens (the ceiling: its decode instances' KV cache), None = unlimited
            (capacity unknown).
        timeout_s: longest wait (s) before 503; 0 = flow control off.
        max_queued: waiters per model at most (then 429, lowest priority first).
        metrics: queue length, waits, sheds and timeouts by tenant and priority.
        policy: "fair" (priority bands, fair by tokens) or "fifo" (arrival order).
        clock: monotonic seconds.
    """

    def __init__(
        self,
        budget: Callable[[str], tuple[int, int] | None],
        timeout_s: float,
        max_queued: int,
        metrics: GatewayMetrics,
        policy: str = "fair",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._budget = budget
        self.timeout_s = timeout_s
        self.max_queued = max_queued
        self.policy = policy
        self._metrics = metrics
        self._clock = clock
        self._flows: dict[str, _ModelFlow] = {}
        self._seq = 0
        self._ticker: asyncio.Task[None] | None = None
        self._children: dict[tuple[Any, ...], Any] = {}

    # -- the request's side --------------------------------------------------------------

    async def admit(
        self, model: str, tenant: str, priority: int, cost: int, weight: float = 1.0
    ) -> FlowTicket:
        """Waits until `cost` tokens of `model` fit its budget in this request's turn; returns
        the ticket to `release` when the answer ended.

        Raises GatewayError 429 (shed: overload, queue full; with Retry-After), 503 (no turn
        within `timeout_s`), asyncio.CancelledError (client gone; it left the queue).
        """
        now = self._clock()
        if self.policy == "fifo":
            tenant_key, priority = "", 0
        else:
            tenant_key = tenant
        ticket = FlowTicket(model, tenant, priority, max(1, cost), now)
        flow = self._flows.get(model)
        if flow is None:
            flow = self._flows[model] = _ModelFlow()
        self._use(flow, ticket, weight)
        if (
            self.timeout_s <= 0
            or (flow.waiting == 0 and self._fits(flow, model, ticket))
            or self._within_share(flow, model, ticket)
        ):
            if flow.waiting:
                self._arrival(flow, ticket, now)
            self._grant(flow, ticket, now)
            return ticket
        try:
            self._refuse_if_overloaded(flow, ticket, tenant_key, weight)
        except GatewayError:
            self._unuse(flow, ticket)
            raise
        self._enqueue(flow, ticket, tenant_key, weight)
        loop = asyncio.get_running_loop()
        ticket.future = future = loop.create_future()
        self._ensure_ticker()
        try:
            done, _ = await asyncio.wait((future,), timeout=self.timeout_s)
        except asyncio.CancelledError:
            if ticket.state == _WAITING:
                self._remove(flow, ticket)
                self._unuse(flow, ticket)
            elif ticket.state == _ADMITTED:
                self.release(ticket)  # admitted just as the client left
            raise
        if done:
            if future.exception() is not None:
                self._unuse(flow, ticket)
            future.result()  # raises the 429 of a shed waiter
            return ticket
        self._remove(flow, ticket)
        self._unuse(flow, ticket)
        later = self._clock()
        waited = later - now
        # Requests ended while it waited: the model drains, others' work holds its budget, so
        # it is overloaded (429, retry later), not down; nothing ended: it makes no progress.
        drains = flow.ended > ticket.ended
        self._child(self._metrics.flow_timeouts, ticket).inc()
        self._child(self._metrics.flow_wait, ticket).observe(waited)
        log.warning(
            "request of tenant %r (priority %d, %d tokens) for model %r waited %.1f s for "
            "its turn, none came (%s)",
            tenant,
            priority,
            ticket.cost,
            model,
            waited,
            "429: the model drained others' requests" if drains else "503: nothing ended",
        )
        if drains:
            raise self._shed(
                ticket, "timeout", self._retry_s(flow, later), f"no turn within {waited:.1f} s"
            )
        raise unavailable(
            f"model {model!r} is over its in-flight budget: no turn within {waited:.1f} s "
            f"(--queue-timeout-s {self.timeout_s:g})"
        )

    def release(self, ticket: FlowTicket) -> None:
        """The request of an admitted `ticket` ended: its tokens leave the budget and the next
        waiters are admitted. Idempotent; a ticket never admitted is ignored."""
        if ticket.state != _ADMITTED:
            return
        ticket.state = _GONE
        flow = self._flows[ticket.model]
        flow.ended += 1
        flow.inflight -= ticket.cost
        flow.by_priority[ticket.priority] -= ticket.cost
        use = flow.use[ticket.tenant]
        use.inflight -= ticket.cost
        self._unuse(flow, ticket)
        if flow.waiting:  # a sample of the drain rate: the model is at its budget
            flow.drained.append((flow.saturated_clock(self._clock()), ticket.cost))
            flow.drained_sum += ticket.cost
        self._per_model(self._metrics.flow_inflight_tokens, ticket.model).set(flow.inflight)
        if flow.waiting:
            self._dispatch(ticket.model, flow)

    def queued(self, model: str) -> int:
        """Requests of `model` waiting for their turn."""
        flow = self._flows.get(model)
        return flow.waiting if flow else 0

    def inflight_tokens(self, model: str) -> int:
        """Tokens of `model` admitted and not ended."""
        flow = self._flows.get(model)
        return flow.inflight if flow else 0

    # -- the queue -----------------------------------------------------------------------

    def _fits(self, flow: _ModelFlow, model: str, ticket: FlowTicket) -> bool:
        """Whether the ticket fits the budget: the tokens in flight of its priority and better
        ones plus its own within the budget (worse priorities do not count against it), and
        everything in flight plus its own within the ceiling; or nothing is in flight."""
        limits = self._budget(model)
        if limits is None:
            return True
        budget, ceiling = limits
        if flow.inflight == 0:
            return True
        better = sum(t for p, t in flow.by_priority.items() if p <= ticket.priority)
        cost = ticket.cost
        return better + cost <= budget and flow.inflight + cost <= ceiling

    def _within_share(
        self, flow: _ModelFlow, model: str, ticket: FlowTicket, queued: bool = False
    ) -> bool:
        """Whether the ticket needs no turn (fair policy): no better priority waits, the model's
        ceiling (its KV cache) holds it, and its tenant stays within its weighted share (among
        the tenants with requests in flight or waiting) of the budget, or of the ceiling when
        others' requests wait and none of its own does (`queued`: the ticket itself waits)."""
        if self.policy != "fair" or (flow.bands and min(flow.bands) < ticket.priority):
            return False
        limits = self._budget(model)
        if limits is None:
            return True
        budget, ceiling = limits
        if flow.inflight + ticket.cost > ceiling:
            return False
        use = flow.use[ticket.tenant]
        part = use.weight / flow.active_weight
        need = use.inflight + ticket.cost
        if need <= budget * part:
            return True
        # The room between the budget and the ceiling: for the bursts of a tenant that is not
        # flooding (nothing of its own waits) while the budget is full (others' requests wait).
        own_waiting = use.waiting - int(queued)
        return own_waiting == 0 and flow.waiting > use.waiting and need <= ceiling * part

    def _use(self, flow: _ModelFlow, ticket: FlowTicket, weight: float) -> None:
        """Counts the ticket's tenant active (its weight in the shares) until `_unuse`."""
        use = flow.use.get(ticket.tenant)
        if use is None:
            use = flow.use[ticket.tenant] = _Use(weight)
            flow.active_weight += weight
        use.requests += 1

    def _unuse(self, flow: _ModelFlow, ticket: FlowTicket) -> None:
        """The ticket's request ended (or never ran); a tenant with none left is inactive."""
        use = flow.use[ticket.tenant]
        use.requests -= 1
        if use.requests == 0:
            del flow.use[ticket.tenant]
            flow.active_weight -= use.weight
            if not flow.use:
                flow.active_weight = 0.0  # no float drift left behind

    def _grant(self, flow: _ModelFlow, ticket: FlowTicket, now: float) -> None:
        ticket.state = _ADMITTED
        flow.inflight += ticket.cost
        flow.by_priority[ticket.priority] = flow.by_priority.get(ticket.priority, 0) + ticket.cost
        flow.use[ticket.tenant].inflight += ticket.cost
        self._per_model(self._metrics.flow_inflight_tokens, ticket.model).set(flow.inflight)
        self._child(self._metrics.flow_wait, ticket).observe(now - ticket.arrived)

    def _enqueue(
        self, flow: _ModelFlow, ticket: FlowTicket, tenant_key: str, weight: float
    ) -> None:
        band = flow.bands.get(ticket.priority)
        if band is None:
            band = flow.bands[ticket.priority] = _Band()
        self._seq += 1
        ticket.seq = self._seq
        ticket.finish = self._finish_tag(band, tenant_key, ticket, weight)
        if tenant_key:
            band.last[tenant_key] = ticket.finish
        heapq.heappush(band.heap, ticket)
        band.count += 1
        band.tokens += ticket.cost
        now = self._clock()
        if flow.waiting == 0:
            flow.saturated_since = now
        self._arrival(flow, ticket, now)
        ticket.ended = flow.ended
        flow.waiting += 1
        flow.use[ticket.tenant].waiting += 1
        self._child(self._metrics.flow_queued, ticket).inc()

    def _finish_tag(self, band: _Band, tenant_key: str, ticket: FlowTicket, weight: float) -> float:
        if self.policy == "fifo":
            return float(self._seq)
        start = max(band.vclock, band.last.get(tenant_key, 0.0))
        return start + ticket.cost / weight

    def _remove(self, flow: _ModelFlow, ticket: FlowTicket) -> None:
        """Takes a waiting ticket out (lazily from its heap)."""
        ticket.state = _GONE
        band = flow.bands[ticket.priority]
        band.count -= 1
        band.tokens -= ticket.cost
        flow.waiting -= 1
        flow.use[ticket.tenant].waiting -= 1
        if flow.waiting == 0:
            flow.saturated_s = flow.saturated_clock(self._clock())
            flow.saturated_since = None
        self._child(self._metrics.flow_queued, ticket).dec()
        if band.count == 0:
            del flow.bands[ticket.priority]  # its clock restarts: nobody waits to be fair to

    def _dispatch(self, model: str, flow: _ModelFlow) -> None:
        """Admits waiters in order while the head fits the budget."""
        now = self._clock()
        while flow.waiting:
            band = flow.bands[min(flow.bands)]
            head = band.head()
            assert head is not None
            if not (
                self._fits(flow, model, head) or self._within_share(flow, model, head, queued=True)
            ):
                return
            heapq.heappop(band.heap)
            band.vclock = head.finish
            self._prune(band)
            self._remove(flow, head)
            self._grant(flow, head, now)
            if head.future is not None and not head.future.done():
                head.future.set_result(None)

    @staticmethod
    def _prune(band: _Band) -> None:
        # A tenant whose last tag is behind the clock starts from the clock anyway.
        if len(band.last) > 4 * band.count + 64:
            band.last = {t: f for t, f in band.last.items() if f > band.vclock}

    # -- overload ------------------------------------------------------------------------

    def _rate(self, flow: _ModelFlow, now: float) -> float | None:
        """Tokens per second the model drained during the last `_RATE_WINDOW_S` seconds in
        which requests waited (None until `_RATE_MIN_SPAN_S` of such time was seen); idle
        time does not dilute it (see the module's docstring)."""
        saturated = flow.saturated_clock(now)
        horizon = saturated - _RATE_WINDOW_S
        while flow.drained and flow.drained[0][0] < horizon:
            flow.drained_sum -= flow.drained.popleft()[1]
        while flow.arrived and flow.arrived[0][0] < horizon:
            _, priority, tokens = flow.arrived.popleft()
            left = flow.arrived_sum[priority] - tokens
            if left:
                flow.arrived_sum[priority] = left
            else:
                del flow.arrived_sum[priority]
        span = min(_RATE_WINDOW_S, saturated)
        if not flow.drained or span < _RATE_MIN_SPAN_S:
            return None
        if flow.drained_sum < flow.inflight:
            # Until what is admitted has turned over once, the completions seen are only the
            # early finishers of requests admitted together: a rate from them projects waits
            # several times too long (a GPU's batch of 8k-token requests shed 45 of 64 that
            # it served within half the timeout).
            return None
        return flow.drained_sum / span

    @staticmethod
    def _arrival(flow: _ModelFlow, ticket: FlowTicket, now: float) -> None:
        """Counts the tokens of a request that arrived while others waited and was taken (queued
        or admitted): a sample of what its priority takes of the drain rate."""
        flow.arrived.append((flow.saturated_clock(now), ticket.priority, ticket.cost))
        flow.arrived_sum[ticket.priority] = flow.arrived_sum.get(ticket.priority, 0) + ticket.cost

    @staticmethod
    def _projected_s(flow: _ModelFlow, now: float, rate: float, priority: int, ahead: int) -> float:
        """Seconds until `ahead` tokens queued before a waiter of `priority` (its own included)
        are served: at the drain rate `rate` (from `_rate`, which also pruned the arrivals) less
        the tokens per second of better priorities that arrived over the same window, as
        those keep going ahead of it. Infinite when they take the whole rate."""
        span = min(_RATE_WINDOW_S, flow.saturated_clock(now))
        better = sum(t for p, t in flow.arrived_sum.items() if p < priority)
        left = rate - better / span
        return ahead / left if left > 0 else float("inf")

    @staticmethod
    def _projection(projected_s: float) -> str:
        if projected_s == float("inf"):
            return "better priorities take all the model drains"
        return f"its projected wait {projected_s:.0f} s"

    def _refuse_if_overloaded(
        self, flow: _ModelFlow, ticket: FlowTicket, tenant_key: str, weight: float
    ) -> None:
        now = ticket.arrived
        rate = self._rate(flow, now)
        if rate:
            band = flow.bands.get(ticket.priority)
            ahead = sum(b.tokens for p, b in flow.bands.items() if p < ticket.priority)
            if band is not None:
                tag = self._finish_tag(band, tenant_key, ticket, weight)
                ahead += sum(t.cost for t in band.heap if t.state == _WAITING and t.finish <= tag)
            wait_s = self._projected_s(flow, now, rate, ticket.priority, ahead + ticket.cost)
            if wait_s > self.timeout_s:
                retry_s = wait_s - self.timeout_s
                if retry_s == float("inf"):
                    retry_s = self._retry_s(flow, now)
                raise self._shed(ticket, "overload", retry_s, self._projection(wait_s))
        if flow.waiting < self.max_queued:
            return
        worst = max(flow.bands)
        if worst <= ticket.priority:
            raise self._shed(
                ticket, "queue_full", self._retry_s(flow, now), f"{flow.waiting} requests wait"
            )
        band = flow.bands[worst]
        victim = max(t for t in band.heap if t.state == _WAITING)
        self._shed_waiter(
            flow, victim, "queue_full", f"a request of priority {ticket.priority} took its place"
        )

    def _retry_s(self, flow: _ModelFlow, now: float) -> float:
        rate = self._rate(flow, now)
        queued = sum(b.tokens for b in flow.bands.values())
        return queued / rate if rate else self.timeout_s

    def _shed(self, ticket: FlowTicket, reason: str, retry_s: float, why: str) -> GatewayError:
        labels = (ticket.model, ticket.tenant, str(ticket.priority), reason)
        self._metrics.flow_shed.labels(*labels).inc()
        return too_many_requests(
            f"Model {ticket.model!r} is overloaded: request of priority {ticket.priority} shed "
            f"({why}; --queue-timeout-s {self.timeout_s:g}).",
            retry_s,
            "overloaded",
        )

    def _shed_waiter(self, flow: _ModelFlow, ticket: FlowTicket, reason: str, why: str) -> None:
        self._remove(flow, ticket)
        assert ticket.future is not None
        if not ticket.future.done():
            ticket.future.set_exception(
                self._shed(ticket, reason, self._retry_s(flow, self._clock()), why)
            )

    def _check(self, model: str, flow: _ModelFlow) -> None:
        """Admits what the budget holds now, then sheds waiters whose projected wait passes
        their remaining time, the worst priority's first (they wait behind everyone)."""
        self._dispatch(model, flow)
        now = self._clock()
        rate = self._rate(flow, now)
        if not rate or not flow.waiting:
            return
        ahead = 0
        for priority in sorted(flow.bands):
            band = flow.bands[priority]
            shed: list[tuple[FlowTicket, float]] = []
            for t in band.live():
                ahead += t.cost
                projected = self._projected_s(flow, now, rate, priority, ahead)
                if now - t.arrived + projected > self.timeout_s:
                    shed.append((t, projected))
                    ahead -= t.cost
            for t, projected in shed:
                self._shed_waiter(flow, t, "overload", f"{self._projection(projected)} more")

    def _ensure_ticker(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.get_running_loop().create_task(
                self._tick(), name="pdplane-flow-control"
            )

    async def _tick(self) -> None:
        while any(f.waiting for f in self._flows.values()):
            await asyncio.sleep(_TICK_S)
            for model, flow in list(self._flows.items()):
                if flow.waiting:
                    self._check(model, flow)

    def _child(self, family: Any, ticket: FlowTicket) -> Any:
        """`family`'s child for the ticket's (model, tenant, priority), cached (labels()
        hashes and locks on every call)."""
        key = (id(family), ticket.model, ticket.tenant, ticket.priority)
        child = self._children.get(key)
        if child is None:
            labels = (ticket.model, ticket.tenant, str(ticket.priority))
            child = self._children[key] = family.labels(*labels)
        return child

    def _per_model(self, family: Any, model: str) -> Any:
        key = (id(family), model)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(model)
        return child
