"""A registry replica's own etcd lease: granted at start, kept alive once a second.

The keys of the instances a replica holds are attached to this lease, so one keep-alive stream
per replica keeps them all, whatever the fleet size. The replica vouches for its instances'
leases only while its own lease is confirmed: `healthy` turns false when no keep-alive was
answered for half the lease's TTL (etcd down, no quorum, this replica cut off).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import grpc
from aetcd import rpc

from pdplane.registry.etcd.client import REQUIRE_LEADER, EtcdClient
from pdplane.registry.store import StoreError, StoreUnavailableError
from pdplane.v1 import registry_store_pb2

__all__ = ["FailureStreak", "ReplicaLease", "describe"]

log = logging.getLogger(__name__)


def describe(exc: BaseException) -> str:
    """A short description of an etcd failure for logs and error messages."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {(exc.details() or '')[:200]}"
    return f"{type(exc).__name__}: {str(exc)[:200]}"


class FailureStreak:
    """Logs a retry loop's failures once per streak: the first at WARNING, the repeats at DEBUG,
    and the recovery at INFO with the count. An etcd outage must not write a line every 100 ms
    (the loops retry that often) and bury everything else in the log."""

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._log = logger
        self._what = what
        self.failures = 0

    def failed(self, detail: str) -> None:
        """One failed attempt (`detail`: what went wrong, already bounded)."""
        self.failures += 1
        level = logging.WARNING if self.failures == 1 else logging.DEBUG
        self._log.log(level, "%s failed (%s); retrying", self._what, detail)

    def ok(self) -> None:
        """An attempt succeeded: ends the streak (INFO line if there was one)."""
        if self.failures:
            self._log.info("%s back after %d failed attempt(s)", self._what, self.failures)
            self.failures = 0


class ReplicaLease:
    """The lease (TTL `ttl_s`, whole seconds) and the `replicas/<id>` record under `key`.

    `on_renewed(was_healthy)` runs (on the store's loop) after each confirmed keep-alive;
    `on_lost()` after etcd reported the lease gone, before a new one is granted.
    """

    def __init__(
        self,
        client: EtcdClient,
        key: bytes,
        record: registry_store_pb2.ReplicaRecord,
        ttl_s: int,
        on_renewed: Callable[[bool], None],
        on_lost: Callable[[], None],
    ) -> None:
        self._client = client
        self._key = key
        self._record = record
        self.ttl_s = ttl_s
        self._on_renewed = on_renewed
        self._on_lost = on_lost
        self.id = 0
        self.confirmed = 0.0  # time.monotonic() of the last confirmation
        self.last_error = ""
        self._streak = FailureStreak(log, "etcd keep-alive")

    def healthy(self, now: float) -> bool:
        """Whether the lease was confirmed within the last half TTL."""
        return now - self.confirmed < self.ttl_s / 2

    def unavailable(self) -> StoreUnavailableError:
        """The error heartbeats get while not `healthy`."""
        age = time.monotonic() - self.confirmed
        return StoreUnavailableError(
            f"registry replica {self._record.replica_id} could not renew its etcd lease for "
            f"{age:.1f} s ({self.last_error or 'etcd unreachable or without quorum'}); "
            "the instance's lease is kept: try another replica"
        )

    async def grant(self) -> None:
        """Takes a new lease and writes the replica record on it."""
        grant = await self._client.call(
            "lease", "LeaseGrant", rpc.LeaseGrantRequest(TTL=self.ttl_s)
        )
        await self._client.call(
            "kv",
            "Put",
            rpc.PutRequest(key=self._key, value=self._record.SerializeToString(), lease=grant.ID),
        )
        self.id = grant.ID
        self.confirmed = time.monotonic()

    async def keep_alive(self) -> None:
        """Renews the lease forever (a task): one keep-alive a second (or a third of the TTL),
        on one stream, moving to the next endpoint when it breaks."""
        interval = min(1.0, self.ttl_s / 3)
        while True:
            call = self._client.lease().LeaseKeepAlive(metadata=REQUIRE_LEADER)
            try:
                while True:
                    await call.write(rpc.LeaseKeepAliveRequest(ID=self.id))
                    reply = await asyncio.wait_for(call.read(), self._client.timeout_s)
                    if reply is grpc.aio.EOF:
                        raise StoreError("keep-alive stream ended")
                    if reply.TTL <= 0:
                        log.error(
                            "etcd lease %x of this replica expired; taking a new one", self.id
                        )
                        self._on_lost()
                        await self.grant()
                        continue
                    was_healthy = self.healthy(time.monotonic())
                    self.confirmed = time.monotonic()
                    self._streak.ok()
                    self._on_renewed(was_healthy)
                    await asyncio.sleep(interval)
            except Exception as exc:  # any failure: next endpoint, the task must live on
                self.last_error = f"keep-alive via {self._client.endpoint}: {describe(exc)}"
                self._streak.failed(self.last_error)
                self._client.rotate()
                await asyncio.sleep(0.2)
            finally:
                call.cancel()
