"""`pdplane scheduler` settings: every field is a --kebab-case flag and a PDPLANE_* variable."""

from __future__ import annotations

from pydantic import Field, field_validator

from pdplane.core import defaults
from pdplane.core.settings import CommandSettings
from pdplane.scheduler.policies import POLICIES

__all__ = ["PolicySettings", "SchedulerSettings"]


def _known_policy(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return name


class PolicySettings(CommandSettings):
    """The decision flags shared by `pdplane scheduler` and `pdplane gateway --scheduler
    embedded` (which runs the same decision code in the gateway process)."""

    prefill_policy: str = Field(
        default="least_loaded", description=f"prefill policy: {', '.join(POLICIES)}"
    )
    decode_policy: str = Field(
        default="least_loaded", description=f"decode policy: {', '.join(POLICIES)}"
    )
    inflight_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="seconds after which an unreleased assignment stops counting",
    )
    seed: int | None = Field(
        default=None, description="seed of the random and power_of_two policies"
    )

    kv_index: bool = Field(
        default=True,
        description="keep a prefix index from every instance's KV events stream (kv_aware)",
    )
    kv_stale_after_s: float = Field(
        default=3.0, gt=0, description="an instance's KV events silent this long is stale (s)"
    )
    kv_max_lag_events: int = Field(
        default=10_000, gt=0, description="an instance's KV events this far behind is stale"
    )
    kv_index_max_blocks: int = Field(
        default=100_000_000, gt=0, description="bound on (instance, block) entries of the index"
    )

    _check_prefill = field_validator("prefill_policy")(_known_policy)
    _check_decode = field_validator("decode_policy")(_known_policy)


class SchedulerSettings(PolicySettings):
    """Flags of `pdplane scheduler` (plus the decision flags of `PolicySettings`)."""

    registry: str = Field(description="registry gRPC address, host:port")
    host: str = Field(default="127.0.0.1", description="address to serve gRPC on")
    port: int = Field(
        default=defaults.SCHEDULER_PORT, ge=0, le=65535, description="gRPC port (0 = any free port)"
    )
    token: str | None = Field(
        default=None, description="bearer token required from callers and sent to the registry"
    )
    registry_token: str | None = Field(
        default=None, description="bearer token for the registry when it differs from --token"
    )
    tls_ca: str | None = Field(
        default=None, description="PEM CA bundle to verify the registry's TLS"
    )
    tls_cert: str | None = Field(default=None, description="PEM certificate to serve gRPC over TLS")
    tls_key: str | None = Field(default=None, description="PEM private key for --tls-cert")
    metrics_port: int = Field(
        default=0, ge=0, le=65535, description="Prometheus /metrics HTTP port (0 = off)"
    )
    registry_wait_s: float = Field(
        default=5.0, ge=0, description="seconds to wait for the first registry snapshot at start"
    )
