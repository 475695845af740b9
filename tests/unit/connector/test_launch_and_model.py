"""The vLLM CPU launcher's command line and the tiny model builder (no vLLM server started)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pdplane.connector.config import ConnectorConfig
from pdplane.launch import vllm_cpu
from pdplane.launch.vllm_cpu import LEAN_ENV, VllmCpuInstance, VllmCpuOptions
from pdplane.models.tiny import build_tiny_model


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_connector_instance_command_carries_role_and_settings(tmp_path: Path) -> None:
    inst = VllmCpuInstance(
        VllmCpuOptions(
            model=tmp_path,
            port=8101,
            role="kv_consumer",
            kv_port=50101,
            registry="127.0.0.1:50051",
            token="tok",
            transfer_timeout_s=9,
            kv_load_failure_policy="recompute",
            omp_threads_bind="1",
        ),
        tmp_path / "d.log",
        base_env={"PATH": "/usr/bin"},
    )
    argv = inst.command()
    assert argv[1:4] == ["-m", "pdplane.cli.vllm_console", "serve"]  # as `vllm serve` runs
    assert argv[4] == str(tmp_path) and "--model" not in argv  # positional, as `vllm serve M`
    assert _flag(argv, "--dtype") == "float32" and "--enforce-eager" in argv
    assert _flag(argv, "--num-gpu-blocks-override") == "64"
    kv = json.loads(_flag(argv, "--kv-transfer-config"))
    assert kv["kv_connector"] == "PdPlaneConnector"
    assert kv["kv_connector_module_path"] == "pdplane.connector"
    assert kv["kv_role"] == "kv_consumer" and kv["kv_load_failure_policy"] == "recompute"
    extra = kv["kv_connector_extra_config"]
    assert extra["url"] == "http://127.0.0.1:8101" and extra["kv_port"] == 50101
    assert extra["registry"] == "127.0.0.1:50051" and "token" not in extra
    assert extra["transfer_timeout_s"] == 9
    env = inst.env()
    assert env["PATH"] == "/usr/bin" and env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert env["PDPLANE_TOKEN"] == "tok"  # in the environment, not argv (ps shows argv)
    assert all(env[k] == v for k, v in LEAN_ENV.items())
    assert inst.kv_endpoint == "127.0.0.1:50101" and inst.url == "http://127.0.0.1:8101"


def test_plain_instance_has_no_connector(tmp_path: Path) -> None:
    inst = VllmCpuInstance(VllmCpuOptions(model=tmp_path, port=8102), tmp_path / "p.log")
    assert "--kv-transfer-config" not in inst.command()
    assert inst.kv_endpoint is None


def test_tiny_model_is_built_once_and_has_a_chat_template(tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    first = build_tiny_model(tmp_path)
    mtime = (first / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_model(tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == mtime  # cached, not rebuilt
    tok = AutoTokenizer.from_pretrained(first)
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hold the block"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s><|user|>hold the block</s><|assistant|>"
    assert tok.decode(tok("the quick red river")["input_ids"]) == "the quick red river"
    assert not list(tmp_path.glob(".tiny-build-*"))  # no temporary directory left behind


def test_connector_instance_publishes_kv_events_to_a_private_socket(tmp_path: Path) -> None:
    inst = VllmCpuInstance(
        VllmCpuOptions(model=tmp_path, port=8103, role="kv_producer"), tmp_path / "e.log"
    )
    events = json.loads(_flag(inst.command(), "--kv-events-config"))
    assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
    path = Path(events["endpoint"].removeprefix("ipc://"))
    assert events["endpoint"].startswith("ipc://")
    assert path.parent.stat().st_mode & 0o777 == 0o700  # only this user can connect
    inst.stop()
    assert not path.parent.exists()  # removed with the instance


def test_kv_events_off_without_connector_prefix_cache_or_when_given(tmp_path: Path) -> None:
    plain = VllmCpuInstance(VllmCpuOptions(model=tmp_path, port=8104), tmp_path / "a.log")
    assert "--kv-events-config" not in plain.command()
    no_cache = VllmCpuInstance(
        VllmCpuOptions(model=tmp_path, port=8105, role="kv_both", prefix_caching=False),
        tmp_path / "b.log",
    )
    assert "--kv-events-config" not in no_cache.command()
    own = ["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "ipc:///x"}']
    given = VllmCpuInstance(
        VllmCpuOptions(model=tmp_path, port=8106, role="kv_both", extra_args=own),
        tmp_path / "c.log",
    )
    assert given.command().count("--kv-events-config") == 1


def test_connector_reads_its_tokens_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:

    monkeypatch.setenv("PDPLANE_TOKEN", "kv-tok")
    monkeypatch.setenv("PDPLANE_REGISTRY_TOKEN", "reg-tok")
    config = ConnectorConfig.from_extra_config({})
    assert config.token == "kv-tok" and config.registry_token == "reg-tok"
    assert ConnectorConfig.from_extra_config({"token": "explicit"}).token == "explicit"


def test_a_vllm_without_the_serve_command_gets_the_api_server_module(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(vllm_cpu, "_has_serve_command", lambda: False)
    argv = VllmCpuInstance(VllmCpuOptions(model=tmp_path, port=8101), tmp_path / "v.log").command()
    assert argv[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    assert _flag(argv, "--model") == str(tmp_path)


def test_the_installed_vllm_has_the_serve_command() -> None:
    # vLLM CPU 0.32 here (and 0.26 on GPU machines): launched as `vllm serve`, no deprecation.
    assert vllm_cpu._has_serve_command()
