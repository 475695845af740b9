"""Flow control (`pdplane.gateway.flow`): the in-flight budget, priority bands, fairness between
tenants by tokens, shedding with 429 and the 503 of a wait past the timeout."""

from __future__ import annotations

import asyncio

import pytest

from pdplane.gateway.errors import GatewayError
from pdplane.gateway.flow import FlowControl, FlowTicket
from pdplane.gateway.metrics import GatewayMetrics

M = "m"


def _flow(  # type: ignore[no-untyped-def]
    budget: int | None = 100, timeout_s: float = 5.0, max_queued: int = 100, ceiling: int = 0, **kw
) -> FlowControl:
    """Flow control with a fixed budget; `ceiling` (default twice the budget) bounds shares."""
    limits = None if budget is None else (budget, ceiling or 2 * budget)
    return FlowControl(lambda _m: limits, timeout_s, max_queued, GatewayMetrics(), **kw)


async def _order(flow: FlowControl, entries: list[tuple[str, int, int]]) -> list[int]:
    """Fills the budget with one request, queues `entries` (tenant, priority, cost) in order,
    then releases one admitted request at a time; returns the entries' indexes in the order
    they were admitted. (The holder's weight leaves the others no share to be admitted on.)"""
    holder = await flow.admit(M, "holder", 0, 100, 1e6)
    admitted: list[int] = []
    tickets: dict[int, FlowTicket] = {}

    async def one(i: int, tenant: str, priority: int, cost: int) -> None:
        tickets[i] = await flow.admit(M, tenant, priority, cost)
        admitted.append(i)

    tasks = [asyncio.create_task(one(i, *e)) for i, e in enumerate(entries)]
    await asyncio.sleep(0.01)
    assert admitted == []
    flow.release(holder)
    while len(admitted) < len(entries):
        await asyncio.sleep(0.001)
        for i in list(admitted):
            if i in tickets:
                flow.release(tickets.pop(i))
    await asyncio.gather(*tasks)
    return admitted


async def test_within_the_budget_admits_at_once_and_past_it_waits() -> None:
    flow = _flow(budget=100)  # one tenant: its share is the whole budget
    a = await flow.admit(M, "t", 0, 60)
    b = await flow.admit(M, "t", 0, 40)
    assert flow.inflight_tokens(M) == 100
    waiter = asyncio.create_task(flow.admit(M, "t", 0, 10))
    await asyncio.sleep(0.01)
    assert not waiter.done() and flow.queued(M) == 1
    flow.release(a)
    c = await asyncio.wait_for(waiter, 1)
    assert flow.inflight_tokens(M) == 50
    for t in (b, c, c):  # idempotent
        flow.release(t)
    assert flow.inflight_tokens(M) == 0


async def test_a_request_larger_than_the_budget_goes_alone() -> None:
    flow = _flow(budget=100)
    big = await flow.admit(M, "t", 0, 500)
    assert flow.inflight_tokens(M) == 500
    flow.release(big)


async def test_higher_priority_first_whatever_the_arrival_order() -> None:
    order = await _order(_flow(), [("a", 5, 100), ("b", 5, 100), ("c", 0, 100), ("d", -1, 100)])
    assert order == [3, 2, 0, 1]


async def test_fair_between_tenants_a_flood_does_not_delay_the_quiet_one() -> None:
    # Tenant "noisy" queued 10 requests before "quiet" sent one: quiet goes second, not 11th.
    entries = [("noisy", 0, 100)] * 10 + [("quiet", 0, 100)]
    assert (await _order(_flow(), entries)).index(10) <= 1
    # FIFO: in arrival order.
    assert await _order(_flow(policy="fifo"), entries) == list(range(11))


async def test_fairness_is_by_tokens_not_requests() -> None:
    # "big" sends 3 prompts of 400 tokens, "small" 12 of 100: each gets the same tokens, so
    # 4 of small's requests go between two of big's (by requests it would be 1).
    entries = [("big", 0, 400)] * 3 + [("small", 0, 100)] * 12
    order = await _order(_flow(budget=400), entries)
    between = order[order.index(0) + 1 : order.index(1)]
    assert len(between) == 4 and all(i >= 3 for i in between)


async def test_a_tenant_within_its_share_is_admitted_at_once_even_over_the_budget() -> None:
    flow = _flow(budget=1000, ceiling=3000)
    noisy = [await flow.admit(M, "noisy", 0, 100) for _ in range(10)]  # the whole budget
    queued = [asyncio.create_task(flow.admit(M, "noisy", 0, 100)) for _ in range(5)]
    await asyncio.sleep(0.01)
    assert flow.queued(M) == 5
    # Two active tenants: quiet's share is 500 tokens of the budget; within it, no wait.
    quiet = [await asyncio.wait_for(flow.admit(M, "quiet", 0, 100), 0.1) for _ in range(5)]
    assert flow.inflight_tokens(M) == 1500
    # Past it, with noisy's requests waiting and none of its own, its burst takes the room
    # between the budget and the ceiling (3000), up to its share of the ceiling (1500).
    quiet += [await asyncio.wait_for(flow.admit(M, "quiet", 0, 100), 0.1) for _ in range(10)]
    assert flow.inflight_tokens(M) == 2500
    # Past that it waits its turn like anyone (after noisy's earlier requests: fair).
    late = asyncio.create_task(flow.admit(M, "quiet", 0, 100))
    await asyncio.sleep(0.01)
    assert not late.done()
    # Within its share but past the ceiling (the KV cache): it waits too.
    capped = _flow(budget=1000, ceiling=1050)
    held = [await capped.admit(M, "noisy", 0, 100) for _ in range(10)]
    over = asyncio.create_task(capped.admit(M, "quiet", 0, 100))
    await asyncio.sleep(0.01)
    assert not over.done()
    capped.release(held.pop())
    capped.release(await asyncio.wait_for(over, 1))
    for t in held:
        capped.release(t)
    # FIFO gives no share.
    fifo = _flow(budget=1000, policy="fifo")
    held = [await fifo.admit(M, "noisy", 0, 100) for _ in range(10)]
    waiting = asyncio.create_task(fifo.admit(M, "quiet", 0, 100))
    await asyncio.sleep(0.01)
    assert not waiting.done()
    for t in held:
        fifo.release(t)
    fifo.release(await waiting)
    for t in noisy + quiet:
        flow.release(t)
    for task in [*queued, late]:
        flow.release(await task)
    assert flow.inflight_tokens(M) == 0 and flow.queued(M) == 0


async def test_the_room_past_the_budget_is_for_bursts_beside_a_flood_only() -> None:
    # A lone tenant, however bursty, stays within the budget: nobody waits beside it.
    lone = _flow(budget=1000, ceiling=3000)
    held = [await lone.admit(M, "t", 0, 100) for _ in range(10)]
    over = asyncio.create_task(lone.admit(M, "t", 0, 100))
    await asyncio.sleep(0.01)
    assert not over.done()
    lone.release(held.pop())
    held.append(await asyncio.wait_for(over, 1))
    for t in held:
        lone.release(t)
    # A tenant with a request of its own waiting is flooding too: no room for it, even once
    # its share of the ceiling would hold the newcomer again.
    flow = _flow(budget=1000, ceiling=3000)
    noisy = [await flow.admit(M, "noisy", 0, 100) for _ in range(10)]
    queued = [asyncio.create_task(flow.admit(M, "noisy", 0, 100)) for _ in range(3)]
    quiet = [await asyncio.wait_for(flow.admit(M, "quiet", 0, 100), 0.1) for _ in range(15)]
    late = [asyncio.create_task(flow.admit(M, "quiet", 0, 100))]
    await asyncio.sleep(0.01)
    flow.release(quiet.pop())
    late.append(asyncio.create_task(flow.admit(M, "quiet", 0, 100)))
    await asyncio.sleep(0.01)
    assert not any(t.done() for t in late) and flow.queued(M) == 5
    for t in [*noisy, *quiet]:
        flow.release(t)
    for task in [*queued, *late]:
        flow.release(await asyncio.wait_for(task, 1))
    assert flow.inflight_tokens(M) == 0 and flow.queued(M) == 0


async def test_weights_share_in_proportion() -> None:
    flow = _flow()
    holder = await flow.admit(M, "h", 0, 100, 1e6)
    admitted: list[str] = []

    async def one(tenant: str, weight: float) -> None:
        t = await flow.admit(M, tenant, 0, 100, weight)
        admitted.append(tenant)
        flow.release(t)

    tasks = [asyncio.create_task(one("heavy", 3.0)) for _ in range(30)]
    tasks += [asyncio.create_task(one("light", 1.0)) for _ in range(30)]
    await asyncio.sleep(0.01)
    flow.release(holder)
    await asyncio.gather(*tasks)
    assert admitted[:20].count("heavy") == 15


async def test_queue_full_sheds_the_lowest_priority_with_429_and_retry_after() -> None:
    flow = _flow(max_queued=2)
    holder = await flow.admit(M, "h", 0, 100, 1e6)
    low1 = asyncio.create_task(flow.admit(M, "t", 5, 10))
    low2 = asyncio.create_task(flow.admit(M, "t", 5, 10))
    await asyncio.sleep(0.01)
    # Full: another low-priority request is refused at once...
    with pytest.raises(GatewayError) as refused:
        await flow.admit(M, "t", 5, 10)
    assert refused.value.status == 429 and int(refused.value.headers["retry-after"]) >= 1
    # ...a high-priority one takes the place of the last low one, which gets 429.
    high = asyncio.create_task(flow.admit(M, "t", 0, 10))
    await asyncio.sleep(0.01)
    assert low2.done() and isinstance(low2.exception(), GatewayError)
    assert low2.exception().status == 429  # type: ignore[union-attr]
    flow.release(holder)
    assert (await high).priority == 0
    await low1


async def test_no_turn_within_the_timeout_is_a_503() -> None:
    flow = _flow(timeout_s=0.05)
    holder = await flow.admit(M, "h", 0, 100, 1e6)
    with pytest.raises(GatewayError) as timed_out:
        await flow.admit(M, "t", 0, 10)
    assert timed_out.value.status == 503 and "--queue-timeout-s 0.05" in timed_out.value.message
    assert flow.queued(M) == 0
    flow.release(holder)


async def test_a_client_leaving_leaves_the_queue_and_takes_nothing() -> None:
    flow = _flow()
    holder = await flow.admit(M, "h", 0, 100, 1e6)
    waiter = asyncio.create_task(flow.admit(M, "t", 0, 10))
    await asyncio.sleep(0.01)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert flow.queued(M) == 0
    flow.release(holder)
    assert flow.inflight_tokens(M) == 0


async def test_unknown_capacity_and_timeout_zero_admit_everything() -> None:
    for flow in (_flow(budget=None), _flow(timeout_s=0)):
        tickets = [await flow.admit(M, "t", 0, 1000) for _ in range(10)]
        assert flow.inflight_tokens(M) == 10_000
        for t in tickets:
            flow.release(t)


async def _saturate(flow: FlowControl, now: list[float], seconds: int) -> FlowTicket:
    """Drains 100 tokens per second for `seconds` s of the fake clock `now` with a request
    always waiting (the model at its budget of 100); returns the request left in flight (its
    tenant's weight leaves others no share to be admitted on)."""
    current = await flow.admit(M, "h", 0, 100, 1e6)
    for _ in range(seconds):
        waiting = asyncio.create_task(flow.admit(M, "h", 0, 100, 1e6))
        await asyncio.sleep(0.01)
        assert flow.queued(M) == 1
        now[0] += 1.0
        flow.release(current)
        current = await waiting
    return current


async def test_projected_wait_past_the_timeout_is_shed_lowest_priority_first() -> None:
    now = [0.0]
    flow = _flow(budget=100, timeout_s=2.0, max_queued=1000, clock=lambda: now[0])
    holder = await _saturate(flow, now, 3)  # the rate the projection uses: 100 tokens/s
    high = [asyncio.create_task(flow.admit(M, "hi", 0, 50)) for _ in range(2)]  # ~1 s of work
    await asyncio.sleep(0.01)
    # Behind 1 s of high-priority work, a low-priority request of 150 tokens projects 2.5 s.
    with pytest.raises(GatewayError) as shed:
        await flow.admit(M, "lo", 5, 150)
    assert shed.value.status == 429 and shed.value.type_ == "overloaded"
    # A high-priority one of 50 tokens projects 1.5 s: it waits.
    more = asyncio.create_task(flow.admit(M, "hi", 0, 50))
    await asyncio.sleep(0.01)
    assert not more.done()
    flow.release(holder)
    for task in [*high, more]:
        flow.release(await task)


async def test_no_shedding_on_a_rate_until_what_is_in_flight_turned_over_once() -> None:
    # Ten requests of 100 tokens admitted together (the budget); after 3 s with requests
    # waiting, only two ended: 200 tokens against 1,000 in flight say little of the rate.
    now = [0.0]
    flow = _flow(budget=1000, ceiling=1000, timeout_s=5.0, max_queued=1000, clock=lambda: now[0])
    batch = [await flow.admit(M, "b", 0, 100, 1e6) for _ in range(10)]
    queue = [asyncio.create_task(flow.admit(M, "b", 0, 100, 1e6)) for _ in range(40)]
    await asyncio.sleep(0.01)
    for _ in range(2):
        now[0] += 1.5
        flow.release(batch.pop())
    await asyncio.sleep(0.15)  # a check of the queue ran
    # 200 tokens in 3 s would project the last of 40 waiters (4,000 tokens) at 60 s: none shed.
    assert not any(t.done() for t in queue[2:])
    assert flow.queued(M) == 38
    # Once what was admitted turned over, the measured rate sheds what cannot make it.
    for _ in range(8):
        now[0] += 0.1
        flow.release(batch.pop())
    await asyncio.sleep(0.15)
    shed = [t for t in queue if t.done() and isinstance(t.exception(), GatewayError)]
    assert shed, "a measured rate past one turnover sheds the waits it projects past 5 s"
    for t in queue:
        if t.done() and t.exception() is None:
            flow.release(t.result())
        elif not t.done():
            t.cancel()


async def _burst(flow: FlowControl, now: list[float], waiting: int) -> list[int]:
    """Fills the budget of 100 with one request and queues `waiting` more of 100 tokens (each
    1 s of work at 100 tokens/s); returns the statuses of those shed, then serves the rest at
    that rate on the fake clock `now`."""
    holder = await flow.admit(M, "b", 0, 100)
    tasks = [asyncio.create_task(flow.admit(M, "b", 0, 100)) for _ in range(waiting)]
    await asyncio.sleep(0.15)  # a check of the queue (every 100 ms) ran
    shed = [
        t.exception().status  # type: ignore[union-attr]
        for t in tasks
        if t.done() and isinstance(t.exception(), GatewayError)
    ]
    for task in [None, *tasks]:
        if task is not None and task.done() and task.exception() is not None:
            continue
        now[0] += 1.0
        flow.release(holder if task is None else await task)
    return shed


async def test_after_a_quiet_spell_a_burst_is_not_shed_on_an_idle_drain_rate() -> None:
    # The time nothing waited says nothing about what the model can drain: a burst within
    # the timeout (3 s of work at 100 tokens/s, timeout 5 s) is queued, not shed.
    now = [0.0]
    trickle = _flow(budget=100, timeout_s=5.0, max_queued=1000, clock=lambda: now[0])
    small = await trickle.admit(M, "t", 0, 10)  # one small request, then quiet
    now[0] += 0.5
    trickle.release(small)
    now[0] += 2.5
    assert await _burst(trickle, now, 3) == []
    # A measured rate (100 tokens/s while saturated) survives a quiet spell of 9.5 s.
    now = [0.0]
    quiet = _flow(budget=100, timeout_s=5.0, max_queued=1000, clock=lambda: now[0])
    quiet.release(await _saturate(quiet, now, 3))
    now[0] += 9.5
    assert await _burst(quiet, now, 3) == []
    # Past the timeout it still sheds: 8 s of work queued, the last ones projected past 5 s.
    assert 429 in await _burst(quiet, now, 8)


async def test_worse_priorities_in_flight_do_not_count_against_a_better_one() -> None:
    flow = _flow(budget=1000, ceiling=1200)
    low = [await flow.admit(M, "batch", 10, 100) for _ in range(10)]  # the whole budget
    # Priority 0 has the budget to itself, within the ceiling (the KV cache): 2 more fit.
    high = [await asyncio.wait_for(flow.admit(M, "chat", 0, 100, 1e-6), 0.1) for _ in range(2)]
    third = asyncio.create_task(flow.admit(M, "chat", 0, 100, 1e-6))
    await asyncio.sleep(0.01)
    assert not third.done()  # past the ceiling
    flow.release(low.pop())
    flow.release(await asyncio.wait_for(third, 1))
    for t in low + high:
        flow.release(t)
    assert flow.inflight_tokens(M) == 0


async def _stream(flow: FlowControl, now: list[float], step_s: float, steps: int) -> FlowTicket:
    """Keeps the budget of 100 full with priority-0 requests of 100 tokens: each step one more
    arrives and waits, the fake clock `now` moves `step_s`, the one in flight ends and the
    newcomer takes its place (100 tokens per `step_s` arrive and drain). Returns the request
    left in flight."""
    current = await flow.admit(M, "hi", 0, 100)
    for _ in range(steps):
        nxt = asyncio.create_task(flow.admit(M, "hi", 0, 100))
        await asyncio.sleep(0.01)
        now[0] += step_s
        flow.release(current)
        current = await asyncio.wait_for(nxt, 1)
    return current


async def test_a_low_priority_request_behind_a_steady_better_stream_is_shed_early() -> None:
    # The better priority arrives as fast as the model drains (1,000 tokens/s), so a worse
    # one is never served; the tokens queued ahead of it at any moment are few (one request),
    # so a projection from them alone kept it waiting until its timeout and a 503.
    now = [0.0]
    flow = _flow(budget=100, ceiling=100, timeout_s=1.0, max_queued=1000, clock=lambda: now[0])
    current = await _stream(flow, now, 0.1, 25)  # 2.5 s of the stream: a measured rate
    low = asyncio.create_task(flow.admit(M, "lo", 5, 10))
    await asyncio.sleep(0.01)  # it arrived
    for _ in range(40):
        if low.done():
            break
        nxt = asyncio.create_task(flow.admit(M, "hi", 0, 100))
        await asyncio.sleep(0.15)  # a check of the queue ran
        now[0] += 0.1
        flow.release(current)
        current = await asyncio.wait_for(nxt, 2)
    shed = low.exception()
    assert isinstance(shed, GatewayError)
    assert shed.status == 429 and shed.type_ == "overloaded"
    assert int(shed.headers["retry-after"]) >= 1
    assert now[0] == pytest.approx(2.5), "shed at arrival, before the stream moved on"
    flow.release(current)
    assert flow.queued(M) == 0 and flow.inflight_tokens(M) == 0


async def test_a_timeout_while_the_model_drains_is_a_429_and_while_it_stalls_a_503() -> None:
    # No measured rate (the clock stands still), so nothing is shed on a projection: the low
    # priority waits its whole timeout while the better one's requests go ahead of it. The
    # model drained all along: it is overloaded, not down, so the answer is 429 to retry.
    flow = _flow(budget=100, ceiling=100, timeout_s=0.3)
    current = await flow.admit(M, "hi", 0, 100)
    low = asyncio.create_task(flow.admit(M, "lo", 5, 10))
    while not low.done():
        nxt = asyncio.create_task(flow.admit(M, "hi", 0, 100))
        await asyncio.sleep(0.02)
        flow.release(current)
        current = await asyncio.wait_for(nxt, 1)
    overloaded = low.exception()
    assert isinstance(overloaded, GatewayError)
    assert overloaded.status == 429 and overloaded.type_ == "overloaded"
    assert int(overloaded.headers["retry-after"]) >= 1
    assert "--queue-timeout-s 0.3" in overloaded.message
    # Nothing ended during the wait: the model makes no progress, 503.
    with pytest.raises(GatewayError) as stalled:
        await flow.admit(M, "lo", 5, 10)
    assert stalled.value.status == 503
    flow.release(current)
    assert flow.queued(M) == 0 and flow.inflight_tokens(M) == 0
