"""deploy/docker/vllm_instance.py: the vLLM command a CPU instance container execs."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import pytest


def _kv_config(argv: list[str]) -> dict[str, Any]:
    return dict(json.loads(argv[argv.index("--kv-transfer-config") + 1]))


def test_prefill_advertises_its_service_name_and_binds_all_interfaces(
    vllm_instance: ModuleType,
) -> None:
    settings = vllm_instance.InstanceSettings.parse(
        ["--role", "prefill", "--registry", "registry:8051", "--advertise-host", "prefill"]
    )
    argv, env = vllm_instance.build(settings)
    assert argv[1:4] == ["-m", "pdplane.cli.vllm_console", "serve"]  # as `vllm serve` runs
    assert argv[argv.index("--host") + 1] == "0.0.0.0"
    assert argv[4] == "/models/tiny"  # the model, positional as `vllm serve MODEL`
    assert argv[argv.index("--served-model-name") + 1] == "tiny-llama"
    kv = _kv_config(argv)
    assert kv["kv_role"] == "kv_producer"
    assert kv["kv_connector_module_path"] == "pdplane.connector"
    extra = kv["kv_connector_extra_config"]
    assert extra["registry"] == "registry:8051"
    assert extra["url"] == "http://prefill:8100"
    assert extra["advertise_host"] == "prefill"
    assert extra["kv_host"] == "0.0.0.0"
    assert extra["kv_port"] == 8200
    assert "token" not in extra and "registry_token" not in extra
    assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_environment_settings_roles_tokens_and_tls(
    vllm_instance: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PDPLANE_ROLE", "decode")
    monkeypatch.setenv("PDPLANE_REGISTRY", "10.0.0.1:8051")
    monkeypatch.setenv("PDPLANE_ADVERTISE_HOST", "decode-7")
    monkeypatch.setenv("PDPLANE_PORT", "9100")
    monkeypatch.setenv("PDPLANE_TOKEN", "s3cret")
    monkeypatch.setenv("PDPLANE_TLS_CA", "/etc/pdplane/tls/ca.pem")
    monkeypatch.setenv("PDPLANE_OMP_THREADS_BIND", "1")
    argv, env = vllm_instance.build(vllm_instance.InstanceSettings.parse([]))
    extra = _kv_config(argv)["kv_connector_extra_config"]
    assert _kv_config(argv)["kv_role"] == "kv_consumer"
    assert extra["url"] == "http://decode-7:9100"
    # Tokens reach the connector through the environment, never argv (ps shows argv).
    assert "token" not in extra and "registry_token" not in extra
    assert "s3cret" not in " ".join(argv)
    assert env["PDPLANE_TOKEN"] == env["PDPLANE_REGISTRY_TOKEN"] == "s3cret"
    assert extra["registry_tls_ca"] == extra["tls_ca"] == "/etc/pdplane/tls/ca.pem"
    assert "tls_cert" not in extra
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_bad_role_exits_2(vllm_instance: ModuleType) -> None:
    with pytest.raises(SystemExit) as exc:
        vllm_instance.InstanceSettings.parse(["--role", "router", "--registry", "r:1"])
    assert exc.value.code == 2
