"""A running registry for tests of any area.

    from tests.integration.registry.fixtures import running_registry, make_spec

    with running_registry() as address:            # "127.0.0.1:<port>"
        ...
    with running_registry(port, lease_ttl_ms=1000, token="t") as address:
        ...

`running_registry` starts the real gRPC service in-process on 127.0.0.1 (port 0 = any free
port), with any `RegistrySettings` field as a keyword, and stops it (joining its threads) on
exit. `make_spec` builds a valid InstanceSpec for tests. `store_defaults` holds settings every
registry started here gets unless the call overrides them (the registry suite sets the etcd
store's there, to run the same tests on both stores).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from pdplane.registry.server import RegistryServer
from pdplane.registry.settings import RegistrySettings
from pdplane.v1 import instance_pb2

__all__ = ["make_spec", "running_registry", "running_registry_server", "store_defaults"]

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
