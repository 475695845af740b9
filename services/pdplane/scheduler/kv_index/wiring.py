"""Starts the prefix index for a scheduler (standalone or embedded in the gateway)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from pdplane.scheduler.kv_index.index import PrefixIndex
from pdplane.scheduler.kv_index.manager import KvIndexManager
from pdplane.scheduler.port import InstanceSource, PolicyFlags

if TYPE_CHECKING:
    from pdplane.scheduler.decision import Decider

__all__ = ["start_kv_index"]


def start_kv_index(
    source: InstanceSource,
    settings: PolicyFlags,
    *,
    token: str | None,
    tls_ca: str | None,
    registry: CollectorRegistry | None = None,
    service: Decider | None = None,
    subscriber: str = "scheduler",
) -> KvIndexManager | None:
    """A started `KvIndexManager` over `source` with `settings`' kv_* flags (None when
    `--no-kv-index`); its index is given to `service` and its metrics to `registry`.
    `token`/`tls_ca` are the instances' gRPC credentials (the fleet token). Stop it with
    `stop()`."""
    if not settings.kv_index:
        return None
    manager = KvIndexManager(
        source,
        PrefixIndex(settings.kv_index_max_blocks),
        token=token,
        tls_ca=tls_ca,
        stale_after_s=settings.kv_stale_after_s,
        max_lag_events=settings.kv_max_lag_events,
        subscriber=subscriber,
        events_interval_ms=settings.kv_events_interval_ms,
    )
    if registry is not None:
        manager.register_metrics(registry)
    if service is not None:
        service.kv_index = manager.index
    manager.start()
    return manager
