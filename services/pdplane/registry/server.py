"""Wires a registry: store + lease reaper + servicer + health/reflection/auth/TLS on a port.

`RegistryServer` runs the whole service in a background thread (the gRPC asyncio server gets
its own event loop there), so the same object serves `pdplane registry`, the tests and
embedding processes such as `pdplane up`.
"""

from __future__ import annotations

import asyncio
import logging
import threading

import grpc

from pdplane.core.grpc import util as grpc_util
from pdplane.core.grpc.auth import AuthPolicy
from pdplane.registry.memory_store import InMemoryStore
from pdplane.registry.servicer import SERVICE_NAME, RegistryServicer
from pdplane.registry.settings import RegistrySettings
from pdplane.registry.store import InstanceStore, LeasePolicy
from pdplane.v1 import registry_pb2_grpc

__all__ = ["LeaseReaper", "RegistryServer", "build_store"]

log = logging.getLogger(__name__)


def build_store(settings: RegistrySettings) -> InstanceStore:
    """The store `settings.store` names, configured from `settings` (not started)."""
    policy = LeasePolicy(
        default_ttl_ms=settings.lease_ttl_ms,
        max_ttl_ms=settings.max_lease_ttl_ms,
        heartbeat_interval_ms=settings.heartbeat_interval_ms,
    )
    if settings.store == "etcd":
        from pdplane.registry.etcd.client import parse_endpoints
        from pdplane.registry.etcd.store import EtcdStore, EtcdStoreConfig

        config = EtcdStoreConfig(
            endpoints=parse_endpoints(settings.etcd_endpoints),
            prefix=settings.etcd_prefix,
            ca=settings.etcd_ca,
            cert=settings.etcd_cert,
            key=settings.etcd_key,
            timeout_s=settings.etcd_timeout_ms / 1000,
            replica_id=settings.replica_id or "",
            replica_ttl_s=max(1, -(-settings.etcd_replica_ttl_ms // 1000)),
            load_flush_s=settings.etcd_load_flush_ms / 1000,
            load_refresh_s=settings.etcd_load_refresh_ms / 1000,
            compact_interval_s=settings.etcd_compact_interval_s,
            address=f"{settings.host}:{settings.port}",
        )
        return EtcdStore(
            config, policy, history=settings.event_history, max_queue=settings.watch_queue_size
        )
    return InMemoryStore(
        policy, history=settings.event_history, max_queue=settings.watch_queue_size
    )


class LeaseReaper:
    """Expires leases every `interval_s` on its own thread, whatever the traffic."""

    def __init__(self, store: InstanceStore, interval_s: float) -> None:
        self._store = store
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pdplane-lease-reaper", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                expired = self._store.expire()
            except Exception:  # the reaper must outlive any single bad pass
                log.exception("lease expiry pass failed")
                continue
            if expired:
                log.info("expired %d lease(s)", expired)


class RegistryServer:
    """The registry service on `settings.host:settings.port`, served from a background thread.

    `start()` binds and returns the bound port (raises RuntimeError when the port cannot be
    bound); `stop(grace)` cancels open watches, stops serving and joins every thread it started.
    """

    def __init__(self, settings: RegistrySettings, store: InstanceStore | None = None) -> None:
        self.settings = settings
        self.store: InstanceStore = store if store is not None else build_store(settings)
        self._reaper = LeaseReaper(self.store, settings.expiry_check_ms / 1000.0)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._shutdown: asyncio.Event | None = None
        self._grace = 0.5
        self._started = threading.Event()
        self._start_error: BaseException | None = None
        self.port = 0

    @property
    def address(self) -> str:
        """ "host:port" clients should dial."""
        host = self.settings.host
        return f"[{host}]:{self.port}" if ":" in host else f"{host}:{self.port}"

    def _bind(self, server: grpc.aio.Server) -> int:
        s = self.settings
        return grpc_util.add_port(server, f"{s.host}:{s.port}", s.tls_cert, s.tls_key)

    def start(self) -> int:
        """Starts the store, then serving; returns the bound port (raises StoreError when the
        store cannot start, e.g. etcd unreachable)."""
        self.store.start()
        try:
            return self._start_serving()
        except BaseException:
            self.store.close()
            raise

    def _start_serving(self) -> int:
        self._thread = threading.Thread(target=self._run_aio, name="pdplane-registry", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._start_error is not None:
            self._thread.join()
            raise self._start_error
        self._reaper.start()
        log.info("registry serving on %s", self.address)
        return self.port

    def _run_aio(self) -> None:
        try:
            # asyncio.run also cancels and awaits the RPC tasks left after the server stopped.
            asyncio.run(self._serve_aio())
        except BaseException as exc:  # reported to start() in the caller's thread
            self._start_error = exc
        finally:
            self._started.set()

    async def _serve_aio(self) -> None:
        self._loop = asyncio.get_running_loop()
        s = self.settings
        server = grpc.aio.server(
            interceptors=grpc_util.aio_server_interceptors(s.token, s.admin_token),
            options=grpc_util.SERVER_OPTIONS,
        )
        servicer = RegistryServicer(
            self.store, AuthPolicy(s.token, s.admin_token), s.watch_coalesce_ms
        )
        registry_pb2_grpc.add_RegistryServicer_to_server(servicer, server)
        await grpc_util.aio_add_health_and_reflection(server, [SERVICE_NAME])
        self.port = self._bind(server)
        await server.start()
        self._shutdown = asyncio.Event()
        self._started.set()
        await self._shutdown.wait()
        await grpc_util.aio_stop(server, self._grace)

    def stop(self, grace: float = 0.5) -> None:
        """Stops serving (open watch streams are cancelled) and joins the threads."""
        self._reaper.stop()
        if self._shutdown is not None and self._loop is not None:
            self._grace = grace
            self._loop.call_soon_threadsafe(self._shutdown.set)
            self._shutdown = None
        if self._thread is not None:
            self._thread.join(timeout=grace + 5.0)
            self._thread = None
        self.store.close()
        log.info("registry on %s stopped", self.address)
