"""`pdplane ...` run as a subprocess, as a user's shell would, and `pdplane up --engine sim`'s
fleet in process, for the launch tests."""

from __future__ import annotations

import os
import queue
import subprocess
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import IO, Any

from pdplane.launch.deployment import FleetSpec
from pdplane.launch.ports import free_port_run

__all__ = ["UP_PORT_FLAGS", "free_ports", "line_queue", "run_pdplane", "sim_fleet_spec"]

# The port flags of `pdplane up` a launch test usually pins (each to a free loopback port).
UP_PORT_FLAGS = (
    "gateway-port",
    "registry-port",
    "scheduler-port",
    "vllm-base-port",
    "kv-base-port",
)


def sim_fleet_spec(tmp_path: Path, **overrides: Any) -> FleetSpec:
    """A fleet of sims on free loopback ports (no profile: steps of the sims' `--itl-ms`),
    logs under `tmp_path`; `overrides` are FleetSpec fields (`decode=2`, ...). Ports are
    reserved for up to 4 instances."""
    spec: dict[str, Any] = {
        "registry_port": free_port_run(),
        "scheduler_port": free_port_run(),
        "gateway_port": free_port_run(),
        "vllm_base_port": free_port_run(4),
        "kv_base_port": free_port_run(4),
        "engine": "sim",
        "sim_profile": "",
        "log_dir": tmp_path / "logs",
        "ready_timeout_s": 120,
    }
    return FleetSpec(**(spec | overrides))


def free_ports(*flags: str) -> dict[str, int]:
    """A free loopback TCP port for each port flag of `pdplane up` in `flags` (default
    `UP_PORT_FLAGS`), keyed by the flag without its leading `--` (`gateway-port`)."""
    return {flag: free_port_run() for flag in (flags or UP_PORT_FLAGS)}


def line_queue(stream: IO[str]) -> queue.Queue[str]:
    """The lines of a child's text `stream` as they come, read by a daemon thread, with "" at
    its end, so that a test's wait for a line is bounded by `queue.get(timeout=...)`."""
    lines: queue.Queue[str] = queue.Queue()

    def read() -> None:
        for line in stream:
            lines.put(line)
        lines.put("")

    threading.Thread(target=read, daemon=True).start()
    return lines


def run_pdplane(
    *args: str, timeout_s: float = 60.0, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs `pdplane ARGS...` (this interpreter's `pdplane.cli.main`) to its end, with this
    environment plus `env`, and returns its exit code, stdout and stderr (text). Raises
    subprocess.TimeoutExpired past `timeout_s` seconds."""
    return subprocess.run(
        [sys.executable, "-m", "pdplane.cli.main", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env={**os.environ, **(env or {})},
    )
