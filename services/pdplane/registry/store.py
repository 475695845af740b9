"""The registry's storage interface: instances, leases, revisions and watch subscriptions.

The servicer speaks only to `InstanceStore`; `memory_store.InMemoryStore` is the single-node
default and `etcd.store.EtcdStore` the replicated one (any number of registry replicas over one
etcd cluster). The lease model (TTL, renew by heartbeat, delete on expiry, a global revision
that every change bumps, watch from a revision) maps onto etcd leases and watches.

Every mutating call comes in two forms: the plain one (thread-safe, may block on I/O in the
etcd store: call it from any thread but an event loop) and the `a`-prefixed coroutine the
asyncio servicer awaits (never blocks its loop).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from pdplane.core.grpc.echo import echo
from pdplane.v1 import instance_pb2, registry_pb2

__all__ = [
    "AlreadyExistsError",
    "InstanceStore",
    "LeaseGrant",
    "LeasePolicy",
    "NotFoundError",
    "StoreError",
    "StoreUnavailableError",
    "Subscription",
    "check_replace",
    "granted_lease_id",
    "is_replay",
]


class StoreError(Exception):
    """Base of the store's errors; the message is meant for the caller."""


class NotFoundError(StoreError):
    """Unknown instance id, or a lease that is not (or no longer) the instance's live lease."""


class AlreadyExistsError(StoreError):
    """The id is held by a live lease: with a different spec, or by a caller that did not
    prove it holds that lease."""


def granted_lease_id(instance_id: str, request_id: str) -> str:
    """The lease id a Register grants (16 hex digits, 64 bits): random without a
    `request_id`; with one, derived from it (SHA-256 of the instance id and the request id), so
    that a retry of the same Register is granted the same lease (registry.proto,
    `RegisterRequest.request_id`; Google AIP-155). The request id is as secret as the lease:
    only its sender knows either."""
    if not request_id:
        return secrets.token_hex(8)
    digest = hashlib.sha256(f"pdplane-lease\0{instance_id}\0{request_id}".encode())
    return digest.hexdigest()[:16]


def is_replay(
    old: instance_pb2.Instance, spec: instance_pb2.InstanceSpec, request_id: str, granted: str
) -> bool:
    """True when a Register is a retry of the one that took `old`'s live lease: it carries a
    request id, the same spec, and the lease it would grant (`granted`) is `old`'s. Such a
    call is answered as the first one was and writes nothing (AIP-155): a drain made since,
    or a later load report, stays."""
    return (
        bool(request_id)
        and old.spec == spec
        and hmac.compare_digest(old.lease_id.encode(), granted.encode())
    )


def check_replace(
    old: instance_pb2.Instance, spec: instance_pb2.InstanceSpec, lease_id: str, admin: bool
) -> None:
    """Raises AlreadyExistsError unless `spec` may replace `old`, which holds a live lease.

    The spec must be identical, and the caller must prove it is the holder: `lease_id` is
    `old`'s live lease id, or `admin` (the admin token). Without that proof a holder of the
    shared token could copy a spec from ListInstances and take the instance's lease (and its
    traffic). A restarted instance re-registers without proof once its old lease expired.
    (A retry of the Register that took the lease is answered before this, see `is_replay`.)
    """
    if old.spec != spec:
        raise AlreadyExistsError(
            f"spec.instance_id: {echo(spec.instance_id)} is held by a live lease with a "
            "different spec"
        )
    if not admin and not hmac.compare_digest(old.lease_id.encode(), lease_id.encode()):
        raise AlreadyExistsError(
            f"spec.instance_id: {echo(spec.instance_id)} is held by a live lease: re-registering "
            "it needs that lease_id or the admin token (a restarted instance registers again "
            "once its old lease expired)"
        )


class StoreUnavailableError(StoreError):
    """The backing store cannot be reached or has no quorum; nothing was changed (or the
    change's outcome is unknown and the caller should retry). Served as UNAVAILABLE."""


@dataclass(frozen=True)
class LeasePolicy:
    """How the registry grants leases. All values in ms."""

    default_ttl_ms: int = 5_000
    max_ttl_ms: int = 60_000
    heartbeat_interval_ms: int = 1_000

    def grant(self, requested_ttl_ms: int) -> tuple[int, int]:
        """(granted TTL, heartbeat interval) for a requested TTL (0 = default), in ms.

        The TTL is capped at `max_ttl_ms` and raised to at least two heartbeat intervals, so
        that one lost heartbeat never expires a lease; the interval is at most a third of the TTL.
        """
        ttl = min(requested_ttl_ms or self.default_ttl_ms, self.max_ttl_ms)
        ttl = max(ttl, 2 * self.heartbeat_interval_ms)
        return ttl, max(1, min(self.heartbeat_interval_ms, ttl // 3))


@dataclass(frozen=True)
class LeaseGrant:
    """A granted lease: its id, TTL and heartbeat interval (ms) and the revision it made."""

    lease_id: str
    ttl_ms: int
    heartbeat_interval_ms: int
    revision: int


class Subscription(Protocol):
    """One watcher's queue of events. `notify` (given to `InstanceStore.watch`) is called,
    from any thread, when `poll` has something new; it must be cheap and never block."""

    def poll(self) -> list[registry_pb2.WatchEvent]:
        """Returns the pending events (never blocks). A watcher that fell behind gets one fresh
        SNAPSHOT instead of the events it missed; revisions are strictly increasing."""
        ...

    def close(self) -> None:
        """Stops delivery; idempotent."""
        ...


class InstanceStore(Protocol):
    """Instances with leases; thread-safe. Every change bumps the global revision."""

    @property
    def revision(self) -> int:
        """The revision of the last change."""
        ...

    def register(
        self,
        spec: instance_pb2.InstanceSpec,
        ttl_ms: int,
        lease_id: str = "",
        admin: bool = False,
        request_id: str = "",
    ) -> LeaseGrant:
        """Adds `spec` (already validated) with the lease `granted_lease_id(spec.instance_id,
        request_id)`. An id whose old lease expired is registered afresh. A live one is
        answered with its lease, unchanged, when this is a retry of the Register that took it
        (`is_replay`), else replaced only as `check_replace` allows (identical spec, and
        `lease_id` its live lease id or `admin`). Raises AlreadyExistsError otherwise."""
        ...

    def heartbeat(
        self, instance_id: str, lease_id: str, load: instance_pb2.LoadReport
    ) -> tuple[int, instance_pb2.InstanceState.ValueType]:
        """Renews the lease and records `load`; returns (TTL ms, state).
        Raises NotFoundError for an unknown or expired lease."""
        ...

    def deregister(
        self, instance_id: str, lease_id: str, drain: bool
    ) -> instance_pb2.InstanceState.ValueType:
        """Removes the instance (returns UNSPECIFIED) or, with `drain`, marks it DRAINING.
        Raises NotFoundError for an unknown instance or a lease that is not its live one."""
        ...

    def expire(self) -> int:
        """Removes every instance whose lease has expired; returns how many."""
        ...

    def list(
        self,
        role: instance_pb2.Role.ValueType = instance_pb2.ROLE_UNSPECIFIED,
        model: str = "",
        state: instance_pb2.InstanceState.ValueType = instance_pb2.INSTANCE_STATE_UNSPECIFIED,
    ) -> tuple[list[instance_pb2.Instance], int]:
        """(instances matching the filter, sorted by id; revision). Zero values match any."""
        ...

    def get(self, instance_id: str) -> instance_pb2.Instance:
        """One instance; raises NotFoundError."""
        ...

    def watch(self, from_revision: int, notify: Callable[[], None]) -> Subscription:
        """Subscribes: the first poll returns the events after `from_revision` when they are
        still held, else a SNAPSHOT (always a SNAPSHOT for 0)."""
        ...

    async def aregister(
        self,
        spec: instance_pb2.InstanceSpec,
        ttl_ms: int,
        lease_id: str = "",
        admin: bool = False,
        request_id: str = "",
    ) -> LeaseGrant:
        """`register` as a coroutine."""
        ...

    async def aheartbeat(
        self, instance_id: str, lease_id: str, load: instance_pb2.LoadReport
    ) -> tuple[int, instance_pb2.InstanceState.ValueType]:
        """`heartbeat` as a coroutine (the hot path: no I/O in either store in the steady
        state)."""
        ...

    async def aderegister(
        self, instance_id: str, lease_id: str, drain: bool
    ) -> instance_pb2.InstanceState.ValueType:
        """`deregister` as a coroutine."""
        ...

    def start(self) -> None:
        """Makes the store ready (connects, loads); raises StoreError when it cannot."""
        ...

    def close(self) -> None:
        """Releases what the store holds (connections, threads); idempotent."""
        ...
