"""`/metrics` with vLLM's metric names and labels (`model_name`, `engine`), one registry per sim."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from pdplane.sim.engine import EngineState

__all__ = ["SimMetrics"]

_LABELS = ["model_name", "engine"]
_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _EngineGauges(Collector):
    """Scheduler-state gauges read from the engine at scrape time (no per-request updates)."""

    def __init__(self, engine: EngineState, labels: list[str]) -> None:
        self._engine = engine
        self._labels = labels

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for name, doc, value in (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                self._engine.num_running,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                self._engine.num_waiting,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                self._engine.kv_usage,
            ),
        ):
            family = GaugeMetricFamily(name, doc, labels=_LABELS)
            family.add_metric(self._labels, float(value))
            yield family


class SimMetrics:
    """The counters and histograms one sim updates, and their Prometheus exposition."""

    def __init__(self, engine: EngineState, model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = [model, "0"]
        self.registry.register(_EngineGauges(engine, labels))

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, _LABELS, registry=self.registry).labels(*labels)

        def histogram(name: str, doc: str) -> Histogram:
            return Histogram(
                name, doc, _LABELS, buckets=_LATENCY_BUCKETS, registry=self.registry
            ).labels(*labels)

        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        self.external_queries = counter(
            "vllm:external_prefix_cache_queries",
            "External prefix cache queries from KV connector, in queried tokens.",
        )
        self.external_hits = counter(
            "vllm:external_prefix_cache_hits",
            "External prefix cache hits from KV connector, in cached tokens.",
        )
        self._success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*_LABELS, "finished_reason"],
            registry=self.registry,
        )
        self._labels = labels
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of TTFT in s.")
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of ITL in s.")
        self.e2e = histogram(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in s."
        )

    def success(self, finished_reason: str) -> None:
        self._success.labels(*self._labels, finished_reason).inc()

    def exposition(self) -> bytes:
        """The Prometheus text format of everything above."""
        return generate_latest(self.registry)
