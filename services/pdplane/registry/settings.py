"""`pdplane registry` settings: flags and `PDPLANE_*` environment variables."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from pdplane.core import defaults
from pdplane.core.grpc.auth import check_bind
from pdplane.core.settings import CommandSettings, LogLevel
from pdplane.core.token_file import token_file_field

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
    token: str | None = Field(
        None,
        description="shared bearer token required from clients (instances, scheduler, gateway): "
        "register, read, and change only the caller's own lease",
    )
    admin_token: str | None = Field(
        None, description="operators' bearer token: also drain or deregister any instance by id"
    )
    token_file: str | None = token_file_field("--token")
    admin_token_file: str | None = token_file_field("--admin-token")
    insecure: bool = Field(
        False, description="allow a non-loopback --host without --token (anyone may register)"
    )
    tls_cert: str | None = Field(None, description="server certificate (PEM) to serve TLS")
    tls_key: str | None = Field(None, description="server private key (PEM) to serve TLS")
    watch_queue_size: int = Field(
        4_096, ge=1, description="events a watcher may lag before it gets a fresh snapshot"
    )
    watch_coalesce_ms: int = Field(
        20,
        ge=0,
        le=1_000,
        description="a watcher taking batches gets the changes of this long as one message (ms; "
        "0: one message per wake-up)",
    )
    event_history: int = Field(
        10_000, ge=0, description="events kept to replay to re-watching clients"
    )
    log_level: LogLevel = Field("INFO", description="logging level")
    store: Literal["memory", "etcd"] = Field(
        "memory", description="where instances live: memory (one node) or etcd (replicated)"
    )
    etcd_endpoints: str = Field(
        "127.0.0.1:2379", description="etcd client endpoints, comma-separated host:port"
    )
    etcd_prefix: str = Field("/pdplane/", description="etcd key prefix of this registry")
    etcd_ca: str | None = Field(None, description="CA certificate (PEM) to verify etcd's TLS")
    etcd_cert: str | None = Field(None, description="client certificate (PEM) for etcd")
    etcd_key: str | None = Field(None, description="client private key (PEM) for etcd")
    etcd_timeout_ms: int = Field(
        1_500, ge=100, le=60_000, description="deadline of one etcd request, failovers included"
    )
    etcd_replica_ttl_ms: int = Field(
        10_000,
        ge=2_000,
        le=600_000,
        description="this replica's etcd lease (ms, whole seconds): instances it held survive "
        "its crash this long, waiting for their next heartbeat elsewhere",
    )
    etcd_load_flush_ms: int = Field(
        200, ge=10, le=10_000, description="how often changed load reports are written (ms)"
    )
    etcd_load_refresh_ms: int = Field(
        10_000, ge=100, description="unchanged load reports are re-sent this often (ms)"
    )
    etcd_compact_interval_s: int = Field(
        300, ge=0, description="compact etcd history older than this (s; 0 = leave it to etcd)"
    )
    replica_id: str | None = Field(
        None, description="name of this replica in etcd (default: host-pid-random)"
    )

    @model_validator(mode="after")
    def _check(self) -> RegistrySettings:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key must be given together")
        check_bind("pdplane registry", self.host, self.token, self.insecure)
        if self.lease_ttl_ms > self.max_lease_ttl_ms:
            raise ValueError("--lease-ttl-ms must not exceed --max-lease-ttl-ms")
        if bool(self.etcd_cert) != bool(self.etcd_key):
            raise ValueError("--etcd-cert and --etcd-key must be given together")
        if self.store == "etcd":
            from pdplane.registry.etcd.client import parse_endpoints

            parse_endpoints(self.etcd_endpoints)
            if not self.etcd_prefix.endswith("/"):
                raise ValueError("--etcd-prefix must end with '/'")
        return self
