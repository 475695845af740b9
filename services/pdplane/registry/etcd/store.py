"""The replicated `InstanceStore`: membership in etcd, heartbeats held by the replica they reach.

Any number of registry replicas share one etcd cluster and serve every RPC. The split:

- Membership is consistent in etcd: register, drain, deregister and expiry are etcd
  transactions (compare-and-swap on the key's mod_revision); every replica's view follows one
  etcd watch, so all derive the same events with the same revisions (`view`).
- A heartbeat costs no etcd request in the steady state. The replica that receives an
  instance's heartbeats owns it: the instance's key is attached to that replica's etcd lease
  (one keep-alive per replica per second, whatever the fleet size) and the replica enforces the
  instance's TTL to the millisecond, deleting the key on expiry. A heartbeat reaching another
  replica moves the key onto that replica's lease (one write, e.g. after a failover).
- Load reports that changed are written in batches, one `loads/<replica>` value every
  `load_flush_s`, and reach every replica's watchers through its etcd watch.
- A replica that cannot renew its own lease for half its TTL (etcd down, no quorum, partition)
  answers heartbeats UNAVAILABLE so instances move to a replica that can, and expires nothing;
  etcd itself expires no lease without a leader and renews them all when one is elected.

All etcd I/O runs on the store's own event loop thread; the plain methods block on it (call
them from any other thread), the `a`-methods await it from another loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from aetcd import rpc

from pdplane.core.grpc.echo import echo
from pdplane.registry.etcd.client import EtcdClient, absent, delete_op, put_op, unchanged_since
from pdplane.registry.etcd.follow import ViewFollower
from pdplane.registry.etcd.lease import ReplicaLease, describe
from pdplane.registry.etcd.loads import LoadReports
from pdplane.registry.etcd.view import EtcdView, composite, etcd_revision
from pdplane.registry.store import (
    LeaseGrant,
    LeasePolicy,
    NotFoundError,
    StoreError,
    StoreUnavailableError,
    Subscription,
    check_replace,
    granted_lease_id,
    is_replay,
)
from pdplane.v1 import instance_pb2, registry_store_pb2

__all__ = ["EtcdStore", "EtcdStoreConfig"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_SERVING = instance_pb2.INSTANCE_STATE_SERVING
_DRAINING = instance_pb2.INSTANCE_STATE_DRAINING
_CAS_TRIES = 5


@dataclass(frozen=True)
class EtcdStoreConfig:
    """Where the etcd cluster is and how a replica uses it (durations in s)."""

    endpoints: list[str]
    prefix: str = "/pdplane/"
    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    timeout_s: float = 1.5
    replica_id: str = ""
    replica_ttl_s: int = 10
    load_flush_s: float = 0.2
    load_refresh_s: float = 10.0
    compact_interval_s: float = 300.0
    address: str = ""


#: How often the expiry pass looks at every held instance, not only those past their deadline
#: (s): an instance deleted or taken over by another replica is forgotten within this.
_SWEEP_INTERVAL_S = 1.0
#: Most instances looked at under one hold of the lock by a pass over many (expiry, a load
#: flush): ~0.5 ms of work.
_LOCKED_CHUNK = 500


@dataclass
class _Owned:
    deadline: float  # time.monotonic() after which the instance's lease is expired
    write_rev: int  # etcd revision of this replica's last write of the key


class EtcdStore:
    """`InstanceStore` over etcd; `start()` before use, `close()` after."""

    def __init__(
        self,
        config: EtcdStoreConfig,
        policy: LeasePolicy | None = None,
        *,
        history: int = 10_000,
        max_queue: int = 4_096,
    ) -> None:
        self.policy = policy or LeasePolicy()
        self.config = config
        self.replica_id = config.replica_id or (
            f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"
        )
        self._prefix = config.prefix.encode()
        self.view = EtcdView(self._prefix, history=history, max_queue=max_queue)
        self.lock = self.view.lock
        self.loads = LoadReports(
            self.replica_id,
            self._key("loads/", self.replica_id),
            config.load_flush_s,
            config.load_refresh_s,
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: EtcdClient | None = None
        self._lease: ReplicaLease | None = None
        self._owned: dict[str, _Owned] = {}
        self._next_sweep = 0.0  # time.monotonic() of the next expiry pass over every instance
        self._follow: ViewFollower | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._closed = False
        self.last_error = ""

    # ------------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Connects, takes a replica lease and loads the view; raises StoreUnavailableError
        (etcd unreachable) or StoreError."""
        started = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._start())
            except BaseException as exc:
                failure.append(exc)
            started.set()
            if not failure:
                loop.run_forever()
            loop.run_until_complete(self._shutdown())
            loop.close()

        self._thread = threading.Thread(target=run, name="pdplane-etcd", daemon=True)
        self._thread.start()
        started.wait()
        if failure:
            self._thread.join()
            raise failure[0]

    async def _start(self) -> None:
        c = self.config
        client = EtcdClient(c.endpoints, ca=c.ca, cert=c.cert, key=c.key, timeout_s=c.timeout_s)
        self._client = client
        self._follow = ViewFollower(client, self.view, self._prefix)
        record = registry_store_pb2.ReplicaRecord(
            replica_id=self.replica_id,
            address=c.address,
            started_unix_ms=time.time_ns() // 1_000_000,
        )
        self._lease = ReplicaLease(
            client,
            self._key("replicas/", self.replica_id),
            record,
            c.replica_ttl_s,
            self._renewed,
            self._lease_lost,
        )
        await self._lease.grant()
        await self._follow.reload()
        loop = asyncio.get_running_loop()
        for job in (
            self._follow.follow(),
            self._follow.compact(c.compact_interval_s),
            self._lease.keep_alive(),
            self._flush_loop(),
        ):
            self._tasks.append(loop.create_task(job))
        log.info(
            "etcd store: replica %s on %s (prefix %s), %d instance(s) at etcd revision %d",
            self.replica_id,
            ",".join(c.endpoints),
            c.prefix,
            len(self.view.records),
            self.view.applied,
        )

    def close(self) -> None:
        """Stops the replica. Its lease is left to expire (not revoked): the instances it held
        move to other replicas with their next heartbeats instead of being removed."""
        if self._closed or self._loop is None:
            return
        self._closed = True
        with contextlib.suppress(RuntimeError):
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(timeout=10)

    async def _shutdown(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(BaseException):
                await task
        if self._client is not None:
            if self._lease is not None and self._lease.id:
                with contextlib.suppress(StoreError):
                    await self._client.call(
                        "kv",
                        "DeleteRange",
                        rpc.DeleteRangeRequest(key=self._key("replicas/", self.replica_id)),
                    )
            await self._client.close()

    # ------------------------------------------------------------------------- plumbing

    def _key(self, kind: str, name: str) -> bytes:
        return self._prefix + kind.encode() + name.encode()

    @property
    def _etcd(self) -> EtcdClient:
        assert self._client is not None, "EtcdStore used before start()"
        return self._client

    @property
    def _follower(self) -> ViewFollower:
        assert self._follow is not None, "EtcdStore used before start()"
        return self._follow

    @property
    def _lease_id(self) -> int:
        return self._lease.id if self._lease is not None else 0

    def _healthy(self, now: float) -> bool:
        return self._lease is not None and self._lease.healthy(now)

    def _unavailable(self) -> StoreUnavailableError:
        assert self._lease is not None
        return self._lease.unavailable()

    def _run(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Runs `coro` on the store's loop and waits for it (from another thread)."""
        assert self._loop is not None, "EtcdStore used before start()"
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return future.result(timeout=4 * self.config.timeout_s + 5)

    async def _hop(self, coro: Coroutine[Any, Any, _T]) -> _T:
        """Awaits `coro` on the store's loop from another event loop."""
        assert self._loop is not None, "EtcdStore used before start()"
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._loop))

    async def _get(self, key: bytes) -> rpc.KeyValue | None:
        kv, revision = await self._etcd.get(key)
        self._follower.saw(revision)
        return kv

    def _forget(self, instance_id: str) -> None:
        """The instance is no longer held here (lock held)."""
        self._owned.pop(instance_id, None)
        self.loads.forget(instance_id)

    # ------------------------------------------------------------------------- membership

    def register(
        self,
        spec: instance_pb2.InstanceSpec,
        ttl_ms: int,
        lease_id: str = "",
        admin: bool = False,
        request_id: str = "",
    ) -> LeaseGrant:
        return self._run(self._register(spec, ttl_ms, lease_id, admin, request_id))

    async def aregister(
        self,
        spec: instance_pb2.InstanceSpec,
        ttl_ms: int,
        lease_id: str = "",
        admin: bool = False,
        request_id: str = "",
    ) -> LeaseGrant:
        return await self._hop(self._register(spec, ttl_ms, lease_id, admin, request_id))

    def _expired_here(self, instance_id: str) -> bool:
        """True when this replica holds `instance_id` and its lease deadline passed (the
        reaper has not deleted the key yet)."""
        with self.lock:
            owned = self._owned.get(instance_id)
        return owned is not None and owned.deadline <= time.monotonic()

    async def _register(
        self,
        spec: instance_pb2.InstanceSpec,
        ttl_ms: int,
        lease_id: str,
        admin: bool,
        request_id: str,
    ) -> LeaseGrant:
        ttl_ms, interval_ms = self.policy.grant(ttl_ms)
        key = self._key("instances/", spec.instance_id)
        granted = granted_lease_id(spec.instance_id, request_id)
        for _ in range(_CAS_TRIES):
            kv = await self._get(key)
            now_ns = time.time_ns()
            instance = instance_pb2.Instance(spec=spec, state=_SERVING, lease_id=granted)
            instance.last_heartbeat.FromNanoseconds(now_ns)
            if kv is None:
                instance.registered_at.FromNanoseconds(now_ns)
                guard = absent(key)
            else:
                stored = registry_store_pb2.StoredInstance.FromString(kv.value)
                old = stored.instance
                expired = self._expired_here(spec.instance_id)
                if not expired and is_replay(old, spec, request_id, granted):
                    return await self._replayed(granted, stored.lease_ttl_ms, kv.mod_revision)
                if not expired:
                    check_replace(old, spec, lease_id, admin)
                    instance.registered_at.CopyFrom(old.registered_at)
                    instance.load.CopyFrom(old.load)
                else:
                    instance.registered_at.FromNanoseconds(now_ns)
                guard = unchanged_since(key, kv.mod_revision)
            value = registry_store_pb2.StoredInstance(instance=instance, lease_ttl_ms=ttl_ms)
            ok, rev = await self._etcd.txn(
                guard, put_op(key, value.SerializeToString(), self._lease_id)
            )
            if ok:
                break
        else:
            raise StoreUnavailableError(f"spec.instance_id: {echo(spec.instance_id)}: contended")
        with self.lock:
            self._forget(spec.instance_id)
            self._owned[spec.instance_id] = _Owned(time.monotonic() + ttl_ms / 1000, rev)
        await self._follower.reached(rev, self.config.timeout_s)
        return LeaseGrant(instance.lease_id, ttl_ms, interval_ms, composite(rev, 0))

    async def _replayed(self, lease_id: str, ttl_ms: int, mod_revision: int) -> LeaseGrant:
        """The answer to a retried Register (`is_replay`): its lease as stored, nothing
        written; once this replica's view holds that record, as after a grant."""
        ttl_ms, interval_ms = self.policy.grant(ttl_ms)
        await self._follower.reached(mod_revision, self.config.timeout_s)
        return LeaseGrant(lease_id, ttl_ms, interval_ms, composite(mod_revision, 0))

    async def _leased(self, instance_id: str, lease_id: str) -> rpc.KeyValue:
        kv = await self._get(self._key("instances/", instance_id))
        if kv is None:
            raise NotFoundError(f"instance_id: no live lease for {echo(instance_id)}")
        stored = registry_store_pb2.StoredInstance.FromString(kv.value)
        if stored.instance.lease_id != lease_id:
            raise NotFoundError(
                f"lease_id: {echo(lease_id)} is not the live lease of {echo(instance_id)}"
            )
        return kv

    def deregister(
        self, instance_id: str, lease_id: str, drain: bool
    ) -> instance_pb2.InstanceState.ValueType:
        return self._run(self._deregister(instance_id, lease_id, drain))

    async def aderegister(
        self, instance_id: str, lease_id: str, drain: bool
    ) -> instance_pb2.InstanceState.ValueType:
        return await self._hop(self._deregister(instance_id, lease_id, drain))

    async def _deregister(
        self, instance_id: str, lease_id: str, drain: bool
    ) -> instance_pb2.InstanceState.ValueType:
        key = self._key("instances/", instance_id)
        tombstone = self._key("removed/", instance_id)
        for _ in range(_CAS_TRIES):
            kv = await self._leased(instance_id, lease_id)
            stored = registry_store_pb2.StoredInstance.FromString(kv.value)
            guard = unchanged_since(key, kv.mod_revision)
            if drain:
                if stored.instance.state == _DRAINING:
                    return _DRAINING
                stored.instance.state = _DRAINING
                ops = [put_op(key, stored.SerializeToString(), kv.lease)]
            else:  # the reason travels with the delete, in the same etcd revision
                ops = [delete_op(key), put_op(tombstone, b"deregistered", 0)]
            ok, rev = await self._etcd.txn(guard, *ops)
            if ok:
                break
        else:
            raise StoreUnavailableError(f"instance_id: {echo(instance_id)}: contended")
        await self._follower.reached(rev, self.config.timeout_s)
        if drain:
            return _DRAINING
        with self.lock:
            self._forget(instance_id)
        with contextlib.suppress(StoreError):  # read by the watchers already
            await self._etcd.call("kv", "DeleteRange", rpc.DeleteRangeRequest(key=tombstone))
        return instance_pb2.INSTANCE_STATE_UNSPECIFIED

    # ------------------------------------------------------------------------- heartbeats

    def _fast_beat(
        self, instance_id: str, lease_id: str, load: instance_pb2.LoadReport
    ) -> tuple[int, instance_pb2.InstanceState.ValueType] | None:
        """The steady state: this replica holds the instance; no I/O. None: ask etcd."""
        now = time.monotonic()
        with self.lock:
            record = self.view.records.get(instance_id)
            owned = self._owned.get(instance_id)
            if (
                record is None
                or owned is None
                or record.instance.lease_id != lease_id
                or (record.owner_lease != self._lease_id and owned.write_rev <= record.mod_revision)
            ):
                return None
            owned.deadline = now + record.ttl_ms / 1000
            self.loads.note(instance_id, lease_id, load, record, time.time_ns())
            reply = record.ttl_ms, record.instance.state
        if not self._healthy(now):
            raise self._unavailable()
        return reply

    def heartbeat(
        self, instance_id: str, lease_id: str, load: instance_pb2.LoadReport
    ) -> tuple[int, instance_pb2.InstanceState.ValueType]:
        fast = self._fast_beat(instance_id, lease_id, load)
        return fast if fast is not None else self._run(self._slow_beat(instance_id, lease_id, load))

    async def aheartbeat(
        self, instance_id: str, lease_id: str, load: instance_pb2.LoadReport
    ) -> tuple[int, instance_pb2.InstanceState.ValueType]:
        fast = self._fast_beat(instance_id, lease_id, load)
        if fast is not None:
            return fast
        return await self._hop(self._slow_beat(instance_id, lease_id, load))

    async def _slow_beat(
        self, instance_id: str, lease_id: str, load: instance_pb2.LoadReport
    ) -> tuple[int, instance_pb2.InstanceState.ValueType]:
        """A heartbeat this replica cannot vouch for from its view: the instance registered on
        another replica (maybe not in this view yet) or is held by another one. Takes it over:
        its key moves onto this replica's lease."""
        key = self._key("instances/", instance_id)
        for _ in range(_CAS_TRIES):
            kv = await self._leased(instance_id, lease_id)
            if kv.lease == self._lease_id:
                rev = kv.mod_revision
                break
            if not self._healthy(time.monotonic()):
                raise self._unavailable()
            ok, rev = await self._etcd.txn(
                unchanged_since(key, kv.mod_revision), put_op(key, kv.value, self._lease_id)
            )
            if ok:
                break
        else:
            raise StoreUnavailableError(f"instance_id: {echo(instance_id)}: contended")
        stored = registry_store_pb2.StoredInstance.FromString(kv.value)
        ttl_ms = stored.lease_ttl_ms
        with self.lock:
            self._owned[instance_id] = _Owned(time.monotonic() + ttl_ms / 1000, rev)
            record = self.view.records.get(instance_id)
            self.loads.note(instance_id, lease_id, load, record, time.time_ns())
        return ttl_ms, stored.instance.state

    def expire(self) -> int:
        """Deletes the keys of held instances whose TTL passed; returns how many."""
        if self._loop is None or self._closed:
            return 0
        return self._run(self._expire())

    async def _expire(self) -> int:
        now = time.monotonic()
        if not self._healthy(now):
            return 0  # nothing is removed while this replica cannot vouch for its leases
        due: list[tuple[str, int]] = []
        # A pass looks at the held instances whose deadline passed; every `_SWEEP_INTERVAL_S`
        # at all of them, to forget those deleted or taken over elsewhere. It takes the lock
        # that every heartbeat takes for `_LOCKED_CHUNK` instances at a time: one hold over a
        # large fleet's 10,000 (preempted for the GIL while held) kept heartbeats waiting for
        # tens of ms.
        with self.lock:
            if now >= self._next_sweep:
                self._next_sweep = now + _SWEEP_INTERVAL_S
                looked_at = list(self._owned)
            else:
                looked_at = [i for i, o in self._owned.items() if o.deadline <= now]
        for start in range(0, len(looked_at), _LOCKED_CHUNK):
            with self.lock:
                for instance_id in looked_at[start : start + _LOCKED_CHUNK]:
                    owned = self._owned.get(instance_id)
                    if owned is None:
                        continue
                    record = self.view.records.get(instance_id)
                    if record is None or record.owner_lease != self._lease_id:
                        if self.view.applied >= owned.write_rev and (
                            record is None or record.mod_revision > owned.write_rev
                        ):
                            self._forget(instance_id)  # deleted, or taken over elsewhere
                        continue
                    if owned.deadline <= now:
                        due.append((instance_id, record.mod_revision))
        if not due:
            return 0
        done = await asyncio.gather(
            *(self._delete_expired(*d) for d in due), return_exceptions=True
        )
        return sum(1 for ok in done if ok is True)

    async def _delete_expired(self, instance_id: str, mod_revision: int) -> bool:
        key = self._key("instances/", instance_id)
        ok, _ = await self._etcd.txn(unchanged_since(key, mod_revision), delete_op(key))
        if ok:
            with self.lock:
                self._forget(instance_id)
        return ok

    def _renewed(self, was_healthy: bool) -> None:
        if was_healthy:
            return
        # Back after an outage: nobody could vouch for a heartbeat meanwhile, so every instance
        # held here gets a full TTL again (as etcd does for its leases under a new leader).
        now = time.monotonic()
        with self.lock:
            for instance_id, owned in self._owned.items():
                record = self.view.records.get(instance_id)
                ttl_s = record.ttl_ms / 1000 if record else 0.0
                owned.deadline = max(owned.deadline, now + ttl_s)
        log.info("etcd store: replica lease renewed again; heartbeats accepted")

    def _lease_lost(self) -> None:
        # etcd deleted the keys on the lost lease; their instances register again when their
        # next heartbeat is answered NOT_FOUND.
        with self.lock:
            self._owned.clear()
            self.loads.clear()

    # ---------------------------------------------------------------------- reading/watch

    @property
    def revision(self) -> int:
        """The revision of the last change this replica applied."""
        with self.lock:
            return self.view.revision

    def get(self, instance_id: str) -> instance_pb2.Instance:
        return self.view.get(instance_id)

    def watch(self, from_revision: int, notify: Callable[[], None]) -> Subscription:
        """As `InstanceStore.watch`; a `from_revision` this replica has not reached yet but
        etcd has (the watcher came from a replica slightly ahead) is waited for, not
        answered with a SNAPSHOT."""
        with self.lock:
            ahead_ok = (
                self._follow is not None
                and etcd_revision(from_revision) <= self._follow.cluster_rev
            )
            return self.view.hub.watch(from_revision, self.view.revision, notify, ahead_ok=ahead_ok)

    @property
    def watcher_count(self) -> int:
        return self.view.hub.watcher_count

    # ------------------------------------------------------------------ background tasks

    async def _flush_loop(self) -> None:
        while True:
            await asyncio.sleep(self.loads.flush_s)
            with self.lock:
                lease = self._lease_id
                owned = list(self._owned)
                taken, pending = self.loads.take(owned, self.view.records, lease)
            if not taken:
                continue
            try:
                await self.loads.flush(self._etcd, self.loads.entries(taken), lease)
            except Exception as exc:  # retried with the next flush; the task must live on
                self.last_error = f"load write: {describe(exc)}"
                with self.lock:
                    self.loads.restore(pending)

    def list(
        self,
        role: instance_pb2.Role.ValueType = instance_pb2.ROLE_UNSPECIFIED,
        model: str = "",
        state: instance_pb2.InstanceState.ValueType = instance_pb2.INSTANCE_STATE_UNSPECIFIED,
    ) -> tuple[list[instance_pb2.Instance], int]:
        """This replica's view (a write acknowledged by this replica is always in it; one on
        another replica once its watch delivered it, typically within milliseconds)."""
        return self.view.list(role, model, state)
