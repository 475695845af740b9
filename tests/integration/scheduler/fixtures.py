"""A running scheduler for tests of any area.

    from tests.integration.scheduler.fixtures import running_scheduler

    with running_registry() as registry, running_scheduler(registry) as address:
        client = RemoteScheduler(address)   # "127.0.0.1:<port>"
    with running_scheduler(registry, prefill_policy="round_robin", token="t") as address:
        ...

`running_scheduler` starts the real gRPC scheduler in-process on 127.0.0.1, port 0 (any free
port) unless `port=` is given, watching the registry at `registry_address`; any
`SchedulerSettings` field is a keyword. On exit it stops the server, its registry watcher and
its metrics server, and joins their threads. `running_scheduler_server` yields the
`SchedulerServer` instead (its `.address`, `.app.service`, `.app.view`, `.app.metrics`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pdplane.scheduler.server import SchedulerServer
from pdplane.scheduler.settings import SchedulerSettings
from pdplane.v1 import instance_pb2

__all__ = ["ROLES", "running_scheduler", "running_scheduler_server"]

#: Role names used by the scheduler tests -> protobuf Role.
ROLES = {
    "prefill": instance_pb2.ROLE_PREFILL,
    "decode": instance_pb2.ROLE_DECODE,
    "both": instance_pb2.ROLE_BOTH,
}


@contextlib.contextmanager
def running_scheduler_server(registry_address: str, **settings: Any) -> Iterator[SchedulerServer]:
    """Like `running_scheduler`, yielding the `SchedulerServer`."""
    fields = {"host": "127.0.0.1", "port": 0, "registry_wait_s": 5.0, **settings}
    config = SchedulerSettings.model_validate({"registry": registry_address, **fields})
    server = SchedulerServer(config)
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=0.2)


@contextlib.contextmanager
def running_scheduler(registry_address: str, **settings: Any) -> Iterator[str]:
    """A scheduler watching `registry_address` for the duration of the block; yields its
    address "127.0.0.1:<bound port>". Keywords are `SchedulerSettings` fields."""
    with running_scheduler_server(registry_address, **settings) as server:
        yield server.address
