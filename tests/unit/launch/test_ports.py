"""`free_port_run`: consecutive free loopback ports below the kernel's ephemeral range."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator

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


def test_ports_handed_out_are_not_handed_out_again_before_they_are_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A launcher chooses every port before anything binds: a registry port and an instance's
    # KV port run must not meet (seen: the registry on the second port of a KV run).
    with socket.socket() as a:
        a.bind(("127.0.0.1", 0))
        first = a.getsockname()[1]
    rng = random.Random(0)

    def picks() -> Iterator[int]:
        yield first
        yield from (first - 1, first)  # both free (nothing bound them), but `first` was given
        while True:
            yield rng.randrange(10_000, 60_000)

    it = picks()
    monkeypatch.setattr("pdplane.launch.ports._rng.randrange", lambda a, b: next(it))
    monkeypatch.setattr("pdplane.launch.ports.ephemeral_floor", lambda: 65_536)
    assert free_port_run(1) == first
    again = free_port_run(2)
    assert first not in (again, again + 1)
