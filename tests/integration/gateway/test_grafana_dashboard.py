"""Every metric a panel of deploy/grafana/pdplane.json queries is exported by the running
services: the gateway, the scheduler (its own /metrics), and the engines (sims here, which
export vLLM's names; tests/e2e/stack/test_dashboard_vllm.py checks those on real vLLM)."""

from __future__ import annotations

import json

import httpx

from pdplane.launch.ports import free_port_run
from tests.integration.gateway.conftest import Stack
from tests.integration.scheduler.fixtures import running_scheduler_server
from tests.support.dashboard import DASHBOARD, dashboard_metrics, exported


def test_the_dashboard_file_is_what_its_builder_writes() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "build", DASHBOARD.with_name("build_dashboard.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert json.loads(DASHBOARD.read_text()) == module.dashboard()


def test_every_panel_metric_is_exported(stack_factory: object) -> None:
    stack: Stack = stack_factory()  # type: ignore[operator]
    sims = stack.sims(["prefill", "decode"])
    stack.wait_ready(sims)
    body = {"model": "sim-model", "prompt": "hello", "max_tokens": 3, "stream": True}
    assert httpx.post(f"{stack.url}/v1/completions", json=body, timeout=10).status_code == 200
    with running_scheduler_server(stack.registry, metrics_port=free_port_run()) as scheduler:
        assert scheduler.app.metrics_port
        found = (
            exported(f"{stack.url}/metrics")
            | exported(f"http://127.0.0.1:{scheduler.app.metrics_port}/metrics")
            | exported(f"{sims.handles[0].url}/metrics")
        )
    wanted = dashboard_metrics()
    assert {"pdplane_gateway_ttft_seconds", "vllm:kv_cache_usage_perc"} <= wanted
    assert wanted - found == set()
