"""Typed, validated settings of the connector, read from `kv_connector_extra_config`.

Every key is optional except where noted; unknown keys are rejected (a typo must not silently
fall back to a default). Example::

    {"registry": "127.0.0.1:8051", "url": "http://127.0.0.1:8100",
     "kv_port": 8200, "transport": "tcp", "transfer_timeout_s": 60, "mode": "pull"}
"""

from __future__ import annotations

import os
import re
import secrets
import socket
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdplane.core import defaults
from pdplane.core.token_file import read_token
from pdplane.v1 import instance_pb2

__all__ = ["ConnectorConfig", "ConnectorConfigError"]

_TCP_PUSH_BUFFER_BYTES = 256 << 20
_INSTANCE_ID = re.compile(r"^[A-Za-z0-9._:-]{1,128}$")


class ConnectorConfigError(ValueError):
    """`kv_connector_extra_config` is invalid; the message names the key."""


class ConnectorConfig(BaseModel):
    """Settings of one vLLM instance's PdPlaneConnector (all ranks share them)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    registry: str | None = Field(
        None,
        description="Registry gRPC address host:port, or several replicas' comma-separated "
        "(failover); unset = do not register.",
    )
    registry_token: str | None = Field(None, description="Bearer token for the registry.")
    registry_tls_ca: str | None = Field(None, description="PEM CA to verify the registry's TLS.")
    instance_id: str | None = Field(
        None, description="Registry instance id; default <hostname>-<kv_port>."
    )
    url: str | None = Field(
        None, description="This instance's OpenAI base URL (http://host:port); needed to register."
    )
    labels: dict[str, str] = Field(default_factory=dict, description="Registry labels.")
    lease_ttl_ms: int = Field(defaults.LEASE_TTL_MS, gt=0, description="Requested lease TTL (ms).")

    kv_host: str = Field("127.0.0.1", description="Bind host of the KvTransfer gRPC server.")
    kv_port: int = Field(
        0, ge=0, lt=65536, description="KvTransfer port of TP rank 0 (rank i: +i); 0 = any."
    )
    advertise_host: str | None = Field(
        None, description="Host peers use to reach the KvTransfer server; default kv_host."
    )
    token: str | None = Field(
        None, description="Bearer token required on KvTransfer calls (and sent to peers)."
    )
    tls_cert: str | None = Field(None, description="PEM certificate of the KvTransfer server.")
    tls_key: str | None = Field(None, description="PEM key of the KvTransfer server.")
    tls_ca: str | None = Field(None, description="PEM CA to verify peers' KvTransfer TLS.")

    transport: Literal["tcp", "nccl"] = Field("tcp", description="How KV block bytes move.")
    mode: Literal["pull", "push"] = Field(
        "pull",
        description="pull: decode pulls held blocks; push: prefill also pushes them layer by "
        "layer during its forward into decode's bounded receive buffer (set it on both sides).",
    )
    push_timeout_s: float = Field(
        10.0, gt=0, description="Push: bound on one step's push streams (s)."
    )
    push_wait_s: float = Field(
        2.0,
        ge=0,
        description="Push: how long decode waits for an announced push still arriving before "
        "it pulls instead (s).",
    )
    transfer_timeout_s: float = Field(
        defaults.KV_TRANSFER_TIMEOUT_S,
        gt=0,
        description="Prefill frees held blocks if decode has not completed by then (s).",
    )
    pull_timeout_s: float = Field(
        30.0, gt=0, description="Decode gives up a pull after this long: load error (s)."
    )
    chunk_bytes: int = Field(4 * 1024 * 1024, gt=0, description="TCP: bytes per KvChunk.")
    pull_workers: int = Field(4, ge=1, le=64, description="Concurrent pulls per decode worker.")

    # NCCL transport options (see transports/nccl/transport.py); unset = the transport's defaults.
    nccl_chunk_bytes: int | None = Field(None, gt=0, description="NCCL: bytes per send.")
    nccl_connect_timeout_s: float | None = Field(
        None, gt=0, description="NCCL: communicator set-up bound (s)."
    )
    push_buffer_bytes: int | None = Field(
        None,
        ge=0,
        description="Push: decode's receive buffer (bytes; NCCL: on the GPU); default 256 MiB "
        "(TCP) / 1 GiB (NCCL).",
    )
    push_spill_bytes: int | None = Field(None, ge=0, description="NCCL push: host spill.")
    max_peer_communicators: int | None = Field(
        None,
        ge=1,
        le=4096,
        description="NCCL: communicators per worker at most (default 64); idle ones beyond "
        "it are closed, least recently used first, never one in use.",
    )
    preconnect_peers: int = Field(
        32,
        ge=0,
        description="Compatible instances of the other role each worker connects to in the "
        "background (at start, before registering, and as they join); 0 = none.",
    )
    preconnect_timeout_s: float = Field(
        30.0, gt=0, description="Bound on the start-up pre-connect before registering (s)."
    )
    push_ttl_s: float | None = Field(None, gt=0, description="Push: unclaimed KV TTL (s).")

    @model_validator(mode="after")
    def _check(self) -> ConnectorConfig:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("tls_cert and tls_key must be set together")
        if self.instance_id is not None and not _INSTANCE_ID.match(self.instance_id):
            raise ValueError("instance_id must match [A-Za-z0-9._:-]{1,128}")
        if self.registry:
            if not self.url:
                raise ValueError("url is required when registry is set")
            if self.kv_port == 0:
                raise ValueError("kv_port must be set (non-zero) when registry is set")
        return self

    @classmethod
    def from_extra_config(cls, extra: dict[str, Any] | None) -> ConnectorConfig:
        """Parses `kv_connector_extra_config`; raises ConnectorConfigError naming the bad key.

        `token` and `registry_token` not in it come from `PDPLANE_TOKEN` and
        `PDPLANE_REGISTRY_TOKEN` (how `pdplane vllm` and `pdplane up` hand them over: an
        environment is private to the process, argv is not), else from the files named by
        `PDPLANE_TOKEN_FILE` / `PDPLANE_REGISTRY_TOKEN_FILE` (compose's generated tokens).
        """
        data = dict(extra or {})
        for key, var in (("token", "PDPLANE_TOKEN"), ("registry_token", "PDPLANE_REGISTRY_TOKEN")):
            if key in data:
                continue
            if os.environ.get(var):
                data[key] = os.environ[var]
            elif path := os.environ.get(f"{var}_FILE"):
                try:
                    data[key] = read_token(path)
                except ValueError as exc:
                    raise ConnectorConfigError(f"{var}_FILE: {exc}") from None
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            errs = "; ".join(
                f"{'.'.join(str(p) for p in e['loc']) or 'config'}: {e['msg']}"
                for e in exc.errors()
            )
            raise ConnectorConfigError(f"invalid kv_connector_extra_config: {errs}") from None

    def transport_options(self) -> dict[str, Any]:
        """Keyword arguments for the configured transport's constructor."""
        if self.transport == "tcp":
            options: dict[str, Any] = {"chunk_bytes": self.chunk_bytes}
            if self.mode == "push":
                options["push_buffer_bytes"] = (
                    _TCP_PUSH_BUFFER_BYTES
                    if self.push_buffer_bytes is None
                    else self.push_buffer_bytes
                )
                if self.push_ttl_s is not None:
                    options["push_ttl_s"] = self.push_ttl_s
            return options
        names = (
            "nccl_chunk_bytes",
            "nccl_connect_timeout_s",
            "max_peer_communicators",
            "push_buffer_bytes",
            "push_spill_bytes",
            "push_ttl_s",
        )
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    @property
    def registry_transport(self) -> instance_pb2.Transport.ValueType:
        """`transport` as the registry's `Transport` enum."""
        if self.transport == "nccl":
            return instance_pb2.TRANSPORT_NCCL
        return instance_pb2.TRANSPORT_TCP

    def kv_endpoint(self, tp_rank: int = 0) -> str:
        """host:port peers use to reach the KvTransfer server of `tp_rank`."""
        host = self.advertise_host or self.kv_host
        if ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.kv_port + tp_rank if self.kv_port else 0}"

    def kv_local_address(self, tp_rank: int = 0) -> str:
        """host:port this instance reaches its own worker server of `tp_rank` at."""
        host = self.kv_host
        if host in ("", "0.0.0.0", "::", "[::]"):
            host = "127.0.0.1"
        elif ":" in host and not host.startswith("["):
            host = f"[{host}]"
        return f"{host}:{self.kv_port + tp_rank}"

    def bind_address(self, tp_rank: int = 0) -> str:
        """host:port the KvTransfer server of `tp_rank` binds (port 0 = any free port)."""
        host = self.kv_host if ":" not in self.kv_host else f"[{self.kv_host}]"
        return f"{host}:{self.kv_port + tp_rank if self.kv_port else 0}"

    def resolved_instance_id(self) -> str:
        """The configured instance id, else `<hostname>-<kv_port>` (the same in the scheduler
        and worker processes), else (no fixed port) a fresh unique one."""
        if self.instance_id:
            return self.instance_id
        host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:64] or "host"
        if self.kv_port:
            return f"{host}-{self.kv_port}"
        return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"
