"""In-flight accounting over gRPC: a burst between heartbeats spreads; Release ends it."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Callable

import pytest

from pdplane.scheduler import RequestFeatures
from pdplane.scheduler.remote import RemoteScheduler
from pdplane.scheduler.server import SchedulerServer
from pdplane.v1 import instance_pb2
from tests.integration.scheduler.conftest import Fleet, sees, view_of, wait_for


async def _burst(client: RemoteScheduler, n: int, prefix: str) -> Counter[str]:
    responses = await asyncio.gather(
        *(client.schedule(RequestFeatures(f"{prefix}{i}", "tiny", 64, 64)) for i in range(n))
    )
    return Counter(r.decode.instance_id for r in responses)


@pytest.fixture
def one_by_four(fleet: Fleet) -> Fleet:
    """p0 plus d0..d3, all reporting idle."""
    fleet.add("p0", "prefill")
    for name in ("d0", "d1", "d2", "d3"):
        fleet.add(name, "decode")
    return fleet


async def test_a_burst_of_100_spreads_over_decodes_by_load(
    one_by_four: Fleet,
    scheduler_factory: Callable[..., SchedulerServer],
    client_factory: Callable[..., RemoteScheduler],
) -> None:
    # d0 reports 50 running requests; the others report idle. Reports stay constant during the
    # burst, so only the scheduler's own in-flight count can spread it.
    one_by_four.loads["d0"] = instance_pb2.LoadReport(num_running=50)
    server = scheduler_factory(decode_policy="least_loaded")
    wait_for(
        lambda: any(
            c.instance_id == "d0" and c.num_running == 50
            for c in view_of(server).candidates("tiny")
        ),
        what="d0's load report",
    )
    client = client_factory(server.address)
    spread = await _burst(client, 100, "a")
    assert sorted(spread.values()) == [33, 33, 34]  # d1..d3 stay below d0's reported 50
    assert "d0" not in spread
    # Released requests stop counting: the next burst spreads the same way again.
    released = await asyncio.gather(*(client.release(f"a{i}", "success") for i in range(100)))
    assert all(released)
    assert sorted((await _burst(client, 30, "b")).values()) == [10, 10, 10]


@pytest.mark.parametrize("policy", ["power_of_two", "round_robin"])
async def test_other_policies_spread_a_burst_too(
    policy: str,
    one_by_four: Fleet,
    scheduler_factory: Callable[..., SchedulerServer],
    client_factory: Callable[..., RemoteScheduler],
) -> None:
    server = scheduler_factory(decode_policy=policy, seed=11)
    wait_for(sees(server, "p0", "d0", "d1", "d2", "d3"))
    spread = await _burst(client_factory(server.address), 100, "r")
    assert len(spread) == 4 and max(spread.values()) <= 35, spread


async def test_release_reports_whether_the_id_was_in_flight(
    fleet: Fleet,
    scheduler_factory: Callable[..., SchedulerServer],
    client_factory: Callable[..., RemoteScheduler],
) -> None:
    fleet.add("p0", "prefill")
    fleet.add("d0", "decode")
    server = scheduler_factory()
    wait_for(sees(server, "p0", "d0"))
    client = client_factory(server.address)
    assert await client.release("never-scheduled", "cancelled") is False
    await client.schedule(RequestFeatures("r1", "tiny", 10))
    assert server.app.service is not None
    assert server.app.service.inflight.inflight_by_instance() == {"p0": 1, "d0": 1}
    assert await client.release("r1", "failed") is True
    assert await client.release("r1", "failed") is False
    assert server.app.service.inflight.inflight_by_instance() == {}
    with pytest.raises(ValueError, match="request_id: must not be empty"):
        await client.release("", "success")
    with pytest.raises(ValueError, match="outcome must be one of"):
        await client.release("r1", "done")
    # The scheduler still answers after all of the above.
    assert (await client.schedule(RequestFeatures("r2", "tiny", 10))).decode.instance_id == "d0"
