"""One running simulated instance: HTTP server, KvTransfer gRPC server, optional registration."""

from __future__ import annotations

import asyncio
import functools
import logging

import grpc
from aiohttp import web

from pdplane.core.grpc import util as grpc_util
from pdplane.core.kv_events.servicer import add_kv_events_servicer
from pdplane.core.tokenizer.bundle import TokenizerBundle, TokenizerUnpublishable, collect
from pdplane.core.tokenizer.servicer import Published, add_tokenizer_servicer
from pdplane.sim.app import build_app
from pdplane.sim.config import SimConfig
from pdplane.sim.servicer import TcpDataServicer, TransferServicer
from pdplane.sim.state import SimState
from pdplane.sim.tokens import Tokenizer
from pdplane.v1 import instance_pb2, kv_transfer_pb2_grpc, kv_transfer_tcp_pb2_grpc

__all__ = ["SimInstance"]

log = logging.getLogger(__name__)

_ROLES = {
    "prefill": instance_pb2.ROLE_PREFILL,
    "decode": instance_pb2.ROLE_DECODE,
    "both": instance_pb2.ROLE_BOTH,
}
_KV_SERVICE = "pdplane.v1.KvTransfer"
_TCP_SERVICE = "pdplane.v1.TcpKvTransfer"


@functools.lru_cache(maxsize=8)
def _published(tokenizer_dir: str) -> Published:
    """What a sim with `--tokenizer tokenizer_dir` publishes (sims of one fleet share it)."""
    if not tokenizer_dir:
        return "the simulator runs without --tokenizer (its word tokenizer is not published)"
    try:
        return collect(tokenizer_dir)
    except TokenizerUnpublishable as exc:
        log.warning("tokenizer %s not published: %s", tokenizer_dir, exc)
        return str(exc)


class SimInstance:
    """A simulated vLLM instance on the running asyncio loop.

    `await start()` binds the HTTP port (aiohttp) and the KvTransfer gRPC port, then registers
    with `registry` ("host:port") when given; `await stop()` deregisters, closes open requests
    and frees everything. Raises OSError from start() when a port cannot be bound.
    """

    def __init__(
        self,
        config: SimConfig,
        *,
        registry: str | None = None,
        registry_token: str | None = None,
        lease_ttl_ms: int = 0,
        tokenizer: Tokenizer | None = None,
    ) -> None:
        self.config = config
        self.state = SimState(config, tokenizer)
        self.published = _published(config.tokenizer)
        self._registry = registry
        self._registry_token = registry_token
        self._lease_ttl_ms = lease_ttl_ms
        self._runner: web.AppRunner | None = None
        self._grpc: grpc.aio.Server | None = None
        self.registration: object | None = None
        self._killing: asyncio.Task[None] | None = None
        self.state.kill = self._kill_soon

    @property
    def url(self) -> str:
        """OpenAI base URL, `http://host:port` (no `/v1`)."""
        return self.state.url

    @property
    def kv_endpoint(self) -> str:
        """host:port of this sim's KvTransfer gRPC server."""
        return self.state.kv_endpoint

    @property
    def instance_id(self) -> str:
        return self.state.instance_id

    def spec(self) -> instance_pb2.InstanceSpec:
        """The registry spec of this instance (valid after start())."""
        c = self.config
        return instance_pb2.InstanceSpec(
            instance_id=self.instance_id,
            role=_ROLES[c.role],
            model=c.model,
            url=self.url,
            kv_endpoint=self.kv_endpoint,
            transport=instance_pb2.TRANSPORT_TCP,
            tp_size=1,
            kv_layout=self.state.kv_layout,
            max_model_len=c.max_model_len,
            version="pdplane-sim 0.1.0 (vllm 0.32.0 API)",
            labels={"sim": "true", **c.labels},
            tokenizer_hash=(
                self.published.content_hash if isinstance(self.published, TokenizerBundle) else ""
            ),
        )

    async def start(self) -> None:
        """Binds both ports and registers; on any failure (e.g. OSError: a port in use) what
        was started is stopped again before the error propagates."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        c = self.config
        self._grpc = grpc.aio.server(
            interceptors=grpc_util.aio_server_interceptors(c.kv_token or None),
            options=grpc_util.KV_SERVER_OPTIONS,
        )
        state = self.state
        kv_transfer_pb2_grpc.add_KvTransferServicer_to_server(
            TransferServicer(state.transfers), self._grpc
        )
        kv_transfer_tcp_pb2_grpc.add_TcpKvTransferServicer_to_server(
            TcpDataServicer(state.push_buffer, state.kv_layout, state.block_bytes), self._grpc
        )
        services = [_KV_SERVICE, _TCP_SERVICE, add_tokenizer_servicer(self._grpc, self.published)]
        if state.events is not None:
            services.append(add_kv_events_servicer(self._grpc, state.events))
        await grpc_util.aio_add_health_and_reflection(self._grpc, services)
        kv_port = grpc_util.add_port(self._grpc, f"{c.host}:{c.kv_port}")
        await self._grpc.start()
        # handler_cancellation: a client disconnect cancels the handler, so that waiting,
        # stalled and pulling requests notice it and free their slot and KV blocks.
        self._runner = web.AppRunner(
            build_app(self.state), handler_cancellation=True, access_log=None, shutdown_timeout=0.5
        )
        await self._runner.setup()
        self.state.runner.start()
        site = web.TCPSite(self._runner, c.host, c.port, backlog=1024)
        await site.start()
        port = self._bound_port()
        host = f"[{c.host}]" if ":" in c.host else c.host
        self.state.url = f"http://{host}:{port}"
        self.state.kv_endpoint = f"{host}:{kv_port}"
        self.state.instance_id = c.instance_id or f"sim-{c.role}-{port}"
        if self._registry:
            self._register()

    def _bound_port(self) -> int:
        assert self._runner is not None
        for address in self._runner.addresses:
            return int(address[1])
        raise OSError("HTTP site did not bind")

    def _register(self) -> None:
        from pdplane.registry.client import RegistrationClient

        client = RegistrationClient(
            self._registry or "",
            self.spec(),
            self.state.load_report,
            token=self._registry_token,
            lease_ttl_ms=self._lease_ttl_ms,
        )
        client.start()
        self.registration = client

    def _kill_soon(self) -> None:
        if self._killing is None:
            self._killing = asyncio.get_running_loop().create_task(self.kill())

    async def kill(self) -> None:
        """Dies as a SIGKILLed engine would (fault injection, `FaultPlan.kill_after_tokens`):
        every open connection is cut mid-answer, the ports close, nothing is deregistered (the
        registry drops the instance when its lease lapses) and held KV is gone."""
        client, self.registration = self.registration, None
        if client is not None:
            await asyncio.to_thread(client.abandon)  # type: ignore[attr-defined]
        runner = self._runner
        if runner is not None and runner.server is not None:
            for handler in list(runner.server.connections):
                if handler.transport is not None:
                    handler.transport.abort()
        log.warning("sim %s killed (fault injection)", self.instance_id)
        await self.stop()

    async def stop(self) -> None:
        """Deregisters, stops serving (open requests are cancelled) and frees held KV."""
        client = self.registration
        if client is not None:
            await asyncio.to_thread(client.stop)  # type: ignore[attr-defined]
            self.registration = None
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.state.events is not None:
            self.state.events.close()
        if self._grpc is not None:
            await self._grpc.stop(grace=None)
            self._grpc = None
        await self.state.runner.stop()
        self.state.transfers.release_all("shutdown")
        if self.state.push_buffer is not None:
            self.state.push_buffer.clear()
        await self.state.peers.close()
