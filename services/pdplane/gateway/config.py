"""The relay's knobs, shared by the relay (retries) and each attempt (dispatch, timeouts)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = ["Dispatch", "FirstTokenFrom", "RelayConfig"]

Dispatch = Literal["sequential", "concurrent"]
FirstTokenFrom = Literal["prefill", "decode"]


@dataclass(frozen=True, slots=True)
class RelayConfig:
    """Relay knobs (see `pdplane.gateway.settings.GatewaySettings` for their meaning)."""

    dispatch: Dispatch = "sequential"
    upstream_timeout_s: float = 300.0
    stream_idle_timeout_s: float = 30.0
    max_retries: int = 1
    upstream_api_key: str | None = None
    queue_timeout_s: float = 60.0
    max_queued_requests: int = 1024
    first_token: FirstTokenFrom = "prefill"
    prompt_tokens_details: bool = False
    migration_limit: int = 3
    migration_timeout_s: float = 60.0
    drain_grace_s: float = 30.0
