"""`free_port_run`: consecutive free loopback ports below the kernel's ephemeral range."""

from __future__ import annotations

import socket

import pytest

from pdplane.launch.ports import ephemeral_floor, free_port_run


@pytest.mark.parametrize("count", [1, 3])
def test_a_run_of_free_ports_below_the_ephemeral_range(count: int) -> None:
    first = free_port_run(count)
    assert first >= 10_000 and first + count <= ephemeral_floor()
    socks = [socket.socket() for _ in range(count)]
    try:
        for offset, sock in enumerate(socks):
            sock.bind(("127.0.0.1", first + offset))  # all of them can be bound now
    finally:
        for sock in socks:
            sock.close()


def test_a_taken_port_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held, socket.socket() as probe:
        held.bind(("127.0.0.1", 0))
        probe.bind(("127.0.0.1", 0))
        taken, free = held.getsockname()[1], probe.getsockname()[1]
        probe.close()
        picks = iter([taken, free])
        monkeypatch.setattr("pdplane.launch.ports._rng.randrange", lambda a, b: next(picks))
        monkeypatch.setattr("pdplane.launch.ports.ephemeral_floor", lambda: 65_536)
        assert free_port_run(1) == free
