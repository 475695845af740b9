"""A running registry for tests of any area.

    from tests.integration.registry.fixtures import running_registry, make_spec

    with running_registry() as address:            # "127.0.0.1:<port>"
        ...
    with running_registry(port, lease_ttl_ms=1000, token="t") as address:
        ...

`running_registry` starts the real gRPC service in-process on 127.0.0.1 (port 0 = any free
port), with any `RegistrySettings` field as a keyword, and stops it (joining its threads) on
exit; `running_relay` does the same for a host's heartbeat relay in front of a registry.
`make_spec` builds a valid InstanceSpec for tests. `store_defaults` holds settings every
registry started here gets unless the call overrides them (the registry suite sets the etcd
store's there, to run the same tests on both stores).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Iterator
from typing import Any

from pdplane.registry.relay import RegistryRelay, RelaySettings
from pdplane.registry.server import RegistryServer
from pdplane.registry.settings import RegistrySettings
from pdplane.v1 import instance_pb2

__all__ = [
    "make_spec",
    "running_registry",
    "running_registry_server",
    "running_relay",
    "store_defaults",
]

#: Settings merged under every `running_registry_server` call's own keywords.
store_defaults: dict[str, Any] = {}


@contextlib.contextmanager
def running_registry_server(port: int = 0, **settings: Any) -> Iterator[RegistryServer]:
    """Like `running_registry` but yields the `RegistryServer` (its `.address`, `.store`)."""
    config = RegistrySettings.model_validate(
        {"host": "127.0.0.1", "port": port, **store_defaults, **settings}
    )
    server = RegistryServer(config)
    server.start()
    try:
        yield server
    finally:
        server.stop(grace=0.2)


@contextlib.contextmanager
def running_registry(port: int = 0, **settings: Any) -> Iterator[str]:
    """A registry serving on 127.0.0.1:`port` for the duration of the block; yields its
    address "127.0.0.1:<bound port>". Keywords are `RegistrySettings` fields."""
    with running_registry_server(port, **settings) as server:
        yield server.address


@contextlib.contextmanager
def running_relay(registry: str, **settings: Any) -> Iterator[RegistryRelay]:
    """`pdplane registry-relay` for `registry`, served on 127.0.0.1 (any free port) from an
    event loop on a thread of its own for the block; yields the `RegistryRelay` (`.port`,
    `.relay`'s counters). Keywords are `RelaySettings` fields."""
    config = RelaySettings.model_validate(
        {"host": "127.0.0.1", "port": 0, "registry": registry, **settings}
    )
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="pdplane-test-relay", daemon=True)
    thread.start()
    relay = asyncio.run_coroutine_threadsafe(_made(config), loop).result(10)
    try:
        asyncio.run_coroutine_threadsafe(relay.start(), loop).result(10)
        yield relay
    finally:
        asyncio.run_coroutine_threadsafe(relay.stop(0.2), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()


async def _made(config: RelaySettings) -> RegistryRelay:
    return RegistryRelay(config)  # its asyncio channels belong to the loop that made them


def make_spec(
    instance_id: str = "p0",
    role: instance_pb2.Role.ValueType = instance_pb2.ROLE_PREFILL,
    model: str = "tiny",
    **overrides: Any,
) -> instance_pb2.InstanceSpec:
    """A valid InstanceSpec (TCP, TP 1, a small float32 layout); keywords override fields."""
    fields: dict[str, Any] = {
        "instance_id": instance_id,
        "role": role,
        "model": model,
        "url": "http://127.0.0.1:8100",
        "kv_endpoint": "127.0.0.1:50100",
        "transport": instance_pb2.TRANSPORT_TCP,
        "tp_size": 1,
        "kv_layout": instance_pb2.KvLayout(
            num_layers=2, num_kv_heads=2, head_size=32, block_size=16, dtype="float32"
        ),
        "max_model_len": 2048,
        "version": "pdplane test",
    }
    fields.update(overrides)
    return instance_pb2.InstanceSpec(**fields)
