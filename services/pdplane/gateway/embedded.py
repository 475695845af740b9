"""`--scheduler embedded`: the scheduler's decision code inside the gateway process.

The remote scheduler costs two gRPC round trips per request (Schedule, Release) on both sides
of the wire, which measured as roughly half of pdplane's proxy CPU per request. Embedded, the
gateway runs the same `SchedulerService` (same policies, compatibility filter, decode KV guard,
in-flight accounting and metric names) over a `CandidateView` of the registry watcher it already
keeps for /v1/models and /health, so scheduling is a function call.

Several embedded gateways over one fleet share their in-flight assignments when each names
the others in `--peers` and serves its own on `--inflight-port` (`pdplane.scheduler.exchange`);
without that, each counts only its own between two load reports.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry

from pdplane.gateway.settings import GatewaySettings
from pdplane.scheduler.client import OUTCOMES, SchedulerUnavailable
from pdplane.scheduler.errors import NoInstance
from pdplane.scheduler.exchange import EmbeddedExchange, InflightExchange
from pdplane.scheduler.inflight import InflightTracker
from pdplane.scheduler.metrics import SchedulerMetrics
from pdplane.scheduler.service import Decision, ScheduleInput, SchedulerService
from pdplane.scheduler.view import CandidateView, InstanceSource

__all__ = ["EmbeddedScheduler"]


class EmbeddedScheduler:
    """The gateway's `SchedulerPort` over an in-process `SchedulerService`.

    Errors match `pdplane.scheduler.client.SchedulerClient`'s (`SchedulerUnavailable` naming the
    missing side, ValueError on invalid input); the answer is the service's `Decision`, which
    has the same `prefill`/`decode` attributes the relay reads of a `ScheduleResponse`.
    """

    def __init__(self, service: SchedulerService, exchange: EmbeddedExchange | None = None) -> None:
        self.service = service
        self.exchange = exchange

    async def start(self) -> None:
        """Starts sharing in-flight assignments with the peers (when configured)."""
        if self.exchange is not None:
            await self.exchange.start()

    async def close(self) -> None:
        """Stops sharing them."""
        if self.exchange is not None:
            await self.exchange.stop()

    @classmethod
    def over(
        cls, source: InstanceSource, policy: GatewaySettings, registry: CollectorRegistry
    ) -> tuple[EmbeddedScheduler, CandidateView]:
        """A scheduler deciding over `source` (the registry watcher) with `policy`'s flags.

        Its metrics (the `pdplane_scheduler_*` families) are registered in `registry`. Returns
        the scheduler and its view; call `view.mark_dirty()` on every change of the source.
        """
        view = CandidateView(source)
        metrics = SchedulerMetrics(registry)
        service = SchedulerService(
            view,
            prefill_policy=policy.prefill_policy,
            decode_policy=policy.decode_policy,
            inflight=InflightTracker(policy.inflight_timeout_s),
            metrics=metrics,
            seed=policy.seed,
        )
        metrics.watch(service.inflight.inflight_by_instance, view.all)
        exchange = None
        if policy.peer_list() or policy.inflight_port:
            shared = InflightExchange(
                service.inflight,
                view,
                replica_id=policy.replica_id,
                peers=policy.peer_list(),
                lag_s=policy.peer_lag_ms / 1000,
                token=policy.token,
                tls_ca=policy.tls_ca,
            )
            shared.register_metrics(registry)
            exchange = EmbeddedExchange(
                shared, policy.host, policy.inflight_port, token=policy.token
            )
        return cls(service, exchange), view

    async def schedule(
        self,
        request_id: str,
        model: str,
        prompt_tokens: int,
        max_tokens: int = 0,
        *,
        routing_key: str = "",
        exclude_instance_ids: Iterable[str] = (),
    ) -> Decision:
        """Chooses and counts a pair (token counts in tokens; max_tokens 0 = unknown); its
        `prefill`/`decode` are the chosen `Candidate`s (instance_id, url, kv_endpoint).

        Raises SchedulerUnavailable (no compatible prefill, decode or pair; the message names
        it) or ValueError (invalid request field).
        """
        try:
            return self.service.schedule(
                ScheduleInput(
                    request_id,
                    model,
                    prompt_tokens,
                    max_tokens,
                    routing_key,
                    exclude_instance_ids=tuple(exclude_instance_ids),
                )
            )
        except NoInstance as exc:
            raise SchedulerUnavailable(str(exc)) from None

    async def release(self, request_id: str, outcome: str) -> bool:
        """Ends the in-flight accounting of `request_id` ("success"|"failed"|"cancelled");
        False when it was not in flight. Raises ValueError on an unknown outcome or empty id."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {sorted(OUTCOMES)}, got {outcome!r}")
        return self.service.release(request_id, outcome)

    def release_nowait(self, request_id: str, outcome: str) -> None:
        """`release` as a plain call: the relay makes it inline, with no task per request."""
        if outcome not in OUTCOMES:
            raise ValueError(f"outcome must be one of {sorted(OUTCOMES)}, got {outcome!r}")
        self.service.release(request_id, outcome)
