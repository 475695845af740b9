"""The local `SchedulerPort`: the scheduler's decision code in the caller's process.

The remote scheduler costs two gRPC round trips per request (Schedule, Release) on both sides
of the wire, which measured as roughly half of pdplane's proxy CPU per request. Locally the
same `Decider` (policies, compatibility filter, decode KV guard, in-flight accounting,
prefix index, metric names) decides over an `InstanceSource` the caller already keeps, so
scheduling is a function call.

Several processes deciding over one fleet (scheduler replicas, or gateways deciding locally)
share their in-flight assignments with the peers named in `--peers`
(`pdplane.scheduler.inflight_exchange`); without peers each counts only its own between two load
reports.

`open_local` is also how a `pdplane scheduler` process wires its service
(`pdplane.scheduler.app`), so both run the same objects.
"""

from __future__ import annotations

import asyncio
from typing import Any

from pdplane.core import tracing
from pdplane.scheduler.decision import Decider
from pdplane.scheduler.inflight import InflightTracker
from pdplane.scheduler.inflight_exchange import EmbeddedExchange, InflightExchange
from pdplane.scheduler.kv_index import KvIndexManager
from pdplane.scheduler.kv_index.wiring import start_kv_index
from pdplane.scheduler.metrics import SchedulerMetrics
from pdplane.scheduler.policies.kv_aware import KvAwareWeights
from pdplane.scheduler.port import Decision, InstanceSource, Outcome, PolicyFlags, RequestFeatures
from pdplane.scheduler.view import CandidateView
from pdplane.scheduler.warming import WarmSettings

__all__ = ["LocalScheduler", "decision_options", "open_local"]


class LocalScheduler:
    """`SchedulerPort` over an in-process `Decider` (`service`, e.g. for tests) and
    the prefix index feeding it (`kv_index`, None when off).

    A decision's sides are the service's `Candidate`s (no copy). Errors are the service's own,
    which are the port's: `SchedulerUnavailable` naming the missing side, ValueError for an
    invalid field. Nothing is awaited: `release_nowait` is `release` as a plain call.
    """

    def __init__(
        self,
        service: Decider,
        kv_index: KvIndexManager | None = None,
        exchange: EmbeddedExchange | None = None,
    ) -> None:
        self.service = service
        self.kv_index = kv_index
        self.exchange = exchange

    def problem(self) -> str | None:
        """None: an embedded scheduler is always reachable (its view's gaps are the fleet's)."""
        return None

    async def start(self) -> None:
        """Starts sharing in-flight assignments with the peers (serving them, with a port).
        Raises OSError/RuntimeError when that port cannot be bound."""
        if self.exchange is not None:
            await self.exchange.start()

    async def schedule(self, features: RequestFeatures) -> Decision:
        """`SchedulerPort.schedule`, decided in this process."""
        with tracing.span("pdplane.scheduler.decision"):
            return self.service.schedule(features)

    async def release(self, request_id: str, outcome: Outcome) -> bool:
        """`SchedulerPort.release`; ValueError on an empty id or an unknown outcome."""
        return self.service.release(request_id, Outcome.parse(outcome))

    def release_nowait(self, request_id: str, outcome: Outcome) -> None:
        """`release` as a plain call: the caller needs no task per request."""
        self.service.release(request_id, Outcome.parse(outcome))

    async def close(self) -> None:
        """Stops the exchange and the prefix index's streams (bounded); the source belongs to
        the caller."""
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            await exchange.stop()
        kv_index, self.kv_index = self.kv_index, None
        if kv_index is not None:
            await asyncio.to_thread(kv_index.stop)


def decision_options(flags: PolicyFlags) -> dict[str, Any]:
    """`Decider` keyword arguments of kv_aware's flags (its engine profile, knobs and
    conditional disaggregation's bound): one reading for every user of the flags."""
    return {
        "kv_weights": KvAwareWeights(
            itl_weight=flags.kv_itl_weight, local_slack=flags.kv_local_slack
        ),
        "kv_profile": flags.kv_profile,
        "local_prefill_max_tokens": flags.local_prefill_max_tokens,
        "warm": WarmSettings(
            min_tokens=flags.kv_warm_min_tokens,
            window_s=flags.kv_warm_window_s,
            requests_per_holder=flags.kv_warm_requests_per_holder,
        ),
    }


def open_local(
    source: InstanceSource,
    flags: PolicyFlags,
    metrics: SchedulerMetrics,
    *,
    token: str | None,
    tls_ca: str | None,
    subscriber: str,
    exchange_at: tuple[str, int] | None = None,
) -> LocalScheduler:
    """A `LocalScheduler` deciding over `source` with `flags` (policies, in-flight expiry,
    seed, the kv_* flags of the prefix index).

    Its view is a `CandidateView` of `source`; its in-flight assignments expire after
    `flags.inflight_timeout_s`; `metrics` also reads, at scrape time, the in-flight count per
    instance and the instances of the view. Unless `flags.kv_index` is off, a started prefix
    index follows every instance's KV events stream (`token`/`tls_ca`: the instances' gRPC
    credentials; `subscriber`: the name they log) and registers its metrics beside them.
    Its in-flight exchange (`.exchange.exchange`) follows `flags.peers` from `start()`, and
    with `exchange_at` (host, port > 0) serves this process's assignments on a gRPC server of
    its own (a caller with its own gRPC server adds `exchange.exchange.servicer` to it
    instead). Start it with `await start()` in the event loop that will use it, close it with
    `await close()`. Raises ValueError for an unknown policy name.
    """
    view = CandidateView(source)
    service = Decider(
        view,
        prefill_policy=flags.prefill_policy,
        decode_policy=flags.decode_policy,
        inflight=InflightTracker(
            flags.inflight_timeout_s, reservation_s=flags.inflight_reservation_s
        ),
        metrics=metrics,
        seed=flags.seed,
        **decision_options(flags),
    )
    metrics.watch(service.inflight.inflight_by_instance, view.all)
    kv_index = start_kv_index(
        source,
        flags,
        token=token,
        tls_ca=tls_ca,
        registry=metrics.registry,
        service=service,
        subscriber=subscriber,
    )
    shared = InflightExchange(
        service.inflight,
        view,
        replica_id=flags.replica_id,
        peers=flags.peer_list(),
        lag_s=flags.peer_lag_ms / 1000,
        token=token,
        # A gateway's own exchange server has no certificate (plaintext, token required), so
        # its peers, gateways too, are reached the same way; a scheduler's follows its TLS.
        tls_ca=None if exchange_at else tls_ca,
    )
    shared.register_metrics(metrics.registry)
    host, port = exchange_at or ("", 0)
    exchange = EmbeddedExchange(shared, host, port, token=token)
    return LocalScheduler(service, kv_index, exchange)
