"""Batched Releases: they ride on the next Schedule, or go out in one ReleaseBatch."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from pdplane.scheduler import RequestFeatures, SchedulerBusy
from pdplane.scheduler.remote import RemoteScheduler
from pdplane.scheduler.server import SchedulerServer
from pdplane.v1 import instance_pb2, scheduler_pb2, scheduler_pb2_grpc
from tests.integration.scheduler.conftest import Fleet


def _inflight(server: SchedulerServer) -> set[str]:
    assert server.app.service is not None
    return set(server.app.service.inflight.request_ids())


def _release_counts(server: SchedulerServer) -> dict[str, float]:
    counts = {}
    for metric in server.app.metrics.registry.collect():
        if metric.name == "pdplane_scheduler_releases":
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    key = f"{sample.labels['outcome']}/{sample.labels['known']}"
                    counts[key] = sample.value
    return counts


@pytest.fixture
def one_pair(fleet: Fleet) -> Fleet:
    fleet.add("p0", "prefill")
    fleet.add("d0", "decode")
    return fleet


async def test_a_queued_release_rides_on_the_next_schedule(
    one_pair: Fleet,
    scheduler_factory: Callable[..., SchedulerServer],
    client_factory: Callable[..., RemoteScheduler],
) -> None:
    server = scheduler_factory()
    client = client_factory(server.address, release_batch_s=30.0)  # no timer flush here
    await client.schedule(RequestFeatures("a", "tiny", 16, 16))
    client.release_nowait("a", "success")
    assert _inflight(server) == {"a"}  # queued, nothing sent yet
    await client.schedule(RequestFeatures("b", "tiny", 16, 16))
    assert _inflight(server) == {"b"}  # "a" was released by b's Schedule call
    assert _release_counts(server) == {"success/true": 1.0}
    # A retry of the same id: its Release travels with its new Schedule, applied first.
    client.release_nowait("b", "failed")
    await client.schedule(RequestFeatures("b", "tiny", 16, 16, exclude_instance_ids=["x"]))
    assert _inflight(server) == {"b"}
    assert _release_counts(server) == {"success/true": 1.0, "failed/true": 1.0}


@pytest.mark.parametrize("stream", [True, False], ids=["on-the-stream", "release-batch"])
async def test_queued_releases_are_flushed_in_one_batch_without_a_schedule(
    one_pair: Fleet,
    scheduler_factory: Callable[..., SchedulerServer],
    client_factory: Callable[..., RemoteScheduler],
    stream: bool,
) -> None:
    server = scheduler_factory()
    client = client_factory(server.address, release_batch_s=0.05, stream=stream)
    for rid in ("a", "b", "c"):
        await client.schedule(RequestFeatures(rid, "tiny", 16, 16))
    for rid in ("a", "b", "c"):
        client.release_nowait(rid, "cancelled")
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 2.0
    while _inflight(server) and loop.time() < deadline:
        await asyncio.sleep(0.01)
    assert _inflight(server) == set()
    assert _release_counts(server) == {"cancelled/true": 3.0}
    with pytest.raises(ValueError, match="outcome"):
        client.release_nowait("d", "maybe")


async def test_release_batch_with_an_invalid_entry_applies_none(
    one_pair: Fleet,
    scheduler_factory: Callable[..., SchedulerServer],
    client_factory: Callable[..., RemoteScheduler],
) -> None:
    server = scheduler_factory()
    client = client_factory(server.address)
    await client.schedule(RequestFeatures("a", "tiny", 16, 16))
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        ok = scheduler_pb2.ReleaseRequest(request_id="a", outcome=scheduler_pb2.OUTCOME_SUCCESS)
        bad = scheduler_pb2.ReleaseRequest(request_id="", outcome=scheduler_pb2.OUTCOME_SUCCESS)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.ReleaseBatch(scheduler_pb2.ReleaseBatchRequest(releases=[ok, bad]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id" in (err.value.details() or "")
        assert _inflight(server) == {"a"}
        reply = await stub.ReleaseBatch(scheduler_pb2.ReleaseBatchRequest(releases=[ok, ok]))
        assert reply.released == 1  # the second one was no longer in flight
    assert _inflight(server) == set()


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "unary"])
async def test_releases_on_a_refused_busy_schedule_are_not_sent_again(
    fleet: Fleet,
    scheduler_factory: Callable[..., SchedulerServer],
    client_factory: Callable[..., RemoteScheduler],
    stream: bool,
) -> None:
    # The scheduler applied them before it refused: sent again, one could ride past the
    # retry of its request (the same id) and end that retry's assignment.
    fleet.add("p0", "prefill")
    fleet.add("d0", "decode")
    fleet.loads["d0"] = instance_pb2.LoadReport(total_kv_blocks=1000, free_kv_blocks=0)
    server = scheduler_factory()
    service = server.app.service
    assert service is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 5.0
    while loop.time() < deadline and not any(
        c.total_kv_blocks for c in service.view.candidates("tiny")
    ):
        await asyncio.sleep(0.01)
    client = client_factory(server.address, release_batch_s=30.0, stream=stream)
    client.release_nowait("gone", "success")
    with pytest.raises(SchedulerBusy, match="no KV room"):
        await client.schedule(RequestFeatures("b", "tiny", 16, 16))
    assert client._pending == []
    assert _release_counts(server) == {"success/false": 1.0}
