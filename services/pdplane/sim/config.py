"""Knobs of one simulated vLLM instance (plain data; the CLI maps its flags onto these)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from pdplane.core.defaults import KV_TRANSFER_TIMEOUT_S
from pdplane.sim.profiles import CostModel, Profile, kv_bytes_per_token, load_profile

__all__ = ["FailMode", "KvMode", "SimConfig", "SimRole"]

SimRole = Literal["prefill", "decode", "both"]
FailMode = Literal["http500", "drop", "stall"]
KvMode = Literal["pull", "push"]

#: SimConfig fields a profile supplies (profile attribute names where they differ).
_FROM_PROFILE = {
    "kv_blocks": "num_blocks",
    "block_size": "block_size",
    "max_num_seqs": "max_num_seqs",
    "max_num_batched_tokens": "max_num_batched_tokens",
    "max_model_len": "max_model_len",
    "num_layers": "num_layers",
    "num_kv_heads": "num_kv_heads",
    "head_size": "head_size",
    "kv_dtype": "kv_dtype",
    "transfer_gbps": "transfer_gbps",
    "transfer_latency_ms": "transfer_latency_ms",
    "push_buffer_bytes": "push_buffer_bytes",
}


@dataclass(slots=True)
class SimConfig:
    """One simulated instance.

    Timing: with `profile` set (a name in `pdplane.sim.profiles.PROFILES` or a profile JSON
    file) steps cost what the profile's cost model says; without one, the simple knobs make a
    step last `itl_ms + ttft_per_token_ms x prompt tokens in the step` (all zero: as fast as
    the event loop goes). `SimConfig.from_profile` also takes the profile's capacity and layout.

    Attributes:
        role: which half of P/D it registers as (it serves any request either way).
        host, port: HTTP bind address; port 0 picks a free port.
        kv_port: KvTransfer gRPC port; 0 picks a free port.
        model: served model name (`/v1/models`, the `model` field of requests).
        model_root: the `root` `/v1/models` reports (vLLM: the path the model was loaded
            from); "" = `model`.
        instance_id: registry id; default `sim-<role>-<port>`.
        profile: cost model source (see above); "" = the simple knobs.
        ttft_per_token_ms: simple knobs: prefill compute time per prompt token (ms/token).
        itl_ms: simple knobs: the fixed duration of every step (ms).
        kv_transfer_ms_per_token: extra pull time per transferred token (ms/token).
        transfer_gbps, transfer_latency_ms: pull speed (GB/s of KV, 0 = no byte cost) and the
            fixed cost of one pull (ms); a pull lasts latency + bytes / speed (+ per token).
        max_num_seqs: vLLM's `--max-num-seqs`: requests in a batch at most.
        max_num_batched_tokens: vLLM's token budget per step (chunked prefill splits longer
            prompts).
        kv_blocks, block_size: paged KV cache size (blocks) and tokens per block.
        prefix_caching: vLLM's automatic prefix caching.
        kv_events: publish the prefix cache's changes (`KvEvents.Subscribe` at `kv_endpoint`);
            off saves ~25 us of CPU per event when nothing subscribes.
        max_model_len: context length (tokens): longer requests get vLLM's 400 errors.
        stream_interval: streamed tokens go out this many at a time (vLLM's
            `--stream-interval`; one SSE event per token, several events per write).
        time_scale: modelled seconds per wall second (see `pdplane.sim.runner`).
        kv_mode: "push" (decode side: accept pushed KV into a receive buffer; prefill side:
            push to the decode named in the request) or "pull".
        push_buffer_bytes: decode's receive buffer for pushed KV (bytes).
        push_overflow: what decode does with a push its buffer refused: "pull" it (pdplane's
            connector) or "recompute" the prompt (the seed's "Failed to receive all KVs").
        tokenizer: Hugging Face tokenizer directory ("" = the deterministic word tokenizer).
        kv_hold_timeout_s: a prefill frees a transfer's blocks after this long without a pull (s).
        kv_load_failure_policy: what decode does when a pull fails: "recompute" the prompt
            locally, or "fail" the request with HTTP 500 (vLLM's `kv_load_failure_policy`).
        failure_rate, fail_mode, fail_after_tokens: fault injection (probability per request,
            what happens, and after how many streamed tokens a drop/stall strikes).
        seed: default sampling seed (a request's own `seed` wins) and fault-draw seed.
        record_limit: how many received requests `/sim/requests` keeps (0 = none).
        num_layers, num_kv_heads, head_size, kv_dtype: the advertised KV layout.
        kv_token: bearer token its KvTransfer/KvEvents server requires and it sends to
            peers ("" = none), like the connector's `PDPLANE_TOKEN`.
        open_control: serve `/sim/*` (fault injection, transfers, records) to any client;
            default False: loopback clients only (403 otherwise).
        cost: an explicit cost model (wins over `profile` and the simple knobs).
    """

    role: SimRole = "both"
    host: str = "127.0.0.1"
    port: int = 0
    kv_port: int = 0
    model: str = "sim-model"
    model_root: str = ""
    instance_id: str = ""
    profile: str = ""
    ttft_per_token_ms: float = 0.0
    itl_ms: float = 0.0
    kv_transfer_ms_per_token: float = 0.0
    transfer_gbps: float = 0.0
    transfer_latency_ms: float = 0.0
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    kv_blocks: int = 8192
    block_size: int = 16
    prefix_caching: bool = True
    kv_events: bool = True
    max_model_len: int = 4096
    stream_interval: int = 1
    time_scale: float = 1.0
    kv_mode: KvMode = "pull"
    push_buffer_bytes: int = 256 << 20
    push_overflow: Literal["pull", "recompute"] = "pull"
    tokenizer: str = ""
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
    kv_token: str = ""
    open_control: bool = False
    cost: CostModel | None = None

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode", "both"):
            raise ValueError(f"role must be prefill, decode or both, not {self.role!r}")
        if self.fail_mode not in ("http500", "drop", "stall"):
            raise ValueError(f"unknown fail_mode {self.fail_mode!r}")
        if not 0.0 <= self.failure_rate <= 1.0:
            raise ValueError("failure_rate must be within [0, 1]")
        for name in (
            "max_num_seqs",
            "max_num_batched_tokens",
            "kv_blocks",
            "block_size",
            "max_model_len",
            "stream_interval",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        for name in (
            "ttft_per_token_ms",
            "itl_ms",
            "kv_transfer_ms_per_token",
            "transfer_gbps",
            "transfer_latency_ms",
            "push_buffer_bytes",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.time_scale <= 0:
            raise ValueError("time_scale must be > 0")
        if self.kv_mode not in ("pull", "push"):
            raise ValueError(f"kv_mode must be pull or push, not {self.kv_mode!r}")
        if self.max_model_len > self.kv_blocks * self.block_size:
            # vLLM refuses to start when one full-length request cannot fit in the cache.
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the KV cache "
                f"({self.kv_blocks} blocks x {self.block_size} tokens)"
            )

    @classmethod
    def from_profile(cls, profile: str | Profile, **overrides: Any) -> SimConfig:
        """A config with a profile's cost model, capacity and layout; `overrides` win.

        Raises ValueError for an unknown profile or a bad field.
        """
        prof = load_profile(profile) if isinstance(profile, str) else profile
        values: dict[str, Any] = {k: getattr(prof, v) for k, v in _FROM_PROFILE.items()}
        values["profile"] = profile if isinstance(profile, str) else prof.name
        values["cost"] = prof.cost
        values.update(overrides)
        return cls(**values)

    def cost_model(self) -> CostModel:
        """The step cost model this instance uses (see the class docstring)."""
        if self.cost is not None:
            return self.cost
        if self.profile:
            return load_profile(self.profile).cost
        return CostModel(weights_ms=self.itl_ms, prefill_token_ms=self.ttft_per_token_ms)

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of KV per token for the advertised layout."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_size, self.kv_dtype)

    def transfer_s(self, tokens: int) -> float:
        """Modelled duration (s) of moving `tokens` tokens of KV between two instances."""
        ms = self.transfer_latency_ms + self.kv_transfer_ms_per_token * tokens
        if self.transfer_gbps:
            ms += tokens * self.kv_bytes_per_token / (self.transfer_gbps * 1e9) * 1e3
        return ms * 1e-3

    def replace(self, **changes: Any) -> SimConfig:
        """A copy with `changes` (labels copied, not shared)."""
        changes.setdefault("labels", dict(self.labels))
        return dataclasses.replace(self, **changes)
