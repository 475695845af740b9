"""Prometheus metrics of the gateway (one registry per app, served on `GET /metrics`).

Latencies in seconds. TTFT is measured from the request's arrival to the first relayed SSE
event; TPOT = (last event - first event) / (events - 1) over a stream (one event per token for
vLLM with n=1). Neither is observable on non-streaming requests, which only record end-to-end
and per-leg latency.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

__all__ = ["GatewayMetrics", "ScrapedGauge"]

_LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0,
)  # fmt: skip
_TPOT_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0,
)  # fmt: skip


class GatewayMetrics:
    """The gateway's metric families, registered in their own `registry`."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pdplane_gateway_requests",
            "Requests answered, by endpoint and HTTP status",
            ["endpoint", "status"],
            registry=r,
        )
        self.ttft = Histogram(
            "pdplane_gateway_ttft_seconds",
            "Time to first token: streamed requests, arrival to the first relayed event; "
            "non-streamed ones, arrival to prefill's answer (prefill computes the first token)",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pdplane_gateway_tpot_seconds",
            "Time per output token after the first, per streamed request",
            buckets=_TPOT_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "pdplane_gateway_e2e_latency_seconds",
            "Arrival to last byte relayed, successful requests",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.leg = Histogram(
            "pdplane_gateway_leg_latency_seconds",
            "Prefill leg (request to response) and decode leg (request to response headers)",
            ["leg"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.retries = Counter(
            "pdplane_gateway_retries",
            "Requests retried on another pair, by the side that failed",
            ["side"],
            registry=r,
        )
        self.first_tokens = Counter(
            "pdplane_gateway_first_tokens",
            "Streamed requests eligible for the first token from prefill (--first-token "
            "prefill), by where their first token came from: prefill, or decode (prefill "
            "returned no token ids, a token without text and no tokenizer, a token-id prompt "
            "ends inside a character, or prefill's text ends with U+FFFD); once per request "
            "whose stream began",
            ["source"],
            registry=r,
        )
        self.prefix_warms = Counter(
            "pdplane_gateway_prefix_warms",
            "Prefix warms the scheduler proposed, by result: sent (the prefill answered 200), "
            "failed (unreachable, timed out or another status), dropped (too many running, one "
            "running on that instance, or the prompt's ids unknown)",
            ["result"],
            registry=r,
        )
        self.cancellations = Counter(
            "pdplane_gateway_cancellations",
            "Requests cancelled by a client disconnect",
            registry=r,
        )
        self.inflight = Gauge(
            "pdplane_gateway_inflight_requests",
            "Requests being handled (scheduled, relaying or streaming)",
            registry=r,
        )
        # labels() hashes and locks on every call; the hot path reuses the children instead.
        self.prefill_leg = self.leg.labels("prefill")
        self.decode_leg = self.leg.labels("decode")
        self.first_from_prefill = self.first_tokens.labels("prefill")
        self.first_from_decode = self.first_tokens.labels("decode")
        self._request_children: dict[tuple[str, int], Any] = {}
        self.kv_aborts = Counter(
            "pdplane_gateway_kv_aborts",
            "AbortTransfer calls sent to prefill instances, by result",
            ["result"],
            registry=r,
        )

        self.routing_precise = Gauge(
            "pdplane_gateway_routing_precise",
            "1 when the model's requests are routed with exact prompt token ids and prefix "
            "block hashes (the gateway has its tokenizer), 0 when by load only (/health says "
            "why)",
            ["model"],
            registry=r,
        )
        self.prompts = Counter(
            "pdplane_gateway_prompts",
            "Scheduled prompts by how their tokens are known: exact (tokenizer, with prefix "
            "block hashes) or estimated",
            ["ids"],
            registry=r,
        )
        self.exact_prompts = self.prompts.labels("exact")
        self.queued = Gauge(
            "pdplane_gateway_queued_requests",
            "Requests waiting for room (every compatible instance full; see --queue-timeout-s)",
            registry=r,
        )
        self.queue_wait = Histogram(
            "pdplane_gateway_queue_wait_seconds",
            "Time a request waited for room before it was scheduled or refused",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_refusals = Counter(
            "pdplane_gateway_queue_refusals",
            "Requests answered 503 by the admission queue: timeout (no room within "
            "--queue-timeout-s) or queue_full (--max-queued-requests waiting already)",
            ["reason"],
            registry=r,
        )
        self.estimated_prompts = self.prompts.labels("estimated")
        self.migrations = Counter(
            "pdplane_gateway_migrations",
            "Requests continued on another decode after theirs was lost mid-way, by why: lost "
            "(connection reset or closed), idle (silent past --stream-idle-timeout-s), "
            "error_event (vLLM's error event), deregistered (left the registry), drain "
            "(draining past --drain-grace-s)",
            ["reason"],
            registry=r,
        )
        self.migration_recomputed = Counter(
            "pdplane_gateway_migration_recomputed_tokens",
            "Tokens the new leg of a migrated request computes again: the prompt plus the "
            "tokens already sent (streams), or the whole request (non-streamed)",
            registry=r,
        )
        self.migration_failures = Counter(
            "pdplane_gateway_migration_failures",
            "Requests whose decode was lost and that could not continue: limit "
            "(--migration-limit spent), timeout (--migration-timeout-s), unavailable (no "
            "decode to continue on, or the new leg refused)",
            ["why"],
            registry=r,
        )
        self.migration_seconds = Histogram(
            "pdplane_gateway_migration_seconds",
            "Loss of a stream's decode to the new decode's response headers",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self._flow_metrics(r)

    def _flow_metrics(self, r: CollectorRegistry) -> None:
        """Flow control (`pdplane.gateway.flow`) and rate limits, by model, tenant and
        priority (the autoscaler counts a model's waiting and shed requests as its demand)."""
        self.flow_queued = Gauge(
            "pdplane_gateway_flow_queued_requests",
            "Requests waiting for their turn in the in-flight budget, by model, tenant and "
            "priority",
            ["model", "tenant", "priority"],
            registry=r,
        )
        self.flow_wait = Histogram(
            "pdplane_gateway_flow_wait_seconds",
            "Time a request waited for its turn (admitted requests and timeouts)",
            ["model", "tenant", "priority"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.flow_shed = Counter(
            "pdplane_gateway_flow_shed",
            "Requests shed with 429 under overload: overload (projected wait past "
            "--queue-timeout-s) or queue_full (--max-queued-requests)",
            ["model", "tenant", "priority", "reason"],
            registry=r,
        )
        self.flow_timeouts = Counter(
            "pdplane_gateway_flow_timeouts",
            "Requests answered 503: no turn within --queue-timeout-s",
            ["model", "tenant", "priority"],
            registry=r,
        )
        self.flow_inflight_tokens = Gauge(
            "pdplane_gateway_flow_inflight_tokens",
            "Tokens (prompt + max_tokens) of the admitted requests not ended, by model",
            ["model"],
            registry=r,
        )
        self.flow_budget_tokens = ScrapedGauge(
            "pdplane_gateway_flow_budget_tokens",
            "The model's in-flight budget (tokens): its decode instances' KV cache times "
            "--inflight-budget",
            "model",
            registry=r,
        )
        self.rate_limited = Counter(
            "pdplane_gateway_rate_limited",
            "Requests refused with 429 by their key's rate limit (requests or tokens)",
            ["tenant", "limit"],
            registry=r,
        )
        self.tenants_reloads = Counter(
            "pdplane_gateway_tenants_reloads",
            "Reads of a changed --tenants file: ok, or error (the previous one stays)",
            ["result"],
            registry=r,
        )

    def answered(self, endpoint: str, status: int) -> None:
        """Counts one answered request of `endpoint` with HTTP `status`."""
        key = (endpoint, status)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(endpoint, str(status))
        child.inc()


class ScrapedGauge(Collector):
    """A gauge family with one label whose samples are read at each scrape: `source()` yields
    (label value, value) pairs (none until it is set). For values that follow state rather
    than events, such as a model's budget from its decode instances: exported from the first
    scrape on, current after scale-out and scale-in, gone with the model."""

    def __init__(self, name: str, documentation: str, label: str, registry: CollectorRegistry):
        self._name = name
        self._documentation = documentation
        self._label = label
        self.source: Callable[[], Iterable[tuple[str, float]]] = tuple
        registry.register(self)

    def _family(self) -> GaugeMetricFamily:
        return GaugeMetricFamily(self._name, self._documentation, labels=[self._label])

    def describe(self) -> list[GaugeMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = self._family()
        for value, sample in self.source():
            family.add_metric([value], sample)
        yield family
