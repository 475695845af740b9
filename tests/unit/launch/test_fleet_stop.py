"""`Fleet.stop` stops its engines side by side, after the gateway and before the other
services: a vLLM takes seconds to shut down, and one after another they added up."""

from __future__ import annotations

import threading

from pdplane.launch.deployment import Fleet, FleetSpec


class _Engine:
    """Stops only once every engine of the fleet is stopping at the same time (a barrier):
    a fleet that stops its engines one after another breaks it."""

    def __init__(self, barrier: threading.Barrier, order: list[str], name: str) -> None:
        self._barrier = barrier
        self._order = order
        self._name = name

    def stop(self) -> None:
        self._barrier.wait(timeout=5)
        self._order.append(self._name)


class _Service:
    def __init__(self, name: str, order: list[str]) -> None:
        self.name = name
        self._order = order

    def stop(self, grace_s: float = 10.0) -> None:
        self._order.append(self.name)


def test_engines_stop_side_by_side_after_the_gateway_and_before_the_rest() -> None:
    fleet = Fleet(FleetSpec())
    order: list[str] = []
    barrier = threading.Barrier(3)
    fleet.instances = [_Engine(barrier, order, f"engine-{i}") for i in range(3)]  # type: ignore[list-item]
    fleet._services = [_Service(n, order) for n in ("registry", "scheduler", "gateway")]  # type: ignore[list-item]
    fleet.stop()
    assert order[0] == "gateway", order
    assert sorted(order[1:4]) == ["engine-0", "engine-1", "engine-2"], order
    assert order[4:] == ["scheduler", "registry"], order
