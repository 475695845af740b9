"""`pdplane sim` flags (each also a `PDPLANE_*` environment variable).

Capacity and layout flags left unset take the `--profile`'s values (or SimConfig's defaults
without a profile); set ones override the profile.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field

from pdplane.core.defaults import KV_TRANSFER_TIMEOUT_S
from pdplane.core.settings import CommandSettings, LogLevel
from pdplane.core.token_file import token_file_field
from pdplane.sim.config import SimConfig

__all__ = ["SimSettings"]


class SimSettings(CommandSettings):
    """Simulated vLLM instances for tests, benchmarks and fault injection."""

    role: Literal["prefill", "decode", "both"] = Field("both", description="P/D role")
    host: str = Field("127.0.0.1", description="HTTP and gRPC bind address")
    port: int = Field(8100, ge=0, le=65535, description="HTTP port of the first instance")
    kv_port: int = Field(
        0, ge=0, le=65535, description="KvTransfer gRPC port of the first instance (0 = any)"
    )
    instances: int = Field(1, ge=1, le=256, description="instances, on consecutive ports")
    model: str = Field("sim-model", description="served model name")
    instance_id: str = Field("", description="registry id (default: sim-<role>-<port>)")
    registry: str | None = Field(None, description="registry host:port; none = no registration")
    registry_token: str | None = Field(None, description="registry bearer token")
    registry_token_file: str | None = token_file_field("--registry-token")
    lease_ttl_ms: int = Field(0, ge=0, description="requested lease TTL (ms); 0 = default")
    profile: str = Field(
        "",
        description="engine profile: a name (zero, tiny-cpu, llama3-8b-h100, ...) or a JSON file",
    )
    ttft_per_token_ms: float = Field(
        0.0, ge=0, description="without a profile: prefill time per prompt token (ms)"
    )
    itl_ms: float = Field(0.0, ge=0, description="without a profile: duration of every step (ms)")
    kv_transfer_ms_per_token: float = Field(
        0.0, ge=0, description="extra KV pull time per token (ms)"
    )
    transfer_gbps: float | None = Field(None, ge=0, description="KV pull speed (GB/s)")
    transfer_latency_ms: float | None = Field(None, ge=0, description="fixed cost of a pull (ms)")
    max_num_seqs: int | None = Field(None, ge=1, description="vLLM --max-num-seqs")
    max_num_batched_tokens: int | None = Field(
        None, ge=1, description="vLLM --max-num-batched-tokens (token budget per step)"
    )
    kv_blocks: int | None = Field(None, ge=1, description="KV cache size (blocks)")
    block_size: int | None = Field(None, ge=1, description="tokens per KV cache block")
    max_model_len: int | None = Field(None, ge=2, description="context length (tokens)")
    prefix_caching: bool = Field(True, description="vLLM's automatic prefix caching")
    kv_events: bool = Field(True, description="serve KvEvents.Subscribe (prefix cache events)")
    stream_interval: int = Field(1, ge=1, description="tokens per streamed write")
    time_scale: float = Field(1.0, gt=0, description="modelled seconds per wall second")
    kv_mode: Literal["pull", "push"] = Field("pull", description="KV transfer mode")
    push_buffer_bytes: int | None = Field(
        None, ge=0, description="push mode: decode's receive buffer (bytes)"
    )
    push_overflow: Literal["pull", "recompute"] = Field(
        "pull", description="push mode: a refused push is pulled or recomputed (the seed)"
    )
    tokenizer: str = Field("", description="Hugging Face tokenizer dir (default: word tokenizer)")
    kv_hold_timeout_s: float = Field(
        KV_TRANSFER_TIMEOUT_S, gt=0, description="prefill frees unpulled KV after this (s)"
    )
    kv_load_failure_policy: Literal["recompute", "fail"] = Field(
        "recompute", description="decode's reaction to a failed KV pull"
    )
    failure_rate: float = Field(0.0, ge=0, le=1, description="probability a request fails")
    fail_mode: Literal["http500", "drop", "stall"] = Field(
        "http500", description="how an injected failure looks"
    )
    fail_after_tokens: int = Field(1, ge=0, description="streamed tokens before a drop/stall")
    seed: int = Field(0, description="sampling and fault-draw seed")
    record_limit: int = Field(1000, ge=0, description="requests kept for GET /sim/requests")
    num_layers: int | None = Field(None, ge=1, description="advertised KV layout: layers")
    num_kv_heads: int | None = Field(None, ge=1, description="advertised KV layout: KV heads")
    head_size: int | None = Field(None, ge=1, description="advertised KV layout: head size")
    kv_dtype: str | None = Field(None, description="advertised KV dtype (layout fingerprint)")
    kv_token: str = Field(
        "", description="bearer token the KvTransfer/KvEvents server requires and sends to peers"
    )
    open_control: bool = Field(
        False, description="serve /sim/* to any client (default: loopback clients only)"
    )
    uvloop: bool = Field(True, description="run on uvloop when installed")
    log_level: LogLevel = Field("WARNING", description="Python logging level")

    def sim_config(self) -> SimConfig:
        """The per-instance knobs (the first instance's ports). Raises ValueError."""
        names = {f.name for f in dataclasses.fields(SimConfig)} - {"cost", "profile"}
        values = {k: v for k, v in self.model_dump().items() if k in names and v is not None}
        if self.profile:
            return SimConfig.from_profile(self.profile, **values)
        return SimConfig(**values)
