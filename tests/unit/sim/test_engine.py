"""Admission: FIFO, running slots, KV blocks, cancellation while waiting."""

from __future__ import annotations

import asyncio

from pdplane.sim.engine import EngineState
from pdplane.sim.faults import FaultPlan


async def test_waits_for_a_running_slot_in_arrival_order() -> None:
    engine = EngineState(max_running=1, kv_blocks=8, block_size=4)
    first = await engine.admit(2)
    order: list[str] = []

    async def later(name: str) -> None:
        admission = await engine.admit(1)
        order.append(name)
        engine.finish(admission)

    tasks = [asyncio.create_task(later("a")), asyncio.create_task(later("b"))]
    await asyncio.sleep(0)
    assert (engine.num_running, engine.num_waiting) == (1, 2)
    engine.finish(first)
    await asyncio.gather(*tasks)
    assert order == ["a", "b"]
    assert (engine.num_running, engine.num_waiting, engine.free_blocks) == (0, 0, 8)


async def test_waits_for_kv_blocks_and_keeps_held_ones() -> None:
    engine = EngineState(max_running=4, kv_blocks=4, block_size=4)
    a = await engine.admit(3)
    waiter = asyncio.create_task(engine.admit(2))
    await asyncio.sleep(0)
    assert not waiter.done() and engine.kv_usage == 0.75
    kept = engine.finish(a, keep=2)  # two blocks stay held for a remote decode
    assert len(kept) == 2
    b = await asyncio.wait_for(waiter, 1)
    assert engine.free_blocks == 0
    engine.finish(b)
    engine.free(kept)
    assert engine.free_blocks == 4


async def test_cancelled_waiter_leaves_the_queue() -> None:
    engine = EngineState(max_running=1, kv_blocks=4, block_size=4)
    a = await engine.admit(1)
    waiter = asyncio.create_task(engine.admit(1))
    await asyncio.sleep(0)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    assert engine.num_waiting == 0
    engine.finish(a)
    assert (engine.running, engine.free_blocks) == (0, 4)


def test_blocks_for_rounds_up_and_caps() -> None:
    engine = EngineState(max_running=1, kv_blocks=4, block_size=16)
    assert [engine.blocks_for(n) for n in (1, 16, 17, 10_000)] == [1, 1, 2, 4]


def test_fault_plan_fail_next_then_rate() -> None:
    plan = FaultPlan(fail_mode="drop")
    plan.update({"fail_next": 2})
    assert [plan.draw() for _ in range(3)] == ["drop", "drop", None]
    plan.update({"failure_rate": 1.0, "fail_mode": "stall"})
    assert plan.draw() == "stall"
    for bad in ({"failure_rate": 2}, {"fail_mode": "x"}, {"nope": 1}, {"fail_next": -1}):
        try:
            plan.update(bad)
        except ValueError:
            continue
        raise AssertionError(f"{bad} accepted")
