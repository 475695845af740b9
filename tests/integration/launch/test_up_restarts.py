"""`pdplane up` keeps its services running: a registry that dies is restarted on its port, and
the log says when it serves again (as it says for a restarted vLLM instance)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from pdplane.cli import up
from pdplane.launch.deployment import Fleet, FleetSpec
from pdplane.launch.ports import free_port_run
from pdplane.launch.process import wait_until


@pytest.fixture
def services(tmp_path: Path) -> Iterator[Fleet]:
    """Registry, scheduler and gateway of an open fleet (no vLLM), as `pdplane up` starts them."""
    base = free_port_run(3)
    spec = FleetSpec(
        registry_port=base,
        scheduler_port=base + 1,
        gateway_port=base + 2,
        log_dir=tmp_path / "logs",
    )
    fleet = Fleet(spec)
    try:
        fleet.start_services(60)
        yield fleet
    finally:
        fleet.stop()


def test_a_killed_registry_is_restarted_and_its_return_is_logged(
    services: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    said: list[str] = []
    monkeypatch.setattr(up, "_say", said.append)
    stop = threading.Event()
    supervisor = threading.Thread(target=up._supervise, args=(services, stop), daemon=True)
    supervisor.start()
    try:
        registry_pid = services.service_pids()[0]  # registry, scheduler, gateway: start order
        cmdline = Path(f"/proc/{registry_pid}/cmdline").read_bytes().split(b"\0")
        assert b"registry" in cmdline, cmdline
        os.kill(registry_pid, signal.SIGKILL)
        back = f"registry serving again at {services.registry_address}"
        wait_until(lambda: back in said, 60, interval_s=0.2, what="the registry's return")
    finally:
        stop.set()
        supervisor.join(30)
    assert not supervisor.is_alive()
    died = [m for m in said if m.startswith("registry exited with status")]
    assert len(died) == 1 and said.index(died[0]) < said.index(back), said
    assert said.count(back) == 1, said  # once, not at every supervision tick
    assert services.service_pids()[0] != registry_pid  # a new process answers
