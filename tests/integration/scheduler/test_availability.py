"""UNAVAILABLE naming the missing side, recovery once it registers, registry restarts."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest

from pdplane.launch.ports import free_port_run
from pdplane.scheduler import RequestFeatures, SchedulerUnavailable
from pdplane.scheduler.remote import RemoteScheduler
from pdplane.scheduler.server import SchedulerServer
from tests.integration.registry.fixtures import running_registry
from tests.integration.scheduler.conftest import Fleet, sees, wait_for
from tests.integration.scheduler.fixtures import running_scheduler_server


async def test_only_decode_is_unavailable_naming_prefill_until_one_registers(
    fleet: Fleet,
    scheduler_factory: Callable[..., SchedulerServer],
    client_factory: Callable[..., RemoteScheduler],
) -> None:
    fleet.add("d0", "decode")
    server = scheduler_factory()
    wait_for(sees(server, "d0"))
    client = client_factory(server.address)
    with pytest.raises(SchedulerUnavailable, match="no prefill instance for model 'tiny'") as err:
        await client.schedule(RequestFeatures("r1", "tiny", 10))
    assert "none registered with role prefill" in err.value.reason
    fleet.add("p0", "prefill")
    wait_for(sees(server, "d0", "p0"))
    response = await client.schedule(RequestFeatures("r1", "tiny", 10))
    assert (response.prefill.instance_id, response.decode.instance_id) == ("p0", "d0")


async def test_only_prefill_is_unavailable_naming_decode(
    fleet: Fleet,
    scheduler_factory: Callable[..., SchedulerServer],
    client_factory: Callable[..., RemoteScheduler],
) -> None:
    fleet.add("p0", "prefill")
    server = scheduler_factory()
    wait_for(sees(server, "p0"))
    client = client_factory(server.address)
    with pytest.raises(SchedulerUnavailable, match="no decode instance for model 'tiny'"):
        await client.schedule(RequestFeatures("r1", "tiny", 10))
    fleet.add("d0", "decode")
    wait_for(sees(server, "p0", "d0"))
    assert (await client.schedule(RequestFeatures("r1", "tiny", 10))).decode.instance_id == "d0"


async def test_empty_registry_and_unknown_model(
    fleet: Fleet,
    scheduler_factory: Callable[..., SchedulerServer],
    client_factory: Callable[..., RemoteScheduler],
) -> None:
    server = scheduler_factory()
    client = client_factory(server.address)
    with pytest.raises(SchedulerUnavailable, match=r"no prefill instance .*none registered"):
        await client.schedule(RequestFeatures("r1", "tiny", 10))
    fleet.add("p0", "prefill")
    wait_for(sees(server, "p0"))
    with pytest.raises(SchedulerUnavailable, match=r"served: tiny"):
        await client.schedule(RequestFeatures("r1", "llama", 10))


async def test_serves_from_the_last_view_while_the_registry_restarts(
    client_factory: Callable[..., RemoteScheduler],
) -> None:
    port = free_port_run()
    settings = {"lease_ttl_ms": 1000, "heartbeat_interval_ms": 100}
    with contextlib.ExitStack() as stack:
        first = contextlib.ExitStack()  # the first registry's lifetime; close() is idempotent
        stack.callback(first.close)
        registry = first.enter_context(running_registry(port, **settings))
        fleet = Fleet(registry)
        stack.callback(fleet.close)
        fleet.add("p0", "prefill")
        fleet.add("d0", "decode")
        server = stack.enter_context(running_scheduler_server(registry))
        wait_for(sees(server, "p0", "d0"))
        client = client_factory(server.address)
        await client.schedule(RequestFeatures("before", "tiny", 10))
        watcher = server.app.watcher
        assert watcher is not None
        snapshots = watcher.snapshots

        first.close()
        wait_for(lambda: watcher.reconnects > 0, what="the watcher to notice the registry is gone")
        for i in range(5):  # the last view keeps serving while the registry is down
            response = await client.schedule(RequestFeatures(f"down-{i}", "tiny", 10))
            assert (response.prefill.instance_id, response.decode.instance_id) == ("p0", "d0")

        stack.enter_context(running_registry(port, **settings))
        wait_for(lambda: watcher.snapshots > snapshots, timeout=10, what="a fresh snapshot")
        wait_for(sees(server, "p0", "d0"), timeout=10, what="instances re-registered")
        response = await client.schedule(RequestFeatures("after", "tiny", 10))
        assert (response.prefill.instance_id, response.decode.instance_id) == ("p0", "d0")


async def test_starts_before_the_registry_and_serves_once_it_appears(
    client_factory: Callable[..., RemoteScheduler],
) -> None:
    registry = f"127.0.0.1:{free_port_run()}"
    with running_scheduler_server(registry, registry_wait_s=0.2) as server:
        client = client_factory(server.address)
        with pytest.raises(SchedulerUnavailable, match="none registered"):
            await client.schedule(RequestFeatures("r1", "tiny", 10))
        port = int(registry.rsplit(":", 1)[1])
        with running_registry(port, lease_ttl_ms=1000, heartbeat_interval_ms=100) as address:
            fleet = Fleet(address)
            try:
                fleet.add("p0", "prefill")
                fleet.add("d0", "decode")
                wait_for(sees(server, "p0", "d0"), timeout=10, what="the late registry's view")
                assert (
                    await client.schedule(RequestFeatures("r1", "tiny", 10))
                ).prefill.instance_id == "p0"
            finally:
                fleet.close()
