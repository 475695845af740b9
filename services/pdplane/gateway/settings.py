"""`pdplane gateway` settings: every field is a `--kebab-case` flag and a `PDPLANE_*` env var."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from pdplane.core import defaults
from pdplane.core.token_file import token_file_field
from pdplane.scheduler import EMBEDDED, PolicySettings

__all__ = ["GatewaySettings"]


class GatewaySettings(PolicySettings):
    """Flags of `pdplane gateway` (env: PDPLANE_SCHEDULER, PDPLANE_API_KEY, ...).

    It is the `pdplane.scheduler.PortSettings` that `open_scheduler` reads.

    The policy flags (`--prefill-policy`, `--decode-policy`, `--inflight-timeout-s`, `--seed`)
    apply with `--scheduler embedded` only; a remote scheduler has its own.
    """

    scheduler: str = Field(
        f"127.0.0.1:{defaults.SCHEDULER_PORT}",
        description=f"scheduler gRPC address host:port, or '{EMBEDDED}': decide in this process "
        "over the registry view (one gateway only; see docs/gateway.md)",
    )
    registry: str = Field(
        f"127.0.0.1:{defaults.REGISTRY_PORT}",
        description="registry gRPC address host:port, or several replicas' comma-separated "
        "(for /v1/models and /health)",
    )
    host: str = Field("127.0.0.1", description="HTTP bind address (0.0.0.0 for all interfaces)")
    port: int = Field(defaults.GATEWAY_PORT, ge=0, le=65535, description="HTTP port; 0 = any")
    api_key: str | None = Field(
        None,
        description="require 'Authorization: Bearer <key>' on /v1/*; comma-separated for several",
    )
    upstream_api_key: str | None = Field(
        None, description="bearer token sent to the instances (vLLM started with --api-key)"
    )
    dispatch: Literal["sequential", "concurrent"] = Field(
        "sequential",
        description="sequential: decode request after prefill's answer; concurrent: decode "
        "request opened while prefill runs (see docs/gateway.md)",
    )
    first_token: Literal["prefill", "decode"] = Field(
        "prefill",
        description="streamed requests: prefill = the first output token, which prefill "
        "computes, goes to the client when decode accepted the rest (decode continues from "
        "it); decode = decode computes it again after the KV transfer. Requests that sample "
        "differently when split (seed, stop strings, logprobs, tools, ...) always use decode "
        "(see docs/gateway.md)",
    )
    enable_prompt_tokens_details: bool = Field(
        False,
        description="usage.prompt_tokens_details.cached_tokens in every usage block, as "
        "`vllm serve --enable-prompt-tokens-details` reports it: the prompt tokens prefill did "
        "not compute (its prefix cache hit)",
    )
    upstream_timeout_s: float = Field(
        300.0, gt=0, description="max silence of an instance before 504 / error event (s)"
    )
    stream_idle_timeout_s: float = Field(
        30.0,
        gt=0,
        description="streams: max silence of decode between two chunks (its first included) "
        "before one error event ends the stream (s)",
    )
    header_timeout_s: float = Field(
        10.0,
        gt=0,
        description="a client connection whose request headers are not complete this long "
        "after it opened (or after the request's first byte) is closed (s)",
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="longest read of one request body on /v1/*; then 408 (s)"
    )
    keep_alive_s: float = Field(
        5.0, gt=0, description="an idle keep-alive client connection is closed after this (s)"
    )
    max_client_connections: int = Field(
        2048,
        ge=0,
        description="client connections plus running requests at once; past it new requests "
        "get 503 (0 = unlimited)",
    )
    queue_timeout_s: float = Field(
        60.0,
        ge=0,
        description="a request that finds every compatible instance full (no decode KV room) "
        "waits this long for room, as vLLM queues it, then gets 503; 0 = 503 at once (s)",
    )
    max_queued_requests: int = Field(
        1024,
        ge=0,
        description="requests waiting for room at once, and per model for their turn in the "
        "in-flight budget; one more gets 503 (room) or 429 (turn; the lowest priority shed "
        "first)",
    )
    inflight_budget: float = Field(
        1.0,
        ge=0,
        description="flow control: tokens (prompt + max_tokens) in flight per model at most, "
        "as a multiple of its decode instances' KV cache (tokens); beyond it requests wait at "
        "the gateway by priority, fair between tenants; 0 = no budget (see docs/flow-control.md)",
    )
    flow_policy: Literal["fair", "fifo"] = Field(
        "fair",
        description="order of the requests waiting for the in-flight budget: fair = by "
        "priority, then fair between tenants by tokens; fifo = arrival order",
    )
    tenants: str | None = Field(
        None,
        description="tenants file (YAML, TOML or JSON): API keys, their tenant, priority, "
        "weight and rate limits; reread when it changes (see docs/flow-control.md)",
    )
    tenants_reload_s: float = Field(
        1.0, gt=0, description="how often the --tenants file is checked for changes (s)"
    )
    migration_limit: int = Field(
        3,
        ge=0,
        le=20,
        description="a request whose decode is lost mid-way continues on another decode from "
        "the tokens already sent, at most this many times; then one error event (0 = never)",
    )
    migration_timeout_s: float = Field(
        60.0,
        gt=0,
        description="total time a request may spend continuing on other decodes (scheduling, "
        "waiting for room or for a decode when no other serves, opening the new leg) before "
        "one error event ends it (s)",
    )
    drain_grace_s: float = Field(
        30.0,
        ge=0,
        description="streams on a draining decode may finish there this long; then they "
        "continue on another decode (s)",
    )
    connect_timeout_s: float = Field(5.0, gt=0, description="TCP connect bound per leg (s)")
    max_retries: int = Field(
        1, ge=0, le=5, description="retries on another pair when an instance is unreachable"
    )
    max_connections: int = Field(
        0, ge=0, description="HTTP connection pool size to the instances; 0 = unlimited"
    )
    token: str | None = Field(
        None, description="bearer token for the scheduler, registry and KvTransfer gRPC calls"
    )
    token_file: str | None = token_file_field("--token")
    tls_ca: str | None = Field(None, description="PEM CA for TLS to the gRPC services")
    schedule_timeout_s: float = Field(5.0, gt=0, description="deadline of one Schedule call (s)")
    schedule_stream: bool = Field(
        True,
        description="remote scheduler: Schedule calls on one long-lived ScheduleStream; off = "
        "one unary Schedule call per request",
    )
    release_batch_s: float = Field(
        0.05,
        ge=0,
        description="remote scheduler: a Release waits at most this long to ride on a Schedule "
        "before it is sent in a ReleaseBatch (s)",
    )
    abort_timeout_s: float = Field(2.0, gt=0, description="deadline of one AbortTransfer (s)")
    registry_wait_s: float = Field(
        5.0, ge=0, description="at startup, wait this long for the registry's first snapshot (s)"
    )
    shutdown_timeout_s: int = Field(
        30, ge=0, description="on SIGTERM/SIGINT, wait this long for open requests to end (s)"
    )
    tokenizer: str | None = Field(
        None,
        description="override: the model's tokenizer directory (the model folder) instead of "
        "the one its instances publish; 'MODEL=DIR,...' for several models. Not needed: "
        "every instance publishes its tokenizer and chat template (see docs/gateway.md)",
    )
    trust_remote_code: bool = Field(
        False,
        description="let the --tokenizer folders run their own tokenizer code (as vLLM's "
        "--trust-remote-code); never applies to tokenizers fetched from instances",
    )
    tokenizer_cache_dir: str | None = Field(
        None,
        description="where tokenizers fetched from the instances are kept, one folder per "
        "content hash; default $PDPLANE_CACHE_DIR/tokenizers or ~/.cache/pdplane/tokenizers "
        "(a temporary folder when that is not writable)",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field("info")
    access_log: bool = Field(
        True,
        description="one log line per request: client, status, model, prompt tokens, the "
        "prefill and decode it went to with their predicted prefix cache hits, the "
        "scheduler's reason, latency (--no-access-log: none)",
    )
    inflight_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="--scheduler embedded: gRPC port serving this gateway's in-flight "
        "assignments to its --peers (0 = not served)",
    )

    @property
    def embedded_scheduler(self) -> bool:
        """Whether `--scheduler embedded` was given."""
        return self.scheduler == EMBEDDED

    def api_keys(self) -> tuple[str, ...]:
        """The accepted API keys (empty: no authentication)."""
        return tuple(k.strip() for k in (self.api_key or "").split(",") if k.strip())
