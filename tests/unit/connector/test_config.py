"""kv_connector_extra_config parsing: typed, validated, clear errors naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdplane.connector.config import ConnectorConfig, ConnectorConfigError
from pdplane.core import defaults


def test_defaults() -> None:
    cfg = ConnectorConfig.from_extra_config(None)
    assert cfg.transport == "tcp"
    assert cfg.transfer_timeout_s == defaults.KV_TRANSFER_TIMEOUT_S
    assert cfg.registry is None and cfg.kv_port == 0


def test_full_config_and_endpoints() -> None:
    cfg = ConnectorConfig.from_extra_config(
        {
            "registry": "127.0.0.1:50051",
            "url": "http://127.0.0.1:8100",
            "kv_port": 50100,
            "advertise_host": "10.0.0.7",
            "transport": "nccl",
            "transfer_timeout_s": 5,
        }
    )
    assert cfg.kv_endpoint() == "10.0.0.7:50100"
    assert cfg.kv_endpoint(tp_rank=3) == "10.0.0.7:50103"
    assert cfg.bind_address(1) == "127.0.0.1:50101"
    assert cfg.resolved_instance_id() == cfg.resolved_instance_id()  # stable across halves


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"transport": "rdma"}, "transport"),
        ({"transfer_timeout_s": 0}, "transfer_timeout_s"),
        ({"kv_port": 70000}, "kv_port"),
        ({"registry": "127.0.0.1:1", "kv_port": 5}, "url is required"),
        ({"registry": "127.0.0.1:1", "url": "http://x:1"}, "kv_port must be set"),
        ({"tls_cert": "c.pem"}, "tls_cert and tls_key"),
        ({"instance_id": "bad id!"}, "instance_id"),
        ({"regsitry": "typo"}, "regsitry"),
    ],
)
def test_invalid_config_names_the_key(extra: dict, named: str) -> None:
    with pytest.raises(ConnectorConfigError, match=named):
        ConnectorConfig.from_extra_config(extra)


def test_transport_options_follow_the_transport() -> None:
    assert ConnectorConfig(chunk_bytes=1024).transport_options() == {"chunk_bytes": 1024}
    nccl = ConnectorConfig.from_extra_config(
        {"transport": "nccl", "nccl_chunk_bytes": 1 << 20, "push_ttl_s": 5}
    )
    assert nccl.transport_options() == {"nccl_chunk_bytes": 1 << 20, "push_ttl_s": 5}
    # tls_ca is the connector's channels' (every transport's stubs share them), not an option
    tls = ConnectorConfig.from_extra_config({"transport": "nccl", "tls_ca": "/etc/pdplane/ca.pem"})
    assert tls.transport_options() == {}
    with pytest.raises(ConnectorConfigError, match="nccl_strategy"):  # not an option
        ConnectorConfig.from_extra_config({"nccl_strategy": "gather"})


def test_tokens_come_from_files_when_the_environment_has_none(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "token").write_text("kv-secret\n")
    monkeypatch.setenv("PDPLANE_TOKEN", "")
    monkeypatch.delenv("PDPLANE_REGISTRY_TOKEN", raising=False)
    monkeypatch.setenv("PDPLANE_TOKEN_FILE", str(tmp_path / "token"))
    monkeypatch.setenv("PDPLANE_REGISTRY_TOKEN_FILE", str(tmp_path / "token"))
    cfg = ConnectorConfig.from_extra_config({})
    assert cfg.token == cfg.registry_token == "kv-secret"
    monkeypatch.setenv("PDPLANE_TOKEN", "from-env")  # a non-empty variable wins
    assert ConnectorConfig.from_extra_config({}).token == "from-env"
    monkeypatch.setenv("PDPLANE_REGISTRY_TOKEN_FILE", str(tmp_path / "absent"))
    with pytest.raises(ConnectorConfigError, match="PDPLANE_REGISTRY_TOKEN_FILE"):
        ConnectorConfig.from_extra_config({})
