"""`pdplane vllm`: the command line of an instance that joins a running system."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdplane.cli.vllm import InstanceSettings, build
from pdplane.launch.vllm_cpu import LEAN_ENV


def _kv(argv: list[str]) -> dict[str, Any]:
    return dict(json.loads(argv[argv.index("--kv-transfer-config") + 1]))


def test_local_decode_joins_the_default_registry_with_up_s_lean_flags(tmp_path: Path) -> None:
    settings = InstanceSettings.parse(
        [
            "--role",
            "decode",
            "--model",
            str(tmp_path),
            "--port",
            "8102",
            "--kv-port",
            "8202",
            "--instance-id",
            "decode-extra",
        ]
    )
    argv, env = build(settings)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--dtype") + 1] == "float32"  # same numerics as `pdplane up`
    assert "--enforce-eager" in argv
    kv = _kv(argv)
    assert kv["kv_role"] == "kv_consumer"
    extra = kv["kv_connector_extra_config"]
    assert extra["registry"] == "127.0.0.1:8051"
    assert extra["url"] == "http://127.0.0.1:8102"
    assert extra["kv_port"] == 8202
    assert extra["instance_id"] == "decode-extra"
    assert "mode" not in extra  # pull: the connector's default
    assert all(env[k] == v for k, v in LEAN_ENV.items())


def test_push_mode_reaches_the_connector(tmp_path: Path) -> None:
    settings = InstanceSettings.parse(
        ["--role", "prefill", "--model", str(tmp_path), "--kv-mode", "push"]
    )
    argv, _ = build(settings)
    assert _kv(argv)["kv_connector_extra_config"]["mode"] == "push"


def test_binding_every_address_needs_an_advertised_host(tmp_path: Path) -> None:
    settings = InstanceSettings.parse(
        ["--role", "prefill", "--model", str(tmp_path), "--host", "0.0.0.0"]
    )
    with pytest.raises(SystemExit, match="advertise-host"):
        build(settings)
