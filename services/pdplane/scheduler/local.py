"""The local `SchedulerPort`: the scheduler's decision code in the caller's process.

The remote scheduler costs two gRPC round trips per request (Schedule, Release) on both sides
of the wire, which measured as roughly half of pdplane's proxy CPU per request. Locally the
same `SchedulerService` (policies, compatibility filter, decode KV guard, in-flight accounting,
metric names) decides over an `InstanceSource` the caller already keeps, so scheduling is a
function call.

The in-flight accounting is then local to that process: two gateways each deciding locally do
not see each other's assignments between two load reports. Deployments with several gateways
keep one remote scheduler so that every assignment is counted in one place.

`build_service` is also how a `pdplane scheduler` process wires its service
(`pdplane.scheduler.app`), so both run the same objects.
"""

from __future__ import annotations

from pdplane.scheduler.inflight import InflightTracker
from pdplane.scheduler.metrics import SchedulerMetrics
from pdplane.scheduler.port import Decision, InstanceSource, Outcome, PolicyFlags, RequestFeatures
from pdplane.scheduler.service import SchedulerService
from pdplane.scheduler.view import CandidateView

__all__ = ["LocalScheduler", "build_service"]


def build_service(
    source: InstanceSource, policy: PolicyFlags, metrics: SchedulerMetrics
) -> SchedulerService:
    """A `SchedulerService` deciding over `source` with `policy`'s flags.

    Its view is a `CandidateView` of `source`, its in-flight assignments expire after
    `policy.inflight_timeout_s`, and `metrics` also reads, at scrape time, the in-flight count
    per instance and the instances of the view. Raises ValueError for an unknown policy name.
    """
    view = CandidateView(source)
    service = SchedulerService(
        view,
        prefill_policy=policy.prefill_policy,
        decode_policy=policy.decode_policy,
        inflight=InflightTracker(policy.inflight_timeout_s),
        metrics=metrics,
        seed=policy.seed,
    )
    metrics.watch(service.inflight.inflight_by_instance, view.all)
    return service


class LocalScheduler:
    """`SchedulerPort` over an in-process `SchedulerService` (`service`, e.g. for tests).

    A decision's sides are the service's `Candidate`s (no copy). Errors are the service's own,
    which are the port's: `SchedulerUnavailable` naming the missing side, ValueError for an
    invalid field. Nothing is awaited: `release_nowait` is `release` as a plain call.
    """

    def __init__(self, service: SchedulerService) -> None:
        self.service = service

    async def schedule(self, features: RequestFeatures) -> Decision:
        """`SchedulerPort.schedule`, decided in this process."""
        return self.service.schedule(features)

    async def release(self, request_id: str, outcome: Outcome) -> bool:
        """`SchedulerPort.release`; ValueError on an empty id or an unknown outcome."""
        return self.service.release(request_id, Outcome.parse(outcome))

    def release_nowait(self, request_id: str, outcome: Outcome) -> None:
        """`release` as a plain call: the caller needs no task per request."""
        self.service.release(request_id, Outcome.parse(outcome))

    async def close(self) -> None:
        """Nothing to free: the source belongs to the caller."""
