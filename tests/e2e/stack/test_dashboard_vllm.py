"""The dashboard's vLLM panels query names real vLLM CPU exports (the sims that stand in for
vLLM in tests/integration/gateway/test_grafana_dashboard.py export the same ones)."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import VllmPair
from tests.support.dashboard import dashboard_metrics, exported

pytestmark = pytest.mark.vllm


def test_every_vllm_panel_metric_is_exported_by_real_vllm(vllm_pair: VllmPair) -> None:
    wanted = {name for name in dashboard_metrics() if name.startswith("vllm:")}
    assert wanted
    for url in (vllm_pair.prefill_url, vllm_pair.decode_url):
        assert wanted - exported(f"{url}/metrics") == set(), url
