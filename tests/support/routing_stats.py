"""The sims' own counters over a window of a routing run, and a router's prefix-index counters.

Sim side (two `GET /fleet/stats` reads, at the start and at the end of the window): output
tokens per second, prefix cache hit rate (prefill and decode instances), KV transferred per
finished decode request, per-decode time-averaged running requests and KV usage (their max/mean
across decodes), peaks, preemptions, push receive-buffer refusals and the recomputes they
caused, engine-side ITL percentiles, and the simulator's own lag (its event loop fell behind).
Router side (pdplane rows, one `GET /metrics` of the gateway at the end of the point): the prefix
index's stale transitions, stream errors and snapshots since the router started, so a kv_aware
point that missed cached prefixes says whether its index had stopped trusting an instance's KV
events. The client's side (TTFT, TPOT, goodput) is `bench.routing.openloop.client_numbers`.
"""

from __future__ import annotations

import statistics
import urllib.request
from collections.abc import Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from pdplane.sim.stats import LogHistogram

__all__ = [
    "ROUTER_KV_COUNTERS",
    "fleet_hit_rate",
    "fleet_numbers",
    "metric_sums",
    "router_kv_counters",
]

#: The embedded scheduler's prefix-index and prefix warming counters a pdplane gateway
#: exports: metric family -> result key (totals since the router started).
ROUTER_KV_COUNTERS = {
    "pdplane_scheduler_kv_stale_transitions": "kv_stale_transitions",
    "pdplane_scheduler_kv_stream_errors": "kv_stream_errors",
    "pdplane_scheduler_kv_snapshots": "kv_snapshots",
    "pdplane_scheduler_prefix_warms": "warms",
    "pdplane_gateway_prefix_warms": "warms_sent_failed_dropped",
}


def _delta(a: dict[str, Any], b: dict[str, Any], key: str) -> float:
    return float(b[key]) - float(a[key])


def fleet_hit_rate(
    instances: Sequence[tuple[dict[str, Any], dict[str, Any]]],
    decodes: Sequence[tuple[dict[str, Any], dict[str, Any]]],
) -> float:
    """1 - prompt tokens computed / prompt tokens, over a window (two reads per instance).

    Computed prompt tokens = computed - generated tokens summed over every instance (a decode
    step computes the one token it generates); the prompt tokens are those of the decode legs,
    one per request. Off by about one token per leg (a prefill leg's sampled token, a decode's
    recomputed last prompt token), against thousands of prompt tokens. 0.0 with no prompt.
    """
    prompt = sum(_delta(a, b, "prompt_tokens") for a, b in decodes)
    if prompt <= 0:
        return 0.0
    computed = sum(
        _delta(a, b, "computed_tokens") - _delta(a, b, "generation_tokens") for a, b in instances
    )
    return 1.0 - max(computed, 0.0) / prompt


def fleet_numbers(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """The sims' counters between two `/fleet/stats` reads (see the module docstring)."""
    pairs = [
        (x["role"], x["stats"], y["stats"])
        for x, y in zip(before["instances"], after["instances"], strict=True)
    ]
    decodes = [(a, b) for role, a, b in pairs if role == "decode"]
    prefills = [(a, b) for role, a, b in pairs if role == "prefill"]
    dt = max(statistics.fmean(_delta(a, b, "clock_s") for _, a, b in pairs), 1e-9)

    def hit_rate(group: list[tuple[dict[str, Any], dict[str, Any]]]) -> float:
        queries = sum(_delta(a, b, "prefix_queries") for a, b in group)
        return sum(_delta(a, b, "prefix_hits") for a, b in group) / queries if queries else 0.0

    def spread(key: str) -> tuple[float, float, float]:
        means = [_delta(a, b, key) / max(_delta(a, b, "clock_s"), 1e-9) for a, b in decodes]
        mean = statistics.fmean(means) if means else 0.0
        return mean, max(means, default=0.0), (max(means) / mean if mean > 0 else 1.0)

    run_mean, run_max, run_ratio = spread("running_integral")
    del run_max  # the ratio says it
    kv_mean, kv_max, kv_ratio = spread("kv_usage_integral")
    wait_mean, wait_max, _ = spread("waiting_integral")
    itl = LogHistogram()
    for a, b in decodes:
        itl = itl.merge(LogHistogram.from_dict(b["itl"]).minus(LogHistogram.from_dict(a["itl"])))
    finished = sum(_delta(a, b, "finished") for a, b in decodes)
    prefilled = sum(_delta(a, b, "finished") for a, b in prefills)
    total = [(a, b) for _, a, b in pairs]
    lag_s = sum(_delta(a, b, "lag_s") for a, b in total)
    return {
        "window_s": dt,
        "output_tok_s": sum(_delta(a, b, "generation_tokens") for a, b in decodes) / dt,
        "prefill_hit_rate": hit_rate(prefills),
        # 1 - prompt tokens computed anywhere (prefill, or locally on decode) / prompt tokens of
        # the decode legs: the fleet's prefix cache hit, alike for every router whether it
        # prefills on a prefill instance or on the decode (each request has one decode leg)
        "fleet_hit_rate": fleet_hit_rate(total, decodes),
        "decode_hit_rate": hit_rate(decodes),
        # requests whose prompt went through a prefill instance (kv_aware may skip it)
        "prefill_legs_per_request": prefilled / finished if finished else 0.0,
        "kv_mb_per_request": (
            sum(_delta(a, b, "kv_bytes_in") for a, b in decodes) / finished / 1e6
            if finished
            else 0.0
        ),
        "decode_running_mean": run_mean,
        "decode_running_max_over_mean": run_ratio,
        "decode_running_peak": max((b["max_running"] for _, b in decodes), default=0),
        "decode_waiting_mean": wait_mean,
        "decode_waiting_max": wait_max,
        "decode_waiting_peak": max((b["max_waiting"] for _, b in decodes), default=0),
        "decode_kv_mean": kv_mean,
        "decode_kv_max": kv_max,
        "decode_kv_max_over_mean": kv_ratio,
        "decode_kv_peak": max((b["max_kv_usage"] for _, b in decodes), default=0.0),
        "preemptions": sum(_delta(a, b, "preemptions") for a, b in total),
        "push_refused": sum(_delta(a, b, "push_refused") for a, b in decodes),
        "overflow_recomputes": sum(_delta(a, b, "push_overflow_recomputes") for a, b in decodes),
        "itl_p50_ms": itl.quantile(0.5) * 1e3,
        "itl_p99_ms": itl.quantile(0.99) * 1e3,
        "sim_lag_s": lag_s,
        # Modelled seconds the sims ran late per modelled second and instance: about 1 - the
        # sims' speed (0 kept up, 0.5 half speed); idle instances dilute it.
        "sim_lag_fraction": lag_s / (dt * len(total)),
    }


def metric_sums(text: str) -> dict[str, float]:
    """Prometheus exposition `text` -> {family name: sum of its samples} (a counter's
    `_created` samples left out)."""
    return {
        f.name: sum(x.value for x in f.samples if not x.name.endswith("_created"))
        for f in text_string_to_metric_families(text)
    }


def router_kv_counters(metrics_url: str, timeout_s: float = 5.0) -> dict[str, float]:
    """The prefix-index counters (`ROUTER_KV_COUNTERS`) from a gateway's Prometheus text at
    `metrics_url`; those it does not export (no prefix index) are left out. Raises OSError when
    the gateway does not answer within `timeout_s` seconds."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as r:
        sums = metric_sums(r.read().decode())
    return {key: sums[name] for name, key in ROUTER_KV_COUNTERS.items() if name in sums}
