"""`/metrics` with vLLM's metric names and labels (`model_name`, `engine`), one registry per sim.

Everything is read from the engine's own counters at scrape time (`EngineStats`), so the hot
path (one step, one token) updates plain integers and never a Prometheus object. Latencies are
in modelled seconds (see `pdplane.sim.runner`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from pdplane.sim.engine import EngineCore
from pdplane.sim.stats import LogHistogram

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


def _histogram(name: str, doc: str, labels: list[str], hist: LogHistogram) -> Metric:
    family = HistogramMetricFamily(name, doc, labels=_LABELS)
    buckets = [(str(b), float(hist.count_below(b))) for b in _LATENCY_BUCKETS]
    buckets.append(("+Inf", float(hist.total)))
    family.add_metric(labels, buckets, hist.sum)
    return family


class _EngineCollector(Collector):
    """vLLM's scheduler gauges, token and cache counters and latency histograms."""

    def __init__(self, core: Callable[[], EngineCore], e2e: LogHistogram, labels: list[str]):
        self._core = core
        self._e2e = e2e
        self._labels = labels

    def collect(self) -> Iterator[Metric]:
        core = self._core()
        s, labels = core.stats, self._labels
        for name, doc, value in (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                core.num_running,
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                core.num_waiting,
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                core.pool.usage,
            ),
        ):
            gauge = GaugeMetricFamily(name, doc, labels=_LABELS)
            gauge.add_metric(labels, float(value))
            yield gauge
        for name, doc, value in (
            ("vllm:prompt_tokens", "Number of prefill tokens processed.", s.prompt_tokens),
            (
                "vllm:generation_tokens",
                "Number of generation tokens processed.",
                s.generation_tokens,
            ),
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                s.prefix_queries,
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                s.prefix_hits,
            ),
            (
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector, in queried tokens.",
                s.external_queries,
            ),
            (
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector, in cached tokens.",
                s.external_hits,
            ),
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine.",
                s.preemptions,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=_LABELS)
            counter.add_metric(labels, float(value))
            yield counter
        success = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests.",
            labels=[*_LABELS, "finished_reason"],
        )
        success.add_metric([*labels, "length"], float(s.finished))
        yield success
        yield _histogram(
            "vllm:time_to_first_token_seconds", "Histogram of TTFT in s.", labels, s.ttft
        )
        yield _histogram(
            "vllm:inter_token_latency_seconds", "Histogram of ITL in s.", labels, s.itl
        )
        yield _histogram(
            "vllm:e2e_request_latency_seconds",
            "Histogram of e2e request latency in s.",
            labels,
            self._e2e,
        )


class SimMetrics:
    """The Prometheus exposition of one sim (a collector over its engine's counters)."""

    def __init__(self, core: Callable[[], EngineCore], model: str) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        #: end-to-end request latency (modelled s), observed by the HTTP handlers
        self.e2e = LogHistogram()
        self.registry.register(_EngineCollector(core, self.e2e, [model, "0"]))

    def exposition(self) -> bytes:
        """The Prometheus text format of everything above."""
        return generate_latest(self.registry)
