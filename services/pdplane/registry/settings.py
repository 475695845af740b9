"""`pdplane registry` settings: flags and `PDPLANE_*` environment variables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pdplane.core import defaults
from pdplane.core.settings import CommandSettings

__all__ = ["RegistrySettings"]


class RegistrySettings(CommandSettings):
    """Settings of the registry service (all durations in ms)."""

    host: str = Field("127.0.0.1", description="address to listen on")
    port: int = Field(defaults.REGISTRY_PORT, ge=0, le=65535, description="gRPC port (0 = any)")
    lease_ttl_ms: int = Field(
        defaults.LEASE_TTL_MS, ge=100, le=600_000, description="default lease TTL (ms)"
    )
    max_lease_ttl_ms: int = Field(
        60_000, ge=100, le=3_600_000, description="longest lease TTL granted (ms)"
    )
    heartbeat_interval_ms: int = Field(
        defaults.HEARTBEAT_INTERVAL_MS, ge=10, le=60_000, description="heartbeat period (ms)"
    )
    expiry_check_ms: int = Field(
        100, ge=10, le=10_000, description="how often expired leases are looked for (ms)"
    )
    token: str | None = Field(None, description="shared bearer token required from clients")
    tls_cert: str | None = Field(None, description="server certificate (PEM) to serve TLS")
    tls_key: str | None = Field(None, description="server private key (PEM) to serve TLS")
    watch_queue_size: int = Field(
        4_096, ge=1, description="events a watcher may lag before it gets a fresh snapshot"
    )
    event_history: int = Field(
        10_000, ge=0, description="events kept to replay to re-watching clients"
    )
    flavour: Literal["aio", "sync"] = Field(
        "aio", description="gRPC server flavour: asyncio (default) or a sync thread pool"
    )
    max_workers: int = Field(32, ge=1, description="thread pool size of the sync flavour")
    log_level: str = Field("INFO", description="logging level")

    @model_validator(mode="after")
    def _check(self) -> RegistrySettings:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key must be given together")
        if self.lease_ttl_ms > self.max_lease_ttl_ms:
            raise ValueError("--lease-ttl-ms must not exceed --max-lease-ttl-ms")
        return self
