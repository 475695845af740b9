"""Prometheus metrics of the scheduler (prometheus-client), on their own CollectorRegistry.

Decisions per policy pair, UNAVAILABLE per missing side, invalid requests, releases per
outcome, the decision latency histogram (seconds) and, read at scrape time from the in-flight
tracker and the view, in-flight assignments per instance and instances per role/state.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdplane.scheduler.candidate import Candidate

__all__ = ["SchedulerMetrics"]

# Decisions take microseconds to a few milliseconds; the default buckets start at 5 ms.
_MAX_INSTANCE_LABELS = 4096  # cached label children; the counter itself keeps its series
_LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 5e-2, 0.1)


class _LiveCollector(Collector):
    def __init__(
        self,
        inflight: Callable[[], dict[str, int]],
        candidates: Callable[[], list[Candidate]],
    ) -> None:
        self._inflight = inflight
        self._candidates = candidates

    def collect(self) -> Iterator[Metric]:
        inflight = GaugeMetricFamily(
            "pdplane_scheduler_inflight_requests",
            "Requests assigned to an instance and not released yet",
            labels=["instance_id"],
        )
        for instance_id, count in sorted(self._inflight().items()):
            inflight.add_metric([instance_id], count)
        yield inflight
        instances = GaugeMetricFamily(
            "pdplane_scheduler_instances",
            "Instances in the scheduler's view",
            labels=["role", "state"],
        )
        counts: dict[tuple[str, str], int] = {}
        for c in self._candidates():
            role = (
                "both"
                if c.can_prefill and c.can_decode
                else ("prefill" if c.can_prefill else "decode")
            )
            key = (role, "serving" if c.serving else "draining")
            counts[key] = counts.get(key, 0) + 1
        for (role, state), count in sorted(counts.items()):
            instances.add_metric([role, state], count)
        yield instances


class SchedulerMetrics:
    """The scheduler's metrics; `registry` is what the metrics HTTP server exposes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self._decisions = Counter(
            "pdplane_scheduler_decisions",
            "Pairs chosen, by prefill and decode policy",
            ["prefill_policy", "decode_policy"],
            registry=self.registry,
        )
        self._unavailable = Counter(
            "pdplane_scheduler_unavailable",
            "Schedule calls answered UNAVAILABLE, by missing side (prefill, decode, pair)",
            ["side"],
            registry=self.registry,
        )
        self._no_room = Counter(
            "pdplane_scheduler_no_room",
            "Schedule calls answered RESOURCE_EXHAUSTED (compatible instances, none with KV "
            "room now), by side; a gateway's waiting request asks again, so one waits counts "
            "many",
            ["side"],
            registry=self.registry,
        )
        self._invalid = Counter(
            "pdplane_scheduler_invalid_requests",
            "Schedule calls answered INVALID_ARGUMENT",
            registry=self.registry,
        )
        self._releases = Counter(
            "pdplane_scheduler_releases",
            "Release calls, by outcome and whether the id was in flight",
            ["outcome", "known"],
            registry=self.registry,
        )
        self._predicted_hits = Counter(
            "pdplane_scheduler_predicted_prefix_hit_tokens",
            "Prompt tokens the prefix index predicted as prefix cache hits on the instance that "
            "computes the prompt (prefill, or decode without prefill); compare per instance "
            "with vLLM's vllm:prefix_cache_hits (docs/scheduler.md)",
            ["instance_id"],
            registry=self.registry,
        )
        self._skipped = Counter(
            "pdplane_scheduler_prefills_skipped",
            "Decisions without a prefill: decode held all but --local-prefill-max-tokens of the "
            "prompt and computes the rest itself",
            registry=self.registry,
        )
        self._warms = Counter(
            "pdplane_scheduler_prefix_warms",
            "Prefix warms proposed (a prefix many requests read, copied onto an idle prefill "
            "that did not hold it: docs/prefix-warming.md)",
            registry=self.registry,
        )
        self._warm_tokens = Counter(
            "pdplane_scheduler_prefix_warm_tokens",
            "Prompt tokens of the prefix warms proposed",
            registry=self.registry,
        )
        # labels() hashes and locks on every call; the hot path reuses the children instead.
        self._decision_children: dict[tuple[str, str], Any] = {}
        self._release_children: dict[tuple[str, bool], Any] = {}
        self._hit_children: dict[str, Any] = {}
        self._latency = Histogram(
            "pdplane_scheduler_decision_seconds",
            "Time to choose a pair inside the scheduler (seconds)",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )

    def watch(
        self,
        inflight: Callable[[], dict[str, int]],
        candidates: Callable[[], list[Candidate]],
    ) -> None:
        """Exposes in-flight per instance and the view's size, read at scrape time."""
        self.registry.register(_LiveCollector(inflight, candidates))

    def decided(self, prefill_policy: str, decode_policy: str, seconds: float) -> None:
        """Counts one decision and observes its latency (seconds)."""
        key = (prefill_policy, decode_policy)
        child = self._decision_children.get(key)
        if child is None:
            child = self._decision_children[key] = self._decisions.labels(*key)
        child.inc()
        self._latency.observe(seconds)

    def predicted_hit(self, instance_id: str, tokens: int) -> None:
        """Counts `tokens` predicted prefix cache hit tokens on `instance_id`."""
        child = self._hit_children.get(instance_id)
        if child is None:
            if len(self._hit_children) >= _MAX_INSTANCE_LABELS:
                self._hit_children.clear()  # bounded: instances come and go
            child = self._hit_children[instance_id] = self._predicted_hits.labels(instance_id)
        child.inc(tokens)

    def prefix_warmed(self, instance_id: str, tokens: int) -> None:
        """Counts one prefix warm of `tokens` tokens proposed onto prefill `instance_id`."""
        self._warms.inc()
        self._warm_tokens.inc(tokens)

    def prefill_skipped(self, decode_id: str, cached_tokens: int) -> None:
        """Counts a decision without prefill; decode `decode_id` predicted to hit
        `cached_tokens` of the prompt."""
        self._skipped.inc()
        self.predicted_hit(decode_id, cached_tokens)

    def unavailable(self, side: str) -> None:
        """Counts one UNAVAILABLE answer; `side` is prefill, decode or pair."""
        self._unavailable.labels(side).inc()

    def no_room(self, side: str) -> None:
        """Counts one RESOURCE_EXHAUSTED answer (`NoRoom`); `side` is prefill or decode."""
        self._no_room.labels(side).inc()

    def invalid(self) -> None:
        """Counts one INVALID_ARGUMENT answer."""
        self._invalid.inc()

    def released(self, outcome: str, known: bool) -> None:
        """Counts one Release call."""
        key = (outcome, known)
        child = self._release_children.get(key)
        if child is None:
            child = self._release_children[key] = self._releases.labels(
                outcome, "true" if known else "false"
            )
        child.inc()
