"""`--scheduler embedded`: the scheduler's decision code inside the gateway process.

The remote scheduler costs two gRPC round trips per request (Schedule, Release) on both sides
of the wire, which measured as roughly half of pdplane's proxy CPU per request. Embedded, the
gateway runs the same `SchedulerService` (same policies, compatibility filter, decode KV guard,
in-flight accounting and metric names) over a `CandidateView` of the registry watcher it already
keeps for /v1/models and /health, so scheduling is a function call.

The in-flight accounting is then local to this gateway: two embedded gateways do not see each
other's assignments between two load reports. Deployments with several gateways keep one remote
scheduler (the default) so that every assignment is counted in one place.
"""

from __future__ import annotations

from collections.abc import Iterable

from prometheus_client import CollectorRegistry

from pdplane.scheduler.client import OUTCOMES, SchedulerUnavailable
from pdplane.scheduler.errors import NoInstance
from pdplane.scheduler.inflight import InflightTracker
from pdplane.scheduler.metrics import SchedulerMetrics
from pdplane.scheduler.service import Decision, ScheduleInput, SchedulerService
from pdplane.scheduler.settings import PolicySettings
from pdplane.scheduler.view import CandidateView, InstanceSource

__all__ = ["EmbeddedScheduler"]


class EmbeddedScheduler:
    """The gateway's `SchedulerPort` over an in-process `SchedulerService`.

    Errors match `pdplane.scheduler.client.SchedulerClient`'s (`SchedulerUnavailable` naming the
    missing side, ValueError on invalid input); the answer is the service's `Decision`, which
    has the same `prefill`/`decode` attributes the relay reads of a `ScheduleResponse`.
    """

    def __init__(self, service: SchedulerService) -> None:
        self.service = service

    @classmethod
    def over(
        cls, source: InstanceSource, policy: PolicySettings, registry: CollectorRegistry
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
        return cls(service), view

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
