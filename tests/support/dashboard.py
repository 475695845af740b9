"""The Grafana dashboard's metric names and what a /metrics endpoint exports, for the tests
that check every panel's metric is exported (by the services with sims, and by real vLLM)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
#: The dashboard file (written by deploy/grafana/build_dashboard.py).
DASHBOARD = ROOT / "deploy" / "grafana" / "pdplane.json"
_NAME = re.compile(r"\b(pdplane_[a-z0-9_]+|vllm:[a-z0-9_:]+)")
_SUFFIXES = ("_bucket", "_total", "_count", "_sum")


def dashboard_metrics() -> set[str]:
    """Metric family names (no _total/_bucket suffix) the dashboard's expressions use."""
    panels = json.loads(DASHBOARD.read_text())["panels"]
    names = set()
    for panel in panels:
        for target in panel.get("targets", []):
            for name in _NAME.findall(target["expr"]):
                for suffix in _SUFFIXES:
                    name = name.removesuffix(suffix)
                names.add(name)
    return names


def exported(url: str) -> set[str]:
    """Family names in the Prometheus text at `url` (declared ones included: a labelled
    counter nobody incremented yet still has its TYPE line)."""
    text = httpx.get(url, timeout=10).text
    return {family.name for family in text_string_to_metric_families(text)}
