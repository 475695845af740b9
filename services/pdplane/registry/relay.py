"""`pdplane registry-relay`: a host's heartbeat relay in front of the registry.

Run one per host (a DaemonSet in Kubernetes) and point the instances on the host at it instead
of at the registry (`--registry`, `PDPLANE_REGISTRY`, the connector's `registry`): it serves
the whole Registry API, answers `HeartbeatStream` itself (to callers with the registry's shared
token) and sends the host's heartbeats to the registry in one `HeartbeatBatch` a tick
(`pdplane.registry.heartbeat_relay`); every other call (Register, Deregister, List, Watch, ...)
goes to the registry unchanged, with the caller's token, deadline and status
(`pdplane.registry.forward`), and the registry authenticates it. Its own health and reflection are
served here. A fleet of a few thousand instances does not need it; docs/registry.md says when
one does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2
from pydantic import Field, model_validator

from pdplane.core import defaults
from pdplane.core.grpc import util as grpc_util
from pdplane.core.grpc.auth import AuthPolicy, check_bind
from pdplane.core.grpc.message_check import AioDecodeErrorInterceptor
from pdplane.core.listen import refuse_taken
from pdplane.core.settings import CommandSettings, LogLevel
from pdplane.core.token_file import token_file_field
from pdplane.registry.failover import split_addresses
from pdplane.registry.forward import HOP_KEY, ForwardingHandler, shapes
from pdplane.registry.heartbeat_relay import (
    HEARTBEAT_STREAM,
    HeartbeatRelay,
    heartbeat_stream_handler,
)
from pdplane.registry.servicer import SERVICE_NAME
from pdplane.v1 import registry_pb2, registry_pb2_grpc

__all__ = ["RegistryRelay", "RelaySettings", "main"]

log = logging.getLogger(__name__)


class RelaySettings(CommandSettings):
    """Settings of `pdplane registry-relay` (durations in ms)."""

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(
        defaults.REGISTRY_RELAY_PORT, ge=0, le=65535, description="gRPC port (0 = any)"
    )
    registry: str = Field(
        f"127.0.0.1:{defaults.REGISTRY_PORT}",
        description="the registry: host:port, or several replicas' h1:port,h2:port (the relay "
        "uses one at a time and moves on when its link breaks)",
    )
    token: str | None = Field(
        None,
        description="the registry's shared bearer token: required from the instances, and sent "
        "with the relay's heartbeat batches",
    )
    token_file: str | None = token_file_field("--token")
    tls_ca: str | None = Field(None, description="CA (PEM) to verify the registry's TLS")
    tls_cert: str | None = Field(None, description="server certificate (PEM) to serve TLS")
    tls_key: str | None = Field(None, description="server private key (PEM) to serve TLS")
    insecure: bool = Field(
        False, description="allow a non-loopback --host without --token (anyone may call it)"
    )
    flush_interval_ms: int = Field(
        defaults.HEARTBEAT_INTERVAL_MS,
        ge=10,
        le=10_000,
        description="how often the host's heartbeats go to the registry, as one message (ms); "
        "a lease is renewed up to this much later than without the relay",
    )
    stale_after_ms: int = Field(
        3_000,
        ge=100,
        le=60_000,
        description="after this long without an answer from the registry the relay answers "
        "heartbeats UNAVAILABLE (ms)",
    )
    log_level: LogLevel = Field("INFO", description="logging level")

    @model_validator(mode="after")
    def _check(self) -> RelaySettings:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key must be given together")
        for address in self.registry.split(","):
            _check_address(address.strip(), self.host, self.port)
        check_bind("pdplane registry-relay", self.host, self.token, self.insecure)
        if self.stale_after_ms <= self.flush_interval_ms:
            raise ValueError("--stale-after-ms must be longer than --flush-interval-ms")
        return self


#: Hosts that reach a relay listening on loopback or on every address of this host.
_THIS_HOST = {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::"}


def _check_address(address: str, host: str, port: int) -> None:
    """Raises ValueError for a --registry entry that is no host:port (or gRPC target such as
    dns:///name:port), or that is this relay itself."""
    if "://" in address or address.startswith("unix:"):
        return
    name, _, digits = address.rpartition(":")
    name = name.strip("[]")
    if not name or not digits.isdigit() or not 0 < int(digits) < 65536:
        raise ValueError(f"--registry: {address!r} is not host:port")
    if int(digits) == port and (name == host.strip("[]") or name in _THIS_HOST):
        raise ValueError(f"--registry: {address} is this relay itself (--port {port})")


class RegistryRelay:
    """The relay's gRPC server on `settings.host:settings.port`, in the running event loop.

    `await start()` binds and returns the bound port (RuntimeError when it cannot);
    `await stop()` stops serving and closes the registry channels. `relay` is the
    `HeartbeatRelay` (its counters: `batches_sent`, `heartbeats_sent`).
    """

    def __init__(self, settings: RelaySettings) -> None:
        self.settings = settings
        self._channels = [
            grpc_util.aio_channel(a, settings.tls_ca, grpc_util.FAST_RECONNECT_OPTIONS)
            for a in split_addresses(settings.registry)
        ]
        self._stubs = [registry_pb2_grpc.RegistryStub(c) for c in self._channels]
        self._current = 0
        # Marks every call this relay sends on, so that one that comes back (a --registry that
        # leads to this relay again) is refused instead of going round without end.
        self._hop = (HOP_KEY, secrets.token_hex(8))
        self.relay = HeartbeatRelay(
            lambda: self._stubs[self._current],
            (*grpc_util.token_metadata(settings.token), self._hop),
            settings.flush_interval_ms / 1000,
            settings.stale_after_ms / 1000,
            relink=self._next_replica,
            on_vouching=self._vouching,
        )
        self._health: Any = None
        self._server: grpc.aio.Server | None = None
        self._sender: asyncio.Task[None] | None = None
        self.port = 0

    def _next_replica(self) -> None:
        self._current = (self._current + 1) % len(self._channels)

    async def _vouching(self, vouching: bool) -> None:
        # The Registry service is NOT_SERVING while the registry does not answer (a readiness
        # probe takes the relay out of its Service); the server ("") stays SERVING while the
        # process lives, for a liveness probe: restarting it would not bring the registry back.
        if self._health is None:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if vouching
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await self._health.set(SERVICE_NAME, status)

    async def start(self) -> int:
        """Binds `settings.host:settings.port`, starts serving and sending batches; returns
        the bound port (RuntimeError when it cannot be bound)."""
        s = self.settings
        # No token check here but on the relay's own HeartbeatStream: every other call is
        # the registry's to authenticate (an operator's drain with the admin token, which the
        # relay never holds, passes through it as any call does).
        server = grpc.aio.server(
            interceptors=[AioDecodeErrorInterceptor()], options=grpc_util.SERVER_OPTIONS
        )
        server.add_generic_rpc_handlers(
            [
                ForwardingHandler(
                    lambda: self._channels[self._current],
                    shapes([registry_pb2.DESCRIPTOR.services_by_name["Registry"]]),
                    self._hop,
                    {HEARTBEAT_STREAM: heartbeat_stream_handler(self.relay, AuthPolicy(s.token))},
                )
            ]
        )
        self._health = await grpc_util.aio_add_health_and_reflection(server, [SERVICE_NAME])
        self.port = grpc_util.add_port(server, f"{s.host}:{s.port}", s.tls_cert, s.tls_key)
        await server.start()
        self._server = server
        self._sender = asyncio.create_task(self.relay.run())
        return self.port

    async def stop(self, grace: float = 0.5) -> None:
        """Stops sending batches and serving (`grace` s for calls in progress)."""
        if self._sender is not None:
            self._sender.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sender
        if self._server is not None:
            await grpc_util.aio_stop(self._server, grace)
        for channel in self._channels:
            await channel.close()


async def _serve(settings: RelaySettings) -> int:
    relay = RegistryRelay(settings)
    try:
        port = await relay.start()
    except (RuntimeError, OSError, ValueError) as exc:
        sys.stderr.write(f"pdplane registry-relay: {exc}\n")
        return 1
    log.info(
        "registry relay serving on %s:%d for the registry at %s, a batch every %d ms",
        settings.host,
        port,
        settings.registry,
        settings.flush_interval_ms,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await stop.wait()
    await relay.stop()
    return 0


def main(argv: list[str]) -> int:
    """Serves the relay with settings from `argv` and `PDPLANE_*` until SIGTERM/SIGINT; returns
    the exit code (0 after a clean stop, 2 on bad flags or a port in use, 1 when it cannot
    start otherwise)."""
    settings = RelaySettings.parse(argv, prog="pdplane registry-relay")
    if refuse_taken("pdplane registry-relay", settings.host, [(settings.port, "--port")]):
        return 2
    for path in (settings.tls_ca, settings.tls_cert, settings.tls_key):
        if path and not Path(path).is_file():
            sys.stderr.write(f"pdplane registry-relay: no such file: {path}\n")
            return 2
    logging.basicConfig(
        level=settings.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    return asyncio.run(_serve(settings))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
