"""Wiring of a scheduler process: settings -> registry watcher -> service -> gRPC (+ metrics).

Used by `pdplane scheduler` and by the in-process test fixture, so both run the same objects;
the service (and its prefix index) is built by `pdplane.scheduler.local.open_local`, as a local
scheduler's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from http.server import HTTPServer

import grpc
from prometheus_client import start_http_server

from pdplane.core.grpc import util as grpc_util
from pdplane.registry.client import InstanceWatcher
from pdplane.scheduler import inflight_exchange
from pdplane.scheduler.decision import Decider
from pdplane.scheduler.inflight_servicer import SERVICE_NAME as INFLIGHT_SERVICE_NAME
from pdplane.scheduler.kv_index import KvIndexManager
from pdplane.scheduler.local import LocalScheduler, open_local
from pdplane.scheduler.metrics import SchedulerMetrics
from pdplane.scheduler.port import InstanceSource
from pdplane.scheduler.servicer import SchedulerServicer
from pdplane.scheduler.settings import SchedulerSettings
from pdplane.scheduler.view import CandidateView
from pdplane.v1 import inflight_pb2_grpc, scheduler_pb2, scheduler_pb2_grpc

__all__ = ["SchedulerApp"]

log = logging.getLogger(__name__)

SERVICE_NAME = scheduler_pb2.DESCRIPTOR.services_by_name["Scheduler"].full_name


class SchedulerApp:
    """One scheduler: `await start()` returns the gRPC address, `await stop()` frees everything.

    `source` replaces the registry watcher (tests, benchmarks); by default an `InstanceWatcher`
    on `settings.registry` is started and stopped with the app.
    """

    def __init__(self, settings: SchedulerSettings, *, source: InstanceSource | None = None):
        self.settings = settings
        self._watcher: InstanceWatcher | None = None
        self._source = source
        self.view: CandidateView | None = None
        self._local: LocalScheduler | None = None
        self.metrics = SchedulerMetrics()
        self.service: Decider | None = None
        self.exchange: inflight_exchange.InflightExchange | None = None
        self._server: grpc.aio.Server | None = None
        self._http: tuple[HTTPServer, threading.Thread] | None = None
        self.kv_index: KvIndexManager | None = None
        self.address = ""
        self.metrics_port = 0

    @property
    def watcher(self) -> InstanceWatcher | None:
        """The registry watcher (None when a `source` was given or before `start`)."""
        return self._watcher

    async def start(self) -> str:
        """Starts watching, serving gRPC and (if configured) metrics; returns "host:port".

        Raises RuntimeError / OSError when a port cannot be bound (everything started so far is
        stopped again).
        """
        s = self.settings
        try:
            self._local = open_local(
                self._source or self._start_watcher(),
                s,
                self.metrics,
                token=s.registry_token or s.token,
                tls_ca=s.tls_ca,
                subscriber="scheduler",
            )
            self.service, self.kv_index = self._local.service, self._local.kv_index
            self.view = self.service.view
            await self._start_grpc()
            await self._local.start()  # follows --peers
            if s.metrics_port:
                server, thread = start_http_server(
                    s.metrics_port, addr=s.host, registry=self.metrics.registry
                )
                self._http = (server, thread)
                self.metrics_port = server.server_port
            if self._watcher is not None:
                ready = await asyncio.to_thread(self._watcher.wait_ready, s.registry_wait_s)
                if not ready:
                    log.warning(
                        "no snapshot from registry %s after %.1f s; serving UNAVAILABLE until "
                        "it arrives",
                        s.registry,
                        s.registry_wait_s,
                    )
        except BaseException:
            await self.stop(grace=0)
            raise
        return self.address

    def _start_watcher(self) -> InstanceWatcher:
        s = self.settings
        # on_change forces a re-read even if a restarted registry reuses a revision number.
        self._watcher = InstanceWatcher(
            s.registry,
            token=s.registry_token or s.token,
            tls_ca=s.tls_ca,
            on_change=self._source_changed,
        )
        self._watcher.start()
        return self._watcher

    def _source_changed(self, _instances: object) -> None:
        if self.view is not None:
            self.view.mark_dirty()

    async def _start_grpc(self) -> None:
        s = self.settings
        assert self.service is not None
        interceptors = grpc_util.aio_server_interceptors(s.token)
        server = grpc.aio.server(interceptors=interceptors, options=grpc_util.SERVER_OPTIONS)
        scheduler_pb2_grpc.add_SchedulerServicer_to_server(
            SchedulerServicer(self.service, self.kv_index.states if self.kv_index else None),
            server,
        )
        # Always served (other replicas may list this one); peers are followed with --peers.
        assert self._local is not None and self._local.exchange is not None
        self.exchange = self._local.exchange.exchange
        inflight_pb2_grpc.add_InflightExchangeServicer_to_server(self.exchange.servicer, server)
        await grpc_util.aio_add_health_and_reflection(server, [SERVICE_NAME, INFLIGHT_SERVICE_NAME])
        host = f"[{s.host}]" if ":" in s.host else s.host
        port = grpc_util.add_port(server, f"{host}:{s.port}", s.tls_cert, s.tls_key)
        self._server = server
        await server.start()
        self.address = f"{host}:{port}"

    async def stop(self, grace: float = 1.0) -> None:
        """Stops gRPC (letting calls finish for `grace` seconds), metrics and the watcher."""
        server, self._server = self._server, None
        if server is not None:
            await grpc_util.aio_stop(server, grace)
        http, self._http = self._http, None
        if http is not None:
            http[0].shutdown()
            http[0].server_close()
            http[1].join(timeout=2.0)
        local, self._local, self.kv_index = self._local, None, None
        if local is not None:
            await local.close()  # the prefix index's streams
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            await asyncio.to_thread(watcher.stop)
