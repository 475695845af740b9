"""Default ports and timings, in one place so that every command and doc agrees."""

from __future__ import annotations

import os
from pathlib import Path

REGISTRY_PORT = 50051  #: pdplane registry gRPC
SCHEDULER_PORT = 50052  #: pdplane scheduler gRPC
SCHEDULER_METRICS_PORT = 8090  #: the scheduler's Prometheus /metrics under `pdplane up`
GATEWAY_PORT = 8000  #: OpenAI-compatible HTTP, like `vllm serve`
VLLM_BASE_PORT = 8100  #: first port `pdplane up` gives a vLLM instance
KV_BASE_PORT = 50100  #: first port `pdplane up` gives a connector's KvTransfer server

LEASE_TTL_MS = 5_000  #: registry lease TTL (ms)
HEARTBEAT_INTERVAL_MS = 1_000  #: instance heartbeat period (ms)
KV_TRANSFER_TIMEOUT_S = 60.0  #: prefill frees held blocks no later than this (s)


def cache_root() -> Path:
    """Where pdplane keeps what it builds or fetches: $PDPLANE_CACHE_DIR, else
    ~/.cache/pdplane."""
    return Path(os.environ.get("PDPLANE_CACHE_DIR") or Path.home() / ".cache" / "pdplane")
