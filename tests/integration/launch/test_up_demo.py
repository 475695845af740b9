"""`pdplane up --demo` on a gateway that requires API keys: the demo request authenticates with
a key `pdplane up` knows (its `--api-key`, else the tenants file's first key); a demo request
the gateway refuses is one clear line and status 1 with `--exit-after-demo`, not a traceback.

The real `pdplane up` (a subprocess, as `deploy/local.sh up --tenants FILE` runs it) on
`pdplane sim` instances.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from pdplane.launch.ports import free_port_run
from tests.integration.launch.cli import run_pdplane

_TENANTS = """
tenants:
  chat: {priority: 0}
keys:
  - {key: sk-chat, tenant: chat}
  - {key: sk-batch, tenant: batch, tokens_per_min: 100000}
"""


@pytest.fixture(autouse=True)
def _clean_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PDPLANE_CACHE_DIR", str(tmp_path / "cache"))
    for name in ("TOKEN", "ADMIN_TOKEN", "REGISTRY_TOKEN", "API_KEY", "TENANTS"):
        monkeypatch.delenv(f"PDPLANE_{name}", raising=False)


def _up_demo(tmp_path: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """`pdplane up --engine sim --demo --exit-after-demo FLAGS` on free ports, to its end."""
    base, vllm, kv = free_port_run(4), free_port_run(2), free_port_run(2)
    return run_pdplane(
        "up", "--engine", "sim", "--demo", "--exit-after-demo",
        "--registry-port", str(base), "--scheduler-port", str(base + 1),
        "--gateway-port", str(base + 2), "--scheduler-metrics-port", str(base + 3),
        "--vllm-base-port", str(vllm), "--kv-base-port", str(kv),
        "--log-dir", str(tmp_path / "logs"), "--ready-timeout-s", "90",
        *flags,
        timeout_s=150,
    )  # fmt: skip


def test_the_demo_request_authenticates_with_the_tenants_file_s_first_key(
    tmp_path: Path,
) -> None:
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(_TENANTS)
    result = _up_demo(tmp_path, "--tenants", str(tenants))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[pdplane up]   answer: " in result.stdout
    assert "Traceback" not in result.stderr
    gateway_log = (tmp_path / "logs" / "gateway.log").read_text()
    assert '"POST /v1/chat/completions" 200' in gateway_log
    assert f"tenants file {tenants}: 2 tenants, 2 keys (and 0 --api-key keys)" in gateway_log


def test_the_demo_request_authenticates_with_the_api_key(tmp_path: Path) -> None:
    result = _up_demo(tmp_path, "--api-key", "sk-one,sk-two")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "[pdplane up]   answer: " in result.stdout
    # The key travels in the gateway's environment, never its argv (which ps shows).
    assert "sk-one" not in result.stdout + result.stderr


def test_a_refused_demo_request_is_one_clear_error_not_a_traceback(tmp_path: Path) -> None:
    # Engines of 16 tokens per request: the demo's prompt and 24 output tokens do not fit.
    result = _up_demo(tmp_path, "--vllm-args", "--max-model-len 16")
    assert result.returncode == 1, result.stdout + result.stderr
    assert "[pdplane up] demo request failed: HTTP 400" in result.stdout
    assert "Traceback" not in result.stdout + result.stderr
    assert "[pdplane up] stopped in" in result.stdout
