#!/usr/bin/env python3
"""Writes `pdplane.json` beside this file: the Grafana dashboard of a pdplane deployment.

    python deploy/grafana/build_dashboard.py          # rewrite the JSON after editing PANELS

Rows: gateway (`pdplane_gateway_*`), its flow control (per tenant and priority), scheduler
(`pdplane_scheduler_*`, also on the gateway's /metrics with `--scheduler embedded`), the
registry as the scheduler sees it (instances by role and state), and the vLLM instances
(`vllm:*`, one series per scraped instance). Every expression uses one Prometheus datasource
chosen at import (`DS_PROMETHEUS`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["PANELS", "dashboard"]

_Q = "histogram_quantile({q}, sum by (le{by}) (rate({m}_bucket[$__rate_interval])))"


def _quantiles(metric: str, by: str = "", legend: str = "") -> list[tuple[str, str]]:
    extra = f", {by}" if by else ""
    return [(_Q.format(q=q, by=extra, m=metric), f"p{int(q * 100)}{legend}") for q in (0.5, 0.99)]


#: (row, title, unit, [(PromQL, legend)]).
PANELS: list[tuple[str, str, str, list[tuple[str, str]]]] = [
    ("Gateway", "Requests by status", "reqps", [
        ("sum by (status) (rate(pdplane_gateway_requests_total[$__rate_interval]))", "{{status}}"),
    ]),
    ("Gateway", "TTFT (streams)", "s", _quantiles("pdplane_gateway_ttft_seconds")),
    ("Gateway", "TPOT (streams)", "s", _quantiles("pdplane_gateway_tpot_seconds")),
    ("Gateway", "End-to-end latency", "s", _quantiles("pdplane_gateway_e2e_latency_seconds")),
    ("Gateway", "Leg latency", "s",
     _quantiles("pdplane_gateway_leg_latency_seconds", by="leg", legend=" {{leg}}")),
    ("Gateway", "Retries, cancellations, KV aborts", "ops", [
        ("sum by (side) (rate(pdplane_gateway_retries_total[$__rate_interval]))",
         "retry ({{side}} failed)"),
        ("rate(pdplane_gateway_cancellations_total[$__rate_interval])", "client cancelled"),
        ("sum by (result) (rate(pdplane_gateway_kv_aborts_total[$__rate_interval]))",
         "KV abort {{result}}"),
    ]),
    ("Gateway", "In flight", "short", [("sum(pdplane_gateway_inflight_requests)", "requests")]),
    ("Flow control", "Waiting for a turn by tenant, priority", "short", [
        ("sum by (tenant, priority) (pdplane_gateway_flow_queued_requests)",
         "{{tenant}} p{{priority}}"),
    ]),
    ("Flow control", "Wait for a turn (p90) by tenant, priority", "s", [
        ("histogram_quantile(0.9, sum by (le, tenant, priority) "
         "(rate(pdplane_gateway_flow_wait_seconds_bucket[$__rate_interval])))",
         "{{tenant}} p{{priority}}"),
    ]),
    ("Flow control", "Shed, timed out, rate limited", "ops", [
        ("sum by (tenant, priority, reason) "
         "(rate(pdplane_gateway_flow_shed_total[$__rate_interval]))",
         "shed {{tenant}} p{{priority}} {{reason}}"),
        ("sum by (tenant, priority) (rate(pdplane_gateway_flow_timeouts_total[$__rate_interval]))",
         "503 {{tenant}} p{{priority}}"),
        ("sum by (tenant, limit) (rate(pdplane_gateway_rate_limited_total[$__rate_interval]))",
         "limited {{tenant}} {{limit}}"),
    ]),
    ("Flow control", "In-flight tokens and budget", "short", [
        ("sum by (model) (pdplane_gateway_flow_inflight_tokens)", "in flight {{model}}"),
        ("sum by (model) (pdplane_gateway_flow_budget_tokens)", "budget {{model}}"),
    ]),
    ("Scheduler", "Decisions", "ops", [
        ("sum by (prefill_policy, decode_policy) "
         "(rate(pdplane_scheduler_decisions_total[$__rate_interval]))",
         "{{prefill_policy}} / {{decode_policy}}"),
        ("sum by (side) (rate(pdplane_scheduler_unavailable_total[$__rate_interval]))",
         "unavailable: no {{side}}"),
    ]),
    ("Scheduler", "Decision latency", "s", _quantiles("pdplane_scheduler_decision_seconds")),
    ("Scheduler", "Releases", "ops", [
        ("sum by (outcome) (rate(pdplane_scheduler_releases_total[$__rate_interval]))",
         "{{outcome}}"),
    ]),
    ("Scheduler", "In flight per instance", "short", [
        ("sum by (instance_id) (pdplane_scheduler_inflight_requests)", "{{instance_id}}"),
    ]),
    ("Registry", "Instances by role and state", "short", [
        ("max by (role, state) (pdplane_scheduler_instances)", "{{role}} {{state}}"),
    ]),
    ("vLLM", "KV cache usage per instance", "percentunit", [
        ("vllm:kv_cache_usage_perc", "{{instance}}"),
    ]),
    ("vLLM", "Running / waiting per instance", "short", [
        ("vllm:num_requests_running", "running {{instance}}"),
        ("vllm:num_requests_waiting", "waiting {{instance}}"),
    ]),
    ("vLLM", "Engine TTFT", "s", _quantiles("vllm:time_to_first_token_seconds")),
    ("vLLM", "ITL", "s", _quantiles("vllm:inter_token_latency_seconds")),
    ("vLLM", "Tokens", "short", [
        ("sum(rate(vllm:prompt_tokens_total[$__rate_interval]))", "prompt tokens/s"),
        ("sum(rate(vllm:generation_tokens_total[$__rate_interval]))", "generated tokens/s"),
    ]),
    ("vLLM", "KV transfers: prompt tokens from another instance", "short", [
        ("sum by (instance) (rate(vllm:external_prefix_cache_hits_total[$__rate_interval]))",
         "loaded {{instance}}"),
        ("sum by (instance) (rate(vllm:external_prefix_cache_queries_total[$__rate_interval]))",
         "asked {{instance}}"),
    ]),
]  # fmt: skip

_DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def dashboard() -> dict[str, Any]:
    """The dashboard as Grafana's JSON model (schema 39), rows of 8-unit-wide panels."""
    panels: list[dict[str, Any]] = []
    y, x, row = 0, 0, None
    for index, (row_title, title, unit, targets) in enumerate(PANELS):
        if row_title != row:
            row = row_title
            y += 8 if x else 0
            panels.append(
                {
                    "type": "row",
                    "title": row,
                    "id": 1000 + index,
                    "collapsed": False,
                    "gridPos": {"h": 1, "w": 24, "x": 0, "y": y},
                    "panels": [],
                }
            )
            y, x = y + 1, 0
        panels.append({
            "type": "timeseries", "id": index + 1, "title": title, "datasource": _DS,
            "gridPos": {"h": 8, "w": 8, "x": x, "y": y},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "targets": [
                {"refId": chr(ord("A") + i), "datasource": _DS, "expr": expr,
                 "legendFormat": legend}
                for i, (expr, legend) in enumerate(targets)
            ],
        })  # fmt: skip
        x += 8
        if x == 24:
            x, y = 0, y + 8
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "type": "datasource",
                      "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "title": "pdplane", "uid": "pdplane", "schemaVersion": 39, "version": 1,
        "tags": ["pdplane", "vllm"], "time": {"from": "now-30m", "to": "now"},
        "refresh": "10s", "panels": panels,
    }  # fmt: skip


if __name__ == "__main__":
    out = Path(__file__).with_name("pdplane.json")
    out.write_text(json.dumps(dashboard(), indent=2) + "\n")
    print(f"wrote {out}")
