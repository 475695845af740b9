"""Registry addresses for clients: one or several replicas ("h1:8051,h2:8051"), with failover.

A client uses one replica at a time (its heartbeats then stay with the replica that holds its
lease) and moves to the next one when a call fails with a status another replica may not
have: UNAVAILABLE (replica down or cut off from etcd), DEADLINE_EXCEEDED (hung), CANCELLED by
the client's own watchdog.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

import grpc

from pdplane.core.grpc import util as grpc_util
from pdplane.v1 import registry_pb2_grpc

__all__ = ["FAILOVER_CODES", "RegistryEndpoints", "call_any", "split_addresses"]

_T = TypeVar("_T")

#: Statuses after which the next replica is tried.
FAILOVER_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
)


def split_addresses(registry: str) -> list[str]:
    """ "h1:8051, h2:8051" -> ["h1:8051", "h2:8051"]; ValueError when empty."""
    addresses = [a.strip() for a in registry.split(",") if a.strip()]
    if not addresses:
        raise ValueError(f"no registry address in {registry!r}")
    return addresses


class RegistryEndpoints:
    """One sync channel per registry address; `stub` talks to the current one.

    `tls_ca` and `extra_options` as for `grpc_util.channel`. Thread-safe enough for the
    clients' use: a failover only moves an index.
    """

    def __init__(
        self,
        registry: str,
        tls_ca: str | Path | None = None,
        extra_options: Iterable[tuple[str, Any]] = (),
    ) -> None:
        self.addresses = split_addresses(registry)
        options = list(extra_options)
        self._channels = [
            grpc_util.channel(a, tls_ca, extra_options=options) for a in self.addresses
        ]
        self._stubs = [registry_pb2_grpc.RegistryStub(c) for c in self._channels]
        self._current = 0

    @property
    def several(self) -> bool:
        """More than one replica to fail over to."""
        return len(self.addresses) > 1

    @property
    def address(self) -> str:
        """The replica calls go to now."""
        return self.addresses[self._current]

    @property
    def stub(self) -> registry_pb2_grpc.RegistryStub:
        return self._stubs[self._current]

    def failover(self) -> None:
        """Moves to the next replica."""
        self._current = (self._current + 1) % len(self.addresses)

    def close(self) -> None:
        for channel in self._channels:
            channel.close()


def call_any(
    endpoints: RegistryEndpoints, fn: Callable[[registry_pb2_grpc.RegistryStub], _T]
) -> _T:
    """`fn(stub)` on each replica in turn until one answers; re-raises the last failover-class
    error (or at once any other error)."""
    for attempt in range(len(endpoints.addresses)):
        try:
            return fn(endpoints.stub)
        except grpc.RpcError as exc:
            code = exc.code() if isinstance(exc, grpc.Call) else None
            if code not in FAILOVER_CODES or attempt == len(endpoints.addresses) - 1:
                raise
            endpoints.failover()
    raise AssertionError("unreachable")
