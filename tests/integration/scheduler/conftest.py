"""A real registry, a fleet of registered instances and a real scheduler, all on loopback."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from pdplane.registry.client import RegistrationClient
from pdplane.scheduler.remote import RemoteScheduler
from pdplane.scheduler.server import SchedulerServer
from pdplane.scheduler.view import CandidateView
from pdplane.v1 import instance_pb2
from tests.integration.registry.conftest import tls_files  # noqa: F401 - shared fixture
from tests.integration.registry.fixtures import make_spec, running_registry
from tests.integration.scheduler.fixtures import ROLES, running_scheduler_server


def wait_for(condition: Callable[[], bool], timeout: float = 5.0, what: str = "") -> None:
    """Polls `condition` every 20 ms until true; fails the test after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout} s waiting for {what or condition}")
        time.sleep(0.02)


class Fleet:
    """Instances registered (and heartbeating) through the real registration client."""

    def __init__(self, registry: str, tls_ca: str | None = None) -> None:
        self.registry = registry
        self.tls_ca = tls_ca
        self.clients: dict[str, RegistrationClient] = {}
        self.loads: dict[str, instance_pb2.LoadReport] = {}
        self.specs: dict[str, instance_pb2.InstanceSpec] = {}

    def add(self, instance_id: str, role: str = "prefill", **spec: Any) -> RegistrationClient:
        """Registers an instance; `spec` overrides InstanceSpec fields (kv_layout=, model=...)."""
        self.loads[instance_id] = instance_pb2.LoadReport()
        # Distinct addresses per instance so responses can be checked; nothing dials them.
        n = len(self.specs) + 1
        fields = {"url": f"http://127.0.0.1:{n}", "kv_endpoint": f"127.0.0.1:{1000 + n}", **spec}
        self.specs[instance_id] = make_spec(instance_id, ROLES[role], **fields)
        client = RegistrationClient(
            self.registry,
            self.specs[instance_id],
            lambda: self.loads[instance_id],
            tls_ca=self.tls_ca,
        )
        client.start()
        assert client.wait_registered(5.0), client.last_error
        self.clients[instance_id] = client
        return client

    def stop(self, instance_id: str) -> None:
        self.clients.pop(instance_id).stop()

    def close(self) -> None:
        for client in self.clients.values():
            client.stop()
        self.clients.clear()


@pytest.fixture
def registry() -> Iterator[str]:
    with running_registry(lease_ttl_ms=1000, heartbeat_interval_ms=100) as address:
        yield address


@pytest.fixture
def fleet(registry: str) -> Iterator[Fleet]:
    fleet = Fleet(registry)
    try:
        yield fleet
    finally:
        fleet.close()


@pytest.fixture
def scheduler_factory(registry: str) -> Iterator[Callable[..., SchedulerServer]]:
    """Starts schedulers on the test registry (keywords = SchedulerSettings fields)."""
    stack: list[Any] = []

    def start(**settings: Any) -> SchedulerServer:
        manager = running_scheduler_server(registry, **settings)
        server = manager.__enter__()
        stack.append(manager)
        return server

    try:
        yield start
    finally:
        for manager in reversed(stack):
            manager.__exit__(None, None, None)


@pytest.fixture
async def client_factory() -> Any:
    clients: list[RemoteScheduler] = []

    def make(address: str, **kwargs: Any) -> RemoteScheduler:
        clients.append(RemoteScheduler(address, **kwargs))
        return clients[-1]

    yield make
    for client in clients:
        await client.close()


def view_of(server: SchedulerServer) -> CandidateView:
    """The running scheduler's view of the registry."""
    view = server.app.view
    assert view is not None, "scheduler not started"
    return view


def sees(server: SchedulerServer, *ids: str, model: str = "tiny") -> Callable[[], bool]:
    """True once the scheduler's view holds exactly `ids` for `model`."""

    def check() -> bool:
        return {c.instance_id for c in view_of(server).candidates(model)} == set(ids)

    return check


@pytest.fixture
def pair_server(
    fleet: Fleet, scheduler_factory: Callable[..., SchedulerServer]
) -> Callable[..., SchedulerServer]:
    """Starts a scheduler (settings as keywords) over prefill p0 + decode d0, once it sees both."""
    fleet.add("p0", "prefill")
    fleet.add("d0", "decode")

    def start(**settings: object) -> SchedulerServer:
        server = scheduler_factory(**settings)
        wait_for(sees(server, "p0", "d0"))
        return server

    return start
