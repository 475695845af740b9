"""`open_scheduler`: the one way to get a `SchedulerPort`, remote or local, from settings."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from pdplane.scheduler.local import open_local
from pdplane.scheduler.metrics import SchedulerMetrics
from pdplane.scheduler.port import EMBEDDED, InstanceSource, PortSettings, SchedulerPort
from pdplane.scheduler.remote import RemoteScheduler

__all__ = ["open_scheduler"]


def open_scheduler(
    settings: PortSettings,
    *,
    source: InstanceSource | None = None,
    metrics_registry: CollectorRegistry | None = None,
) -> SchedulerPort:
    """The scheduler `settings.scheduler` names: a `RemoteScheduler` of "host:port", or, for
    `EMBEDDED`, a `LocalScheduler` deciding over `source` with the settings' policy flags.

    The local scheduler's metrics (the `pdplane_scheduler_*` families, as a scheduler process
    exports them, and its prefix index's) are registered in `metrics_registry` (a new registry
    when None); its prefix index reaches the instances with `token`/`tls_ca`. The remote one
    connects on first use. Close the port with `await port.close()`.
    Raises ValueError for `EMBEDDED` without a `source`, or for an unknown policy name.
    """
    if settings.scheduler != EMBEDDED:
        return RemoteScheduler(
            settings.scheduler,
            token=settings.token,
            tls_ca=settings.tls_ca,
            timeout_s=settings.schedule_timeout_s,
            release_batch_s=settings.release_batch_s,
            stream=settings.schedule_stream,
        )
    if source is None:
        raise ValueError(f"--scheduler {EMBEDDED} needs the registry's instances (a source)")
    return open_local(
        source,
        settings,
        SchedulerMetrics(metrics_registry),
        token=settings.token,
        tls_ca=settings.tls_ca,
        subscriber="gateway",
        exchange_at=(settings.host, settings.inflight_port) if settings.inflight_port else None,
    )
