"""A long-running command started on a port another process listens on fails at once: exit
status 2 (bad input), one line on stderr naming the address and the flag to change, no
traceback, nothing started (the sim never prints its "up" line)."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdplane.launch.ports import free_port_run
from tests.integration.launch.cli import run_pdplane

# A registry address nothing answers on: the commands must fail before they dial it.
_NO_REGISTRY = "127.0.0.1:1"


@pytest.fixture
def taken() -> Iterator[int]:
    """A loopback port with a listener on it for the test's duration."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port_run()))
        sock.listen()
        yield sock.getsockname()[1]


def _assert_refused(
    result: subprocess.CompletedProcess[str], prog: str, address: str, flag: str
) -> None:
    out = result.stdout + result.stderr
    assert result.returncode == 2, out
    assert "Traceback" not in out, out
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, out
    assert lines[0].startswith(f"{prog}: address already in use: {address} ({flag})"), out
    assert "choose another port" in lines[0] and flag in lines[0].rsplit("(", 1)[1], out
    assert result.stdout == "", out


def test_sim_on_a_taken_http_port(taken: int) -> None:
    result = run_pdplane("sim", "--port", str(taken))
    _assert_refused(result, "pdplane sim", f"127.0.0.1:{taken}", "--port")


def test_sim_names_a_taken_port_of_a_later_instance(taken: int) -> None:
    result = run_pdplane("sim", "--port", str(taken - 1), "--instances", "2")
    _assert_refused(result, "pdplane sim", f"127.0.0.1:{taken}", "--port")


def test_sim_on_a_taken_kv_port(taken: int) -> None:
    result = run_pdplane("sim", "--port", "0", "--kv-port", str(taken))
    _assert_refused(result, "pdplane sim", f"127.0.0.1:{taken}", "--kv-port")


def test_registry_on_a_taken_port(taken: int) -> None:
    result = run_pdplane("registry", "--port", str(taken))
    _assert_refused(result, "pdplane registry", f"127.0.0.1:{taken}", "--port")


@pytest.mark.parametrize("flag", ["--port", "--metrics-port"])
def test_scheduler_on_a_taken_port(taken: int, flag: str) -> None:
    argv = ["scheduler", "--registry", _NO_REGISTRY, "--port", "0", flag, str(taken)]
    result = run_pdplane(*argv)
    _assert_refused(result, "pdplane scheduler", f"127.0.0.1:{taken}", flag)


def test_gateway_on_a_taken_port(taken: int) -> None:
    result = run_pdplane("gateway", "--registry", _NO_REGISTRY, "--port", str(taken))
    _assert_refused(result, "pdplane gateway", f"127.0.0.1:{taken}", "--port")


def test_gateway_on_a_taken_inflight_port(taken: int) -> None:
    argv = ["gateway", "--registry", _NO_REGISTRY, "--scheduler", "embedded", "--port", "0"]
    result = run_pdplane(*argv, "--inflight-port", str(taken))
    _assert_refused(result, "pdplane gateway", f"127.0.0.1:{taken}", "--inflight-port")


@pytest.mark.parametrize("flag", ["--port", "--kv-port"])
def test_vllm_on_a_taken_port_fails_before_building_or_starting_anything(
    taken: int, flag: str, tmp_path: Path
) -> None:
    # No model given: the tiny one would be built under PDPLANE_CACHE_DIR before vLLM starts,
    # and neither may happen on a taken port.
    other = "--kv-port" if flag == "--port" else "--port"
    argv = ["vllm", "--role", "decode", "--registry", _NO_REGISTRY, flag, str(taken)]
    result = run_pdplane(
        *argv, other, str(free_port_run()), env={"PDPLANE_CACHE_DIR": str(tmp_path)}
    )
    _assert_refused(result, "pdplane vllm", f"127.0.0.1:{taken}", flag)
    assert list(tmp_path.iterdir()) == []  # no model built


def test_a_host_that_is_not_this_machine_s_is_named_with_its_reason() -> None:
    # 192.0.2.1 (TEST-NET-1, RFC 5737) is assigned to no interface here.
    result = run_pdplane("sim", "--host", "192.0.2.1", "--port", "8100", "--registry-token", "t")
    out = result.stdout + result.stderr
    assert result.returncode == 2 and "Traceback" not in out, out
    line = result.stderr.strip()
    assert line.startswith("pdplane sim: cannot listen on 192.0.2.1:8100 (--port): "), out
    assert "already in use" not in line and "check --host" in line, out
