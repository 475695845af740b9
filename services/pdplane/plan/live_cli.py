"""`pdplane plan --registry ADDR`: the live advice loop (sampling, gateway metrics, gauges).

Samples `ListInstances` every `interval_s` into a `LoadWindow`, optionally the gateway's
`/metrics` (TTFT and TPOT histograms; the window's quantiles come from the difference of two
scrapes' cumulative buckets), and either prints one verdict after one window or, with
`serve_metrics`, keeps going and exports the verdict as Prometheus gauges for an autoscaler.
"""

from __future__ import annotations

import json
import math
import sys
import threading
import time
from collections import deque
from collections.abc import Callable

import httpx
from prometheus_client import CollectorRegistry, Gauge, start_http_server
from prometheus_client.parser import text_string_to_metric_families

from pdplane.core.grpc import util as grpc_util
from pdplane.plan.live import Advice, LoadWindow, advise, histogram_quantile
from pdplane.registry.failover import RegistryEndpoints, call_any
from pdplane.v1 import registry_pb2

__all__ = ["AdviceGauges", "GatewayWindow", "parse_duration", "run_live"]

_TTFT = "pdplane_gateway_ttft_seconds"
_TPOT = "pdplane_gateway_tpot_seconds"


def parse_duration(text: str) -> float:
    """'10m' / '30s' / '1h' / '250ms' / '45' (s) -> seconds. Raises ValueError otherwise."""
    t = text.strip()
    for unit, k in (("ms", 1e-3), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if t.endswith(unit) and t[: -len(unit)].replace(".", "", 1).isdigit():
            return float(t[: -len(unit)]) * k
    if t.replace(".", "", 1).isdigit():
        return float(t)
    raise ValueError(f"bad duration {text!r}: expected e.g. 10m, 30s, 250ms")


def _buckets(text: str) -> dict[str, list[tuple[float, float]]]:
    out: dict[str, list[tuple[float, float]]] = {_TTFT: [], _TPOT: []}
    for fam in text_string_to_metric_families(text):
        if fam.name in out:
            for s in fam.samples:
                if s.name.endswith("_bucket"):
                    out[fam.name].append((float(s.labels["le"]), float(s.value)))
    return out


class GatewayWindow:
    """Scrapes of the gateway's `/metrics` over the window; TTFT / TPOT p90 of the window."""

    def __init__(self, url: str, window_s: float) -> None:
        self.url = url.rstrip("/") + "/metrics"
        self.window_s = window_s
        self.scrapes: deque[tuple[float, dict[str, list[tuple[float, float]]]]] = deque()

    def scrape(self, now: float) -> str | None:
        """One scrape, whose page it returns for other readers (None: it failed and is
        skipped; the window keeps the others)."""
        try:
            text = httpx.get(self.url, timeout=5).text
        except httpx.HTTPError:
            return None
        self.scrapes.append((now, _buckets(text)))
        while len(self.scrapes) > 2 and self.scrapes[1][0] < now - self.window_s:
            self.scrapes.popleft()
        return text

    def p90(self, name: str) -> float:
        if len(self.scrapes) < 2:
            return math.nan
        old, new = dict(self.scrapes[0][1][name]), self.scrapes[-1][1][name]
        return histogram_quantile([(le, c - old.get(le, 0.0)) for le, c in new], 0.9)


class AdviceGauges:
    """The verdict as Prometheus gauges (an HPA/KEDA scales each role on `delta`)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.bound = Gauge(
            "pdplane_plan_bottleneck", "1 when this role is the bottleneck", ["role"], registry=r
        )
        self.delta = Gauge(
            "pdplane_plan_instances_delta",
            "Advised change of instances: +1 add, -1 remove, 0 keep",
            ["role"],
            registry=r,
        )
        self.waiting = Gauge(
            "pdplane_plan_waiting_per_instance",
            "Mean queued requests per instance over the window",
            ["role"],
            registry=r,
        )
        self.kv = Gauge(
            "pdplane_plan_kv_cache_usage",
            "Mean KV cache usage (0..1) over the window",
            ["role"],
            registry=r,
        )
        self.ttft = Gauge(
            "pdplane_plan_ttft_p90_seconds", "Gateway TTFT p90 over the window", registry=r
        )
        self.itl = Gauge(
            "pdplane_plan_itl_p90_seconds", "Gateway TPOT p90 over the window", registry=r
        )

    def update(self, a: Advice) -> None:
        for role in ("prefill", "decode"):
            self.bound.labels(role).set(float(a.bottleneck in (role, "both")))
            self.delta.labels(role).set(a.delta.get(role, 0))
            self.waiting.labels(role).set(a.loads[role].waiting)
            self.kv.labels(role).set(a.loads[role].kv_usage)
        self.ttft.set(a.ttft_p90_s)
        self.itl.set(a.itl_p90_s)


def _advice_dict(a: Advice) -> dict[str, object]:
    return {
        "advice": a.summary,
        "bottleneck": a.bottleneck,
        "delta": a.delta,
        "reasons": a.reasons,
        "loads": {
            r: {
                "instances": v.instances,
                "running": v.running,
                "waiting": v.waiting,
                "kv_usage": v.kv_usage,
            }
            for r, v in a.loads.items()
        },
        "ttft_p90_s": None if math.isnan(a.ttft_p90_s) else a.ttft_p90_s,
        "itl_p90_s": None if math.isnan(a.itl_p90_s) else a.itl_p90_s,
        "samples": a.samples,
    }


def run_live(
    registry: str,
    *,
    window_s: float,
    interval_s: float = 1.0,
    gateway: str | None = None,
    token: str | None = None,
    tls_ca: str | None = None,
    ttft_slo_s: float = math.inf,
    itl_slo_s: float = math.inf,
    serve_metrics: int | None = None,
    json_out: bool = False,
    stop: threading.Event | None = None,
    on_advice: Callable[[Advice], None] | None = None,
) -> Advice:
    """Samples for `window_s` and returns the verdict; with `serve_metrics` (a port, 0 = any)
    goes on until `stop` is set, updating the gauges and printing each changed verdict.

    Raises grpc.RpcError when the registry cannot be reached.
    """
    endpoints = RegistryEndpoints(registry, tls_ca)
    metadata = grpc_util.token_metadata(token)
    win = LoadWindow(window_s)
    gw = GatewayWindow(gateway, window_s) if gateway else None
    gauges = AdviceGauges() if serve_metrics is not None else None
    if gauges is not None:
        start_http_server(serve_metrics or 0, registry=gauges.registry)
    stop = stop or threading.Event()
    start = time.monotonic()
    last = ""
    try:
        while True:
            now = time.monotonic()
            reply = call_any(
                endpoints,
                lambda stub: stub.ListInstances(
                    registry_pb2.ListInstancesRequest(), timeout=5, metadata=metadata
                ),
            )
            win.add(reply.instances, now)
            if gw is not None:
                gw.scrape(now)
            advice = advise(
                win.loads(),
                ttft_p90_s=gw.p90(_TTFT) if gw else math.nan,
                itl_p90_s=gw.p90(_TPOT) if gw else math.nan,
                ttft_slo_s=ttft_slo_s,
                itl_slo_s=itl_slo_s,
            )
            advice.samples = len(win.samples)
            if on_advice is not None:
                on_advice(advice)
            if gauges is not None:
                gauges.update(advice)
                if advice.summary != last and now - start >= window_s:
                    last = advice.summary
                    sys.stdout.write(_line(advice, json_out))
                    sys.stdout.flush()
            elif now - start >= window_s:
                sys.stdout.write(_line(advice, json_out))
                return advice
            if stop.wait(interval_s):
                return advice
    finally:
        endpoints.close()


def _line(a: Advice, json_out: bool) -> str:
    if json_out:
        return json.dumps(_advice_dict(a)) + "\n"
    p, d = a.loads["prefill"], a.loads["decode"]
    return (
        f"{a.summary}: {'; '.join(a.reasons) or 'no queue, KV cache below the mark'} "
        f"(prefill x{p.instances:.0f} wait {p.waiting:.1f} kv {p.kv_usage:.0%}; "
        f"decode x{d.instances:.0f} wait {d.waiting:.1f} kv {d.kv_usage:.0%}; "
        f"{a.samples} samples)\n"
    )
