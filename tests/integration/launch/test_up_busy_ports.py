"""A second `pdplane up` on ports that are taken fails at once, before starting anything, names
the ports, and never reports a service "up" that another process answers for."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from pdplane.launch.ports import free_port_run
from tests.integration.launch.cli import free_ports
from tests.integration.registry.fixtures import running_registry


def _up(tmp_path: Path, ports: dict[str, int]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "pdplane.cli.main", "up", "--log-dir", str(tmp_path / "logs")]
    for name, port in ports.items():
        argv += [f"--{name}", str(port)]
    # A model folder that exists, so nothing is built; no vLLM may start anyway.
    argv += ["--model", str(tmp_path)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120)


def test_up_on_a_running_registry_port_fails_before_starting_anything(tmp_path: Path) -> None:
    ports = free_ports("gateway-port", "scheduler-port", "vllm-base-port", "kv-base-port")
    with running_registry(port=free_port_run()) as registry:  # the first `pdplane up`'s
        ports["registry-port"] = int(registry.rsplit(":", 1)[1])
        result = _up(tmp_path, ports)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert f"{ports['registry-port']} (registry)" in out and "in use" in out, out
    assert " up (" not in out and "healthy" not in out and "starting" not in out, out


def test_up_names_every_taken_port(tmp_path: Path) -> None:
    ports = free_ports()
    taken = []
    for name in ("gateway-port", "vllm-base-port", "kv-base-port"):
        sock = socket.socket()
        sock.bind(("127.0.0.1", ports[name]))
        sock.listen()
        taken.append(sock)
    try:
        result = _up(tmp_path, ports)
    finally:
        for sock in taken:
            sock.close()
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    for expected in (
        f"{ports['gateway-port']} (gateway)",
        f"{ports['vllm-base-port']} (prefill-0 vLLM)",
        f"{ports['kv-base-port']} (prefill-0 KV)",
    ):
        assert expected in out, out
    assert "starting" not in out, out


def test_up_names_a_taken_scheduler_metrics_port_and_every_port_flag(tmp_path: Path) -> None:
    ports = free_ports()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port_run()))
        sock.listen()
        ports["scheduler-metrics-port"] = sock.getsockname()[1]
        result = _up(tmp_path, ports)
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert f"{ports['scheduler-metrics-port']} (scheduler metrics)" in out, out
    advice = out.split("choose other ports", 1)[1]
    for flag in ports:  # every port flag of `pdplane up` that can conflict
        assert f"--{flag}" in advice, out
