"""Knobs of one simulated vLLM instance (plain data; the CLI maps its flags onto these)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from pdplane.core.defaults import KV_TRANSFER_TIMEOUT_S

__all__ = ["FailMode", "SimConfig", "SimRole"]

SimRole = Literal["prefill", "decode", "both"]
FailMode = Literal["http500", "drop", "stall"]


@dataclass(slots=True)
class SimConfig:
    """One simulated instance.

    Timing knobs are in milliseconds; zero means "as fast as the event loop goes".

    Attributes:
        role: which half of P/D it registers as (it serves any request either way).
        host, port: HTTP bind address; port 0 picks a free port.
        kv_port: KvTransfer gRPC port; 0 picks a free port.
        model: served model name (`/v1/models`, the `model` field of requests).
        instance_id: registry id; default `sim-<role>-<port>`.
        ttft_per_token_ms: prefill compute time per prompt token (ms/token).
        itl_ms: time between two output tokens (ms).
        kv_transfer_ms_per_token: decode's simulated pull time per transferred token (ms/token).
        max_running: requests computed at once; the rest wait (`vllm:num_requests_waiting`).
        kv_blocks, block_size: paged KV cache size (blocks) and tokens per block.
        max_model_len: context length (tokens): longer requests get vLLM's 400 errors.
        kv_hold_timeout_s: a prefill frees a transfer's blocks after this long without a pull (s).
        kv_load_failure_policy: what decode does when a pull fails: "recompute" the prompt
            locally, or "fail" the request with HTTP 500 (vLLM's `kv_load_failure_policy`).
        failure_rate, fail_mode, fail_after_tokens: fault injection (probability per request,
            what happens, and after how many streamed tokens a drop/stall strikes).
        seed: default sampling seed (a request's own `seed` wins) and fault-draw seed.
        record_limit: how many received requests `/sim/requests` keeps (0 = none).
        num_layers, num_kv_heads, head_size, kv_dtype: the advertised KV layout.
    """

    role: SimRole = "both"
    host: str = "127.0.0.1"
    port: int = 0
    kv_port: int = 0
    model: str = "sim-model"
    instance_id: str = ""
    ttft_per_token_ms: float = 0.0
    itl_ms: float = 0.0
    kv_transfer_ms_per_token: float = 0.0
    max_running: int = 256
    kv_blocks: int = 8192
    block_size: int = 16
    max_model_len: int = 4096
    kv_hold_timeout_s: float = KV_TRANSFER_TIMEOUT_S
    kv_load_failure_policy: Literal["recompute", "fail"] = "recompute"
    failure_rate: float = 0.0
    fail_mode: FailMode = "http500"
    fail_after_tokens: int = 1
    seed: int = 0
    record_limit: int = 1000
    num_layers: int = 2
    num_kv_heads: int = 2
    head_size: int = 32
    kv_dtype: str = "float32"
    labels: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, not {self.role!r}")
        if self.fail_mode not in ("http500", "drop", "stall"):
            raise ValueError(f"fail_mode must be http500, drop or stall, not {self.fail_mode!r}")
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError("failure_rate must be within [0, 1]")
        for name in ("max_running", "kv_blocks", "block_size", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in ("ttft_per_token_ms", "itl_ms", "kv_transfer_ms_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
