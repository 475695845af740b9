"""`pdplane scheduler` settings: every field is a --kebab-case flag and a PDPLANE_* variable."""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator

from pdplane.core import defaults
from pdplane.core.grpc.auth import check_bind
from pdplane.core.settings import CommandSettings
from pdplane.core.token_file import token_file_field
from pdplane.scheduler.latency import DEFAULT_PROFILE, LatencyModel
from pdplane.scheduler.policies import POLICIES
from pdplane.scheduler.policies.kv_aware import ITL_WEIGHT, LOCAL_PREFILL_MAX_TOKENS, LOCAL_SLACK
from pdplane.scheduler.warming import WARM_MIN_TOKENS, WARM_REQUESTS_PER_HOLDER, WARM_WINDOW_S

__all__ = ["PolicySettings", "SchedulerSettings"]


def _known_policy(name: str) -> str:
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}")
    return name


class PolicySettings(CommandSettings):
    """The decision flags shared by `pdplane scheduler` and `pdplane gateway --scheduler
    embedded` (which runs the same decision code in the gateway process)."""

    # kv_aware is least_loaded while no instance is LIVE in the prefix index, so it is the
    # default whether or not KV events flow.
    prefill_policy: str = Field(
        default="kv_aware", description=f"prefill policy: {', '.join(POLICIES)}"
    )
    decode_policy: str = Field(
        default="kv_aware", description=f"decode policy: {', '.join(POLICIES)}"
    )
    inflight_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="seconds after which an unreleased assignment stops counting",
    )
    inflight_reservation_s: float = Field(
        default=10.0,
        gt=0,
        description="seconds an unreleased assignment counts as pending load and reserved "
        "decode KV blocks while its instances' load reports do not change",
    )
    seed: int | None = Field(
        default=None, description="seed of the random and power_of_two policies"
    )
    peers: str = Field(
        default="",
        description="other replicas deciding over the same fleet (InflightExchange gRPC "
        "addresses host:port, comma-separated; a name with several addresses counts each): "
        "their in-flight assignments count here as load (docs/scheduler.md)",
    )
    peer_lag_ms: float = Field(
        default=1000.0,
        ge=0,
        description="with --peers: an own assignment also counts once per peer, standing for "
        "that peer's decisions not received yet, until two updates from it arrived, at most "
        "this long (ms; 0 = never)",
    )
    replica_id: str | None = Field(
        default=None, description="this replica's id among its peers (default: host-pid-random)"
    )

    def peer_list(self) -> list[str]:
        """`peers` as a list of addresses."""
        return [p.strip() for p in self.peers.split(",") if p.strip()]

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
    kv_events_interval_ms: int = Field(
        default=10,
        ge=0,
        le=1000,
        description="ask each instance for at most one KV events message per this many ms "
        "(it batches them): the index's CPU follows this rate, not the request rate (0 = "
        "every batch at once)",
    )
    kv_index_max_blocks: int = Field(
        default=100_000_000, gt=0, description="bound on (instance, block) entries of the index"
    )

    kv_profile: str = Field(
        default=DEFAULT_PROFILE,
        description="kv_aware: the engine profile it predicts latencies with, a built-in name "
        "(llama3-8b-h100, llama3-8b-h200, qwen2-7b-a100, tiny-cpu, ...) or a JSON file from "
        "pdplane profile",
    )
    kv_itl_weight: float = Field(
        default=ITL_WEIGHT,
        ge=0,
        description="kv_aware decode: ms of predicted TTFT one ms of predicted step time is worth",
    )
    kv_local_slack: float = Field(
        default=LOCAL_SLACK,
        ge=0,
        description="kv_aware: a decode computes a prompt's rest itself only if its step grows "
        "by at most this fraction",
    )
    local_prefill_max_tokens: int = Field(
        default=LOCAL_PREFILL_MAX_TOKENS,
        ge=0,
        description="kv_aware: at most this many prompt tokens computed on decode without a "
        "prefill leg (when it holds the rest and the model predicts it faster without hurting "
        "its streams); 0 = always disaggregate",
    )

    kv_warm_min_tokens: int = Field(
        default=WARM_MIN_TOKENS,
        ge=0,
        description="prefix warming: the shortest prefix (tokens) copied onto an idle prefill "
        "that does not hold it when many requests read it (docs/prefix-warming.md); 0 = off",
    )
    kv_warm_window_s: float = Field(
        default=WARM_WINDOW_S,
        gt=0,
        allow_inf_nan=False,
        description="prefix warming: how far back reads of a prefix count (s)",
    )
    kv_warm_requests_per_holder: int = Field(
        default=WARM_REQUESTS_PER_HOLDER,
        ge=1,
        description="prefix warming: reads within --kv-warm-window-s per prefill holding a "
        "prefix that make it worth one more holder",
    )

    _check_prefill = field_validator("prefill_policy")(_known_policy)
    _check_decode = field_validator("decode_policy")(_known_policy)

    @field_validator("kv_profile")
    @classmethod
    def _known_profile(cls, name: str) -> str:
        LatencyModel(name)  # ValueError names the known profiles or what is wrong with the file
        return name


class SchedulerSettings(PolicySettings):
    """Flags of `pdplane scheduler` (plus the decision flags of `PolicySettings`)."""

    registry: str = Field(
        description="registry gRPC address host:port, or several replicas' comma-separated"
    )
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
    token_file: str | None = token_file_field("--token")
    registry_token_file: str | None = token_file_field("--registry-token")
    insecure: bool = Field(
        default=False,
        description="allow a non-loopback --host without --token (anyone may Schedule/Release)",
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

    @model_validator(mode="after")
    def _protected(self) -> SchedulerSettings:
        check_bind("pdplane scheduler", self.host, self.token, self.insecure)
        return self
