"""`pdplane up` keeps its services running: a registry that dies is restarted on its port, and
the log says when it serves again (as it says for a restarted vLLM instance); an instance that
keeps failing is left stopped while the rest of the fleet serves."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from pdplane.cli import up
from pdplane.launch.deployment import Fleet, FleetSpec
from pdplane.launch.ports import free_port_run
from pdplane.launch.process import wait_until
from tests.integration.launch.cli import sim_fleet_spec


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


@pytest.fixture
def sim_fleet(tmp_path: Path) -> Iterator[Fleet]:
    """1P2D of sims, as `pdplane up --engine sim --decode 2` starts them."""
    spec = sim_fleet_spec(tmp_path, decode=2)
    fleet = Fleet(spec)
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


_BACK = "decode-1 healthy again at"


def test_an_instance_that_keeps_failing_is_left_stopped_and_the_fleet_serves_on(
    sim_fleet: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One instance killed again and again (the OOM killer, a bad GPU) is left stopped once it
    # spends its restart budget; the other decode keeps serving. Only when a role has no
    # instance left does `pdplane up` give up.
    said: list[str] = []
    monkeypatch.setattr(up, "_say", said.append)
    stop = threading.Event()
    status: list[int] = []
    supervisor = threading.Thread(
        target=lambda: status.append(up._supervise(sim_fleet, stop)), daemon=True
    )
    supervisor.start()
    [victim] = [i for i in sim_fleet.instances if sim_fleet.name_of(i) == "decode-1"]
    try:
        for round_ in range(4):
            pid = victim.process.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            if round_ < 3:
                wait_until(
                    lambda n=round_ + 1: sum(m.startswith(_BACK) for m in said) == n,
                    60,
                    interval_s=0.2,
                    what="decode-1 restarted",
                )
        wait_until(lambda: any("decode-1 keeps failing" in m for m in said), 30, what="given up")
        assert supervisor.is_alive() and status == [], said
        body = {"model": sim_fleet.model_name, "prompt": "hello", "max_tokens": 3}
        for _ in range(4):
            r = httpx.post(f"{sim_fleet.gateway_url}/v1/completions", json=body, timeout=30)
            assert r.status_code == 200, r.text
    finally:
        stop.set()
        supervisor.join(30)
    assert status == [0]
