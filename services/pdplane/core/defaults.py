"""Default ports and timings, in one place so that every command and doc agrees.

Every default port lies below Linux's ephemeral range (`ip_local_port_range`, 32768-60999 by
default; 49152-65535 elsewhere), where the kernel hands out ports to outgoing connections and
to sockets bound to port 0, as vLLM binds its own ZMQ sockets while it starts. A port chosen
inside that range can be taken by one of them for a moment, just before pdplane binds it (seen:
a connector's KvTransfer server failing with "Failed to bind to address"); below it, only a
process that asks for that very port can hold it.
"""

from __future__ import annotations

import os
from pathlib import Path

GATEWAY_PORT = 8000  #: OpenAI-compatible HTTP, like `vllm serve`
REGISTRY_PORT = 8051  #: pdplane registry gRPC
SCHEDULER_PORT = 8052  #: pdplane scheduler gRPC
REGISTRY_RELAY_PORT = 8054  #: a host's `pdplane registry-relay` gRPC (8053: in-flight peers)
SCHEDULER_METRICS_PORT = 8090  #: the scheduler's Prometheus /metrics under `pdplane up`
AUTOSCALE_METRICS_PORT = 8091  #: the controller's /metrics under `pdplane up --autoscale`
VLLM_BASE_PORT = 8100  #: first port `pdplane up` gives a vLLM instance (instance i: +i)
KV_BASE_PORT = 8200  #: first port `pdplane up` gives a connector's KvTransfer server (+i)

LEASE_TTL_MS = 5_000  #: registry lease TTL (ms)
HEARTBEAT_INTERVAL_MS = 1_000  #: instance heartbeat period (ms)
KV_TRANSFER_TIMEOUT_S = 60.0  #: prefill frees held blocks no later than this (s)


def cache_root() -> Path:
    """Where pdplane keeps what it builds or fetches: $PDPLANE_CACHE_DIR, else
    ~/.cache/pdplane."""
    return Path(os.environ.get("PDPLANE_CACHE_DIR") or Path.home() / ".cache" / "pdplane")
